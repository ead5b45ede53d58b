"""The dim-sharded Engram gate: two kernels around one all-gather.

Under tensor parallelism over ``P`` ranks with ``width = dim / P``, rank ``r`` holds
columns ``[r*width, (r+1)*width)`` of every key and of the value (a merged
column-parallel ``wkv`` over ``[dim] * (hc+1)``: ``kv_local [T, (hc+1)*width]``).
The gate only needs two per-token sums over dim per stream, so instead of
all-gathering the whole projection (``(hc+1)*dim`` elements per token) each rank:

1. :func:`engram_gate_partials` packs one ``send`` row per token: its value slice,
   then per stream the fp32 pair ``(sum key^2, sum hidden*q*k*key)`` over its slice,
   stored in kv's dtype (a bf16/fp16 row carries each pair as 4 elements, an fp32
   row as 2: ``pair_elems = 8 // element_size``).
2. the caller all-gathers ``send`` along tokens, rank-major
   (:meth:`kda_engram.parallel.TensorParallelGroup.all_gather`), giving
   ``gathered [P*T, width + pair_elems*hc]``;
3. :func:`engram_gate_finish` sums the partials **in rank order** (so every rank
   computes bit-identical gates from bit-identical gathered rows), takes hidden's
   RMS over the full dim (hidden is replicated), reassembles the value from the
   slices and writes ``hidden + gate * value``.

Traffic per token is ``(width + pair_elems*hc) * P`` elements, i.e.
``(dim + 4*hc*P) * 2`` bytes in bf16, instead of ``(hc+1) * dim * 2``.

Alignment: the pairs are read through an fp32 view of the row, so their offset
``width * element_size`` and the row stride must be multiples of 4 bytes (bf16/fp16:
``width`` even; fp32: any width). The entry points check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..validation.engram import check_gate_finish_arguments, check_gate_partials_arguments
from ..validation.engram import pair_elems, send_width  # noqa: F401 (the packed row's geometry, re-exported)
from ..validation.entry import settle_pending
from .gate import (
    check_num_warps,
    _load_qk,
    _masked_gate,
    _row_piece,
    _store_piece,
    _store_pieces,
    launch_geometry,
    tokens_per_program,
)

# Elements per operand of a partials tile, at most (sums and copies need no full row).
PARTIALS_MAX_CHUNK = 2048
# Tokens per partials program, at most, loaded as one [TOKENS, CHUNK] tile (faster
# than walking tokens one at a time: docs/design/engram_gate.md).
PARTIALS_MAX_TOKENS = 8


def _f32_view(name: str, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (kv dtype, last dim stride 1) seen as fp32, for the packed pairs."""
    try:
        return buf.view(torch.float32)
    except RuntimeError as exc:
        raise ValueError(f"{name}: cannot be viewed as fp32 for the packed partial sums ({exc})") from None


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_gate_partials_kernel(
    hidden_states, kv, q_weight, k_weight, send, send_f32,
    num_tokens,
    hidden_stride_t, hidden_stride_h, hidden_stride_d,
    kv_stride_t, kv_stride_d,
    q_stride_h, q_stride_d, k_stride_h, k_stride_d,
    send_stride_t, send_f32_stride_t,
    dim_start,
    WIDTH: tl.constexpr, HC: tl.constexpr, PAIR_OFFSET: tl.constexpr, CHUNK: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """Grid ``cdiv(T, TOKENS) * (HC + 1)``: program ``(b, j)`` writes stream ``j``'s
    pair (``j < HC``) or copies the value slice (``j == HC``) for tokens
    ``[b*TOKENS, (b+1)*TOKENS)``. Sums and copies are single passes over ``WIDTH`` in
    ``CHUNK`` blocks (no full row in registers), the tokens as one ``[TOKENS, CHUNK]``
    tile: their loads are in flight together and ``q_w[j]*k_w[j]`` is read once per
    block for all of them."""
    pid = tl.program_id(0)
    block = pid // (HC + 1)
    j = pid % (HC + 1)
    q_row = q_weight + j * q_stride_h + dim_start * q_stride_d
    k_row = k_weight + j * k_stride_h + dim_start * k_stride_d
    tokens = (block * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    token_ok = tokens < num_tokens
    if j == HC:
        for start in tl.range(0, WIDTH, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            valid = token_ok[:, None] & (offs < WIDTH)[None, :]
            value = tl.load(kv + tokens[:, None] * kv_stride_t + (HC * WIDTH + offs)[None, :] * kv_stride_d, mask=valid)
            tl.store(send + tokens[:, None] * send_stride_t + offs[None, :], value, mask=valid)
    else:
        hidden_rows = hidden_states + tokens[:, None] * hidden_stride_t + j * hidden_stride_h + dim_start * hidden_stride_d
        key_rows = kv + tokens[:, None] * kv_stride_t + (j * WIDTH) * kv_stride_d
        acc_key = tl.zeros([TOKENS, CHUNK], dtype=tl.float32)
        acc_dot = tl.zeros([TOKENS, CHUNK], dtype=tl.float32)
        for start in tl.range(0, WIDTH, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            valid = token_ok[:, None] & (offs < WIDTH)[None, :]
            hidden = tl.load(hidden_rows + offs[None, :] * hidden_stride_d, mask=valid, other=0.0).to(tl.float32)
            key = tl.load(key_rows + offs[None, :] * kv_stride_d, mask=valid, other=0.0).to(tl.float32)
            qk = _load_qk(q_row, k_row, q_stride_d, k_stride_d, start, CHUNK, WIDTH, "")
            acc_key += key * key
            acc_dot += hidden * qk[None, :] * key
        pair = send_f32 + tokens * send_f32_stride_t + PAIR_OFFSET + 2 * j
        tl.store(pair, tl.sum(acc_key, axis=1), mask=token_ok)
        tl.store(pair + 1, tl.sum(acc_dot, axis=1), mask=token_ok)


@triton.jit
def _hidden_value_piece(
    hidden_row, hidden_stride_d, gathered, gathered_stride_t, gathered_stride_d, token, num_tokens,
    start, N: tl.constexpr, DIM: tl.constexpr, WIDTH: tl.constexpr,
):
    """Columns ``[start, start + N)`` of hidden and of the value reassembled from the
    rank-major slices (column ``d`` lives in rank ``d // WIDTH``'s row), both fp32."""
    offs = start + tl.arange(0, N)
    valid = offs < DIM
    hidden = _row_piece(hidden_row, hidden_stride_d, start, True, N, DIM, "")
    # `//` and `%` by the constexpr WIDTH keep the runs of WIDTH contiguous columns
    # visible to Triton's axis analysis, so the slices still load as vectors.
    rank = offs // WIDTH
    col = offs % WIDTH
    value = tl.load(
        gathered + rank.to(tl.int64) * (num_tokens * gathered_stride_t) + token * gathered_stride_t + col * gathered_stride_d,
        mask=valid,
        other=0.0,
    ).to(tl.float32)
    return hidden, value


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_gate_finish_kernel(
    hidden_states, gathered, gathered_f32, token_mask, out,
    num_tokens,
    hidden_stride_t, hidden_stride_h, hidden_stride_d,
    gathered_stride_t, gathered_stride_d, gathered_f32_stride_t,
    mask_stride,
    out_stride_t, out_stride_h, out_stride_d,
    inv_dim, dim_scale, eps, clamp_value,
    DIM: tl.constexpr, WIDTH: tl.constexpr, TP_SIZE: tl.constexpr, HC: tl.constexpr,
    PAIR_OFFSET: tl.constexpr,
    HEAD: tl.constexpr, TAIL: tl.constexpr, CHUNK: tl.constexpr, LOOP: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Grid ``T * HC``, one (token, stream) per program, the same register plan as
    the single-rank kernel (engram/gate.py): hidden and value rows held in at most
    two power-of-two pieces, or two chunked passes for large dims."""
    pid = tl.program_id(0)
    token = (pid // HC).to(tl.int64)
    stream = pid % HC
    hidden_row = hidden_states + token * hidden_stride_t + stream * hidden_stride_h
    out_row = out + token * out_stride_t + stream * out_stride_h
    token_ok = token < num_tokens  # always true on this grid; the store helper wants it
    active = True  # read by _masked_gate only with HAS_MASK
    if HAS_MASK:
        active = tl.load(token_mask + token * mask_stride) != 0

    # Rank order, the same on every rank: bit-identical gates everywhere.
    pair = gathered_f32 + token * gathered_f32_stride_t + PAIR_OFFSET + 2 * stream
    key_sq = tl.load(pair)
    dot = tl.load(pair + 1)
    for r in tl.static_range(1, TP_SIZE):
        pair_r = pair + (r * num_tokens) * gathered_f32_stride_t
        key_sq += tl.load(pair_r)
        dot += tl.load(pair_r + 1)

    if not LOOP:
        hidden0, value0 = _hidden_value_piece(
            hidden_row, hidden_stride_d, gathered, gathered_stride_t, gathered_stride_d, token, num_tokens,
            0, HEAD, DIM, WIDTH,
        )
        hidden_sq = tl.sum(hidden0 * hidden0, axis=0)
        hidden1, value1 = 0.0, 0.0  # the tail piece, when there is one
        if TAIL > 0:
            hidden1, value1 = _hidden_value_piece(
                hidden_row, hidden_stride_d, gathered, gathered_stride_t, gathered_stride_d, token, num_tokens,
                HEAD, TAIL, DIM, WIDTH,
            )
            hidden_sq += tl.sum(hidden1 * hidden1, axis=0)
        gate = _masked_gate(hidden_sq, key_sq, dot, active, inv_dim, dim_scale, eps, clamp_value, HAS_MASK)
        _store_pieces(out_row, out_stride_d, hidden0, value0, hidden1, value1, gate, token_ok, HEAD, TAIL, DIM)
    else:
        acc_hidden = tl.zeros([CHUNK], dtype=tl.float32)
        for start in tl.range(0, DIM, CHUNK):
            # evict_last: the second pass re-reads this row, which should still be
            # in L2 (measured: docs/design/engram_gate.md, the dim-sharded gate).
            hidden = _row_piece(hidden_row, hidden_stride_d, start, token_ok, CHUNK, DIM, "evict_last")
            acc_hidden += hidden * hidden
        gate = _masked_gate(tl.sum(acc_hidden, axis=0), key_sq, dot, active, inv_dim, dim_scale, eps, clamp_value,
                            HAS_MASK)
        for start in tl.range(0, DIM, CHUNK):
            hidden, value = _hidden_value_piece(
                hidden_row, hidden_stride_d, gathered, gathered_stride_t, gathered_stride_d, token, num_tokens,
                start, CHUNK, DIM, WIDTH,
            )
            _store_piece(out_row, out_stride_d, hidden, value, gate, start, token_ok, CHUNK, DIM)


def engram_gate_partials(
    hidden_states: torch.Tensor,
    kv_local: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    rank: int,
    tp_size: int,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
    tokens: int | None = None,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Pack this rank's value slice and per-stream gate partial sums.

    Args:
        hidden_states: ``[T, hc, dim]`` (replicated on every rank), any strides.
        kv_local: ``[T, (hc+1)*width]`` in hidden's dtype, ``width = dim / tp_size``:
            this rank's columns of ``[key_0 | ... | key_{hc-1} | value]``.
        q_weight, k_weight: ``[hc, dim]`` full (replicated) weights, any float dtype.
        rank, tp_size: this rank's index and the number of ranks.
        out: optional ``send`` buffer ``[T, width + pair_elems*hc]`` in kv's dtype with a
            unit last stride (``torch.empty`` when omitted).
        check_inputs: validate on the host (no device reads: capturable either way).
        tokens, chunk, num_warps: launch overrides for tuning: tokens per program
            (see :func:`kda_engram.engram.gate.tokens_per_program`; rounded up to a
            power of two, the tile's rows), the block width (a power of two >= 16)
            and warps.

    Returns:
        ``send [T, width + pair_elems*hc]`` in kv's dtype: the value slice (copied
        bit for bit), then per stream the fp32 pair ``(sum key^2, sum hidden*q*k*key)``
        over the slice, ``pair_elems = 8 // kv.element_size()``.
    """
    settle_pending()  # raises an earlier call's pending error first
    if check_inputs:
        check_gate_partials_arguments(hidden_states, kv_local, q_weight, k_weight, rank, tp_size, out)
    return run_engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, rank=rank, tp_size=tp_size, out=out,
                                    tokens=tokens, chunk=chunk, num_warps=num_warps)


def run_engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, *, rank, tp_size, out=None, tokens=None,
                             chunk=None, num_warps=None) -> torch.Tensor:
    """:func:`engram_gate_partials`' launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_gate_partials_arguments`); the eager
    body of its op (:mod:`kda_engram.ops.engram`)."""
    T, hc, dim = hidden_states.shape
    width = dim // tp_size
    if out is None:
        out = torch.empty(T, send_width(dim, hc, tp_size, kv_local.dtype), dtype=kv_local.dtype, device=kv_local.device)
    if T == 0:
        return out
    send_f32 = _f32_view("out", out)
    size = kv_local.element_size()
    if tokens is None:
        block = min(PARTIALS_MAX_TOKENS, tokens_per_program(T * (hc + 1), hidden_states.device))
    else:
        block = tokens_per_program(T * (hc + 1), hidden_states.device, tokens)  # validates the override
    block = triton.next_power_of_2(block)
    if chunk is None:
        # A tile holds at most PARTIALS_MAX_CHUNK elements per operand.
        chunk = min(triton.next_power_of_2(width), max(16, PARTIALS_MAX_CHUNK // block))
    elif chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two >= 16, got {chunk}")
    check_num_warps(num_warps)
    lanes = chunk * block
    _engram_gate_partials_kernel[(triton.cdiv(T, block) * (hc + 1),)](
        hidden_states, kv_local, q_weight, k_weight, out, send_f32,
        T,
        *hidden_states.stride(),
        *kv_local.stride(),
        *q_weight.stride(), *k_weight.stride(),
        out.stride(0), send_f32.stride(0),
        rank * width,
        WIDTH=width, HC=hc, PAIR_OFFSET=width * size // 4, CHUNK=chunk, TOKENS=block,
        num_warps=num_warps if num_warps is not None else (4 if lanes <= 1024 else 8),
    )
    return out


def engram_gate_finish(
    hidden_states: torch.Tensor,
    gathered: torch.Tensor,
    *,
    tp_size: int,
    eps: float,
    clamp_value: float = 1e-6,
    token_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The gate from the all-gathered ``send`` rows of every rank.

    Args:
        hidden_states: ``[T, hc, dim]`` (replicated), any strides.
        gathered: ``[tp_size*T, width + pair_elems*hc]`` in hidden's dtype, rank-major
            (rows ``[r*T, (r+1)*T)`` are rank ``r``'s send), unit last stride.
        tp_size: number of ranks that packed ``gathered``.
        eps, clamp_value, token_mask: as in :func:`kda_engram.engram.gate.engram_post_wkv`.
        out: optional ``[T, hc, dim]`` in hidden's dtype.
        check_inputs: validate on the host (no device reads: capturable either way).
        chunk, num_warps: launch overrides for tuning (``chunk`` forces two passes).

    Returns:
        ``out [T, hc, dim]``; partials are summed in rank order, so ranks holding the
        same ``hidden_states`` and ``gathered`` get the same bits.
    """
    settle_pending()  # raises an earlier call's pending error first
    if check_inputs:
        check_gate_finish_arguments(hidden_states, gathered, tp_size, eps, clamp_value, token_mask, out)
    return run_engram_gate_finish(hidden_states, gathered, tp_size=tp_size, eps=eps, clamp_value=clamp_value,
                                  token_mask=token_mask, out=out, chunk=chunk, num_warps=num_warps)


def run_engram_gate_finish(hidden_states, gathered, *, tp_size, eps, clamp_value=1e-6, token_mask=None, out=None,
                           chunk=None, num_warps=None) -> torch.Tensor:
    """:func:`engram_gate_finish`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_gate_finish_arguments`); the eager
    body of its op (:mod:`kda_engram.ops.engram`)."""
    T, hc, dim = hidden_states.shape
    width = dim // tp_size
    if out is None:
        out = torch.empty_like(hidden_states)
    if T == 0:
        return out
    gathered_f32 = _f32_view("gathered", gathered)
    # Two passes past SINGLE_PASS_MAX_DIM (not engram_post_wkv's wide single pass):
    # measured faster here (docs/design/engram_gate.md).
    geom = launch_geometry(dim, chunk, num_warps)
    mask_arg = token_mask if token_mask is not None else hidden_states
    _engram_gate_finish_kernel[(T * hc,)](
        hidden_states, gathered, gathered_f32, mask_arg, out,
        T,
        *hidden_states.stride(),
        gathered.stride(0), gathered.stride(1), gathered_f32.stride(0),
        token_mask.stride(0) if token_mask is not None else 0,
        *out.stride(),
        1.0 / dim, dim**-0.5, float(eps), float(clamp_value),
        DIM=dim, WIDTH=width, TP_SIZE=tp_size, HC=hc,
        PAIR_OFFSET=width * gathered.element_size() // 4,
        HAS_MASK=token_mask is not None,
        **geom,
    )
    return out
