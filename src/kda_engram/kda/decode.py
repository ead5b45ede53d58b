"""KDA decode: one fused Triton launch per step on the paged recurrent-state cache.

Two entry points share one kernel:

* :func:`kda_decode` -- one token per sequence, ``q: [B, H, K]``. The state of
  sequence ``b`` is read from and written back to row ``state_indices[b]`` of
  ``state_cache`` in place.
* :func:`kda_decode_multi` -- ``S`` tokens per sequence (speculative decoding),
  ``q: [B, S, H, K]``. The walk starts from row ``initial_state_indices[b]`` and
  the state after token ``s`` is written to row ``state_indices[b, s]``, so an
  engine can roll back to the state after the last accepted draft token. With
  ``cu_seqlens`` the tokens are packed ``[1, T, ...]``, any count per sequence (the
  kernel reads each sequence's offset and length: no gather, no scatter), and
  ``num_accepted_tokens`` / ``null_row`` pick the start row and the "no row" index
  on the device (vLLM's speculative verify, in one launch).

Per head, with ``S`` the V-first state ``[V, K]``, stored fp32 or
bf16 (:mod:`kda_engram.kda.state_dtype`; always fp32 on chip)::

    q̂ = q / sqrt(Σq² + 1e-6),  k̂ likewise,  β = sigmoid(raw_beta)
    a  = -exp(A_log)·softplus(raw_g + dt_bias)           (lower_bound None)
       = L·sigmoid(exp(A_log)·(raw_g + dt_bias))          (lower_bound L)
    S' = S·diag(exp a);  δ = β (v − S' k̂);  S = S' + δ k̂ᵀ;  o = scale · S q̂

Machine fit: decode is memory-bound (the state moves in and out once per step,
~6 flops per element); each program owns ``BLOCK_V`` contiguous rows of one
(sequence, head) state and all ``K`` columns, loads them once and stores them once
(per token with ``S`` tokens). Plain loads, stores and reductions, no ``tl.dot``:
the same code runs on Hopper, CDNA3/4 and the interpreter (docs/design/kda_decode.md).

Memory ownership. Inputs may be arbitrary strided views (e.g. column slices of one
fused projection); the kernel takes every stride and never copies them. The
state is read and written in place; rows that no index names are never touched,
and a negative index names no row: it is neither read nor written. Nothing is
allocated except ``out`` when the caller passes none (``torch.empty``: every
element is written). With ``check_inputs=False`` the entry points make no host
synchronisation and no host-side checks, so a call can be captured in a CUDA
graph; the caller then guarantees what the checks would have verified (indices in
range and free of duplicates -- an out-of-range index would write out of bounds,
a duplicate would race).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import L2NORM_EPS
from ..launch_config import check_block_override, check_warps_override, decode_tiling_for, device_arch
from ..platform import interpreting
from ..validation.entry import EntryChecks
from ..validation.kda_decode import (
    check_decode_inputs,
    check_decode_multi_arguments,
    guard_decode_indices,
)
from ..validation.kda_inputs import check_input_forms, check_log_decay_values
from .gate import gate_form, gate_operands, gate_pointers, log_decay
from .state_dtype import round_state

__all__ = ["kda_decode", "kda_decode_multi", "decode_tiling", "launch_decode"]


@triton.jit
def _l2_normalize(x, EPS: tl.constexpr):
    """``x / sqrt(sum x^2 + EPS)`` of one head's 1-D vector (the eps inside the sqrt)."""
    return x / tl.sqrt(tl.sum(x * x, axis=0) + EPS)


@triton.jit
def _token_load(ptrs, step_in, MASKED: tl.constexpr):
    """One token's values as fp32; ``MASKED``: zeros where the step is not taken."""
    if MASKED:
        return tl.load(ptrs, mask=step_in, other=0.0).to(tl.float32)
    return tl.load(ptrs).to(tl.float32)


