"""Rules of the KDA short convolution: its weight, window cache and rows (the prefill's
fused conv, the decode step, the checkpoint gather)."""

from __future__ import annotations

import torch

from ..constants import CONV_WIDTH
from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_index_values,
    check_kernel_device,
    check_tensor,
    value_at,
)
from .kda_inputs import check_cu_seqlens

__all__ = [
    "check_conv_arguments",
    "check_conv_checkpoint",
    "check_conv_decode",
    "check_out_dtype",
]


def check_conv_arguments(conv_weight, conv_state, conv_state_indices, conv_has_initial_state, *,
                         channels: int, num_seqs: int, device, checks: DeviceChecks | None) -> None:
    """The prefill's conv arguments: ``conv_weight [C, 4]``; ``conv_state
    [slots, C, 3]`` with ``conv_state_indices [N]`` (negative = no row; the others
    in range and distinct, queued) and optional bool ``conv_has_initial_state [N]``."""
    if conv_weight is None:
        for name, x in (("conv_state", conv_state), ("conv_state_indices", conv_state_indices),
                        ("conv_has_initial_state", conv_has_initial_state)):
            if x is not None:
                raise ValueError(f"{name}: given without conv_weight (the conv path needs conv_weight)")
        return
    check_tensor("conv_weight", conv_weight, shape=[channels, CONV_WIDTH], dtypes=FLOAT_DTYPES, device=device)
    if conv_state is None:
        for name, x in (("conv_state_indices", conv_state_indices), ("conv_has_initial_state", conv_has_initial_state)):
            if x is not None:
                raise ValueError(f"{name}: given without conv_state")
        return
    check_tensor("conv_state", conv_state, shape=[None, channels, CONV_WIDTH - 1], dtypes=FLOAT_DTYPES, device=device)
    if conv_state_indices is None:
        raise ValueError("conv_state_indices: required with conv_state (int [N], negative = no row)")
    check_tensor("conv_state_indices", conv_state_indices, shape=[num_seqs], dtypes=INDEX_DTYPES, device=device)
    if conv_has_initial_state is not None:
        check_tensor("conv_has_initial_state", conv_has_initial_state, shape=[num_seqs], dtypes=(torch.bool,),
                     device=device)
    if checks is not None:
        check_index_values(checks, "conv_state_indices", conv_state_indices, conv_state.shape[0])


def _check_conv_tensors(x_name, x, conv_weight, conv_state, lead):
    check_tensor(x_name, x, shape=[lead, None], dtypes=FLOAT_DTYPES)
    check_kernel_device(x_name, x)
    dev = x.device
    C = x.shape[1]
    check_tensor("conv_weight", conv_weight, shape=[C, None], dtypes=FLOAT_DTYPES, device=dev)
    W = conv_weight.shape[1]
    if W < 2:
        raise ValueError(f"conv_weight: expected a width of at least 2 taps, got {W}")
    check_tensor("conv_state", conv_state, shape=[None, C, W - 1], dtypes=FLOAT_DTYPES, device=dev)
    return C, W


def check_out_dtype(out_dtype) -> None:
    """``out_dtype``: None (the input's dtype) or a float dtype of the outputs."""
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        raise TypeError(f"out_dtype: expected None or one of {names}, got {out_dtype!r}")


def check_conv_decode(x, conv_weight, conv_state, conv_state_indices, out, checks: DeviceChecks | None, *,
                      out_dtype=None):
    """``kda_conv_decode``: ``x [B, C]``, ``conv_weight [C, W]``, ``conv_state
    [slots, C, W - 1]``, ``conv_state_indices [B]`` (in range, distinct: queued),
    ``out [B, C]``, ``out_dtype`` a float dtype. Returns ``(C, W)``."""
    C, W = _check_conv_tensors("x", x, conv_weight, conv_state, None)
    check_tensor("conv_state_indices", conv_state_indices, shape=[x.shape[0]], dtypes=INDEX_DTYPES, device=x.device)
    if out is not None:
        check_tensor("out", out, shape=[x.shape[0], C], dtypes=FLOAT_DTYPES, device=x.device)
    check_out_dtype(out_dtype)
    if checks is not None:
        check_index_values(checks, "conv_state_indices", conv_state_indices, conv_state.shape[0])
    return C, W


def check_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state,
                          checks: DeviceChecks | None) -> int:
    """``kda_conv_checkpoint``: ``x [T, C]``, ``conv_state [slots, C, W - 1]``,
    ``cu_seqlens`` (at most T), ``checkpoint_offsets [N]`` (0 = none, else in
    ``[W - 1, length]``) and ``checkpoint_indices [N]`` (rows of the active ones in
    range and distinct); value rules queued. Returns N."""
    check_tensor("x", x, shape=[None, None], dtypes=FLOAT_DTYPES)
    check_kernel_device("x", x)
    dev = x.device
    check_tensor("conv_state", conv_state, shape=[None, x.shape[1], None], dtypes=FLOAT_DTYPES, device=dev)
    lengths = check_cu_seqlens(cu_seqlens, x.shape[0], dev, checks, covers_all=False, return_lengths=True)
    N = cu_seqlens.numel() - 1
    check_tensor("checkpoint_offsets", checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    check_tensor("checkpoint_indices", checkpoint_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    if checks is None or N == 0:
        return N
    W = conv_state.shape[2] + 1
    offs = checkpoint_offsets.to(torch.int64)
    bad = (offs < 0) | ((offs > 0) & ((offs < W - 1) | (offs > lengths)))
    first = torch.argmax(bad.to(torch.int8))
    checks.add(bad.any(), f"checkpoint_offsets[{{}}]: expected 0 (none) or {W - 1} <= p <= the sequence length "
               "{}, got {}", first, value_at(lengths, first), value_at(offs, first))
    active = torch.where(offs > 0, checkpoint_indices.to(torch.int64), -1)
    check_index_values(checks, "checkpoint_indices", active, conv_state.shape[0])
    return N
