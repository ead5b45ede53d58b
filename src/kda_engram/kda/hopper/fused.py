"""The fused KDA prefill on Hopper (sm_90a), in Gluon: raw ``q, k, v, raw_g, raw_beta``
in, ``o`` (and the states) out, in one launch; the prologue's work stays on chip beside
the walk (issue 52, ``FUSED_PREFILL.md``).

One CTA per (sequence, head), chunks of ``BT = 32`` tokens (two 16-token sub-chunks),
two partitions:

* **producer** (one warpgroup, or two that split each chunk's rows: ``producer_warps``
  4 or 8): the TMA loads of the raw ``q, k, g`` tiles (two raw
  stages) and of ``v`` (into the ring), and per chunk the gate (log2 units), its
  cumsum ``G``, the L2 norms, the walk operands ``qg = q̂ 2^G``, ``kd = k̂ 2^G``,
  ``decay = 2^G_last``, the strips of ``A_kk`` and ``A_qk`` re-anchored at each strip's
  end (``mma_v2``), the inverse ``(I + A_kk)^-1`` by 16 x 16 blocks in fp32, and
  the fold ``t_fold = M^T kg``, ``a_fold = A_qk M`` (``M = T diag(beta)`` split hi/lo),
  written into a three-stage shared-memory ring;
* **consumers** (the default partition, two warpgroups, one per V half): the Gluon walk
  (:func:`kda_engram.kda.hopper.walk._walk_sequence`) reading its operands from the
  ring: the fp32 state stays in wgmma registers for the whole sequence.

So per token-head only the raw inputs are read and ``o`` written (about 1.35 KB at
K = V = 128 in bf16, against about 4.2 KB for the folded prologue and the walk).
Chunk 32, not 64: a ``[64, 128]`` fp32 tile is 64 registers per thread in a
warpgroup, and the producer needs the gate cumsum and both normalised inputs at once
(docs/design/kda_fused_prefill.md, "The register budget does not close at chunk 64").

The order of operations is :func:`kda_engram.kda.hopper.fused_model.model_fused_prefill`
with ``chunk_size=32``. Served: bf16 ``q, k, v``, K = V = 128, every gate form (bounded,
softplus, a precomputed log decay), raw ``g`` bf16 or fp32, ``qk_l2norm`` and
``beta_sigmoid`` either way, the state contract of the walk (initial / final state, the
state cache with negative rows and ``has_initial_state``, checkpoints). Where a
sub-chunk can span more than ``MAX_ANCHOR_SPAN`` (the unbounded gates, or a bounded one
past ``|lower_bound| = MAX_ANCHOR_SPAN / (16 log2 e)``: :func:`needs_exact_diagonal`),
the kernel flags such chunks at run time and forms their two diagonal blocks exactly
(:func:`_exact_diagonal_block`); below the diagonal the boundary-anchored product is exact
for any decay. :func:`fused_unsupported` says why a call is not served. The record of
experiments is docs/design/kda_fused_prefill.md.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from ...constants import MAX_ANCHOR_SPAN, SUB_CHUNK
from ..gate import L2NORM_EPS_JIT, chunk_log2_gate, gate_form, gate_pointers, needs_exact_diagonal
from .walk import _walk_sequence, state_launch_args, tma_compatible, tma_descriptor

__all__ = ["FUSED_CHUNK", "FUSED_PRODUCER_REGS", "fused_prefill", "fused_prefill_launch", "fused_unsupported",
           "needs_exact_diagonal"]

FUSED_CHUNK = 32
#: Ring stages: the producer writes chunk c + 1 while the consumers walk chunk c, and
#: ``v`` of chunk c + 2 is in flight.
FUSED_RING = 3
#: Warps of the producer partition: one warpgroup, or two splitting each chunk's rows.
FUSED_PRODUCER_WARPS = 4
#: Registers per producer thread, by its warp count; the consumers' two warpgroups get
#: the rest of the register file ((65,536 - 32 x warps x this) / 256 = 168, what the
#: checkpointing walk needs).
FUSED_PRODUCER_REGS = {4: 168, 8: 88}
#: The largest sub-chunk decay span (log2 units) whose anchored factors stay normal
#: numbers; an unbounded gate's chunk past it takes the exact diagonal blocks.
_MAX_SPAN = gl.constexpr(MAX_ANCHOR_SPAN)
#: Channels per step of the exact diagonal blocks (a [16, 16, 8] tile: 16 per thread).
_DIAG_KC = gl.constexpr(8)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _beta(beta_ptr, sb_t, idx, Lc, BETA_SIGMOID: gl.constexpr):
    """The chunk's ``beta`` at rows ``idx`` (in ``idx``'s layout; 0 past the sequence end),
    read where it is used: a ``[BT]`` vector in the producer's row layout would hold all
    BT values in every thread."""
    valid = idx < Lc
    beta = gl.load(beta_ptr + idx.to(gl.int64) * sb_t, mask=valid, other=0.0).to(gl.float32)
    if BETA_SIGMOID:
        beta = 1.0 / (1.0 + gl.exp(-beta))
    return gl.where(valid, beta, gl.zeros_like(beta))


@gluon.jit
def _store_row_inv_norms(x_s, nrm_s, Lc, BT: gl.constexpr, K: gl.constexpr, PW: gl.constexpr):
    """``1 / sqrt(||x_i||^2 + eps)`` of the raw tile's rows into ``nrm_s [BT]`` (rows past
    ``Lc`` count as zero, so the next sequence's rows cannot bring inf or NaN). A row
    layout (thread = ``K / 16`` adjacent channels of ``BT / (2 PW)`` rows): a row's sum is
    in-thread adds and four shuffles, where the channel layout needs five shuffles and a
    cross-warp exchange per row."""
    RL: gl.constexpr = gl.BlockedLayout([1, K // 16], [2, 16], [PW, 1], [1, 0])
    x = x_s.load(RL).to(gl.float32)
    r = gl.arange(0, BT, gl.SliceLayout(1, RL))
    x = gl.where(gl.expand_dims(r < Lc, 1), x, gl.zeros_like(x))
    nrm_s.store(gl.rsqrt(gl.sum(x * x, 1) + L2NORM_EPS_JIT))


@gluon.jit
def _exact_diagonal_block(raw_t, nrm_s, u_s, a2_t, beta_ptr, sb_t, Lc, zs, b: gl.constexpr, BT: gl.constexpr,
                          BS: gl.constexpr, K: gl.constexpr, KC: gl.constexpr, PW: gl.constexpr,
                          QK_L2NORM: gl.constexpr, BETA_SIGMOID: gl.constexpr):
    """Sub-chunk ``b``'s diagonal blocks of ``A_qk`` (``j <= i``) and ``A_kk`` (``j < i``,
    rows times beta), exactly for any decay: ``sum_c x̂_ic k̂_jc 2^(u_ic - u_jc)``, the
    exponent at most 0 on and below the diagonal, so no factor leaves the fp32 range
    (the anchored product's factors do once a sub-chunk's span passes 126). Written over
    ``a2_t`` (``[A_qk; A_kk]``, ``[2 BT, BT]`` fp32). ``raw_t``: the raw ``[q; k]`` rows
    (``[2 BT, K]`` bf16, plain row-major), ``u_s``: ``G - s0`` (``[BT, K]`` fp32). A
    ``[BS i, BS j, KC c]`` tile per step, the channel sum inside a thread; rows and
    columns past ``Lc`` are zero (the raw rows there are the next sequence's). ``zs``: the
    producer's loop-variant zero (its row indices are built from it, not hoisted)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 2, KC], [4, 8, 1], [PW, 1, 1], [2, 1, 0])
    LI: gl.constexpr = gl.SliceLayout(1, L3)
    LJ: gl.constexpr = gl.SliceLayout(0, L3)
    LA: gl.constexpr = gl.SliceLayout(2, L3)
    i_in = gl.expand_dims(b * BS + zs + gl.arange(0, BS, gl.SliceLayout(1, LI)) < Lc, 1)
    j_in = gl.expand_dims(b * BS + zs + gl.arange(0, BS, gl.SliceLayout(1, LJ)) < Lc, 1)
    acc_q = gl.zeros([BS, BS], gl.float32, LA)
    acc_k = gl.zeros([BS, BS], gl.float32, LA)
    for c0 in gl.static_range(0, K, KC):
        ui = u_s.slice(b * BS, BS).slice(c0, KC, dim=1).load(LI)
        uj = u_s.slice(b * BS, BS).slice(c0, KC, dim=1).load(LJ)
        qi = raw_t.slice(b * BS, BS).slice(c0, KC, dim=1).load(LI).to(gl.float32)
        ki = raw_t.slice(BT + b * BS, BS).slice(c0, KC, dim=1).load(LI).to(gl.float32)
        kj = raw_t.slice(BT + b * BS, BS).slice(c0, KC, dim=1).load(LJ).to(gl.float32)
        qi = gl.where(i_in, qi, gl.zeros_like(qi))
        ki = gl.where(i_in, ki, gl.zeros_like(ki))
        kj = gl.where(j_in, kj, gl.zeros_like(kj))
        d = gl.minimum(gl.expand_dims(ui, 1) - gl.expand_dims(uj, 0), 0.0)  # above the diagonal: masked below
        e = gl.exp2(d) * gl.expand_dims(kj, 0)
        acc_q += gl.sum(gl.expand_dims(qi, 1) * e, 2)
        acc_k += gl.sum(gl.expand_dims(ki, 1) * e, 2)
    ri = gl.arange(0, BS, gl.SliceLayout(1, LA)) + zs
    rj = gl.arange(0, BS, gl.SliceLayout(0, LA)) + zs
    row_scale = _beta(beta_ptr, sb_t, b * BS + ri, Lc, BETA_SIGMOID)
    if QK_L2NORM:  # x̂ = x / ||x||: the rows' and the columns' inverse norms
        nq = nrm_s.index(zs).slice(b * BS, BS)
        nk = nrm_s.index(1 + zs).slice(b * BS, BS)
        nk_j = gl.expand_dims(nk.load(gl.SliceLayout(0, LA)), 0)
        acc_q = acc_q * gl.expand_dims(nq.load(gl.SliceLayout(1, LA)), 1) * nk_j
        acc_k = acc_k * gl.expand_dims(nk.load(gl.SliceLayout(1, LA)), 1) * nk_j
    lower = gl.expand_dims(rj, 0) <= gl.expand_dims(ri, 1)
    strict = gl.expand_dims(rj, 0) < gl.expand_dims(ri, 1)
    a2_t.slice(b * BS, BS).slice(b * BS, BS, dim=1).store(gl.where(lower, acc_q, gl.zeros_like(acc_q)))
    a2_t.slice(BT + b * BS, BS).slice(b * BS, BS, dim=1).store(
        gl.where(strict, acc_k, gl.zeros_like(acc_k)) * gl.expand_dims(row_scale, 1))


@gluon.jit
def _block_inverse(a2_v, d_v, t_v, zs, BT: gl.constexpr, BS: gl.constexpr, PW: gl.constexpr, TL: gl.constexpr):
    """``T = (I + A_kk)^-1`` in fp32 (``[BT, BT]`` in ``TL``), by 16 x 16 blocks: the
    diagonal blocks by column-oriented forward substitution, both at once (block ``b`` on
    warps ``b PW / 2 ..``; thread = one column, its 16 rows in registers), the second
    block row applied to ``[A_10, I]`` (so it yields ``T_11 A_10`` beside ``T_11``), then
    ``T_10 = -(T_11 A_10) T_00``. 120 FMAs per thread where the 32-row substitution took
    496, and no dependence between rows within a step.

    ``a2_v``: ``[A_qk; A_kk]`` stored transposed (``[BT, 2 BT]`` fp32, memory row ``j`` =
    column ``j``), every thread's writes visible. ``d_v [BS, 2 BS]``, ``t_v [BT, BT]``:
    fp32 scratch (A_kk's diagonal blocks, then T). ``zs``: a loop-variant zero of the
    producer's (the identity is built from it, not hoisted)."""
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a stack of row-major tiles (.index)
    PLAIN3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    CP: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [PW, 1], [1, 0])
    # [2 b, BS i, BT c]: block b's rows i, every column c (thread = (b, c)).
    LX3: gl.constexpr = gl.BlockedLayout([1, BS, 1], [1, 1, 32], [2, 1, PW // 2], [2, 1, 0])
    L_BI: gl.constexpr = gl.SliceLayout(2, LX3)
    # The product T_11 A_10 times T_00: [BS i, BS m, BS c], the m sum in a thread.
    L3: gl.constexpr = gl.BlockedLayout([1, BS, 1], [2, 1, 16], [PW, 1, 1], [2, 1, 0])
    # d[j, b BS + i] = A_kk[b BS + i, b BS + j]: column j of diagonal block b, one row per step.
    for b in gl.static_range(2):
        d_v.slice(b * BS, BS, dim=1).store(a2_v.slice(b * BS, BS).slice(BT + b * BS, BS, dim=1).load(CP))
    b3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, gl.SliceLayout(1, L_BI)), 1), 2)
    i3 = gl.expand_dims(gl.expand_dims(gl.arange(0, BS, gl.SliceLayout(0, L_BI)), 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, gl.SliceLayout(1, LX3))), 0), 1) + zs
    a10 = a2_v.slice(BT + BS, BS, dim=1).permute((1, 0)).load(gl.SliceLayout(0, LX3))  # [i, c] = A_kk[BS + i, c]
    X = gl.where((b3 == 1) & (c3 < BS), gl.expand_dims(a10, 0), gl.where(c3 == b3 * BS + i3, 1.0, 0.0))
    gl.thread_barrier()  # d complete
    d3 = d_v._reinterpret(gl.float32, [BS, 2, BS], PLAIN)
    for j in gl.static_range(BS):  # static: row j of X is a register pick
        aj = gl.expand_dims(d3.index(j).load(L_BI), 2)  # [2, BS, 1]: A_bb[:, j]
        xj = gl.expand_dims(gl.sum(gl.where(i3 == j, X, gl.zeros_like(X)), 1), 1)
        # Rows i <= j are final: a select the compiler folds per register.
        X = gl.where(i3 > j, X - aj * xj, X)
    t_v._reinterpret(gl.float32, [2, BS, BT], PLAIN3).store(X)  # T, with T_11 A_10 in block (1, 0)
    gl.thread_barrier()
    w = t_v.slice(BS, BS).slice(0, BS, dim=1).load(gl.SliceLayout(2, L3))
    t00 = t_v.slice(0, BS).slice(0, BS, dim=1).load(gl.SliceLayout(0, L3))
    t10 = -gl.sum(gl.expand_dims(w, 2) * gl.expand_dims(t00, 0), 1)
    gl.thread_barrier()  # every thread has read T_11 A_10
    t_v.slice(BS, BS).slice(0, BS, dim=1).store(t10)
    gl.thread_barrier()
    return t_v.load(TL)