@triton.jit
def _kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr,
    state_ptr, init_idx_ptr, idx_ptr, o_ptr, cu_ptr, accepted_ptr,
    scale, lower_bound, num_tokens,
    sq_b, sq_s, sq_h, sq_k,
    sk_b, sk_s, sk_h, sk_k,
    sv_b, sv_s, sv_h, sv_v,
    sg_b, sg_s, sg_h, sg_k,
    sb_b, sb_s, sb_h,
    sa_h,
    sd_h, sd_k,
    ss_n, ss_h, ss_v, ss_k,
    si_b,
    sw_b, sw_s,
    so_b, so_s, so_h, so_v,
    sacc_b,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GATE: tl.constexpr,
    EPS: tl.constexpr,
    STATE_BF16: tl.constexpr,
    NATIVE_ROUND: tl.constexpr,
    QK_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    VARLEN: tl.constexpr,
    ACCEPTED: tl.constexpr,
    NULL_ROW: tl.constexpr,
):
    """Grid: ``(B · H · V / BLOCK_V,)``, tile index fastest, then head, then sequence.

    The program of (b, h, tile) reads its [BLOCK_V, K] block of row
    ``init_idx[b]`` (nothing when ``<= NULL_ROW``: a padding sequence, whose outputs
    are zero and whose state rows are never touched), runs tokens 0..S-1 and after
    token s stores the block to row ``idx[b, s]`` when that is ``> NULL_ROW``
    (a constexpr: a runtime bound cost the bf16 one-token variant 25 registers).
    ``ACCEPTED``: the start row is ``idx[b, accepted[b] - 1]`` instead (the column
    clamped into ``[0, S)``). ``VARLEN``: the tokens are packed ``[1, T, ...]``,
    sequence ``b``'s token ``s`` at ``cu[b] + s`` (the batch strides unused); steps
    past its length (or outside ``[0, num_tokens)``) read zeros and write no output
    and no row; a sequence of no token reads no state.
    With ``STATE_BF16`` the cache is bf16: loads widen to fp32, every token's
    state is rounded to bf16 (RTNE) and the walk carries the rounded value, so S
    tokens in one launch equal S one-token launches bit for bit.
    ``GATE`` (:func:`kda_engram.kda.gate.gate_form`): the gate form; the precomputed
    one has ``g_ptr`` hold the log decay itself (``alog_ptr`` and ``dtb_ptr`` are never read); ``QK_L2NORM`` / ``BETA_SIGMOID`` off: q, k and
    beta are used as given.
    """
    NUM_TILES: tl.constexpr = V // BLOCK_V
    pid = tl.program_id(0)
    tile = pid % NUM_TILES
    h = (pid // NUM_TILES) % H
    b = (pid // (NUM_TILES * H)).to(tl.int64)

    offs_k = tl.arange(0, K)
    offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    tile_in = (offs_v[:, None] < V) & (offs_k[None, :] < K)  # all true; gives the mask its shape
    tile_offs = offs_v[:, None] * ss_v + offs_k[None, :] * ss_k

    # Row numbers go to int64 before they meet the slot stride: slots * H * V * K
    # passes 2^31 at a few thousand slots.
    if ACCEPTED:
        column = tl.minimum(tl.maximum(tl.load(accepted_ptr + b * sacc_b).to(tl.int64) - 1, 0), S - 1)
        init_row = tl.load(idx_ptr + b * sw_b + column * sw_s).to(tl.int64)
    else:
        init_row = tl.load(init_idx_ptr + b * si_b).to(tl.int64)
    live = init_row > NULL_ROW
    seq = b  # the batch index of the token addresses
    if VARLEN:  # sequence b's tokens: [first, first + length) of the packed T; no batch stride
        first = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - first
        seq = b * 0
        live = live & (length > 0)
    state_h = state_ptr + h * ss_h
    state = tl.load(
        state_h + tl.where(live, init_row, 0) * ss_n + tile_offs,
        mask=tile_in & live,
        other=0.0,
        eviction_policy="evict_first",
    ).to(tl.float32)

    a_scale, bias = gate_operands(alog_ptr, sa_h, dtb_ptr, sd_h, sd_k, h, offs_k, GATE)

    for s in range(S):
        # VARLEN: a step past the sequence (or a token outside [0, T)) loads zeros
        # and is dropped below; otherwise every step is in (the mask folds away).
        if VARLEN:
            t = first + s
            step_in = (s < length) & (t >= 0) & (t < num_tokens)
        else:
            t = s
            step_in = s < S
        q = _token_load(q_ptr + seq * sq_b + t * sq_s + h * sq_h + offs_k * sq_k, step_in, VARLEN)
        k = _token_load(k_ptr + seq * sk_b + t * sk_s + h * sk_h + offs_k * sk_k, step_in, VARLEN)
        g = _token_load(g_ptr + seq * sg_b + t * sg_s + h * sg_h + offs_k * sg_k, step_in, VARLEN)
        vv = _token_load(v_ptr + seq * sv_b + t * sv_s + h * sv_h + offs_v * sv_v, step_in, VARLEN)
        beta = _token_load(beta_ptr + seq * sb_b + t * sb_s + h * sb_h, step_in, VARLEN)
        if BETA_SIGMOID:
            beta = tl.sigmoid(beta)

        if QK_L2NORM:
            q = _l2_normalize(q, EPS)
            k = _l2_normalize(k, EPS)
        # No floor (unlike the chunk kernels): exp(-inf) = 0, any strength stays finite.
        a = log_decay(g, bias, a_scale, lower_bound, GATE)

        # A step not taken (VARLEN) still steps the tile, on zeros: it comes after
        # the sequence's last token (or on a broken cu_seqlens), and writes nothing.
        state = state * tl.exp(a)[None, :]
        pred = tl.sum(state * k[None, :], axis=1)  # S' k̂   [BLOCK_V]
        sq = tl.sum(state * q[None, :], axis=1)  # S' q̂   [BLOCK_V]
        delta = beta * (vv - pred)
        state = state + delta[:, None] * k[None, :]
        # The decay was applied above in fp32, before the rounding: a decay that
        # would round to 1.0 in bf16 still shrinks the fp32 tile.
        state = round_state(state, STATE_BF16, NATIVE_ROUND)
        o = scale * (sq + delta * tl.sum(k * q, axis=0))
        o = tl.where(live, o, 0.0).to(o_ptr.dtype.element_ty)
        o_at = o_ptr + seq * so_b + t * so_s + h * so_h + offs_v * so_v
        if VARLEN:
            tl.store(o_at, o, mask=(offs_v < V) & step_in)
        else:
            tl.store(o_at, o)

        out_row = tl.load(idx_ptr + b * sw_b + s * sw_s).to(tl.int64)
        write = live & (out_row > NULL_ROW) & step_in
        tl.store(
            state_h + tl.where(write, out_row, 0) * ss_n + tile_offs,
            state.to(state_ptr.dtype.element_ty),  # exact: already rounded to the cache dtype
            mask=tile_in & write,
            eviction_policy="evict_first",
        )


def decode_tiling(
    batch: int, heads: int, v_dim: int, device: torch.device | str | None = None, steps: int = 1,
    state_dtype: torch.dtype = torch.float32,
) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a decode launch of ``batch · heads`` heads of
    ``steps`` tokens each.

    One token: 16 rows x 4 warps (a 16-row tile of a 128-wide fp32 state is 8 KiB,
    so more programs keep more bytes in flight per SM); several tokens: 2 warps
    (the tile stays live across the steps). A bf16 state has its own rule. The
    rule is :func:`kda_engram.launch_config.decode_tiling_for`; the sweep behind
    it: docs/design/kda_decode.md. Any power-of-two ``BLOCK_V`` dividing ``V`` is
    correct; this only picks speed.
    """
    del batch, heads  # the measured optimum did not depend on the grid size
    tiling = decode_tiling_for(device_arch(device), v_dim, steps, state_dtype)  # the per-architecture rule
    return tiling.block_v, tiling.num_warps


def launch_decode(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, init_idx, idx, out,
                  scale, lower_bound, *, steps, init_stride, idx_strides, block_v=None, num_warps=None,
                  native_round=None, gate="raw", qk_l2norm=True, beta_sigmoid=True, cu_seqlens=None,
                  num_accepted_tokens=None, null_row=-1):
    """Launch the kernel on 4-D strides ``[B, S, H, *]``. For the one-token entry
    point ``steps == 1`` and the token strides are passed as 0 (no views made).
    ``cu_seqlens [B+1]``: the tokens are packed ``[1, T, H, *]`` (``steps``: the most
    a sequence has); ``num_accepted_tokens [B]``: each sequence starts from its row
    ``idx[b, num_accepted_tokens[b] - 1]`` (``init_idx`` unread); rows ``<= null_row``
    are no row."""
    B = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _, H, V, K = state_cache.shape
    check_block_override("block_v", block_v, V, "V")
    check_warps_override("num_warps", num_warps)
    if B == 0:
        return out
    if block_v is None or num_warps is None:
        bv, nw = decode_tiling(B, H, V, state_cache.device, steps, state_cache.dtype)
        block_v = bv if block_v is None else block_v
        num_warps = nw if num_warps is None else num_warps
    if scale is None:
        scale = K ** -0.5

    def s4(t):  # [B, S, H, X] strides of a [B, H, X] or [B, S, H, X] tensor
        return t.stride() if t.dim() == 4 else (t.stride(0), 0, t.stride(1), t.stride(2))

    def s3(t):  # raw_beta: [B, S, H] strides
        return t.stride() if t.dim() == 3 else (t.stride(0), 0, t.stride(1))

    alog, sa_h, dtb, sd_h, sd_k = gate_pointers(raw_g, A_log, dt_bias, K, gate)
    grid = (B * H * (V // block_v),)
    accepted = idx if num_accepted_tokens is None else num_accepted_tokens  # any pointer when unread
    _kda_decode_kernel[grid](
        q, k, v, raw_g, raw_beta, alog, dtb,
        state_cache, init_idx, idx, out, idx if cu_seqlens is None else cu_seqlens, accepted,
        float(scale), float(lower_bound) if lower_bound is not None else 0.0, q.shape[1],
        *s4(q), *s4(k), *s4(v), *s4(raw_g), *s3(raw_beta),
        sa_h, sd_h, sd_k,
        *state_cache.stride(),
        init_stride, *idx_strides,
        *s4(out),
        accepted.stride(0),
        S=steps, H=H, K=K, V=V, BLOCK_V=block_v,
        GATE=gate_form(gate, lower_bound),
        EPS=L2NORM_EPS,
        STATE_BF16=state_cache.dtype == torch.bfloat16,
        NATIVE_ROUND=not interpreting() if native_round is None else native_round,
        QK_L2NORM=bool(qk_l2norm), BETA_SIGMOID=bool(beta_sigmoid),
        VARLEN=cu_seqlens is not None, ACCEPTED=num_accepted_tokens is not None, NULL_ROW=int(null_row),
        num_warps=num_warps,
    )
    return out


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
    gate: str = "raw",
    qk_l2norm: bool = True,
    beta_sigmoid: bool = True,
    null_row: int = -1,
) -> torch.Tensor:
    """One KDA decode step for a batch of sequences, state updated in place.

    Args:
        q, k: ``[B, H, K]`` raw (pre-L2-norm) query and key; bf16, fp16 or fp32.
            Any strides (e.g. views into one fused projection); never copied.
        v: ``[B, H, V]``, same dtype as ``q``.
        raw_g: ``[B, H, K]`` raw gate (before ``dt_bias`` and the activation).
        raw_beta: ``[B, H]`` raw beta (before the sigmoid).
        A_log: ``[H]``; dt_bias: ``[H, K]`` or ``[H*K]``.
        state_cache: fp32 or bf16 ``[slots, H, V, K]`` (V-first), read and written
            in place. bf16 halves the bytes a step moves: the state is widened
            to fp32 on load, stepped in fp32 and rounded to bf16 (RTNE) once per
            store.
        state_indices: int32/int64 ``[B]``: the state of sequence ``b`` is row
            ``state_indices[b]``. Negative = padding: that row is neither read nor
            written and ``out[b]`` is zero. Rows no index names are never touched.
        scale: output scale, default ``K ** -0.5``.
        lower_bound: ``None`` for the softplus gate, ``L < 0`` for the bounded gate
            ``a = L·sigmoid(exp(A_log)·(raw_g + dt_bias))``.
        out: optional ``[B, H, V]`` output buffer (any float dtype, any strides);
            default ``torch.empty`` in ``v``'s dtype.
        gate: ``"raw"`` (above) or ``"log_decay"``: ``raw_g`` is then the
            per-channel log decay ``a`` itself (natural log, ``<= 0``, any float
            dtype, -inf allowed), and ``A_log``, ``dt_bias``, ``lower_bound`` are None.
        qk_l2norm: ``False`` uses q and k as given (normalised by the caller).
        beta_sigmoid: ``False`` takes ``raw_beta`` as beta itself.
        null_row: an int ``>= -1``; an index ``<= null_row`` is padding (default -1:
            negative); vLLM's convention is 0. Read by the kernel (a constant of it).
        check_inputs: validate shapes, dtypes, devices, scalars, index range and
            duplicate indices. The last two are computed on the device and read
            back once, after the launch, which a broken rule turns into a no-op
            on the cache (one host sync that waits only for the flags).
            ``False`` skips every host-side check, so the call is CUDA-graph
            capturable.

    Returns ``out``: ``[B, H, V]``, ``scale · S_new q̂`` per head. One launch fuses
    the L2 norms, gate, beta sigmoid, state update and output; all math in fp32.
    """
    check_input_forms(gate, A_log, dt_bias, lower_bound, qk_l2norm, beta_sigmoid)  # picks kernel branches
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        (batch,) = check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, out, scale,
                                       lower_bound, lead=1)
        check_log_decay_values(gate, raw_g, checks)
        # Launch, then read back: a broken rule turns every row into "none" (the
        # launch then touches no state row) and raises after the launch. The null
        # rows become -1 for the rules (they know negative rows as padding).
        state_indices = guard_decode_indices(state_indices, batch, state_cache, checks, null_row)
        if gate == "log_decay":  # the index launch guards by its own rules: add the gate's
            state_indices = checks.guard(state_indices, -1)
    out = run_kda_decode(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, scale=scale,
                         lower_bound=lower_bound, out=out, gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid,
                         null_row=null_row)
    checks.run()  # the verdict (index range and distinctness): deferred, see validation.entry
    return out


def run_kda_decode(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, *, scale=None,
                   lower_bound=None, out=None, gate="raw", qk_l2norm=True, beta_sigmoid=True,
                   null_row=-1) -> torch.Tensor:
    """:func:`kda_decode`'s launch without any rule: the caller has run them (and
    guarded ``state_indices``); the eager body of its op (:mod:`kda_engram.ops.kda`)."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    launch_decode(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, state_indices, out,
        scale, lower_bound, steps=1, init_stride=state_indices.stride(0),
        idx_strides=(state_indices.stride(0), 0), gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid,
        null_row=null_row,
    )
    return out


