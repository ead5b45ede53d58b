"""The KDA recurrent state's host helpers shared by both prefill paths and the ops: the
state's index tensors guarded with the call's other indices (:func:`guarded_state`) and
the returned final state (:func:`allocate_final_state`). The state's arguments travel as
one :class:`~kda_engram.bundles.StateArgs`; the kernels' side of the state's storage
dtype is :mod:`kda_engram.kda.state_dtype`."""

from __future__ import annotations

import torch

from ..bundles import StateArgs
from ..validation.kda_prefill import final_state_dtype

__all__ = ["allocate_final_state", "guarded_state", "state_launch_modes"]


def allocate_final_state(state: StateArgs, shape, device) -> torch.Tensor:
    """The returned final state ``torch.empty(shape)`` in
    :func:`~kda_engram.validation.kda_prefill.final_state_dtype` (its rules, a dtype the state
    may take and one dtype per call, are :func:`~kda_engram.validation.kda_prefill.check_state_structure`'s)."""
    return torch.empty(*shape, dtype=final_state_dtype(state), device=device)


def guarded_state(checks, state: StateArgs, *others: tuple) -> tuple:
    """``(*guarded others, guarded state)``: ``others`` (``(tensor, none)`` pairs) and
    the state's rows and offsets guarded in one launch (:meth:`DeviceChecks.guard_many`):
    when a queued rule is broken every row is -1 (none) and every offset 0, so the
    launches write no state or checkpoint row. No-ops without queued rules."""
    *got, rows, offsets, ck_rows = checks.guard_many(
        *others, (state.state_indices, -1), (state.checkpoint_offsets, 0), (state.checkpoint_state_indices, -1))
    return (*got, state.replace(state_indices=rows, checkpoint_offsets=offsets, checkpoint_state_indices=ck_rows))


def state_launch_modes(initial_state, final_state, state_cache) -> tuple[int, int, object, object]:
    """``(LOAD_STATE, STORE_STATE, state read, state written)`` of a walk launch (the
    chunk walk, the Gluon walk, the fused prefill): 2 and 2 with the state cache (read
    and written in place), else 1 where a dense initial / final state is given and 0
    where it is not (``None`` then for the tensor)."""
    if state_cache is not None:
        return 2, 2, state_cache, state_cache
    return (1 if initial_state is not None else 0, 1 if final_state is not None else 0, initial_state,
            final_state)