@gluon.jit
def _row_operands(raw_rows, inv_norms, vm, u, f0, s0, e_g, walk_op, row_op, CL: gl.constexpr, ROW: gl.constexpr,
                  QK_L2NORM: gl.constexpr, EXACT_DIAG: gl.constexpr):
    """One input's rows of a chunk (q's or k's, thread = channel): ``x̂`` (zero past the
    end, normalised), its walk operand ``x̂ 2^G`` into ``walk_op`` (``qg`` or ``kd``) and
    its row operand ``x̂ f0`` of the ``A`` product into ``row_op``; returns ``x̂``. The
    walk operand is ``x̂ f0 2^s0`` unless ``EXACT_DIAG``, where ``f0`` may overflow past a
    126 span and it takes its own ``exp2``."""
    xf = raw_rows.load(CL).to(gl.float32)
    xf = gl.where(vm, xf, gl.zeros_like(xf))
    if QK_L2NORM:
        xf = xf * gl.expand_dims(inv_norms.load(ROW), 1)
    xx = xf * f0
    if EXACT_DIAG:
        walk_op.store((xf * gl.exp2(u + gl.expand_dims(s0, 0))).to(gl.bfloat16))
    else:
        walk_op.store((xx * e_g).to(gl.bfloat16))
    row_op.store(xx.to(gl.bfloat16))
    return xf


