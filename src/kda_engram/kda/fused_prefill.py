"""Experimental single-launch KDA prefill with 16-token chunks (bounded gate only).

:func:`fused_kda_prefill_c16` has the arguments and results of
:func:`kda_engram.kda.prefill.chunk_kda_prefill` (no conv, no groups) but runs in
one launch: every program owns one (sequence, head, V-tile), keeps its fp32
state tile on chip and, for each 16-token chunk of its sequence, prepares the
chunk from the raw projections (L2 norms, gate, cumsum, intra-chunk matrices,
inverse) right before the state step. Nothing but the raw inputs, the output
and the states crosses HBM (1.28 KB per token-head against 3.6 KB for the
two-stage contract).

Why chunk 16 and the bounded gate only: with ``lower_bound = L`` in
``[-5, 0)`` the chunk-local cumulative gate ``G`` (log2 units) of 16 tokens
lies in ``[16 L log2(e), 0] = [-115.4, 0]``, so ``2^G`` and ``2^-G`` are both
normal fp32/bf16 numbers and ``2^(G_i - G_j) = 2^G_i 2^-G_j`` factors with no
anchor. The softplus gate has no such bound (the peers' chunk-16 kernels
overflow on it); callers fall back to the two-stage path for it.

Per chunk, with ``S`` the V-first state tile at the chunk start, held
transposed (``st[k, v] = S[v, k]``) and ``kd = k̂ 2^G``, ``qd = q̂ 2^G``,
``ki = k̂ 2^-G``, ``kg = k̂ 2^(G_last - G)``::

    A  = strict_lower(beta_i kd ki^T)        T = (I + A)^-1   (exact product form)
    R  = beta (v - kd S^T)                   v_new = T R      (= u - w S^T)
    o  = scale (qd S^T + tril(qd ki^T) v_new)
    S  = S diag(2^G_last) + v_new^T kg

``T R`` folds the WY/UT ``w = T beta kd`` and ``u = T beta v`` into one product
(``u - w S^T = T beta (v - kd S^T)``), so ``w`` is never formed. The design
notes and measurements are in ``docs/design/kda_fused_prefill.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import L2NORM_EPS, LOG2E
from ..platform import interpreting
from ..validation.kda import check_state_structure

__all__ = ["BENCH_CONFIGS", "CHUNK_C16", "MIN_LOWER_BOUND", "fused_config", "fused_kda_prefill_c16"]

CHUNK_C16 = 16
# |G| over 16 tokens stays below 16 * 5 * log2(e) = 115.4 < 126 (smallest normal
# exponent): 2^G and 2^-G are normal numbers. Steeper bounds need anchoring.
MIN_LOWER_BOUND = -5.0
# The L2-norm epsilon as a compile-time constant of the kernels.
_L2_EPS = tl.constexpr(L2NORM_EPS)
_HEAD_DIMS = (16, 32, 64, 128)
# The launch configurations the sm_90a compile check builds and the GPU sweep
# (benchmarks/sweep_kda_fused.py) times, all under 1 KB of spills (table in
# docs/design/kda_fused_prefill.md). The sweep runs them in this order, the
# riskiest last: kda/chunk.py saw Triton 3.6 miscompile 32-column state tiles.
BENCH_CONFIGS = (
    {"BV": 64, "num_warps": 4, "num_stages": 2},
    {"BV": 64, "num_warps": 8, "num_stages": 2},
    {"BV": 128, "num_warps": 8, "num_stages": 2},
    {"BV": 64, "num_warps": 4, "num_stages": 2, "inv_precision": "tf32x3"},
    {"BV": 64, "num_warps": 8, "num_stages": 2, "pipeline": True},
    {"BV": 128, "num_warps": 8, "num_stages": 2, "pipeline": True},
    {"BV": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128},
    {"BV": 32, "num_warps": 4, "num_stages": 2},
)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # fp32 operands at IEEE precision (fp16 cannot hold 2^+-115, tf32 loses
    # digits); bf16 operands on the tensor cores with fp32 accumulation.
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _prep16(
    c, bos, length, i_h, o_k, o_c, dtb, a_scale, neg_bound,
    q_ptr, k_ptr, g_ptr, b_ptr,
    sq_t, sq_h, sq_k, sk_t, sk_h, sk_k, sg_t, sg_h, sg_k, sb_t, sb_h,
    C: tl.constexpr, IEEE: tl.constexpr, INV_PREC: tl.constexpr,
):
    """The state-independent half of chunk ``c``, from the raw inputs:
    ``(qd, kd, kg, aqk, T, beta, decay)``; ``qd``, ``kd``, ``kg`` ``[C, K]`` in the
    operand dtype, ``aqk`` (inclusive lower) and ``T = (I + A_kk)^-1`` ``[C, C]``
    fp32. Rows past the sequence's end load as zeros and get ``beta = 0`` and
    ``a = 0``, so they add nothing (a chunk wholly past the end is all zeros)."""
    DT: tl.constexpr = tl.float32 if IEEE else tl.bfloat16
    t0 = bos + c * C  # int64 base; tile offsets stay 32-bit
    live = (c * C + o_c) < length
    lm = live[:, None]
    q = tl.load(q_ptr + t0 * sq_t + i_h * sq_h + (o_c[:, None] * sq_t + o_k[None, :] * sq_k), mask=lm,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t0 * sk_t + i_h * sk_h + (o_c[:, None] * sk_t + o_k[None, :] * sk_k), mask=lm,
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t0 * sg_t + i_h * sg_h + (o_c[:, None] * sg_t + o_k[None, :] * sg_k), mask=lm,
                other=0.0).to(tl.float32)
    rb = tl.load(b_ptr + t0 * sb_t + i_h * sb_h + o_c * sb_t, mask=live, other=0.0).to(tl.float32)

    # beta, the bounded gate in log2 units, its chunk-local cumsum, L2 norms (eps inside the sqrt).
    beta = tl.where(live, tl.sigmoid(rb), 0.0)
    a = tl.where(lm, neg_bound * tl.sigmoid(a_scale * (g + dtb[None, :])), 0.0)
    G = tl.cumsum(a, 0)  # [C, K], in [16 L log2 e, 0]
    g_last = tl.sum(tl.where(o_c[:, None] == C - 1, G, 0.0), 0)  # dead rows add 0: = G at the last live row
    decay = tl.exp2(g_last)
    k = k * tl.rsqrt(tl.sum(k * k, 1) + _L2_EPS)[:, None]
    q = q * tl.rsqrt(tl.sum(q * q, 1) + _L2_EPS)[:, None]
    # 2^(G_i - G_j) = 2^G_i 2^-G_j: no anchor at C = 16.
    ki = k * tl.exp2(-G)
    ki_t = tl.trans(ki).to(DT)
    kg = (ki * decay[None, :]).to(DT)  # k^ 2^(G_last - G)
    eg = tl.exp2(G)
    qd = (q * eg).to(DT)
    kd = (k * eg).to(DT)
    aqk = tl.where(o_c[:, None] >= o_c[None, :], _dot(qd, ki_t, None, IEEE), 0.0)
    akk = tl.where(o_c[:, None] > o_c[None, :], beta[:, None] * _dot(kd, ki_t, None, IEEE), 0.0)

    # T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8) for the nilpotent
    # strictly lower A (A^16 = 0); fp32, 6 tiny 16x16x16 products (IEEE FMA by
    # default; tf32/tf32x3 put them on the tensor cores, see the config). The factors
    # are polynomials in A and commute, so they are paired to shorten the chain
    # (A^2 -> A^4 -> A^8 -> P2 -> T: 5 dependent products instead of 6).
    eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    a2 = tl.dot(akk, akk, input_precision=INV_PREC)
    p1 = tl.dot(eye - akk, eye + a2, input_precision=INV_PREC)
    a4 = tl.dot(a2, a2, input_precision=INV_PREC)
    a8 = tl.dot(a4, a4, input_precision=INV_PREC)
    p2 = tl.dot(eye + a4, eye + a8, input_precision=INV_PREC)
    tinv = tl.dot(p1, p2, input_precision=INV_PREC)
    return qd, kd, kg, aqk, tinv, beta, decay


@triton.jit
def _step16(
    c, st, qd, kd, kg, aqk, tinv, beta, decay, bos, length, i_h, o_v, o_c,
    v_ptr, out_ptr, scale, sv_t, sv_h, sv_v, so_t, so_h, so_v,
    p_ck, ck_on, ck_off,
    HAS_CKPT: tl.constexpr, C: tl.constexpr, IEEE: tl.constexpr,
):
    """The state step of chunk ``c`` on its prepared operands: writes the
    chunk's output rows (and the checkpoint that ends here) and returns the state
    after it. ``v_new = T beta (v - kd S^T)`` (= ``u - w S^T``)."""
    DT: tl.constexpr = tl.float32 if IEEE else tl.bfloat16
    t0 = bos + c * C
    live = (c * C + o_c) < length
    lm = live[:, None]
    v = tl.load(v_ptr + t0 * sv_t + i_h * sv_h + (o_c[:, None] * sv_t + o_v[None, :] * sv_v), mask=lm,
                other=0.0).to(tl.float32)
    sb = st.to(DT)
    o = _dot(qd, sb, None, IEEE)
    r = beta[:, None] * (v - _dot(kd, sb, None, IEEE))
    v_new = _dot(tinv.to(DT), r.to(DT), None, IEEE)  # [C, BV]
    vb = v_new.to(DT)
    o = _dot(aqk.to(DT), vb, o, IEEE)
    st = _dot(tl.trans(kg), vb, st * decay[:, None], IEEE)  # S diag(decay) + v_new^T kg, transposed
    tl.store(out_ptr + t0 * so_t + i_h * so_h + (o_c[:, None] * so_t + o_v[None, :] * so_v),
             (o * scale).to(out_ptr.dtype.element_ty), mask=lm)
    if HAS_CKPT:
        if ck_on & (ck_off == (c + 1) * C):
            tl.store(p_ck, st)
    return st


@triton.jit
def _kda_fused_c16_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, out_ptr,
    cu_ptr, s_in_ptr, s_out_ptr, s_idx_ptr, has_init_ptr,
    ck_ptr, ck_off_ptr, ck_idx_ptr,
    scale, neg_bound,
    sq_t, sq_h, sq_k, sk_t, sk_h, sk_k, sv_t, sv_h, sv_v, sg_t, sg_h, sg_k, sb_t, sb_h,
    s_alog, sd_h, sd_k, so_t, so_h, so_v, H,
    st_in_r, st_in_h, st_in_v, st_in_k,
    st_out_r, st_out_h, st_out_v, st_out_k,
    st_ck_r, st_ck_h, st_ck_v, st_ck_k,
    st_cu, st_idx, st_has, st_cko, st_cki,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    LOAD_STATE: tl.constexpr,  # 0: zeros, 1: initial_state[n], 2: cache[idx[n]] if has_init[n]
    STORE_STATE: tl.constexpr,  # 0: none, 1: final_state[n], 2: cache[idx[n]]
    HAS_CKPT: tl.constexpr,
    CKPT_INDEXED: tl.constexpr,
    IEEE: tl.constexpr,
    INV_PREC: tl.constexpr,  # input precision of the inverse's fp32 products
    PIPELINE: tl.constexpr,  # prepare chunk c + 1 beside chunk c's state step
    INTERPRET: tl.constexpr,
):
    """Grid ``(N * H * V / BV,)``; program ``(n * H + h) * (V / BV) + i_v``
    (the V-tiles of one head are neighbours, so they share its q/k/g reads in L2)."""
    NV: tl.constexpr = V // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // H
    i_h = (i_nh % H).to(tl.int64)

    bos_raw = tl.load(cu_ptr + i_n * st_cu)
    eos_raw = tl.load(cu_ptr + (i_n + 1) * st_cu)
    bos = bos_raw.to(tl.int64)
    length = (eos_raw - bos_raw).to(tl.int32)
    n_chunks = (length + C - 1) // C

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    full = (o_k[:, None] < K) & (o_v[None, :] < V)
    dtb = tl.load(dtb_ptr + i_h * sd_h + o_k * sd_k).to(tl.float32)
    a_scale = tl.exp(tl.load(alog_ptr + i_h * s_alog).to(tl.float32))

    st = tl.zeros([K, BV], dtype=tl.float32)  # st[k, v] = S[v, k]
    if LOAD_STATE == 1:
        p_in = s_in_ptr + i_n.to(tl.int64) * st_in_r + i_h * st_in_h + (o_v[None, :] * st_in_v + o_k[:, None] * st_in_k)
        st = tl.load(p_in).to(tl.float32)
    elif LOAD_STATE == 2:
        slot = tl.load(s_idx_ptr + i_n * st_idx).to(tl.int64)
        has = tl.load(has_init_ptr + i_n * st_has) != 0
        p_in = s_in_ptr + slot * st_in_r + i_h * st_in_h + (o_v[None, :] * st_in_v + o_k[:, None] * st_in_k)
        st = tl.load(p_in, mask=full & has & (slot >= 0), other=0.0).to(tl.float32)

    p_ck = ck_ptr
    ck_on = i_n < 0
    ck_off = i_n.to(tl.int64) * 0
    if HAS_CKPT:
        ck_off = tl.load(ck_off_ptr + i_n * st_cko).to(tl.int64)
        if CKPT_INDEXED:
            ck_row = tl.load(ck_idx_ptr + i_n * st_cki).to(tl.int64)
        else:
            ck_row = i_n.to(tl.int64)
        ck_on = (ck_off > 0) & (ck_off % 64 == 0) & (ck_off <= length) & (ck_row >= 0)
        p_ck = ck_ptr + ck_row * st_ck_r + i_h * st_ck_h + (o_v[None, :] * st_ck_v + o_k[:, None] * st_ck_k)

    # The interpreter needs a `while` over a loaded bound; compiled code takes the
    # `for`, software-pipelined at num_stages >= 2 (see kda/chunk.py). PIPELINE
    # prepares chunk c + 1 in the iteration that steps chunk c (its operands are
    # carried in compact layouts), so the prologue chain and the state chain are
    # independent instruction streams the scheduler can interleave.
    pa = (bos, length, i_h, o_k, o_c, dtb, a_scale, neg_bound, q_ptr, k_ptr, g_ptr, b_ptr,
          sq_t, sq_h, sq_k, sk_t, sk_h, sk_k, sg_t, sg_h, sg_k, sb_t, sb_h)
    if PIPELINE:
        qd, kd, kg, aqk, tinv, beta, decay = _prep16(0, *pa, C, IEEE, INV_PREC)
    if INTERPRET:
        c = 0
        while c < n_chunks:
            if PIPELINE:
                nq, nk, ng, naqk, ntinv, nbeta, ndecay = _prep16(c + 1, *pa, C, IEEE, INV_PREC)
            else:
                qd, kd, kg, aqk, tinv, beta, decay = _prep16(c, *pa, C, IEEE, INV_PREC)
            st = _step16(c, st, qd, kd, kg, aqk, tinv, beta, decay, bos, length, i_h, o_v, o_c,
                         v_ptr, out_ptr, scale, sv_t, sv_h, sv_v, so_t, so_h, so_v, p_ck, ck_on, ck_off,
                         HAS_CKPT, C, IEEE)
            if PIPELINE:
                qd, kd, kg, aqk, tinv, beta, decay = nq, nk, ng, naqk, ntinv, nbeta, ndecay
            c += 1
    else:
        if PIPELINE:
            for c in range(0, n_chunks):
                nq, nk, ng, naqk, ntinv, nbeta, ndecay = _prep16(c + 1, *pa, C, IEEE, INV_PREC)
                st = _step16(c, st, qd, kd, kg, aqk, tinv, beta, decay, bos, length, i_h, o_v, o_c,
                             v_ptr, out_ptr, scale, sv_t, sv_h, sv_v, so_t, so_h, so_v, p_ck, ck_on, ck_off,
                             HAS_CKPT, C, IEEE)
                qd, kd, kg, aqk, tinv, beta, decay = nq, nk, ng, naqk, ntinv, nbeta, ndecay
        else:
            for c in range(0, n_chunks):
                qd, kd, kg, aqk, tinv, beta, decay = _prep16(c, *pa, C, IEEE, INV_PREC)
                st = _step16(c, st, qd, kd, kg, aqk, tinv, beta, decay, bos, length, i_h, o_v, o_c,
                             v_ptr, out_ptr, scale, sv_t, sv_h, sv_v, so_t, so_h, so_v, p_ck, ck_on, ck_off,
                             HAS_CKPT, C, IEEE)

    if STORE_STATE == 1:
        p_out = (s_out_ptr + i_n.to(tl.int64) * st_out_r + i_h * st_out_h
                 + (o_v[None, :] * st_out_v + o_k[:, None] * st_out_k))
        tl.store(p_out, st)
    elif STORE_STATE == 2:
        slot_out = tl.load(s_idx_ptr + i_n * st_idx).to(tl.int64)
        p_out = s_out_ptr + slot_out * st_out_r + i_h * st_out_h + (o_v[None, :] * st_out_v + o_k[:, None] * st_out_k)
        tl.store(p_out, st, mask=full & (slot_out >= 0))


def fused_config(num_seqs: int, num_heads: int, head_v: int, device=None) -> dict:
    """Default launch configuration (``BV``, ``num_warps``, ``num_stages``).

    Picked from the sm_90a compile table in ``docs/design/kda_fused_prefill.md``
    (no spills, fewest registers); not yet timed on a GPU: the sweep
    ``benchmarks/sweep_kda_fused.py`` decides it."""
    bv = min(64, head_v)
    return {"BV": bv, "num_warps": 4, "num_stages": 2}


def fused_kda_prefill_c16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_cache: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    checkpoint_state: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    checkpoint_state_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA prefill of a varlen batch in one launch, 16-token chunks, bounded gate.

    Arguments, state rows and results as :func:`kda_engram.kda.prefill.chunk_kda_prefill`
    without the conv and groups (and with ``check_inputs=False``: only the
    argument combinations and ``lower_bound`` are checked, nothing is read back,
    so the call is CUDA-graph capturable):

    * ``q``, ``k``, ``raw_g``: ``[1, T, H, K]``; ``v``: ``[1, T, H, V]``;
      ``raw_beta``: ``[1, T, H]``; any strides (read in place, never copied).
      K, V in 16, 32, 64, 128.
    * ``A_log`` ``[H]``; ``dt_bias`` ``[H * K]`` or ``[H, K]``.
    * ``lower_bound`` ``L`` in ``[-5, 0)`` (required: the gate
      ``a = L sigmoid(exp(A_log) (raw_g + dt_bias))``); ``scale`` defaults to ``K^-0.5``.
    * ``cu_seqlens`` int32/int64 ``[N+1]``; zero-length sequences allowed.
    * State fp32 V-first ``[*, H, V, K]``: ``initial_state`` / ``output_final_state``,
      or ``state_cache`` + ``state_indices`` (-1 = no row) + ``has_initial_state``
      (updated in place; final state then ``None``); ``checkpoint_offsets``
      (multiples of 64, 0 = none) into ``checkpoint_state`` rows
      ``checkpoint_state_indices[n]`` (or row ``n``).
    * ``out`` ``[1, T, H, V]`` (default: new, ``v``'s dtype), written only where
      ``cu_seqlens`` covers; it may be ``v`` itself (each program reads a chunk's
      ``v`` columns before it writes the same rows and columns of ``out``).
    * ``config``: ``BV``, ``num_warps``, ``num_stages`` (and ``maxnreg``, a register
      cap per thread, and ``inv_precision``: ``"ieee"`` (default), ``"tf32x3"`` or
      ``"tf32"`` for the 16x16 inverse's products, and ``pipeline``: prepare the
      next chunk beside the current state step) overrides of :func:`fused_config`.

    Returns ``(out [1, T, H, V], final_state [N, H, V, K] | None)``.
    """
    check_state_structure(initial_state, output_final_state, state_cache, state_indices, has_initial_state,
                          checkpoint_state, checkpoint_offsets, checkpoint_state_indices)
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not (
            MIN_LOWER_BOUND <= lower_bound < 0):
        raise ValueError(f"lower_bound: expected a float in [{MIN_LOWER_BOUND}, 0) (the chunk-16 path serves the "
                         f"bounded gate only), got {lower_bound!r}")
    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    if K not in _HEAD_DIMS or V not in _HEAD_DIMS:
        raise ValueError(f"q/v: head dims K, V must be one of {_HEAD_DIMS}, got K={K}, V={V}")
    device = q.device
    num_seqs = cu_seqlens.numel() - 1
    if scale is None:
        scale = K**-0.5
    if out is None:
        out = torch.empty(1, T, H, V, dtype=v.dtype, device=device)
    final_state = None
    if output_final_state:
        final_state = torch.empty(num_seqs, H, V, K, dtype=torch.float32, device=device)
    if num_seqs <= 0 or H == 0:
        return out, final_state

    cfg = fused_config(num_seqs, H, V, device)
    if config:
        cfg.update({key: val for key, val in config.items() if key in ("BV", "num_warps", "num_stages", "maxnreg",
                                                                      "inv_precision", "pipeline")})
    bv = cfg["BV"]
    if isinstance(bv, bool) or not isinstance(bv, int) or bv < 16 or V % bv:
        raise ValueError(f"config: BV must be an int >= 16 dividing V={V}, got {bv!r}")
    inv_prec = cfg.get("inv_precision", "ieee")
    if inv_prec not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"config: inv_precision must be 'ieee', 'tf32' or 'tf32x3', got {inv_prec!r}")
    if interpreting():
        inv_prec = "ieee"  # the interpreter computes every fp32 product in fp32
    if num_seqs * H * (V // bv) >= 2**31:
        raise ValueError(f"cu_seqlens/q: N x H x V/BV programs must stay below 2^31, got N={num_seqs}, H={H}")

    if state_cache is not None:
        load_mode, store_mode, s_in, s_out = 2, 2, state_cache, state_cache
    else:
        load_mode = 1 if initial_state is not None else 0
        store_mode = 1 if final_state is not None else 0
        s_in, s_out = initial_state, final_state
    dummy = out  # stands in for absent pointers; never dereferenced (constexpr-disabled paths)
    st4 = lambda x: tuple(x.stride()) if x is not None and x.dim() == 4 else (0, 0, 0, 0)  # noqa: E731
    st1 = lambda x: x.stride(0) if x is not None else 0  # noqa: E731
    has_t = has_initial_state.view(torch.uint8) if has_initial_state is not None else cu_seqlens
    idx_t = state_indices if state_indices is not None else cu_seqlens
    has_ckpt = checkpoint_offsets is not None
    ck_indexed = checkpoint_state_indices is not None
    # dt_bias [H * K] or [H, K]: strides of its [H, K] view, read in place.
    sd_h, sd_k = (dt_bias.stride(0) * K, dt_bias.stride(0)) if dt_bias.dim() == 1 else dt_bias.stride()
    ieee = q.dtype != torch.bfloat16  # fp32 and fp16 inputs: fp32 operands (fp16 cannot hold 2^+-115)

    _kda_fused_c16_kernel[(num_seqs * H * (V // bv),)](
        q, k, v, raw_g, raw_beta, A_log, dt_bias, out,
        cu_seqlens,
        s_in if s_in is not None else dummy, s_out if s_out is not None else dummy, idx_t, has_t,
        checkpoint_state if has_ckpt else dummy,
        checkpoint_offsets if has_ckpt else cu_seqlens,
        checkpoint_state_indices if ck_indexed else cu_seqlens,
        float(scale), float(lower_bound) * LOG2E,
        *q.stride()[1:], *k.stride()[1:], *v.stride()[1:], *raw_g.stride()[1:], *raw_beta.stride()[1:],
        A_log.stride(0), sd_h, sd_k, *out.stride()[1:], H,
        *st4(s_in), *st4(s_out), *st4(checkpoint_state if has_ckpt else None),
        cu_seqlens.stride(0), st1(state_indices), st1(has_initial_state),
        st1(checkpoint_offsets), st1(checkpoint_state_indices),
        K=K, V=V, BV=bv, C=CHUNK_C16,
        LOAD_STATE=load_mode, STORE_STATE=store_mode, HAS_CKPT=has_ckpt, CKPT_INDEXED=ck_indexed,
        IEEE=ieee, INV_PREC=inv_prec, PIPELINE=bool(cfg.get("pipeline", False)), INTERPRET=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out, final_state
