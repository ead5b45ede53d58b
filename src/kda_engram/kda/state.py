"""The KDA recurrent state's host helpers, shared by both prefill paths and the ops:
where the checkpoint snapshots go (:func:`checkpoint_buffer`) and the returned final
state (:func:`allocate_final_state`). The kernels' side of the state's storage dtype
is :mod:`kda_engram.kda.state_dtype`."""

from __future__ import annotations

import torch

from ..validation.kda import check_state_dtype_match
from .state_dtype import STATE_DTYPES

__all__ = ["allocate_final_state", "checkpoint_buffer"]


def checkpoint_buffer(checkpoint_state, checkpoint_offsets, state_cache):
    """Where the snapshots go: ``checkpoint_state``, or the state cache itself when
    snapshots are asked for (``checkpoint_offsets``) without a buffer. Why the
    ``None`` form: a custom op cannot take one buffer as two mutated arguments."""
    if checkpoint_state is None and checkpoint_offsets is not None:
        return state_cache
    return checkpoint_state


def allocate_final_state(final_state_dtype, initial_state, checkpoint_state, checkpoint_offsets, shape,
                         device) -> torch.Tensor:
    """The returned final state ``torch.empty(shape)``: ``final_state_dtype``, else
    ``initial_state``'s dtype, else fp32; it must match a checkpoint buffer in use
    (one state dtype per call). Shared by both prefill paths."""
    if final_state_dtype is None:
        final_state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    if final_state_dtype not in STATE_DTYPES:
        raise TypeError(f"final_state_dtype: expected float32 or bfloat16, got {final_state_dtype}")
    final_state = torch.empty(*shape, dtype=final_state_dtype, device=device)
    check_state_dtype_match(["final_state_dtype", "checkpoint_state"],
                            [final_state, checkpoint_state if checkpoint_offsets is not None else None])
    return final_state
