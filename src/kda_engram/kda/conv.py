"""Decode-time short convolution of KDA: one token per sequence, conv window in place.

KDA runs a depthwise causal convolution of width ``W = 4`` (then SiLU) over the
raw q, k and v bands of its input projection. Prefill fuses it into the prologue
(:func:`kda_engram.kda.prologue.fused_kda_prologue`); this module has the two
small pieces around it that serving needs:

* :func:`kda_conv_decode` -- one decode step: channel ``c`` of sequence ``b``
  computes ``y = silu(sum_{w<W-1} weight[c, w] * window[w] + weight[c, W-1] * x)``
  and shifts ``x`` into its window (``[slots, C, W-1]``, the last ``W-1`` *raw*
  inputs, oldest first -- the prologue's conv-state layout), in place.
* :func:`kda_conv_checkpoint` -- prefix caching: copy the conv window *at* token
  offset ``p`` of a prefill (the raw inputs of tokens ``p-W+1 .. p-1``) out of the
  projection into a conv-state row, so a later prefill resumes at ``p`` exactly
  (together with the recurrent-state checkpoint the chunk kernel writes).

Machine fit: both are pure copies plus a few FMAs per channel (12 KiB of state
and 6 KiB of input per sequence at 16 heads x 128, bf16), far below every
other cost of a decode step; the kernels exist so that the step stays on the
device (no host sync, CUDA-graph capturable) and never copies its strided input
(the band view of the fused projection), not for speed. Each program owns a
``BLOCK_C`` slice of one sequence's channels, so programs never share a window
row and need no synchronisation: the row is read before it is written by the
same program.

Memory ownership: ``conv_state`` is the caller's cache, updated in place; a
negative index names no row (never read: the window is zeros; never written).
Rows no index names are never touched. ``out`` is ``torch.empty`` when not given.
Portable Triton only (loads, stores, ``tl.sum``, ``tl.sigmoid``): NVIDIA, AMD and
the interpreter run the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._validation import FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_tensor

__all__ = ["kda_conv_decode", "kda_conv_checkpoint", "conv_decode_reference", "conv_checkpoint_reference"]

BLOCK_C = 256


@triton.jit
def _conv_decode_kernel(
    x_ptr, sx_b, sx_c,
    w_ptr, sw_c, sw_w,
    cs_ptr, scs_n, scs_c, scs_w,
    idx_ptr, s_idx,
    o_ptr, so_b, so_c,
    C,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(B, cdiv(C, BLOCK))``: channels ``[pid1*BLOCK, ...)`` of sequence ``pid0``."""
    b = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = ch < C
    tap = tl.arange(0, WP)
    row = tl.load(idx_ptr + b * s_idx).to(tl.int64)
    live = row >= 0
    base = cs_ptr + tl.where(live, row, 0) * scs_n + ch[:, None] * scs_c
    # Taps 0..W-2 from the window (zeros for "no row"), tap W-1 is the new input.
    old = tl.load(base + tap[None, :] * scs_w, mask=cm[:, None] & (tap[None, :] < W - 1) & live, other=0.0)
    x = tl.load(x_ptr + b * sx_b + ch * sx_c, mask=cm, other=0.0)
    taps = tl.where(tap[None, :] == W - 1, x.to(tl.float32)[:, None], old.to(tl.float32))
    wt = tl.load(w_ptr + ch[:, None] * sw_c + tap[None, :] * sw_w, mask=cm[:, None] & (tap[None, :] < W), other=0.0)
    y = tl.sum(taps * wt.to(tl.float32), axis=1)
    y = y * tl.sigmoid(y)
    tl.store(o_ptr + b * so_b + ch * so_c, y.to(o_ptr.dtype.element_ty), mask=cm)
    # New window: slot w takes old slot w+1, the last slot takes x (raw, in the state's dtype).
    shifted = tl.load(base + (tap[None, :] + 1) * scs_w, mask=cm[:, None] & (tap[None, :] < W - 2) & live, other=0.0)
    new = tl.where(tap[None, :] == W - 2, x.to(cs_ptr.dtype.element_ty)[:, None], shifted)
    # Every thread's reads of the row complete before any thread overwrites it
    # (the tile layout need not give one thread a whole window).
    tl.debug_barrier()
    tl.store(base + tap[None, :] * scs_w, new, mask=cm[:, None] & (tap[None, :] < W - 1) & live)


