"""The short convolution of KDA: prefill, decode step and checkpoint copy.

KDA runs a depthwise causal convolution of width ``W = 4`` (then SiLU) over the
raw q, k and v bands of its input projection. Three kernels serve it:

* :func:`conv_prefill_bands` -- the prefill: every token of a varlen batch,
  starting each sequence from its conv-state row and writing the row back.
  :func:`kda_engram.kda.prologue.kda_prefill_prologue` runs it first when given a
  conv weight (it validates the arguments; this function does not).
* :func:`kda_conv_decode` -- one decode step: channel ``c`` of sequence ``b``
  computes ``y = silu(sum_{w<W-1} weight[c, w] * window[w] + weight[c, W-1] * x)``
  and shifts ``x`` into its window (``[slots, C, W-1]``, the last ``W-1`` *raw*
  inputs, oldest first -- the conv-state layout of all three), in place.
* :func:`kda_conv_checkpoint` -- prefix caching: copy the conv window *at* token
  offset ``p`` of a prefill (the raw inputs of tokens ``p-W+1 .. p-1``) out of the
  projection into a conv-state row, so a later prefill resumes at ``p`` exactly
  (together with the recurrent-state checkpoint the chunk kernel writes).

Why the prefill conv is a launch of its own: fused into the prologue's first
launch (255 registers per thread already) its shifted taps tripled that kernel's
time; one program per (chunk, head, band) runs at about 65% of its HBM floor
(measurements: docs/design/kda_conv.md).

Machine fit of the decode and checkpoint kernels: pure copies plus a few FMAs
per channel (12 KiB of state and 6 KiB of input per sequence at 16 heads x 128,
bf16), far below every other cost of a decode step; they exist so that the step
stays on the device (no host sync, CUDA-graph capturable) and never copies its
strided input (the band view of the fused projection), not for speed. Each
program owns a ``BLOCK_C`` slice of one sequence's channels, so programs never
share a window row and need no synchronisation: the row is read before it is
written by the same program (in the prefill, by the program of the sequence's
first chunk, for one head's channels).

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

from ..constants import CHUNK_SIZE
from ..launch_config import check_warps_override, is_pow2
from ..validation.entry import EntryChecks
from ..validation.kda_conv import check_conv_checkpoint, check_conv_decode
from .metadata import chunk_row

__all__ = ["kda_conv_decode", "kda_conv_checkpoint"]

BLOCK_C = 256
# Launch geometry of the prefill conv: one program per (chunk, head, band), rows in
# blocks of CONV_ROW_BLOCK (CONV_STATE_ROW_BLOCK with a conv state), 4 warps: the
# fastest of the variants measured on an H200 (docs/design/kda_conv.md).
CONV_ROW_BLOCK = 16
CONV_STATE_ROW_BLOCK = 8
CONV_PREFILL_WARPS = 4


@triton.jit
def _conv_prefill_band(
    x_ptr, sx_t, sx_c, o_ptr, so_t, so_c, w_ptr, sw_c, sw_w, cs_row, scs_c, scs_w,
    ch0, t0, bos, eos, state_ok, write_state,
    BT: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    """One head of one band: the conv outputs of tokens ``[t0, t0 + BT)`` (those
    before ``eos``), ``D`` channels from ``ch0``, and (``write_state``) the new window
    of those channels in the conv-state row ``cs_row``. Rows before ``bos`` occur
    only when ``t0 == bos`` (W - 1 <= RB).

    Addresses are int64 bases at token ``t0`` plus int32 tiles of local rows
    (``-(W-1) <= row < BT``), half the registers of int64 tiles (the launcher
    checks that ``(BT + W) * stride`` fits); one ``[RB, D]`` load per tap (the
    shifted rows hit L1)."""
    tl.static_assert(W - 1 <= RB, "the taps before bos must fall in the first row block")
    cols = tl.arange(0, D)
    x_base = x_ptr + t0 * sx_t
    o_base = o_ptr + t0 * so_t + ch0 * so_c
    w_base = w_ptr + ch0 * sw_c
    first = (bos - t0).to(tl.int32)  # local row of bos (<= 0)
    stop = (tl.minimum(eos - t0, BT)).to(tl.int32)  # local rows >= stop are not this chunk's
    for blk in tl.static_range(BT // RB):
        rows = blk * RB + tl.arange(0, RB)
        live = rows < stop
        acc = tl.zeros([RB, D], dtype=tl.float32)
        for s in tl.static_range(W):
            pos = rows - (W - 1) + s
            xv = tl.load(x_base + pos[:, None] * sx_t + cols[None, :] * sx_c, mask=(live & (pos >= first))[:, None],
                         other=0.0).to(tl.float32)
            acc += xv * tl.load(w_base + cols * sw_c + s * sw_w).to(tl.float32)[None, :]
        if HAS_STATE:
            # Taps before bos read the old window: only in the first block of a
            # sequence's first chunk. Kept out of the loads above, which then
            # issue together (inside that loop, the branch serialised them: 2x the time).
            if blk == 0:
                if state_ok:
                    for s in tl.static_range(W - 1):
                        pos = rows - (W - 1) + s
                        sv = tl.load(cs_row + (ch0 + cols)[None, :] * scs_c + (pos - first + W - 1)[:, None] * scs_w,
                                     mask=(live & (pos < first))[:, None], other=0.0).to(tl.float32)
                        acc += sv * tl.load(w_base + cols * sw_c + s * sw_w).to(tl.float32)[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(o_base + rows[:, None] * so_t + cols[None, :] * so_c, y.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])
    if HAS_STATE:
        if write_state:
            slot_w = tl.arange(0, WP)
            # Local row that lands in window slot slot_w: up to the sequence's length
            # past t0, so its address tile is int64 (unlike the chunk's rows above).
            src = (eos - t0) - (W - 1) + slot_w
            keep = slot_w < W - 1
            from_x = keep & (src >= bos - t0)
            nx = tl.load(x_base + src[:, None] * sx_t + cols[None, :] * sx_c, mask=from_x[:, None], other=0.0)
            # A sequence shorter than the window keeps the old window's tail: slot slot_w + length.
            from_old = keep & (src < bos - t0) & state_ok
            old = tl.load(cs_row + (ch0 + cols)[None, :] * scs_c + (slot_w + (eos - bos))[:, None] * scs_w,
                          mask=from_old[:, None], other=0.0)
            window = tl.where(from_x[:, None], nx.to(tl.float32), old.to(tl.float32))
            # Every read of this row slice (the taps above, the old window) completes
            # before any thread of the program overwrites it.
            tl.debug_barrier()
            tl.store(cs_row + (ch0 + cols)[None, :] * scs_c + slot_w[:, None] * scs_w,
                     window.to(cs_row.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _conv_prefill_kernel(
    q_ptr, sq_t, sq_h, sq_c,
    k_ptr, sk_t, sk_h, sk_c,
    v_ptr, sv_t, sv_h, sv_c,
    w_ptr, sw_c, sw_w,
    cs_ptr, scs_s, scs_c, scs_w,
    csi_ptr, scsi,
    chi_ptr, schi,
    cu_ptr, ci_ptr, sci_r, sci_c,
    o_ptr, so_t, so_c,
    H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, RB: tl.constexpr, W: tl.constexpr,
    WP: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    """Grid ``(chunk rows, H, 3)``: program ``(r, h, b)`` convolves the ``BT`` tokens
    of chunk row ``r`` (the prologue's chunk metadata) for head ``h`` of band ``b``
    (q, k, v). The program of a sequence's first chunk also owns the conv-state
    row's slice of those channels: it reads the old window for the first ``W - 1``
    taps and, after a barrier, writes the new one (the sequence's last ``W - 1`` raw
    inputs; for sequences shorter than that, shifted in after the old window)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    band = tl.program_id(2)
    seq, cidx, bos, eos, t0 = chunk_row(cu_ptr, ci_ptr, sci_r, sci_c, r, BT)
    if seq < 0:
        return
    cs_row = cs_ptr
    state_ok = cidx < 0  # False unless this program reads an initial window
    write_state = cidx < 0
    if HAS_STATE:
        slot = tl.load(csi_ptr + seq * scsi).to(tl.int64)
        cs_row = cs_ptr + tl.maximum(slot, 0) * scs_s
        write_state = (cidx == 0) & (slot >= 0)
        if HAS_INIT_FLAGS:
            state_ok = write_state & (tl.load(chi_ptr + seq * schi) != 0)
    if band == 0:
        _conv_prefill_band(q_ptr + h * sq_h, sq_t, sq_c, o_ptr, so_t, so_c, w_ptr, sw_c, sw_w, cs_row, scs_c, scs_w,
                           h * K, t0, bos, eos, state_ok, write_state, BT, RB, K, W, WP, HAS_STATE)
    elif band == 1:
        _conv_prefill_band(k_ptr + h * sk_h, sk_t, sk_c, o_ptr, so_t, so_c, w_ptr, sw_c, sw_w, cs_row, scs_c, scs_w,
                           (H + h) * K, t0, bos, eos, state_ok, write_state, BT, RB, K, W, WP, HAS_STATE)
    else:
        _conv_prefill_band(v_ptr + h * sv_h, sv_t, sv_c, o_ptr, so_t, so_c, w_ptr, sw_c, sw_w, cs_row, scs_c, scs_w,
                           2 * H * K + h * V, t0, bos, eos, state_ok, write_state, BT, RB, V, W, WP, HAS_STATE)


def conv_prefill_bands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    conv_weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    conv_has_initial_state: torch.Tensor | None = None,
    *,
    row_block: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU of a varlen prefill, one launch; no input checks
    (the caller, :func:`~kda_engram.kda.prologue.kda_prefill_prologue`, validates).

    Args:
        q, k: ``[1, T, H, K]`` raw bands, v: ``[1, T, H, V]``, one float dtype, any
            strides (band views of the fused projection are read in place).
        conv_weight: ``[2 H K + H V, W]``, channels q band, k band, v band, within a
            band ``h * K + c`` (torch's depthwise ``conv1d`` weight squeezed).
        cu_seqlens: ``[N+1]``; chunk_indices: ``[rows, 2]`` from
            :func:`~kda_engram.kda.metadata.prepare_chunk_indices` (64-token rows).
        conv_state: optional ``[slots, C, W - 1]``, updated in place: sequence ``n``
            starts from row ``conv_state_indices[n]`` where ``conv_has_initial_state[n]``
            (zeros otherwise, or when the flags are None) and that row ends as the
            sequence's last ``W - 1`` raw inputs; a negative index: no row.
        row_block, num_warps: launch overrides for tuning: rows per register block
            (a power of two dividing 64, at least ``W - 1``; default
            ``CONV_STATE_ROW_BLOCK`` with a conv state, ``CONV_ROW_BLOCK`` without)
            and warps (``CONV_PREFILL_WARPS``).

    Returns the convolved ``(q, k, v)``: views of one new ``[1, T, C]`` buffer in
    the input dtype (``torch.empty``; the convolution is summed in fp32 and rounded
    once, as a separate conv kernel's output would be).
    """
    _, T, H, K = q.shape
    V = v.shape[3]
    C = H * (2 * K + V)
    W = conv_weight.shape[1]
    buf = torch.empty(1, T, C, dtype=q.dtype, device=q.device)
    bands = (buf[..., : H * K].view(1, T, H, K), buf[..., H * K : 2 * H * K].view(1, T, H, K),
             buf[..., 2 * H * K :].view(1, T, H, V))
    has_state = conv_state is not None
    has_flags = has_state and conv_has_initial_state is not None
    if row_block is None:
        row_block = max(CONV_STATE_ROW_BLOCK if has_state else CONV_ROW_BLOCK, triton.next_power_of_2(W - 1))
    if not (is_pow2(row_block) and CHUNK_SIZE % row_block == 0 and row_block >= W - 1):
        raise ValueError(f"row_block: expected a power of two dividing {CHUNK_SIZE} and >= W - 1 = {W - 1}, got {row_block!r}")
    check_warps_override("num_warps", num_warps)
    rows = chunk_indices.shape[0]
    if rows == 0 or H == 0 or T == 0:
        return bands
    for name, stride in (("q", q.stride(1)), ("k", k.stride(1)), ("v", v.stride(1)), ("the output", C)):
        # The kernel's int32 offsets within a chunk: (64 + W) rows of this stride.
        if (CHUNK_SIZE + W) * abs(stride) >= 2**31:
            raise ValueError(f"{name}: token stride {stride} too large for the conv's 32-bit in-chunk offsets; "
                             f"expected below {2**31 // (CHUNK_SIZE + W)}")
    _conv_prefill_kernel[(rows, H, 3)](
        q, q.stride(1), q.stride(2), q.stride(3),
        k, k.stride(1), k.stride(2), k.stride(3),
        v, v.stride(1), v.stride(2), v.stride(3),
        conv_weight, conv_weight.stride(0), conv_weight.stride(1),
        conv_state if has_state else q, *(conv_state.stride() if has_state else (0, 0, 0)),
        conv_state_indices if has_state else cu_seqlens, conv_state_indices.stride(0) if has_state else 0,
        # A bool tensor is read as bytes (no int1 pointers in the kernel).
        conv_has_initial_state.view(torch.uint8) if has_flags else cu_seqlens,
        conv_has_initial_state.stride(0) if has_flags else 0,
        cu_seqlens, chunk_indices, chunk_indices.stride(0), chunk_indices.stride(1),
        buf, buf.stride(1), buf.stride(2),
        H,
        K=K, V=V, BT=CHUNK_SIZE, RB=row_block, W=W, WP=triton.next_power_of_2(W - 1),
        HAS_STATE=has_state, HAS_INIT_FLAGS=has_flags,
        num_warps=CONV_PREFILL_WARPS if num_warps is None else num_warps,
    )
    return bands


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
            for fp32 (a decode step costs nothing more for it), where the prefill
            rounds its conv output to the input dtype once.
        check_inputs: shapes, dtypes, devices and the index range / distinctness
            (the last reads the indices back: a host sync). ``False`` launches one
            kernel and nothing else (CUDA-graph capturable).

    Returns ``out [B, C]``: ``silu(sum_w weight[c, w] * [window | x][w])`` in fp32
    arithmetic.
    """
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        check_conv_decode(x, conv_weight, conv_state, conv_state_indices, out, checks, out_dtype=out_dtype)
    if x.numel() > 0:  # an empty step launches nothing: no guard needed
        # Launch, then read back: a broken rule makes every row "none" (no conv_state row touched).
        conv_state_indices = checks.guard(conv_state_indices, -1)
    out = run_kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, out=out, out_dtype=out_dtype)
    checks.run()  # the verdict, after the launch (deferred by default: validation.entry)
    return out


def run_kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, *, out=None, out_dtype=None) -> torch.Tensor:
    """:func:`kda_conv_decode`'s launch without any rule: the caller has run them
    (and guarded ``conv_state_indices``); the eager body of its op
    (:mod:`kda_engram.ops.kda`)."""
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
        check_inputs: shapes, dtypes and the offset / index values (read back in
            one transfer: one host sync).

    Returns ``conv_state``.
    """
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        check_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state, checks)
    if cu_seqlens.numel() > 1 and x.shape[1] > 0:  # no sequence or no channel launches nothing: no guard needed
        # Launch, then read back: a broken rule makes every offset 0 and every row
        # "none" (no conv_state row touched).
        cu_seqlens, checkpoint_offsets, checkpoint_indices = checks.guard_many(
            (cu_seqlens, 0), (checkpoint_offsets, 0), (checkpoint_indices, -1))
    run_kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state)
    checks.run()  # the verdict, after the launch (deferred by default: validation.entry)
    return conv_state


def run_kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state) -> None:
    """:func:`kda_conv_checkpoint`'s launch without any rule: the caller has run
    them (and guarded the offsets and rows); the eager body of its op
    (:mod:`kda_engram.ops.kda`)."""
    N = cu_seqlens.numel() - 1
    C = x.shape[1]
    if N <= 0 or C == 0:
        return
    W = conv_state.shape[2] + 1
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
