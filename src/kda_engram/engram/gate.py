"""Fused Engram post-``wkv`` gate on one rank: ``out = hidden + gate * value``.

Per token ``t`` and hyper-connection stream ``h``, in fp32::

    dot  = sum_d hidden*q_w[h]*k_w[h]*key_h * rsqrt(mean hidden^2 + eps)
           * rsqrt(mean key_h^2 + eps) / sqrt(dim)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp_value)))      (sign(0) = +1)
    out  = hidden + gate * value          (gate = 0 where token_mask is false)

Each program gates one stream; by default one token, as the reference engine
launches it. The kernel streams (about 26 bytes per token per unit of dim in bf16
at hc = 4, a few FLOPs per byte), so every path is about reading each HBM byte
once. :func:`engram_post_wkv` picks one by dim and grid size:

* **single pass** (``dim <= SINGLE_PASS_MAX_DIM``): the row in registers as two
  power-of-two pieces (:func:`row_pieces`), optionally several tokens per program
  (:func:`tokens_per_program`);
* **wide single pass** (``dim <= WIDE_ROW_MAX_DIM``, the model's 5120): the same on
  fewer warps, one token per program;
* **persistent single pass** (wide-row dims, large grids, NVIDIA): as many programs
  as the GPU holds, each walking tokens with the next token's loads in flight;
* **small grids** (wide-row dims, few programs per compute unit): two passes of
  half-row blocks with L2 eviction hints;
* **chunked two passes** (wider dims, or ``chunk=``): bounded registers for any dim
  at the price of an L2 re-read of hidden.

The measurements behind each path and constant: docs/design/engram_gate.md.

Rows ``t >= num_kv_tokens`` read key = value = 0 (masked loads, never out of
bounds), so their output is ``hidden`` bit for bit. Sums overflow fp32 only when
``|x|^2 * dim`` passes 3.4e38 (|x| ~ 2.6e17 at dim 5120); the reference shares that
limit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..launch_config import GateGeometry, check_warps_override, is_pow2
from ..platform import arch, interpreting, num_compute_units
from ..validation.engram import check_gate_common, check_gate_scalars  # noqa: F401 (re-exported)
from ..validation.engram import check_post_wkv_arguments
from ..validation.entry import settle_pending

# Up to this dim the row stays in registers at warps_for(row lanes) warps and a
# program may walk several tokens.
SINGLE_PASS_MAX_DIM = 2048
# Up to this dim the row stays in registers on fewer warps (about
# WIDE_ROW_ELEMS_PER_THREAD elements of a row per thread), one token per program:
# 79-93% of the HBM floor at dim 5120 (docs/design/engram_gate.md).
WIDE_ROW_MAX_DIM = 5120
WIDE_ROW_ELEMS_PER_THREAD = 40
# Past WIDE_ROW_MAX_DIM (or with chunk=): two passes over LOOP_CHUNK-wide blocks on
# LOOP_WARPS warps, one token per program (the fastest of a block/warps/tokens sweep).
LOOP_CHUNK = 1024
LOOP_WARPS = 2
# Dims past SINGLE_PASS_MAX_DIM, by programs (T * hc) per compute unit: up to
# SMALL_GRID_ROWS_PER_CU, two hinted passes of small_grid_chunk(dim)-wide blocks on
# SMALL_GRID_WARPS warps (the few programs need the L2 hints); up to
# WIDE_ROW_HINTS_MAX_ROWS_PER_CU, the wide single pass with eviction hints; past it
# without them (they cost 1.4-1.7% at T = 16384).
SMALL_GRID_ROWS_PER_CU = 4
SMALL_GRID_WARPS = 8
WIDE_ROW_HINTS_MAX_ROWS_PER_CU = 64
# From this many programs per compute unit (NVIDIA, wide-row dims) the persistent
# single pass takes over, pipelined over PERSISTENT_STAGES tokens: 90-94% of the
# floor at T >= 2048, dim 5120.
PERSISTENT_MIN_ROWS_PER_CU = 32
PERSISTENT_STAGES = 2
# Token blocking: at most this many tokens per program, and only while the grid
# keeps at least PROGRAMS_PER_CU programs per compute unit.
MAX_TOKENS_PER_PROGRAM = 8
PROGRAMS_PER_CU = 16


# --------------------------------------------------------------------------------------
# Launch geometry shared with the sharded gate (engram/sharded_gate.py)
# --------------------------------------------------------------------------------------


def row_pieces(n: int) -> tuple[int, int]:
    """Cover ``n`` columns with two power-of-two register blocks ``(HEAD, TAIL)``:
    ``HEAD`` = the largest power of two <= n, ``TAIL`` = the masked power of two that
    covers the rest (0 when n is a power of two; at least 16 lanes otherwise).
    Rows narrower than 16 take one masked 16-lane block."""
    if n < 16:
        return 16, 0
    head = 1 << (n.bit_length() - 1)
    rest = n - head
    tail = 0 if rest == 0 else max(16, triton.next_power_of_2(rest))
    return head, tail


def warps_for(lanes: int) -> int:
    """Warps for a program that holds ``lanes`` fp32 elements per operand: about
    8-16 elements per thread, so a bf16 row loads as 16-byte vectors without
    spilling the five live operands."""
    if lanes <= 1024:
        return 4
    if lanes <= 4096:
        return 8
    return 16


def tokens_per_program(num_rows: int, device: torch.device, tokens: int | None = None) -> int:
    """Tokens a program walks through for one stream (``num_rows = T * streams``).

    Each program otherwise re-reads ``q_w[h]`` and ``k_w[h]`` (as many bytes as its
    hidden and key rows together) from L2; walking ``TOKENS`` tokens reads them once.
    Blocks only while at least ``PROGRAMS_PER_CU`` programs per compute unit remain,
    so small batches keep their parallelism (T = 64 at hc = 4: one token each)."""
    if tokens is not None:
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens: expected a positive int, got {tokens!r}")
        return tokens
    per_cu = num_rows // (PROGRAMS_PER_CU * num_compute_units(device))
    block = 1
    while block * 2 <= min(per_cu, MAX_TOKENS_PER_PROGRAM):
        block *= 2
    return block


def launch_geometry(dim: int, chunk: int | None, num_warps: int | None,
                    max_row_dim: int = SINGLE_PASS_MAX_DIM) -> dict:
    """Constexprs of a gate kernel that must keep a ``dim`` row (single pass, up to
    ``max_row_dim``) or stream it in ``chunk``-wide blocks (two passes). A new dict
    each call (callers add keys); worked out once per argument set."""
    return dict(_launch_geometry(dim, chunk, num_warps, max_row_dim))


@functools.lru_cache(maxsize=256, typed=True)  # typed: a chunk of 32.0 is refused, not 32's
def _launch_geometry(dim: int, chunk: int | None, num_warps: int | None, max_row_dim: int) -> tuple:
    if chunk is None and dim <= max_row_dim:
        head, tail = row_pieces(dim)
        geom = dict(HEAD=head, TAIL=tail, CHUNK=16, LOOP=False)
        lanes = head + tail
    else:
        chunk = LOOP_CHUNK if chunk is None else chunk
        if not (is_pow2(chunk) and chunk >= 16):
            raise ValueError(f"chunk: expected a power of two >= 16, got {chunk!r}")
        geom = dict(HEAD=16, TAIL=0, CHUNK=chunk, LOOP=True)
        lanes = chunk
    check_num_warps(num_warps)
    geom["num_warps"] = num_warps if num_warps is not None else warps_for(lanes)
    return tuple(validated_geometry(geom).items())


@functools.lru_cache(maxsize=256)
def _validated_geometry(key: tuple) -> tuple:
    geom = {}
    for name, _, value in key:
        geom[name] = value
    return tuple(GateGeometry(**geom).as_dict().items())


def validated_geometry(geom: dict) -> dict:
    """``GateGeometry(**geom).as_dict()`` (its checks raise), worked out once per
    geometry (the key holds each value's type: 4.0 and True are not 4 and 1)."""
    key = []
    for name, value in geom.items():
        key.append((name, type(value), value))
    return dict(_validated_geometry(tuple(key)))


def check_num_warps(num_warps: int | None) -> None:
    check_warps_override("num_warps", num_warps)


# --------------------------------------------------------------------------------------
# Kernel pieces
# --------------------------------------------------------------------------------------


@triton.jit
def _signed_sqrt_gate(hidden_sq, key_sq, dot, inv_dim, dim_scale, eps, clamp_value):
    """The gate from the full-dim sums (scalars, fp32). ``dot == 0`` (and -0) take
    the positive sign, so the gate is ``sigmoid(+sqrt(clamp_value))`` there."""
    hidden_rms = tl.rsqrt(hidden_sq * inv_dim + eps)
    key_rms = tl.rsqrt(key_sq * inv_dim + eps)
    dot = dot * hidden_rms * key_rms * dim_scale
    mag = tl.sqrt(tl.maximum(tl.abs(dot), clamp_value))
    return tl.sigmoid(tl.where(dot < 0.0, -mag, mag))


@triton.jit
def _load_qk(q_row, k_row, q_stride_d, k_stride_d, start, N: tl.constexpr, DIM: tl.constexpr,
             POLICY: tl.constexpr):
    """``q_w[h] * k_w[h]`` over columns ``[start, start + N)``, fp32 (exact for bf16/fp16).
    ``POLICY``: the L2 eviction hint of both loads ("" = none)."""
    offs = start + tl.arange(0, N)
    valid = offs < DIM
    q = tl.load(q_row + offs * q_stride_d, mask=valid, other=0.0, eviction_policy=POLICY).to(tl.float32)
    k = tl.load(k_row + offs * k_stride_d, mask=valid, other=0.0, eviction_policy=POLICY).to(tl.float32)
    return q * k


@triton.jit
def _row_piece(row, stride_d, start, row_ok, N: tl.constexpr, DIM: tl.constexpr, POLICY: tl.constexpr):
    """Columns ``[start, start + N)`` of one row (hidden, key or value), fp32; zero
    past ``DIM`` or where ``row_ok`` is false. ``POLICY``: the load's L2 eviction hint."""
    offs = start + tl.arange(0, N)
    return tl.load(row + offs * stride_d, mask=(offs < DIM) & row_ok, other=0.0, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _stream_piece(
    hidden_row, key_row, qk,
    hidden_stride_d, kv_stride_d,
    start, token_ok, kv_ok,
    N: tl.constexpr, DIM: tl.constexpr, POLICY: tl.constexpr,
):
    """Load columns ``[start, start + N)`` of one (token, stream) and return the
    hidden block (in its load dtype, kept for the output) and the piece's three
    sums (fp32). ``POLICY``: the L2 eviction hint of both loads."""
    offs = start + tl.arange(0, N)
    valid = offs < DIM
    hidden = tl.load(hidden_row + offs * hidden_stride_d, mask=valid & token_ok, other=0.0, eviction_policy=POLICY)
    key = _row_piece(key_row, kv_stride_d, start, kv_ok, N, DIM, POLICY)
    hidden_f = hidden.to(tl.float32)
    hidden_sq = tl.sum(hidden_f * hidden_f, axis=0)
    key_sq = tl.sum(key * key, axis=0)
    dot = tl.sum(hidden_f * qk * key, axis=0)
    return hidden, hidden_sq, key_sq, dot


@triton.jit
def _store_piece(out_row, out_stride_d, hidden, value, gate, start, token_ok, N: tl.constexpr, DIM: tl.constexpr):
    offs = start + tl.arange(0, N)
    tl.store(
        out_row + offs * out_stride_d,
        (hidden.to(tl.float32) + gate * value).to(out_row.dtype.element_ty),
        mask=(offs < DIM) & token_ok,
    )


@triton.jit
def _masked_gate(hidden_sq, key_sq, dot, active, inv_dim, dim_scale, eps, clamp_value, HAS_MASK: tl.constexpr):
    """:func:`_signed_sqrt_gate` of the full-dim sums, 0 where the token is not
    ``active`` (its mask entry, read only with ``HAS_MASK``): the one gate of every
    path of both gate kernels (this one and engram/sharded_gate.py)."""
    gate = _signed_sqrt_gate(hidden_sq, key_sq, dot, inv_dim, dim_scale, eps, clamp_value)
    if HAS_MASK:
        gate = tl.where(active, gate, 0.0)
    return gate


@triton.jit
def _store_pieces(out_row, out_stride_d, hidden0, value0, hidden1, value1, gate, token_ok,
                  HEAD: tl.constexpr, TAIL: tl.constexpr, DIM: tl.constexpr):
    """The single pass's output: ``hidden + gate * value`` over the row's
    :func:`row_pieces` ``(HEAD, TAIL)``; ``hidden1`` / ``value1`` (the tail piece) are
    read only when ``TAIL > 0``."""
    _store_piece(out_row, out_stride_d, hidden0, value0, gate, 0, token_ok, HEAD, DIM)
    if TAIL > 0:
        _store_piece(out_row, out_stride_d, hidden1, value1, gate, HEAD, token_ok, TAIL, DIM)


@triton.jit
def _gate_token(
    token, stream, q_row, k_row, qk0, qk1,
    hidden_states, kv, token_mask, out,
    num_tokens, num_kv_tokens,
    hidden_stride_t, hidden_stride_h, hidden_stride_d,
    kv_stride_t, kv_stride_d, q_stride_d, k_stride_d, mask_stride,
    out_stride_t, out_stride_h, out_stride_d,
    inv_dim, dim_scale, eps, clamp_value,
    DIM: tl.constexpr, HC: tl.constexpr,
    HEAD: tl.constexpr, TAIL: tl.constexpr, CHUNK: tl.constexpr, LOOP: tl.constexpr,
    HAS_MASK: tl.constexpr, KEEP: tl.constexpr, LAST_USE: tl.constexpr,
):
    """Gate stream ``stream`` of token ``token`` (int64; a token past ``num_tokens``
    is masked off). ``qk0`` / ``qk1``: the stream's ``q_w * k_w`` row pieces (single
    pass; the two passes reload them per block and ignore these)."""
    token_ok = token < num_tokens
    kv_ok = token_ok & (token < num_kv_tokens)
    hidden_row = hidden_states + token * hidden_stride_t + stream * hidden_stride_h
    key_row = kv + token * kv_stride_t + (stream * DIM) * kv_stride_d
    value_row = kv + token * kv_stride_t + (HC * DIM) * kv_stride_d
    out_row = out + token * out_stride_t + stream * out_stride_h
    active = True  # read by _masked_gate only with HAS_MASK
    if HAS_MASK:  # issued early: its latency hides behind the row loads
        active = tl.load(token_mask + token * mask_stride, mask=token_ok, other=0) != 0

    if not LOOP:
        # Each piece's value row is loaded with its hidden and key rows, so
        # the program has a single load round trip.
        hidden0, hidden_sq, key_sq, dot = _stream_piece(
            hidden_row, key_row, qk0, hidden_stride_d, kv_stride_d,
            0, token_ok, kv_ok, HEAD, DIM, LAST_USE,
        )
        value0 = _row_piece(value_row, kv_stride_d, 0, kv_ok, HEAD, DIM, KEEP)
        hidden1, value1 = 0.0, 0.0  # the tail piece, when there is one
        if TAIL > 0:
            hidden1, hidden_sq1, key_sq1, dot1 = _stream_piece(
                hidden_row, key_row, qk1, hidden_stride_d, kv_stride_d,
                HEAD, token_ok, kv_ok, TAIL, DIM, LAST_USE,
            )
            value1 = _row_piece(value_row, kv_stride_d, HEAD, kv_ok, TAIL, DIM, KEEP)
            hidden_sq += hidden_sq1
            key_sq += key_sq1
            dot += dot1
        gate = _masked_gate(hidden_sq, key_sq, dot, active, inv_dim, dim_scale, eps, clamp_value, HAS_MASK)
        _store_pieces(out_row, out_stride_d, hidden0, value0, hidden1, value1, gate, token_ok, HEAD, TAIL, DIM)
    else:
        acc_hidden = tl.zeros([CHUNK], dtype=tl.float32)
        acc_key = tl.zeros([CHUNK], dtype=tl.float32)
        acc_dot = tl.zeros([CHUNK], dtype=tl.float32)
        for start in tl.range(0, DIM, CHUNK):
            hidden = _row_piece(hidden_row, hidden_stride_d, start, token_ok, CHUNK, DIM, KEEP)
            key = _row_piece(key_row, kv_stride_d, start, kv_ok, CHUNK, DIM, KEEP)
            qk = _load_qk(q_row, k_row, q_stride_d, k_stride_d, start, CHUNK, DIM, KEEP)
            acc_hidden += hidden * hidden
            acc_key += key * key
            acc_dot += hidden * qk * key
        gate = _masked_gate(
            tl.sum(acc_hidden, axis=0), tl.sum(acc_key, axis=0), tl.sum(acc_dot, axis=0), active,
            inv_dim, dim_scale, eps, clamp_value, HAS_MASK,
        )
        for start in tl.range(0, DIM, CHUNK):
            hidden = _row_piece(hidden_row, hidden_stride_d, start, token_ok, CHUNK, DIM, LAST_USE)
            value = _row_piece(value_row, kv_stride_d, start, kv_ok, CHUNK, DIM, KEEP)
            _store_piece(out_row, out_stride_d, hidden, value, gate, start, token_ok, CHUNK, DIM)


@triton.jit(do_not_specialize=["num_tokens", "num_kv_tokens", "steps", "token_step"])
def _engram_post_wkv_kernel(
    hidden_states, kv, q_weight, k_weight, token_mask, out,
    num_tokens, num_kv_tokens, steps, token_step,
    hidden_stride_t, hidden_stride_h, hidden_stride_d,
    kv_stride_t, kv_stride_d,
    q_stride_h, q_stride_d, k_stride_h, k_stride_d,
    mask_stride,
    out_stride_t, out_stride_h, out_stride_d,
    inv_dim, dim_scale, eps, clamp_value,
    DIM: tl.constexpr, HC: tl.constexpr, TOKENS: tl.constexpr,
    HEAD: tl.constexpr, TAIL: tl.constexpr, CHUNK: tl.constexpr, LOOP: tl.constexpr,
    HAS_MASK: tl.constexpr, KEEP: tl.constexpr, LAST_USE: tl.constexpr,
    PERSISTENT: tl.constexpr, INTERPRET: tl.constexpr, PERSISTENT_STAGES: tl.constexpr,
):
    """Grid ``cdiv(T, TOKENS) * HC``: program ``(b, h)`` gates stream ``h`` of tokens
    ``[b*TOKENS, (b+1)*TOKENS)`` one after the other, loading ``q_w[h]*k_w[h]`` once
    (single-pass path) instead of once per token. ``num_kv_tokens`` is the number
    of readable kv rows, already clamped to ``kv.shape[0]`` by the host.

    ``PERSISTENT`` (single pass): a grid of ``token_step * HC`` programs, about as
    many as fit on the GPU at once; program ``(b, h)`` gates stream ``h`` of tokens
    ``b, b + token_step, ...`` (``steps`` of them, those past ``num_tokens`` masked
    off), so the ``HC`` programs of a token still run side by side and share its
    value row in L2. The compiled loop takes ``steps`` at run time (no recompile per
    T); under the interpreter, whose loop needs a Python int, the host passes
    ``TOKENS = steps``.

    ``KEEP`` / ``LAST_USE``: L2 eviction hints ("" = none). ``KEEP``: the weights,
    the value row (shared by the ``HC`` programs of a token) and all of pass one's
    loads (its key too, which is not read again: the measured launch). ``LAST_USE``:
    a row's last read (pass two's hidden; the single pass's hidden and key)."""
    pid = tl.program_id(0)
    block = pid // HC
    stream = pid % HC
    q_row = q_weight + stream * q_stride_h
    k_row = k_weight + stream * k_stride_h
    qk0 = 0.0
    qk1 = 0.0
    if not LOOP:
        qk0 = _load_qk(q_row, k_row, q_stride_d, k_stride_d, 0, HEAD, DIM, KEEP)
        if TAIL > 0:
            qk1 = _load_qk(q_row, k_row, q_stride_d, k_stride_d, HEAD, TAIL, DIM, KEEP)

    if PERSISTENT and not INTERPRET:
        # Two stages: the next token's row loads are issued while this one is
        # reduced (faster than one stage: docs/design/engram_gate.md).
        for i in tl.range(0, steps, num_stages=PERSISTENT_STAGES):
            _gate_token(
                (block + i * token_step).to(tl.int64), stream, q_row, k_row, qk0, qk1,
                hidden_states, kv, token_mask, out, num_tokens, num_kv_tokens,
                hidden_stride_t, hidden_stride_h, hidden_stride_d, kv_stride_t, kv_stride_d,
                q_stride_d, k_stride_d, mask_stride, out_stride_t, out_stride_h, out_stride_d,
                inv_dim, dim_scale, eps, clamp_value,
                DIM, HC, HEAD, TAIL, CHUNK, LOOP, HAS_MASK, KEEP, LAST_USE,
            )
    else:
        for i in tl.range(0, TOKENS):
            if PERSISTENT:
                token = (block + i * token_step).to(tl.int64)
            else:
                token = (block * TOKENS + i).to(tl.int64)
            _gate_token(
                token, stream, q_row, k_row, qk0, qk1,
                hidden_states, kv, token_mask, out, num_tokens, num_kv_tokens,
                hidden_stride_t, hidden_stride_h, hidden_stride_d, kv_stride_t, kv_stride_d,
                q_stride_d, k_stride_d, mask_stride, out_stride_t, out_stride_h, out_stride_d,
                inv_dim, dim_scale, eps, clamp_value,
                DIM, HC, HEAD, TAIL, CHUNK, LOOP, HAS_MASK, KEEP, LAST_USE,
            )


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def wide_row_warps(lanes: int) -> int:
    """Warps of a wide single-pass program holding ``lanes`` row elements per
    operand: the power of two that keeps about ``WIDE_ROW_ELEMS_PER_THREAD`` per thread."""
    return triton.next_power_of_2(triton.cdiv(lanes, 32 * WIDE_ROW_ELEMS_PER_THREAD))


def small_grid_chunk(dim: int) -> int:
    """Block width of the small-grid two passes: the largest power of two <= dim / 2
    (2048 at dim 5120, 1024 at 2560: two and a half blocks per row)."""
    return max(16, 1 << ((dim // 2).bit_length() - 1))


def post_wkv_launch(T: int, hc: int, dim: int, device, chunk=None, num_warps=None, tokens=None,
                    l2_hints=None, programs=None) -> tuple[dict, int]:
    """``(constexprs and num_warps, tokens per program)`` of an ``engram_post_wkv``
    launch: :func:`launch_geometry` up to ``SINGLE_PASS_MAX_DIM``; up to
    ``WIDE_ROW_MAX_DIM``, by programs per compute unit (the table above
    ``SMALL_GRID_ROWS_PER_CU``), the hinted two passes on a small grid or the wide
    single pass (:func:`wide_row_warps` warps, one token; hinted up to
    ``WIDE_ROW_HINTS_MAX_ROWS_PER_CU``); the two passes at ``LOOP_WARPS`` warps and
    one token past it or with ``chunk``; from ``PERSISTENT_MIN_ROWS_PER_CU`` programs
    per compute unit on an NVIDIA GPU, the wide single pass runs persistent
    (``geom["PERSISTENT"]``; :func:`engram_post_wkv` sizes its grid). A ``chunk``,
    ``num_warps`` or ``tokens`` override turns off the small-grid, persistent and
    default-hint choices; ``l2_hints`` sets the hints; ``programs`` (a positive
    multiple of ``hc``) forces the persistent single pass with that many programs,
    which walks one token per step (a ``tokens`` override other than 1 is refused)."""
    rows_per_cu = T * hc / num_compute_units(device)
    # The hints, the small grid and the persistent grid only where they were
    # measured: the wide-row dims (and the persistent grid on NVIDIA only).
    measured = (chunk, num_warps, tokens) == (None, None, None) and SINGLE_PASS_MAX_DIM < dim <= WIDE_ROW_MAX_DIM
    if programs is not None:
        if not isinstance(programs, int) or programs < hc or programs % hc:
            raise ValueError(f"programs: expected a positive multiple of hc = {hc}, got {programs!r}")
        if tokens not in (None, 1):
            raise ValueError(f"tokens: the persistent grid (programs={programs}) walks one token per step, got tokens={tokens!r}")
        persistent = True
    else:
        persistent = (measured and rows_per_cu >= PERSISTENT_MIN_ROWS_PER_CU and not interpreting()
                      and arch(device).startswith("sm_"))
    if measured and not persistent and rows_per_cu <= SMALL_GRID_ROWS_PER_CU:
        chunk, num_warps = small_grid_chunk(dim), SMALL_GRID_WARPS
        l2_hints = True if l2_hints is None else l2_hints
    elif l2_hints is None:
        l2_hints = measured and not persistent and rows_per_cu <= WIDE_ROW_HINTS_MAX_ROWS_PER_CU
    geom = launch_geometry(dim, chunk, num_warps, WIDE_ROW_MAX_DIM)
    if persistent and geom["LOOP"]:
        raise ValueError(f"programs: the persistent grid runs the single pass only (dim {dim}, chunk {chunk})")
    geom["KEEP"], geom["LAST_USE"] = ("evict_last", "evict_first") if l2_hints else ("", "")
    geom["PERSISTENT"] = persistent
    if geom["LOOP"] or dim > SINGLE_PASS_MAX_DIM:
        if num_warps is None:
            geom["num_warps"] = LOOP_WARPS if geom["LOOP"] else wide_row_warps(geom["HEAD"] + geom["TAIL"])
        tokens = 1 if tokens is None else tokens
    if persistent:
        tokens = 1
    return validated_geometry(geom), tokens_per_program(T * hc, device, tokens)


_RESIDENT_PROGRAMS: dict = {}


def resident_programs_per_cu(compiled, device) -> int:
    """Programs of ``compiled`` (a Triton ``CompiledKernel``) that one NVIDIA SM holds
    at once: the smallest of what its registers (allocated per warp in units of
    256), threads, shared memory and the 32-block limit allow."""
    compiled._init_handles()  # loads the binary; n_regs is known from then on
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    fits = [props.regs_per_multiprocessor // max(regs_per_warp * warps, 1),
            props.max_threads_per_multi_processor // (32 * warps), 32]
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
    if compiled.metadata.shared and smem_per_sm:
        fits.append(smem_per_sm // (compiled.metadata.shared + 1024))  # 1 KB reserved per block
    return max(1, min(fits))


def engram_post_wkv(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    eps: float,
    clamp_value: float = 1e-6,
    token_mask: torch.Tensor | None = None,
    num_kv_tokens: int | None = None,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
    chunk: int | None = None,
    num_warps: int | None = None,
    tokens: int | None = None,
    l2_hints: bool | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """The Engram gate on one rank, fused: ``out = hidden + gate * value``.

    Args:
        hidden_states: ``[T, hc, dim]`` bf16/fp16/fp32, any strides.
        kv: ``[T_kv, (hc+1)*dim]`` in hidden's dtype, rows ``[key_0 | ... | key_{hc-1} |
            value]`` (the ``wkv`` projection, e.g. a strided view of a larger buffer).
        q_weight, k_weight: ``[hc, dim]``, any float dtype (read as fp32).
        eps: added to both mean squares before the rsqrt.
        clamp_value: lower bound on ``|dot|`` under the square root.
        token_mask: optional bool ``[T]``; false rows get gate 0 (``out = hidden``).
        num_kv_tokens: rows ``t >= num_kv_tokens`` (default ``kv.shape[0]``; never more
            than that) read key = value = 0, so ``out = hidden`` there.
        out: optional ``[T, hc, dim]`` output in hidden's dtype (may alias nothing
            else the call reads); allocated with ``torch.empty`` when omitted.
        check_inputs: validate shapes, dtypes and devices on the host (no device
            reads either way, so the call is CUDA-graph capturable).
        chunk, num_warps, tokens: launch overrides for tuning (``chunk`` forces the
            two-pass path with that power-of-two block width; ``tokens`` sets the
            tokens per program, see :func:`tokens_per_program`; dims past
            ``SINGLE_PASS_MAX_DIM`` default to one token, see :func:`post_wkv_launch`).
        l2_hints: launch override: L2 eviction hints on the loads (on by default
            only for the small-grid launch, see :func:`post_wkv_launch`).
        programs: launch override: run the persistent single pass on this many
            programs (a multiple of hc); by default the persistent grid is what the
            GPU holds at once, chosen for large T on NVIDIA GPUs.

    Returns:
        ``out`` ``[T, hc, dim]`` in hidden's dtype. All math is fp32.
    """
    settle_pending()  # raises an earlier call's pending error first
    if check_inputs:
        check_post_wkv_arguments(hidden_states, kv, q_weight, k_weight, eps, clamp_value, token_mask, num_kv_tokens,
                                 out)
    return run_engram_post_wkv(hidden_states, kv, q_weight, k_weight, eps=eps, clamp_value=clamp_value,
                               token_mask=token_mask, num_kv_tokens=num_kv_tokens, out=out, chunk=chunk,
                               num_warps=num_warps, tokens=tokens, l2_hints=l2_hints, programs=programs)


def run_engram_post_wkv(hidden_states, kv, q_weight, k_weight, *, eps, clamp_value=1e-6, token_mask=None,
                        num_kv_tokens=None, out=None, chunk=None, num_warps=None, tokens=None, l2_hints=None,
                        programs=None) -> torch.Tensor:
    """:func:`engram_post_wkv`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_post_wkv_arguments`); the eager body
    of its op (:mod:`kda_engram.ops.engram`)."""
    T, hc, dim = hidden_states.shape
    if out is None:
        out = torch.empty_like(hidden_states)
    if T == 0:
        return out
    # Host integers only: never read past kv's rows, whatever the caller passed.
    n_kv = kv.shape[0] if num_kv_tokens is None else max(0, min(int(num_kv_tokens), kv.shape[0]))
    device = hidden_states.device
    geom, block = post_wkv_launch(T, hc, dim, device, chunk, num_warps, tokens, l2_hints, programs)
    mask_arg = token_mask if token_mask is not None else hidden_states
    args = [
        hidden_states, kv, q_weight, k_weight, mask_arg, out,
        T, n_kv, 1, 1,
        *hidden_states.stride(),
        *kv.stride(),
        *q_weight.stride(), *k_weight.stride(),
        token_mask.stride(0) if token_mask is not None else 0,
        *out.stride(),
        1.0 / dim, dim**-0.5, float(eps), float(clamp_value),
    ]
    consts = dict(DIM=dim, HC=hc, TOKENS=block, HAS_MASK=token_mask is not None, INTERPRET=interpreting(),
                  PERSISTENT_STAGES=PERSISTENT_STAGES, **geom)
    grid = triton.cdiv(T, block) * hc
    if geom["PERSISTENT"]:
        if programs is None:
            # Compiled once per configuration (the launch below reuses it): the grid
            # is what the GPU holds at once, rounded down to whole tokens.
            key = (device.index, hidden_states.dtype, kv.dtype, q_weight.dtype, k_weight.dtype,
                   tuple(sorted(consts.items())))
            per_cu = _RESIDENT_PROGRAMS.get(key)
            if per_cu is None:
                compiled = _engram_post_wkv_kernel.warmup(*args, grid=(1,), **consts)
                per_cu = _RESIDENT_PROGRAMS[key] = resident_programs_per_cu(compiled, device)
            programs = max(hc, per_cu * num_compute_units(device) // hc * hc)
        token_step = min(programs // hc, T)
        steps = triton.cdiv(T, token_step)
        args[8:10] = [steps, token_step]
        grid = token_step * hc
        if consts["INTERPRET"]:
            consts["TOKENS"] = steps
    _engram_post_wkv_kernel[(grid,)](*args, **consts)
    return out