@gluon.jit
def _issue_chunk(c, NT, bos, h, q_desc, k_desc, g_desc, v_desc, qk_s, g_s, v_s, raw_ready, ring_ready,
                 ring_empty, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, RING: gl.constexpr):
    """Chunk ``c``'s TMA loads (none past the last chunk): raw ``q, k`` (one ``[2 BT, K]``
    tile, q's rows first) and ``g`` into raw stage ``c % 2``, ``v`` into ring stage
    ``c % RING`` once the consumers released it."""
    pred = c < NT
    r = bos + c * BT
    rs = c % 2
    rbar = raw_ready.index(rs)
    mbarrier.expect(rbar, q_desc.block_type.nbytes + k_desc.block_type.nbytes + g_desc.block_type.nbytes,
                    pred=pred)
    tma.async_copy_global_to_shared(q_desc, [r, h * K], rbar, qk_s.index(rs).slice(0, BT), pred=pred)
    tma.async_copy_global_to_shared(k_desc, [r, h * K], rbar, qk_s.index(rs).slice(BT, BT), pred=pred)
    tma.async_copy_global_to_shared(g_desc, [r, h * K], rbar, g_s.index(rs), pred=pred)
    st = c % RING
    mbarrier.wait(ring_empty.index(st), ((c // RING) & 1) ^ 1, pred=pred & (c >= RING))
    vbar = ring_ready.index(st)
    mbarrier.expect(vbar, v_desc.block_type.nbytes, pred=pred)  # the first of the stage's two arrivals
    tma.async_copy_global_to_shared(v_desc, [r, h * V], vbar, v_s.index(st), pred=pred)


@gluon.jit
def _producer(q_desc, k_desc, g_desc, v_desc, qk_s, g_s, v_s, qg_s, kd_s, tf_s, af_s, dec_s, a2_s, aq_s,
              kg_s, x_s, col_s, mh_s, ml_s, nrm_s, u_s,
              raw_ready, ring_ready, ring_empty,
              b_ptr, sb_t, sb_h, alog_ptr, salog, dtb_ptr, sdtb_h, sdtb_c, lower_bound,
              h, bos, seqlen, NT,
              K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BS: gl.constexpr, RING: gl.constexpr,
              GATE: gl.constexpr, EXACT_DIAG: gl.constexpr, QK_L2NORM: gl.constexpr, BETA_SIGMOID: gl.constexpr,
              PHASES: gl.constexpr, PW: gl.constexpr):
    """The producer partition (module docstring): every chunk's ring tiles, in order."""
    # Thread = one channel, the chunk's BT rows in its registers: the gate cumsum and the
    # picks of G at the sub-chunk ends stay inside a thread.
    # With two producer warpgroups (PW = 8) the chunk's rows split in two: each thread
    # holds one channel of BT / RG rows, and the cumsum and the picks of G cross the row
    # groups through shared memory.
    RG: gl.constexpr = PW // 4
    CL: gl.constexpr = gl.BlockedLayout([BT // RG, 1], [1, 32], [RG, 4], [0, 1])
    ROW: gl.constexpr = gl.SliceLayout(1, CL)
    CH: gl.constexpr = gl.SliceLayout(0, CL)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, PW // 2], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # The inverse's result T [BT, BT] and M = T diag(beta).
    TL: gl.constexpr = gl.BlockedLayout([BT // PW, 1], [1, 32], [PW, 1], [1, 0])  # thread = column

    h64 = h.to(gl.int64)
    ch = gl.arange(0, K, CH)
    rows = gl.arange(0, BT, ROW)
    a_scale = gl.exp(gl.load(alog_ptr + h64 * salog).to(gl.float32))
    bias = gl.load(dtb_ptr + h64 * sdtb_h + ch * sdtb_c).to(gl.float32)
    # [A_qk; A_kk] (2 BT rows: one m64 tile) splits its columns over the warpgroups;
    # t_fold^T (K rows) its rows.
    WG: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, RG],
                                                 instr_shape=[16, BT // RG, 16])
    WGT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PW, 1], instr_shape=[16, BT, 16])
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # row-major, as the raw TMA tiles land
    AQ_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [PW, 1], [1, 0])

    _issue_chunk(0, NT, bos, h, q_desc, k_desc, g_desc, v_desc, qk_s, g_s, v_s, raw_ready, ring_ready,
                 ring_empty, K, V, BT, RING)
    for c in range(NT):
        # Every producer warp has finished reading raw stage (c + 1) % 2 (chunk c - 1).
        gl.thread_barrier()
        _issue_chunk(c + 1, NT, bos, h, q_desc, k_desc, g_desc, v_desc, qk_s, g_s, v_s, raw_ready, ring_ready,
                     ring_empty, K, V, BT, RING)
        Lc = gl.minimum(seqlen - c * BT, BT)
        valid = rows < Lc
        vm = gl.expand_dims(valid, 1)  # broadcast over the channels where used
        beta_ptr = b_ptr + (bos + c * BT).to(gl.int64) * sb_t + h64 * sb_h
        # The chunk's beta, read now so its global-load latency passes under the gate
        # and the row operands: A_kk's rows (the product's row layout) and M's columns.
        r2 = gl.arange(0, 2 * BT, gl.SliceLayout(1, WG))
        is_k = r2 >= BT
        rr = gl.where(is_k, r2 - BT, r2)
        beta_rows = _beta(beta_ptr, sb_t, rr, Lc, BETA_SIGMOID)
        beta_cols = _beta(beta_ptr, sb_t, gl.arange(0, BT, gl.SliceLayout(0, TL)), Lc, BETA_SIGMOID)

        rs = c % 2
        # A zero the compiler cannot prove (Lc >= 0). The scratch tiles are viewed, and
        # the chunk-invariant masks and the identity built, through it: held across the
        # loop, their swizzled addresses, wgmma descriptors and 32-register identity
        # spilled the producer (248 B per thread); recomputed, nothing spills.
        zs = Lc >> 31
        x_v = x_s.index(zs)
        col_v = col_s.index(zs)
        kg_v = kg_s.index(zs)
        mh_v = mh_s.index(zs)
        ml_v = ml_s.index(zs)
        aq_v = aq_s.index(zs)
        a2_v = a2_s.index(zs)
        if EXACT_DIAG:
            if g_desc.dtype == gl.float32:  # u in the raw fp32 gate's stage, read by then
                u_v = g_s.index(rs)._reinterpret(gl.float32, [BT, K], PLAIN)
            else:
                u_v = u_s.index(zs)
        mbarrier.wait(raw_ready.index(rs), (c // 2) & 1)
        # 1. The gate in log2 units (0 past the sequence end) and its chunk-local cumsum.
        a = chunk_log2_gate(g_s.index(rs).load(CL).to(gl.float32), gl.expand_dims(bias, 0), a_scale, lower_bound,
                            GATE)
        a = gl.where(vm, a, gl.zeros_like(a))
        G = gl.associative_scan(a, 0, _add)
        s0 = gl.sum(gl.where(gl.expand_dims(rows == BS - 1, 1), G, gl.zeros_like(G)), 0)  # b_1
        g_last = gl.sum(gl.where(gl.expand_dims(rows == BT - 1, 1), G, gl.zeros_like(G)), 0)

        st = c % RING
        if PHASES >= 2:
            # 2. The walk operands and A_qk, A_kk in one product. One anchor, the
            # sub-chunks' boundary s0 = G_15: A[i, j] = sum_c x̂_ic 2^(G_ic - s0) .
            # k̂_jc 2^(s0 - G_jc). Every factor spans at most one sub-chunk from the anchor,
            # so with the bounded gate (span <= 126) each is a normal number, and below the
            # diagonal the off-diagonal block's factors are both <= 1 (exact for any
            # decay). Two exp2 per element, f0 = 2^(G - s0) and r0 = 2^(s0 - G); the other
            # factors are one of them times a per-channel power of two, a product of
            # normal numbers that underflows only where the exact factor does: qg, kd =
            # x̂ f0 2^s0, kg = k̂ r0 2^(G_last - s0). The row operands [q̂ f0; k̂ f0] and the
            # column operand k̂ r0 go to swizzled tiles (wgmma takes no unswizzled
            # operand here): one m64n32k128 wgmma, q's rows then k's.
            # Order: q, then k, then r0 once f0 is dead (three [BT]-row tiles live at
            # most: u, f0 and the input, so the producer fits its registers).
            u = G - gl.expand_dims(s0, 0)
            if EXACT_DIAG:
                # A sub-chunk spanning more than 126 (any channel): the anchored diagonal
                # blocks are not normal numbers there and are replaced in step 3, from u.
                flagged = gl.max(gl.maximum(-s0, s0 - g_last), 0) > _MAX_SPAN
                if flagged:
                    gl.thread_barrier()  # every warp has read the raw gate (its stage may hold u)
                    u_v.store(u)
            f0 = gl.exp2(u)
            e_g = gl.expand_dims(gl.exp2(s0), 0)
            dec_s.index(st).store(gl.exp2(g_last))
            raw = qk_s.index(rs)
            if QK_L2NORM:
                _store_row_inv_norms(raw.slice(0, BT), nrm_s.index(0), Lc, BT, K, PW)
                _store_row_inv_norms(raw.slice(BT, BT), nrm_s.index(1), Lc, BT, K, PW)
                gl.thread_barrier()
            _row_operands(raw.slice(0, BT), nrm_s.index(0), vm, u, f0, s0, e_g, qg_s.index(st), x_v.slice(0, BT),
                          CL, ROW, QK_L2NORM, EXACT_DIAG)
            kf = _row_operands(raw.slice(BT, BT), nrm_s.index(1), vm, u, f0, s0, e_g, kd_s.index(st),
                               x_v.slice(BT, BT), CL, ROW, QK_L2NORM, EXACT_DIAG)
            kr = kf * gl.exp2(-u)
            col_v.store(kr.to(gl.bfloat16))
            if not EXACT_DIAG:
                kg_v.store((kr * gl.expand_dims(gl.exp2(g_last - s0), 0)).to(gl.bfloat16))
            else:
                kg_v.store((kf * gl.exp2(gl.expand_dims(g_last - s0, 0) - u)).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            A2 = warpgroup_mma(x_v, col_v.permute((1, 0)), gl.zeros([2 * BT, BT], gl.float32, WG),
                               use_acc=False)  # [A_qk; A_kk] unmasked
            c2 = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, WG)) + zs, 0)
            keep = gl.where(gl.expand_dims(is_k, 1), c2 < gl.expand_dims(rr, 1), c2 <= gl.expand_dims(rr, 1))
            row_scale = gl.where(is_k, beta_rows, 1.0)
            A2 = gl.where(keep, A2, gl.zeros_like(A2)) * gl.expand_dims(row_scale, 1)  # A_kk's rows times beta

        if PHASES >= 3:
            # 3. T = (I + A_kk)^-1 by column-oriented forward substitution in fp32
            # (thread = column c of T, its rows in registers): after step j row j is final,
            # and every row i > j takes -A_ij T_j, an FMA per row with no dependence between
            # rows (the row-by-row form's 32-term sums are a 32-FMA chain per step).
            # A_kk is stored transposed, so its column j is one broadcast row read.
            a2_v.permute((1, 0)).store(A2)  # memory row j: column j of [A_qk; A_kk]
            aq_v.store(A2.to(gl.bfloat16))
            if EXACT_DIAG:
                if flagged:
                    gl.thread_barrier()  # a2_s and u complete
                    a2_t = a2_v.permute((1, 0))
                    for b in gl.static_range(2):
                        _exact_diagonal_block(qk_s.index(rs)._reinterpret(gl.bfloat16, [2 * BT, K], PLAIN), nrm_s,
                                              u_v, a2_t, beta_ptr, sb_t,
                                              Lc, zs, b, BT, BS, K, _DIAG_KC, PW, QK_L2NORM, BETA_SIGMOID)
                    gl.thread_barrier()
                    aq_v.slice(0, BT).store(a2_t.slice(0, BT).load(AQ_L).to(gl.bfloat16))
            gl.thread_barrier()
            # T by 16 x 16 blocks (the model's form): x_s and col_s are free once the
            # product has read them and hold T and A_kk's diagonal blocks.
            # Viewed through a zero of their own: through zs, their addresses were
            # computed at the top of the iteration and held (spilled) until here.
            z3 = (Lc + BT) >> 31
            T = _block_inverse(a2_s.index(z3), col_s.index(z3)._reinterpret(gl.float32, [BS, 2 * BS], PLAIN),
                               x_s.index(z3)._reinterpret(gl.float32, [BT, BT], PLAIN), z3, BT, BS, PW, TL)
            Mx = T * gl.expand_dims(beta_cols, 0)  # M = T diag(beta)
            Mh = Mx.to(gl.bfloat16)
            Ml = (Mx - Mh.to(gl.float32)).to(gl.bfloat16)

        if PHASES >= 4:
            # 4. The fold, M split hi/lo: t_fold^T = kg^T M on wgmma (both operands in
            # shared memory), a_fold = A_qk M on mma_v2.
            mh_v.store(Mh)
            ml_v.store(Ml)
            fence_async_shared()
            gl.thread_barrier()
            tfT = warpgroup_mma(kg_v.permute((1, 0)), mh_v, gl.zeros([K, BT], gl.float32, WGT), use_acc=False)
            tfT = warpgroup_mma(kg_v.permute((1, 0)), ml_v, tfT)
            tf_s.index(st).permute((1, 0)).store(tfT.to(gl.bfloat16))
            aqA = aq_v.slice(0, BT).load(A_OP)
            af = mma_v2(aqA, mh_v.load(B_OP), gl.zeros([BT, BT], gl.float32, MMA))
            af = mma_v2(aqA, ml_v.load(B_OP), af)
            af_s.index(st).store(af.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ring_ready.index(st))  # the stage's second arrival (v's TMA was the first)


@gluon.jit
def _fused_prefill_kernel(q_desc, k_desc, g_desc, v_desc, o_desc,
                          o_ptr, b_ptr, sb_t, sb_h, alog_ptr, salog, dtb_ptr, sdtb_h, sdtb_c, lower_bound,
                          s_in_ptr, s_out_ptr, s_idx_ptr, has_ptr, ck_ptr, ck_off_ptr, ck_idx_ptr, cu_ptr, scale, H,
                          s_ot, s_oh,
                          s_in_n, s_in_h, s_in_v, s_in_k,
                          s_out_n, s_out_h, s_out_v, s_out_k,
                          s_ck_n, s_ck_h, s_ck_v, s_ck_k,
                          K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BS: gl.constexpr,
                          RING: gl.constexpr, GATE: gl.constexpr, EXACT_DIAG: gl.constexpr, QK_L2NORM: gl.constexpr,
                          BETA_SIGMOID: gl.constexpr,
                          LOAD_STATE: gl.constexpr, STORE_STATE: gl.constexpr, HAS_CKPT: gl.constexpr,
                          CKPT_INDEXED: gl.constexpr, CKPT_BF16: gl.constexpr,
                          PHASES: gl.constexpr, PW: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          num_warps: gl.constexpr):
    """Grid ``(N * H,)``, head fastest. ``LOAD_STATE`` / ``STORE_STATE`` as in the walk
    (:func:`kda_engram.kda.hopper.walk._folded_walk_kernel`)."""
    gl.static_assert(V == 16 * num_warps, "the consumers: 16 V rows per warp, one m64 wgmma per warpgroup")
    gl.static_assert(BT == 2 * BS, "two 16-token sub-chunks per chunk")
    pid = gl.program_id(0)
    h = pid % H
    n = pid // H
    bos = gl.load(cu_ptr + n).to(gl.int32)
    eos = gl.load(cu_ptr + n + 1).to(gl.int32)
    seqlen = eos - bos
    NF = seqlen // BT
    NT = (seqlen + BT - 1) // BT

    OPK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], gl.bfloat16)
    OPC: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.bfloat16)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ROWS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a stack of 1-D rows (``.index(i)``)
    qk_s = gl.allocate_shared_memory(q_desc.dtype, [2, 2 * BT, K], q_desc.layout)  # per stage: q's rows, k's
    g_s = gl.allocate_shared_memory(g_desc.dtype, [2, BT, K], g_desc.layout)
    qg_s = gl.allocate_shared_memory(gl.bfloat16, [RING, BT, K], OPK)
    kd_s = gl.allocate_shared_memory(gl.bfloat16, [RING, BT, K], OPK)
    tf_s = gl.allocate_shared_memory(gl.bfloat16, [RING, BT, K], OPK)
    af_s = gl.allocate_shared_memory(gl.bfloat16, [RING, BT, BT], OPC)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [RING, BT, V], v_desc.layout)
    dec_s = gl.allocate_shared_memory(gl.float32, [RING, K], ROWS)
    a2_s = gl.allocate_shared_memory(gl.float32, [1, BT, 2 * BT], FLAT)  # [A_qk; A_kk] transposed
    aq_s = gl.allocate_shared_memory(gl.bfloat16, [1, 2 * BT, BT],
                                     gl.NVMMASharedLayout.get_default_for([2 * BT, BT], gl.bfloat16))
    o_s = gl.allocate_shared_memory(o_desc.dtype, [BT, V], o_desc.layout)
    kg_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, K], OPK)  # the producer's: kg for the fold,
    x_s = gl.allocate_shared_memory(gl.bfloat16, [1, 2 * BT, K],  # the row operands [q̂ f0; k̂ f0]
                                    gl.NVMMASharedLayout.get_default_for([2 * BT, K], gl.bfloat16))
    col_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, K], OPK)  # the column operand k̂ r0
    mh_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BT], OPC)  # M = T diag(beta), hi and lo
    ml_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BT], OPC)
    nrm_s = gl.allocate_shared_memory(gl.float32, [2, BT], ROWS)  # the rows' inverse norms, q's and k's
    if EXACT_DIAG and g_desc.dtype != gl.float32:
        # u = G - s0 of a flagged chunk for the exact diagonal blocks (a bf16 raw gate's
        # stage is too small to hold it; an fp32 one holds it in place).
        u_s = gl.allocate_shared_memory(gl.float32, [1, BT, K], FLAT)
    else:
        u_s = nrm_s  # unused
    raw_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ring_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    ring_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(raw_ready.index(s), count=1)
    for s in gl.static_range(RING):
        mbarrier.init(ring_ready.index(s), count=2)  # v's TMA (expect) and the producer's tiles
        mbarrier.init(ring_empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_walk_sequence, (v_desc, v_desc, v_desc, v_desc, v_desc, o_desc, qg_s, kd_s, tf_s, af_s, v_s, o_s,
                          ring_ready, ring_empty, o_ptr, dec_s, s_in_ptr, s_out_ptr, s_idx_ptr, has_ptr, ck_ptr,
                          ck_off_ptr, ck_idx_ptr,
                          n, h, 0, bos, seqlen, NF, NT, 0, scale,
                          s_ot, s_oh, 0, 0, 0,
                          s_in_n, s_in_h, s_in_v, s_in_k,
                          s_out_n, s_out_h, s_out_v, s_out_k,
                          s_ck_n, s_ck_h, s_ck_v, s_ck_k,
                          K, V, V, BT, RING, LOAD_STATE, STORE_STATE, HAS_CKPT, CKPT_INDEXED, CKPT_BF16,
                          True, True, True, num_warps)),
        (_producer, (q_desc, k_desc, g_desc, v_desc, qk_s, g_s, v_s, qg_s, kd_s, tf_s, af_s, dec_s, a2_s, aq_s,
                     kg_s, x_s, col_s, mh_s, ml_s, nrm_s, u_s,
                     raw_ready, ring_ready, ring_empty,
                     b_ptr, sb_t, sb_h, alog_ptr, salog, dtb_ptr, sdtb_h, sdtb_c, lower_bound,
                     h, bos, seqlen, NT, K, V, BT, BS, RING, GATE, EXACT_DIAG, QK_L2NORM, BETA_SIGMOID, PHASES,
                     PW)),
    ], [PW], [PRODUCER_REGS])
    for s in gl.static_range(2):
        mbarrier.invalidate(raw_ready.index(s))
    for s in gl.static_range(RING):
        mbarrier.invalidate(ring_ready.index(s))
        mbarrier.invalidate(ring_empty.index(s))