def kda_decode_multi(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    initial_state_indices: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
    gate: str = "raw",
    qk_l2norm: bool = True,
    beta_sigmoid: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    null_row: int = -1,
) -> torch.Tensor:
    """``S`` KDA decode steps per sequence in one launch (speculative decoding).

    The sibling of :func:`kda_decode` for ``S`` draft tokens per sequence. Every
    program keeps its state tile in registers across the ``S`` tokens: the state
    is read once and written after each token to that token's own row, so the
    engine can roll back rejected draft tokens by picking the row of the last
    accepted one.

    Args:
        q, k, raw_g: ``[B, S, H, K]``; v: ``[B, S, H, V]``; raw_beta: ``[B, S, H]``.
            Same meaning, dtypes and stride freedom as in :func:`kda_decode`.
        A_log, dt_bias, state_cache, scale, lower_bound, check_inputs, gate,
        qk_l2norm, beta_sigmoid: as in :func:`kda_decode`.
        state_indices: int32/int64 ``[B, S]``: the state after token ``s`` of
            sequence ``b`` is written to row ``state_indices[b, s]``; negative =
            not written (the token's output is still computed).
        initial_state_indices: int32/int64 ``[B]``: the row sequence ``b`` starts
            from; default ``state_indices[:, 0]`` (a view). Negative = padding
            sequence: nothing is read, no state row is written (whatever
            ``state_indices[b]`` says) and its outputs are zero. A sequence may
            start from a row it writes itself (it is read before the first write),
            not from a row another sequence writes.
        out: optional ``[B, S, H, V]`` output buffer.
        cu_seqlens: int ``[N+1]`` or None. Given, the tokens are packed: ``q, k,
            raw_g [1, T, H, K]``, ``v [1, T, H, V]``, ``raw_beta [1, T, H]``, ``out
            [1, T, H, V]``; sequence ``n`` has tokens ``cu_seqlens[n]:cu_seqlens[n+1]``,
            0 to ``W`` of them, ``state_indices [N, W]``. Each sequence walks its own
            length in the one launch (uneven counts, and zero-length sequences
            such as CUDA-graph padding, which touch nothing); tokens no sequence
            owns are not written (zeros when ``out`` is allocated here).
        num_accepted_tokens: int ``[N]`` or None (then ``initial_state_indices``):
            sequence ``n`` starts from row ``state_indices[n, num_accepted_tokens[n] - 1]``,
            the state after its last accepted draft token (speculative verify).
        null_row: an int ``>= -1``; an index ``<= null_row`` names no row (default
            -1: negative); vLLM's convention is 0 (``NULL_BLOCK_ID``). A kernel
            constant: each value compiles its own variant.

    With S = 1 and ``initial_state_indices = state_indices[:, 0]`` this is
    exactly :func:`kda_decode`. With S = 0 (or no token) the call is valid and
    empty: it returns the output and touches no state row.

    Returns ``out``: ``[B, S, H, V]`` (``[1, T, H, V]`` with ``cu_seqlens``).
    """
    check_input_forms(gate, A_log, dt_bias, lower_bound, qk_l2norm, beta_sigmoid)  # picks kernel branches
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        check_decode_multi_arguments(checks, q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                                     initial_state_indices, out, scale, lower_bound, gate, cu_seqlens,
                                     num_accepted_tokens, null_row)
    if q.shape[1] > 0 and state_indices.shape[1] > 0:  # no step reads or writes nothing: no guard needed
        # Launch, then read back (see kda_decode): broken rules make every row "none"
        # (-1 is none for any null_row >= -1).
        state_indices, initial_state_indices = checks.guard_many((state_indices, -1), (initial_state_indices, -1))
    out = run_kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                               initial_state_indices, scale=scale, lower_bound=lower_bound, out=out, gate=gate,
                               qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid, cu_seqlens=cu_seqlens,
                               num_accepted_tokens=num_accepted_tokens, null_row=null_row)
    checks.run()  # the verdict, after the launch
    return out


def run_kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                         initial_state_indices=None, *, scale=None, lower_bound=None, out=None, gate="raw",
                         qk_l2norm=True, beta_sigmoid=True, cu_seqlens=None, num_accepted_tokens=None,
                         null_row=-1) -> torch.Tensor:
    """:func:`kda_decode_multi`'s launch without any rule: the caller has run them
    (and guarded the indices); the eager body of its op (:mod:`kda_engram.ops.kda`).
    No step (S = 0, or no token with ``cu_seqlens``) launches nothing and returns
    the empty (or, allocated here with ``cu_seqlens``, zero) output."""
    if out is None:
        alloc = torch.empty if cu_seqlens is None else torch.zeros  # packed: unowned tokens stay defined
        out = alloc(v.shape, dtype=v.dtype, device=v.device)
    steps = state_indices.shape[1]
    if q.shape[1] == 0 or steps == 0:
        return out
    if initial_state_indices is None:
        initial_state_indices = state_indices[:, 0]  # a view of the (guarded) rows
    launch_decode(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, initial_state_indices, state_indices, out,
        scale, lower_bound, steps=steps, init_stride=initial_state_indices.stride(0),
        idx_strides=state_indices.stride(), gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid,
        cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens, null_row=null_row,
    )
    return out
