"""The folded prologue in one Gluon launch for Hopper (sm_90a): raw ``q, k, raw_g,
raw_beta`` to the operands of the Gluon walk (:mod:`kda_engram.kda.hopper.walk`),
the intra-chunk products on tensor cores (``warpgroup_mma``).

Same outputs, layouts, dtypes and masking as
:func:`kda_engram.kda.hopper.folded_prologue.prepare_folded_prologue` (the contract of
:func:`kda_engram.kda.reference.naive_chunk_operands`, keys ``qg, kd, t_fold,
a_fold, decay``), the intra-chunk work on tensor cores (why, and what the Triton
launches cost: docs/design/kda_prefill.md).

One CTA of one warpgroup (4 warps) per (64-token chunk row, head); warp ``w`` owns
the 16-row sub-chunk ``w``. Per chunk, with ``lc`` the sub-chunk-local inclusive
gate cumsum (log2 units), ``s_I`` sub-chunk ``I``'s total and ``b_I`` the sum of the
totals before it (``g = b_I + lc``):

1. Gate, L2 norms, beta; ``qg = q̂ 2^g``, ``kd = k̂ 2^g``, ``decay = 2^g_last`` to
   memory; into shared memory (bf16): ``kf = k̂ 2^(s - lc)`` (<= 1, the column
   operand of every strip) and ``kg = k̂ 2^(g_last - g)``. Kept in registers:
   ``QE = q̂ 2^(lc - s)`` and ``KE = k̂ 2^(lc - s)`` (in [1, 2^(16 |L| log2 e)]).
2. ``A_qk`` and ``A_kk`` by 16-column strips ``J``: one m64n16k128 wgmma each,
   ``R_J kf_J^T``, the row operand ``R_J`` anchored at the strip's end ``b_(J+1)``:
   ``QE`` on the strip's own rows, ``(QE 2^s_I) 2^(b_I - b_(J+1))`` (<= 1, multiplied
   in that order so an underflow to 0 only drops a product below 2^-126) below it,
   zero above (the |L| guard: ``16 |L| log2 e <= 126`` keeps ``QE`` and ``kf`` normal
   bf16 numbers; :data:`MAX_ANCHOR_SPAN`).
3. The four diagonal 16x16 inverses ``(I + A_kk,II)^-1`` in fp32 (forward
   substitution, one warp per block), composed to the 64x64 ``T`` by block
   substitution: with ``D`` the block-diagonal inverse and ``N = D A_off``
   (strictly block-lower, ``N^4 = 0``), ``T = (I - N + N^2 - N^3) D``; each 64x64x64
   product is three bf16 wgmmas of hi/lo-split operands (about 2^-16 relative,
   fp32-grade for operands stored in bf16).
4. The fold by wgmma: ``t_fold = beta (T^T kg)`` (T^T hi/lo split),
   ``a_fold = (A_qk T) beta`` (hi/lo split, three wgmmas).

Served: the bounded gate ``lower_bound`` in ``[-MAX_ANCHOR_SPAN / (16 log2 e), 0)``,
bf16, K = 128, ``qk_l2norm`` and ``beta_sigmoid`` either way, the conv (its own
launch first, as the Triton prologue does). Anything else is a ``ValueError``
naming what it cannot serve (the caller keeps the Triton folded prologue for it).
Torch model (Gluon has no CPU interpreter): :mod:`kda_engram.kda.hopper.prologue_model`;
benchmark: :mod:`kda_engram.tools.benchmarks.bench_gluon_prologue`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ...bundles import ConvArgs, KDAInputs
from ...constants import CHUNK_SIZE, MAX_ANCHOR_SPAN, SUB_CHUNK
from ..gate import GATE_BOUNDED, L2NORM_EPS_JIT, chunk_log2_gate, dt_bias_strides, subchunk_span_bound
from .folded_prologue import allocate_folded_operands

__all__ = ["GLUON_PROLOGUE_WARPS", "gluon_folded_prologue", "gluon_prologue_unsupported"]

#: One warpgroup: warp w owns sub-chunk w (the rows of one m64 wgmma).
GLUON_PROLOGUE_WARPS = 8


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _gate_cumsum(ptrs, mask, alog, dtb, lower_bound):
    """The bounded gate of a ``[4, 16, K]`` tile in log2 units (0 on masked rows), its
    sub-chunk-local inclusive cumsum ``lc`` and the sub-chunk totals ``s [4, K]``."""
    xg = gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
    a = chunk_log2_gate(xg, dtb, alog, lower_bound, GATE_BOUNDED)  # the shared @triton.jit gate
    a = gl.where(mask, a, gl.zeros_like(a))
    return gl.associative_scan(a, 1, _add), gl.sum(a, 1)


@gluon.jit
def _pick(x, blk, idx):
    """Row ``idx`` of a ``[4, C]`` tensor whose dim 0 runs over warps, broadcast to every warp (``[C]``)."""
    return gl.sum(gl.where(blk == idx, x, gl.zeros_like(x)), 0)


@gluon.jit
def _strip(XE, s, bI, blk2, blk3, r_s, kf_s, J: gl.constexpr, BT: gl.constexpr, K: gl.constexpr,
           BS: gl.constexpr, MMA16: gl.constexpr):
    """Strip ``J`` (columns ``16J..16J+15``) of ``X̂ K̂^T 2^(g_i - g_j)``, unmasked ``[64, 16]`` fp32:
    the row operand anchored at the strip's end ``b_(J+1)`` (``XE = x̂ 2^(lc - s)`` on the
    strip's own rows; ``(XE 2^s_I) 2^(b_I - b_(J+1))`` below; zero above) times ``kf_J^T``.
    ``s, bI [4, K]``: the sub-chunk totals and the cumsum before each sub-chunk."""
    bJ1 = _pick(bI + s, blk2, J)  # b_(J+1)
    es3 = gl.expand_dims(gl.exp2(s), 1)  # 2^s_I: XE 2^s_I = x̂ 2^lc (<= 1)
    cv3 = gl.expand_dims(gl.exp2(gl.minimum(bI - gl.expand_dims(bJ1, 0), 0.0)), 1)  # 2^(b_I - b_(J+1)), I > J
    rx = gl.where(blk3 == J, XE, gl.where(blk3 > J, (XE * es3) * cv3, gl.zeros_like(XE)))
    gl.thread_barrier()  # the previous strip's wgmma has read r_s
    r_s.store(gl.reshape(rx.to(gl.bfloat16), [BT, K]))
    fence_async_shared()
    gl.thread_barrier()
    return warpgroup_mma(r_s, kf_s.slice(J * BS, BS, 0).permute((1, 0)), gl.zeros([BT, BS], gl.float32, MMA16),
                         use_acc=False)


@gluon.jit
def _mm3(a, b, bhi_s, blo_s, A_OP: gl.constexpr, ACC: gl.constexpr, M: gl.constexpr, N: gl.constexpr):
    """``a @ b`` (fp32 ``[M, K]`` x ``[K, N]``) as three bf16 wgmmas of hi/lo splits
    (``a_hi b_hi + a_hi b_lo + a_lo b_hi``, about 2^-16 relative): fp32-grade for the
    inverse composition without a tf32 B operand (MN-major tf32 aborts this Triton)."""
    bh = b.to(gl.bfloat16)
    bl = (b - bh.to(gl.float32)).to(gl.bfloat16)
    gl.thread_barrier()  # the previous product's wgmmas have read bhi_s / blo_s
    bhi_s.store(bh)
    blo_s.store(bl)
    fence_async_shared()
    gl.thread_barrier()
    ah = a.to(gl.bfloat16)
    al = (a - ah.to(gl.float32)).to(gl.bfloat16)
    ah = gl.convert_layout(ah, A_OP)
    al = gl.convert_layout(al, A_OP)
    acc = warpgroup_mma(ah, bhi_s, gl.zeros([M, N], gl.float32, ACC), use_acc=False)
    acc = warpgroup_mma(ah, blo_s, acc)
    acc = warpgroup_mma(al, bhi_s, acc)
    return acc


@gluon.jit
def _gluon_prologue_kernel(
    q_ptr, sq_t, sq_h, sq_c,
    k_ptr, sk_t, sk_h, sk_c,
    g_ptr, sg_t, sg_h, sg_c,
    b_ptr, sb_t, sb_h,
    alog_ptr, salog,
    dtb_ptr, sdtb_h, sdtb_c,
    cu_ptr, ci_ptr, sci_r, sci_c,
    qg_ptr, kd_ptr, tf_ptr, af_ptr, decay_ptr,
    H, lower_bound,
    K: gl.constexpr, BT: gl.constexpr, BS: gl.constexpr,
    QK_L2NORM: gl.constexpr, BETA_SIGMOID: gl.constexpr, PHASES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Grid ``(chunk rows * H,)``, head fastest; one warpgroup per (chunk row, head).
    Writes the chunk's rows of ``qg, kd, t_fold [1, T, H, K]``, ``a_fold [1, T, H, 64]``
    (rows inside the sequence only) and its ``decay [chunks, H, K]`` row."""
    gl.static_assert(num_warps == 8, "two warpgroups: warps w and w + 4 own sub-chunk w")
    gl.static_assert(BT == 4 * BS, "four 16-row sub-chunks per chunk")
    NB: gl.constexpr = BT // BS
    pid = gl.program_id(0)
    h = pid % H
    r = (pid // H).to(gl.int64)
    seq = gl.load(ci_ptr + r * sci_r).to(gl.int32)
    if seq < 0:
        return
    cidx = gl.load(ci_ptr + r * sci_r + sci_c).to(gl.int64)
    bos = gl.load(cu_ptr + seq).to(gl.int64)
    eos = gl.load(cu_ptr + seq + 1).to(gl.int64)
    start = bos + cidx * BT
    h64 = h.to(gl.int64)

    # ------------------------------------------------------------------ layouts
    # Phase 1: [block, row, channel], warp = block, 8 rows x 8 channels per thread.
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 4], [1, 2, 16], [4, 1, 2], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(1, L3)  # [block, channel]
    R2: gl.constexpr = gl.SliceLayout(2, L3)  # [block, row]
    CH: gl.constexpr = gl.SliceLayout(0, S2)  # [channel]
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, 8, 16])
    MMA64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, BT // 2, 16])
    MMAK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, K // 2, 16])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA64, k_width=2)
    AK: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMAK, k_width=2)
    # The diagonal inverses: [block, j, c], thread = one column c of its block, all j in registers.
    LX: gl.constexpr = gl.BlockedLayout([1, BS, 1], [1, 4, 8], [4, 1, 2], [2, 1, 0])
    LD2: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 2], [1, 0])
    LROW: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    OPK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], gl.bfloat16)
    OP64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.bfloat16)

    r_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], OPK)  # a strip's row operand
    kf_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], OPK)
    kg_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], OPK)
    aqk_s = gl.allocate_shared_memory(gl.float32, [BT, BT], FLAT)
    akk_s = gl.allocate_shared_memory(gl.float32, [BT, BT], FLAT)

    # ------------------------------------------------------------ 1. gate, norms
    blk2 = gl.expand_dims(gl.arange(0, NB, gl.SliceLayout(1, S2)), 1)  # [4, 1] in S2
    blk3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NB, gl.SliceLayout(1, R2)), 1), 2)  # [4, 1, 1]
    rr3 = gl.expand_dims(gl.expand_dims(gl.arange(0, BS, gl.SliceLayout(0, R2)), 0), 2)  # [1, 16, 1]
    ch = gl.arange(0, K, CH)
    cc3 = gl.expand_dims(gl.expand_dims(ch, 0), 1)  # [1, 1, K]
    row3 = blk3 * BS + rr3
    t3 = start + row3
    valid3 = t3 < eos
    m3 = valid3 & (cc3 < K)

    alog = gl.exp(gl.load(alog_ptr + h64 * salog).to(gl.float32))
    dtb = gl.load(dtb_ptr + h64 * sdtb_h + cc3 * sdtb_c).to(gl.float32)
    lc, s = _gate_cumsum(g_ptr + h64 * sg_h + t3 * sg_t + cc3 * sg_c, m3, alog, dtb, lower_bound)
    # b_I (the cumsum before sub-chunk I), summed in order: b_1 = s_0, b_2 = b_1 + s_1, ...
    s0 = _pick(s, blk2, 0)
    b2 = s0 + _pick(s, blk2, 1)
    b3 = b2 + _pick(s, blk2, 2)
    g_last = b3 + _pick(s, blk2, 3)
    gl.store(decay_ptr + (r * H + h) * K + ch, gl.exp2(g_last))
    bI = gl.where(blk2 == 0, gl.zeros_like(s),
                  gl.where(blk2 == 1, gl.expand_dims(s0, 0),
                           gl.where(blk2 == 2, gl.expand_dims(b2, 0), gl.expand_dims(b3, 0))))  # [4, K]
    u = lc - gl.expand_dims(s, 1)  # g - b_(I+1), in [0, span] (the gate is <= 0)
    e_g = gl.expand_dims(bI + s, 1)  # b_(I+1)
    e_kg = gl.expand_dims(gl.exp2(gl.expand_dims(g_last, 0) - (bI + s)), 1)  # 2^(g_last - b_(I+1))

    o_qk = H * K
    qk_off = t3 * o_qk + h64 * K + cc3
    ri16 = gl.arange(0, BT, gl.SliceLayout(1, MMA16))
    tr16 = start + ri16
    beta16 = gl.load(b_ptr + tr16 * sb_t + h64 * sb_h, mask=tr16 < eos, other=0.0).to(gl.float32)
    if BETA_SIGMOID:
        beta16 = 1.0 / (1.0 + gl.exp(-beta16))
    beta16 = gl.where(tr16 < eos, beta16, gl.zeros_like(beta16))

    # ----------------------------------------------- 2. kd, kf, kg, qg; KE, QE
    kf = gl.load(k_ptr + h64 * sk_h + t3 * sk_t + cc3 * sk_c, mask=m3, other=0.0).to(gl.float32)
    if QK_L2NORM:
        kf = kf * gl.expand_dims(gl.rsqrt(gl.sum(kf * kf, 2) + L2NORM_EPS_JIT), 2)
    gl.store(kd_ptr + qk_off, (kf * gl.exp2(u + e_g)).to(kd_ptr.dtype.element_ty), mask=m3)
    kfac = kf * gl.exp2(-u)  # k̂ 2^(b_(I+1) - g) <= 1
    kf_s.store(gl.reshape(kfac.to(gl.bfloat16), [BT, K]))
    kg = kfac * e_kg  # k̂ 2^(g_last - g)
    kg_s.store(gl.reshape(kg.to(gl.bfloat16), [BT, K]))
    KE = kf * gl.exp2(u)  # k̂ 2^(g - b_(I+1)), up to 2^span
    qf = gl.load(q_ptr + h64 * sq_h + t3 * sq_t + cc3 * sq_c, mask=m3, other=0.0).to(gl.float32)
    if QK_L2NORM:
        qf = qf * gl.expand_dims(gl.rsqrt(gl.sum(qf * qf, 2) + L2NORM_EPS_JIT), 2)
    gl.store(qg_ptr + qk_off, (qf * gl.exp2(u + e_g)).to(qg_ptr.dtype.element_ty), mask=m3)
    QE = qf * gl.exp2(u)
    # (every pointer and offset tile dies here: only QE and KE cross the strips)
    if PHASES == 1:
        return

    # ------------------------------------------------ 2'. A_kk, A_qk by strips
    for J in gl.static_range(NB):
        ak = _strip(KE, s, bI, blk2, blk3, r_s, kf_s, J, BT, K, BS, MMA16)
        cj = J * BS + gl.arange(0, BS, gl.SliceLayout(0, MMA16))
        ak = gl.where(gl.expand_dims(cj, 0) < gl.expand_dims(ri16, 1), ak, gl.zeros_like(ak))
        akk_s.slice(J * BS, BS, 1).store(ak * gl.expand_dims(beta16, 1))
    for J in gl.static_range(NB):
        aq = _strip(QE, s, bI, blk2, blk3, r_s, kf_s, J, BT, K, BS, MMA16)
        cj = J * BS + gl.arange(0, BS, gl.SliceLayout(0, MMA16))
        aqk_s.slice(J * BS, BS, 1).store(gl.where(gl.expand_dims(cj, 0) <= gl.expand_dims(ri16, 1), aq,
                                                  gl.zeros_like(aq)))
    gl.thread_barrier()
    if PHASES == 2:
        return

    # ------------------------------------------------ 3. diagonal inverses, T
    # (allocated here, after the strips: their space can reuse the strips' buffers)
    d_s = gl.allocate_shared_memory(gl.float32, [BS, BT], FLAT)  # row i: the four blocks' rows i
    x_s = gl.allocate_shared_memory(gl.float32, [BT, BS], FLAT)  # the diagonal inverses, stacked
    t_s = gl.allocate_shared_memory(gl.float32, [BT, BT], FLAT)
    bhi_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], OP64)
    blo_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], OP64)
    for b in gl.static_range(NB):
        d_s.slice(b * BS, BS, 1).store(akk_s.slice(b * BS, BS, 0).slice(b * BS, BS, 1).load(LD2))
    gl.thread_barrier()
    jx = gl.expand_dims(gl.expand_dims(gl.arange(0, BS, gl.SliceLayout(0, gl.SliceLayout(2, LX))), 0), 2)
    cx = gl.expand_dims(gl.arange(0, BS, gl.SliceLayout(0, gl.SliceLayout(1, LX))), 0)  # [1, 16]
    X = gl.zeros([NB, BS, BS], gl.float32, LX)
    for i in gl.static_range(BS):
        arow = gl.convert_layout(gl.reshape(d_s.slice(i, 1, 0).load(LROW), [NB, BS]),
                                 gl.SliceLayout(2, LX))  # A_bb[i, :]
        xi = gl.where(cx == i, 1.0, 0.0) - gl.sum(gl.expand_dims(arow, 2) * X, 1)
        X = gl.where(jx == i, gl.expand_dims(xi, 1), X)
    x_s.store(gl.reshape(X, [BT, BS]))
    t_s.store(gl.zeros([BT, BT], gl.float32, LD2))
    gl.thread_barrier()
    for b in gl.static_range(NB):
        t_s.slice(b * BS, BS, 0).slice(b * BS, BS, 1).store(x_s.slice(b * BS, BS, 0).load(LD2))
    gl.thread_barrier()
    Dm = t_s.load(MMA64)
    ri64 = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(1, MMA64)), 1)
    ci64 = gl.expand_dims(gl.arange(0, BT, gl.SliceLayout(0, MMA64)), 0)
    Ak = akk_s.load(MMA64)
    Aoff = gl.where(ri64 // BS != ci64 // BS, Ak, gl.zeros_like(Ak))
    Nm = _mm3(Dm, Aoff, bhi_s, blo_s, A64, MMA64, BT, BT)
    N2 = _mm3(Nm, Nm, bhi_s, blo_s, A64, MMA64, BT, BT)
    N3 = _mm3(Nm, N2, bhi_s, blo_s, A64, MMA64, BT, BT)
    P = gl.where(ri64 == ci64, 1.0, 0.0) - Nm + N2 - N3
    Tm = _mm3(P, Dm, bhi_s, blo_s, A64, MMA64, BT, BT)
    if PHASES == 3:
        gl.store(af_ptr + (start + ri64) * (H * BT) + h64 * BT + ci64, Tm.to(af_ptr.dtype.element_ty),
                 mask=(start + ri64 < eos) & (ci64 < BT))  # T, so the phase's work is not dead code
        return

    # ------------------------------------------------------------------ 4. fold
    gl.thread_barrier()
    t_s.store(Tm)
    gl.thread_barrier()
    TT = t_s.permute((1, 0)).load(AK)  # T^T as the A operand, fp32
    th = TT.to(gl.bfloat16)
    tl_ = (TT - th.to(gl.float32)).to(gl.bfloat16)
    tf = warpgroup_mma(th, kg_s, gl.zeros([BT, K], gl.float32, MMAK), use_acc=False)
    tf = warpgroup_mma(tl_, kg_s, tf)
    rk_ = gl.arange(0, BT, gl.SliceLayout(1, MMAK))
    trk = start + rk_
    vk = trk < eos
    betak = gl.load(b_ptr + trk * sb_t + h64 * sb_h, mask=vk, other=0.0).to(gl.float32)
    if BETA_SIGMOID:
        betak = 1.0 / (1.0 + gl.exp(-betak))
    tf = tf * gl.expand_dims(betak, 1)
    ck = gl.expand_dims(gl.arange(0, K, gl.SliceLayout(0, MMAK)), 0)
    gl.store(tf_ptr + gl.expand_dims(trk, 1) * o_qk + h64 * K + ck, tf.to(tf_ptr.dtype.element_ty),
             mask=gl.expand_dims(vk, 1) & (ck < K))

    Aq = aqk_s.load(MMA64)
    af = _mm3(Aq, Tm, bhi_s, blo_s, A64, MMA64, BT, BT)
    tc = start + gl.arange(0, BT, gl.SliceLayout(0, MMA64))
    betac = gl.load(b_ptr + tc * sb_t + h64 * sb_h, mask=tc < eos, other=0.0).to(gl.float32)
    if BETA_SIGMOID:
        betac = 1.0 / (1.0 + gl.exp(-betac))
    af = af * gl.expand_dims(betac, 0)
    tr64 = start + ri64
    o_a = H * BT
    gl.store(af_ptr + tr64 * o_a + h64 * BT + ci64, af.to(af_ptr.dtype.element_ty),
             mask=(tr64 < eos) & (ci64 < BT))


# --------------------------------------------------------------------------- host side


def gluon_prologue_unsupported(q, lower_bound, *, gate="raw", num_warps=None) -> str | None:
    """Why :func:`gluon_folded_prologue` cannot serve these inputs (one line), or ``None``."""
    if q.dtype != torch.bfloat16:
        return f"needs bf16 inputs (wgmma bf16 operands), got {q.dtype}"
    if q.shape[3] != 128:
        return f"needs K = 128, got K = {q.shape[3]}"
    if gate != "raw":
        return f"serves the raw bounded gate only, got gate={gate!r}"
    if lower_bound is None:
        return ("serves the bounded gate only (lower_bound in [-5.45, 0)): the softplus gate has no bound on a "
                "sub-chunk's cumsum, so the strip anchoring cannot keep its factors in range")
    span = subchunk_span_bound(gate, lower_bound)
    if span > MAX_ANCHOR_SPAN:
        return (f"lower_bound={lower_bound}: a sub-chunk's gate span 16 |L| log2 e = {span:.1f} exceeds "
                f"{MAX_ANCHOR_SPAN} (its anchored factors would leave the normal bf16 range)")
    if num_warps not in (None, GLUON_PROLOGUE_WARPS):
        return f"runs {GLUON_PROLOGUE_WARPS} warps (one warpgroup), got num_warps={num_warps}"
    return None


def gluon_folded_prologue(x: KDAInputs, cu_seqlens, chunk_indices, conv: ConvArgs = ConvArgs(), *, num_warps=None,
                          maxnreg=None, phases=4):
    """Drop-in for :func:`kda_engram.kda.hopper.folded_prologue.prepare_folded_prologue`
    (same arguments, assumed valid; same ``launch()`` returning ``dict(qg, kd,
    t_fold, a_fold, decay, v)``), one Gluon launch instead of two Triton ones.

    ``q, k, raw_g [1, T, H, 128]`` bf16 (any strides), ``raw_beta [1, T, H]``,
    ``A_log [H]``, ``dt_bias [H*K]`` or ``[H, K]``, ``cu_seqlens [N+1]``,
    ``chunk_indices [chunks, 2]``. Raises ``ValueError`` for what it cannot serve
    (:func:`gluon_prologue_unsupported`: the softplus / log-decay gates, |L| > 5.45,
    non-bf16, K != 128). ``t_fold`` rows and ``a_fold`` columns past a sequence's
    end inside its last chunk are not part of the contract (the walk masks them).

    ``maxnreg``: a register cap for the GPU sweep (uncapped it compiles to 255 registers,
    one CTA of 8 warps per SM; 128 would fit two, with a spill: see the design record).
    ``phases`` < 4 stops after that phase (1 gate and norms, 2 strips, 3 inverse): a
    timing study of where the launch's time goes; its outputs are then incomplete."""
    if phases not in (1, 2, 3, 4):
        raise ValueError(f"gluon_folded_prologue: phases must be 1, 2, 3 or 4, got {phases!r}")
    q, k, raw_g, raw_beta, A_log, dt_bias = x.q, x.k, x.raw_g, x.raw_beta, x.A_log, x.dt_bias
    why = gluon_prologue_unsupported(q, x.lower_bound, gate=x.gate, num_warps=num_warps)
    if why is not None:
        raise ValueError(f"gluon_folded_prologue: {why}")
    _, T, H, K = q.shape
    num_chunks = chunk_indices.shape[0]
    out = allocate_folded_operands(q, x.v, num_chunks)
    if num_chunks == 0 or H == 0:
        return lambda: out
    sdtb_h, sdtb_c = dt_bias_strides(dt_bias, K)
    grid = (num_chunks * H,)

    def launch():
        qb, kb = q, k
        if conv.on:
            from ..conv import conv_prefill_bands

            qb, kb, out["v"] = conv_prefill_bands(q, k, x.v, conv.conv_weight, cu_seqlens, chunk_indices,
                                                  conv.conv_state, conv.conv_state_indices,
                                                  conv.conv_has_initial_state)
        _gluon_prologue_kernel[grid](
            qb, qb.stride(1), qb.stride(2), qb.stride(3),
            kb, kb.stride(1), kb.stride(2), kb.stride(3),
            raw_g, raw_g.stride(1), raw_g.stride(2), raw_g.stride(3),
            raw_beta, raw_beta.stride(1), raw_beta.stride(2),
            A_log, A_log.stride(0),
            dt_bias, sdtb_h, sdtb_c,
            cu_seqlens, chunk_indices, chunk_indices.stride(0), chunk_indices.stride(1),
            out["qg"], out["kd"], out["t_fold"], out["a_fold"], out["decay"],
            H, float(x.lower_bound),
            K=K, BT=CHUNK_SIZE, BS=SUB_CHUNK, QK_L2NORM=bool(x.qk_l2norm), BETA_SIGMOID=bool(x.beta_sigmoid),
            PHASES=int(phases), num_warps=GLUON_PROLOGUE_WARPS,
            **({} if maxnreg is None else {"maxnreg": int(maxnreg)}),
        )
        return out

    return launch