# --------------------------------------------------------------------------- host side


def fused_unsupported(q, k, v, raw_g, raw_beta, out, *, gate="raw", lower_bound=None) -> str | None:
    """``None`` when the fused kernel serves these tensors and gate, else why (one line).
    Device and architecture are the caller's (the backend verifier's) to check."""
    if gate not in ("raw", "log_decay"):
        return f"serves gate='raw' or 'log_decay', got {gate!r}"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return f"needs bf16 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[3] != 128 or v.shape[3] != 128:
        return f"needs K = V = 128, got K = {q.shape[3]}, V = {v.shape[3]}"
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x is not None and not tma_compatible(x):
            return f"{name} must have unit channel stride, packed heads and a 16-byte token stride (TMA)"
    if raw_g.dtype not in (torch.bfloat16, torch.float32) or not tma_compatible(raw_g, (2, 4)):
        return "raw_g must be bf16 or fp32 with unit channel stride, packed heads and a 16-byte token stride (TMA)"
    return None


def fused_prefill_launch(q, k, v, raw_g, raw_beta, A_log, dt_bias, out, scale, cu_seqlens, *, lower_bound,
                         qk_l2norm=True, beta_sigmoid=True, initial_state=None, final_state=None, state_cache=None,
                         state_indices=None, has_initial_state=None, checkpoint_state=None, checkpoint_offsets=None,
                         checkpoint_state_indices=None, gate="raw", producer_warps=FUSED_PRODUCER_WARPS,
                         producer_regs=None, phases=4):
    """``(kernel, grid, args, kwargs)`` of one fused launch. Arguments are assumed valid
    and served (:func:`fused_unsupported` says ``None``); CPU tensors compile too.

    ``q, k, raw_g [1, T, H, K]``, ``v, out [1, T, H, V]``, ``raw_beta [1, T, H]``,
    ``A_log [H]``, ``dt_bias [H*K]`` or ``[H, K]``, ``cu_seqlens [N+1]``; the state
    keywords as :func:`kda_engram.kda.hopper.walk.folded_walk_launch` takes them
    (checkpoint offsets must be multiples of 64, the contract's alignment).
    ``producer_warps``: 4 (one producer warpgroup) or 8 (two, each taking half of a
    chunk's rows); ``producer_regs`` defaults to what leaves the consumers 168."""
    if producer_warps not in FUSED_PRODUCER_REGS:
        raise ValueError(f"producer_warps must be one of {sorted(FUSED_PRODUCER_REGS)}, got {producer_warps!r}")
    _, T, H, K = q.shape
    V = v.shape[3]
    N = cu_seqlens.numel() - 1
    BT = FUSED_CHUNK
    # The raw tiles are read by the producer's thread-per-channel layout only: unswizzled.
    descs = (tma_descriptor(q, [BT, K], False), tma_descriptor(k, [BT, K], False),
             tma_descriptor(raw_g, [BT, K], False),
             tma_descriptor(v, [BT, V]), tma_descriptor(out, [BT, V]))
    state_ptrs, state_strides, state_modes = state_launch_args(
        out, cu_seqlens, initial_state=initial_state, final_state=final_state, state_cache=state_cache,
        state_indices=state_indices, has_initial_state=has_initial_state, checkpoint_state=checkpoint_state,
        checkpoint_offsets=checkpoint_offsets, checkpoint_state_indices=checkpoint_state_indices)
    alog, salog, dtb, sdtb_h, sdtb_c = gate_pointers(raw_g, A_log, dt_bias, K, gate)
    args = (*descs, out, raw_beta, raw_beta.stride(1), raw_beta.stride(2), alog, salog, dtb,
            sdtb_h, sdtb_c, float(lower_bound) if lower_bound is not None else 0.0,
            *state_ptrs, cu_seqlens, float(scale), H, out.stride(1), out.stride(2), *state_strides)
    kwargs = dict(K=K, V=V, BT=BT, BS=SUB_CHUNK, RING=FUSED_RING, GATE=gate_form(gate, lower_bound),
                  EXACT_DIAG=needs_exact_diagonal(gate, lower_bound),
                  QK_L2NORM=bool(qk_l2norm), BETA_SIGMOID=bool(beta_sigmoid), **state_modes,
                  PHASES=int(phases), PW=int(producer_warps),
                  PRODUCER_REGS=int(producer_regs or FUSED_PRODUCER_REGS[producer_warps]), num_warps=V // 16)
    return _fused_prefill_kernel, (N * H,), args, kwargs


def fused_prefill(q, k, v, raw_g, raw_beta, A_log, dt_bias, out, scale, cu_seqlens, **kw):
    """Launch the fused prefill (:func:`fused_prefill_launch` for the arguments). Writes
    ``out``'s rows inside the sequences, the state rows it was given, and nothing else."""
    N = cu_seqlens.numel() - 1
    if N == 0 or q.shape[2] == 0:
        return
    kernel, grid, args, kwargs = fused_prefill_launch(q, k, v, raw_g, raw_beta, A_log, dt_bias, out, scale,
                                                      cu_seqlens, **kw)
    kernel[grid](*args, **kwargs)