@triton.jit
def _conv_checkpoint_kernel(
    x_ptr, sx_t, sx_c,
    cu_ptr, s_cu,
    off_ptr, s_off,
    idx_ptr, s_idx,
    cs_ptr, scs_n, scs_c, scs_w,
    C,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(N, cdiv(C, BLOCK))``: writes ``x[bos + p - W + 1 + w, ch]`` to slot ``w``
    of row ``idx[n]`` when ``W - 1 <= p <= length`` and ``idx[n] >= 0``."""
    n = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = ch < C
    tap = tl.arange(0, WP)
    bos = tl.load(cu_ptr + n * s_cu).to(tl.int64)
    eos = tl.load(cu_ptr + (n + 1) * s_cu).to(tl.int64)
    p = tl.load(off_ptr + n * s_off).to(tl.int64)
    row = tl.load(idx_ptr + n * s_idx).to(tl.int64)
    on = (row >= 0) & (p >= W - 1) & (p <= eos - bos) & (p > 0)
    pos = bos + p - (W - 1) + tap
    m = cm[:, None] & (tap[None, :] < W - 1) & on
    xv = tl.load(x_ptr + tl.where(m, pos[None, :], 0) * sx_t + ch[:, None] * sx_c, mask=m, other=0.0)
    dst = cs_ptr + tl.where(on, row, 0) * scs_n + ch[:, None] * scs_c + tap[None, :] * scs_w
    tl.store(dst, xv.to(cs_ptr.dtype.element_ty), mask=m)


def _check_conv(x_name, x, conv_weight, conv_state, lead):
    check_tensor(x_name, x, shape=[lead, None], dtypes=FLOAT_DTYPES)
    C = x.shape[1]
    dev = x.device
    check_tensor("conv_weight", conv_weight, shape=[C, None], dtypes=FLOAT_DTYPES, device=dev)
    W = conv_weight.shape[1]
    if W < 2:
        raise ValueError(f"conv_weight: expected a width of at least 2 taps, got {W}")
    check_tensor("conv_state", conv_state, shape=[None, C, W - 1], dtypes=FLOAT_DTYPES, device=dev)
    return C, W


def kda_conv_decode(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    conv_state_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """One decode step of the depthwise causal conv + SiLU, conv window updated in place.

    Args:
        x: ``[B, C]`` raw inputs of this step (for KDA the ``[q | k | v]`` bands of
            the fused projection, ``C = 2 H K + H V``), any strides: a column slice
            of the projection is read in place, never copied.
        conv_weight: ``[C, W]`` depthwise weight (torch's ``conv1d`` ``[C, 1, W]``
            squeezed; tap ``W - 1`` multiplies the current token).
        conv_state: ``[slots, C, W - 1]`` windows of the last ``W - 1`` raw inputs,
            oldest first (the prologue's layout), any float dtype; row
            ``conv_state_indices[b]`` is read and then shifted (``x`` appended) in
            place. Storing raw inputs in the model dtype is exact.
        conv_state_indices: int32/int64 ``[B]``; negative = no row (window zeros,
            nothing written -- a padding row of a captured batch).
        out: optional ``[B, C]`` output (any float dtype, any strides).
        out_dtype: dtype of a new ``out`` (default ``x.dtype``). The KDA layer asks
            for fp32: the prefill path keeps the conv output in fp32 before the L2
            norms, so decode then rounds no differently.
        check_inputs: shapes, dtypes, devices and the index range / distinctness
            (the last reads the indices back: a host sync). ``False`` launches one
            kernel and nothing else (CUDA-graph capturable).

    Returns ``out [B, C]``: ``silu(sum_w weight[c, w] * [window | x][w])`` in fp32
    arithmetic.
    """
    if check_inputs:
        C, W = _check_conv("x", x, conv_weight, conv_state, None)
        check_tensor("conv_state_indices", conv_state_indices, shape=[x.shape[0]], dtypes=INDEX_DTYPES, device=x.device)
        check_index_range("conv_state_indices", conv_state_indices, conv_state.shape[0])
        if out is not None:
            check_tensor("out", out, shape=[x.shape[0], C], dtypes=FLOAT_DTYPES, device=x.device)
    B, C = x.shape
    W = conv_weight.shape[1]
    if out is None:
        out = torch.empty(B, C, dtype=out_dtype or x.dtype, device=x.device)
    if B == 0 or C == 0:
        return out
    grid = (B, triton.cdiv(C, BLOCK_C))
    _conv_decode_kernel[grid](
        x, x.stride(0), x.stride(1),
        conv_weight, conv_weight.stride(0), conv_weight.stride(1),
        conv_state, *conv_state.stride(),
        conv_state_indices, conv_state_indices.stride(0),
        out, out.stride(0), out.stride(1),
        C,
        W=W, WP=triton.next_power_of_2(W), BLOCK=BLOCK_C,
        num_warps=4,
    )
    return out


def kda_conv_checkpoint(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    checkpoint_offsets: torch.Tensor,
    checkpoint_indices: torch.Tensor,
    conv_state: torch.Tensor,
    *,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Write each sequence's conv window at its checkpoint offset into a conv-state row.

    The companion of the chunk kernel's recurrent-state checkpoint: a prefill that
    snapshots the state after ``p`` tokens also needs the conv window there (the raw
    inputs of tokens ``p-W+1 .. p-1``) to resume at ``p`` exactly.

    Args:
        x: ``[T, C]`` raw conv inputs of the prefill tokens (the ``[q | k | v]``
            bands of the projection; any strides, read in place).
        cu_seqlens: ``[N+1]`` offsets of the prefill sequences in ``x``.
        checkpoint_offsets: int ``[N]`` offsets ``p`` relative to each sequence's
            first token; ``0`` = none. Only ``W - 1 <= p <= length`` is written (the
            KDA checkpoints are multiples of 64, so always when ``p > 0``).
        checkpoint_indices: int ``[N]`` destination rows; negative = none.
        conv_state: ``[rows, C, W - 1]`` (often the conv cache itself), written in place
            at the named rows only.
        check_inputs: shapes, dtypes and (syncing) offset / index checks.

    Returns ``conv_state``.
    """
    W = conv_state.shape[2] + 1 if conv_state.dim() == 3 else 0
    if check_inputs:
        check_tensor("x", x, shape=[None, None], dtypes=FLOAT_DTYPES)
        dev = x.device
        C = x.shape[1]
        check_tensor("conv_state", conv_state, shape=[None, C, None], dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("cu_seqlens", cu_seqlens, shape=[None], dtypes=INDEX_DTYPES, device=dev)
        N = cu_seqlens.numel() - 1
        if N < 0:
            raise ValueError("cu_seqlens: expected shape [N+1] with N >= 0, got [0]")
        check_tensor("checkpoint_offsets", checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=dev)
        check_tensor("checkpoint_indices", checkpoint_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
        cu = cu_seqlens.tolist()
        if cu and (cu[0] != 0 or cu[-1] > x.shape[0] or any(b < a for a, b in zip(cu, cu[1:]))):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to at most T={x.shape[0]}, got {cu}")
        offs = checkpoint_offsets.tolist()
        for n, p in enumerate(offs):
            if p < 0 or (p and (p < W - 1 or p > cu[n + 1] - cu[n])):
                raise ValueError(
                    f"checkpoint_offsets[{n}]: expected 0 (none) or {W - 1} <= p <= the sequence length "
                    f"{cu[n + 1] - cu[n]}, got {p}"
                )
        active = checkpoint_indices[checkpoint_offsets > 0]
        check_index_range("checkpoint_indices", active, conv_state.shape[0])
    N = cu_seqlens.numel() - 1
    C = x.shape[1]
    if N <= 0 or C == 0:
        return conv_state
    grid = (N, triton.cdiv(C, BLOCK_C))
    _conv_checkpoint_kernel[grid](
        x, x.stride(0), x.stride(1),
        cu_seqlens, cu_seqlens.stride(0),
        checkpoint_offsets, checkpoint_offsets.stride(0),
        checkpoint_indices, checkpoint_indices.stride(0),
        conv_state, *conv_state.stride(),
        C,
        W=W, WP=triton.next_power_of_2(W), BLOCK=BLOCK_C,
        num_warps=4,
    )
    return conv_state


# --------------------------------------------------------------------------- references


def conv_decode_reference(x, conv_weight, conv_state, conv_state_indices):
    """Plain PyTorch :func:`kda_conv_decode` (fp64): ``(out [B, C], new conv_state)``,
    the input state left untouched."""
    new_state = conv_state.clone()
    B, C = x.shape
    W = conv_weight.shape[1]
    out = torch.zeros(B, C, dtype=torch.float64)
    for b in range(B):
        row = int(conv_state_indices[b])
        window = conv_state[row].double().cpu() if row >= 0 else torch.zeros(C, W - 1, dtype=torch.float64)
        taps = torch.cat([window, x[b].double().cpu()[:, None]], dim=1)  # [C, W]
        y = torch.nn.functional.conv1d(taps[None], conv_weight.double().cpu()[:, None, :], groups=C)[0, :, 0]
        out[b] = torch.nn.functional.silu(y)
        if row >= 0:
            new_state[row] = taps[:, 1:].to(new_state.dtype)
    return out, new_state


def conv_checkpoint_reference(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state):
    """Plain PyTorch :func:`kda_conv_checkpoint` on a copy of ``conv_state``."""
    new_state = conv_state.clone()
    W = conv_state.shape[2] + 1
    cu = [int(c) for c in cu_seqlens]
    for n in range(len(cu) - 1):
        p, row = int(checkpoint_offsets[n]), int(checkpoint_indices[n])
        if row < 0 or p <= 0 or p < W - 1 or p > cu[n + 1] - cu[n]:
            continue
        s = cu[n] + p - (W - 1)
        new_state[row] = x[s : s + W - 1].t().to(new_state.dtype)
    return new_state

