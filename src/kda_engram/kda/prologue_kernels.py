"""The KDA prologue's kernels: ``_kda_prologue_intra_kernel`` (L2 norms, gate and its
chunk-local cumsum, the intra-chunk ``A_qk`` / ``A_kk`` and the right-hand sides) and
``_kda_prologue_solve_kernel`` (the triangular solve for ``w`` and ``u``), with the
``@triton.jit`` helpers they share with the folded prologue
(:mod:`kda_engram.kda.hopper.folded_prologue`). The operand contract, the numerics and
why two launches: :mod:`kda_engram.kda.prologue`, which launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import MAX_ANCHOR_SPAN
from .gate import L2NORM_EPS_JIT, chunk_log2_gate, gate_operands
from .metadata import chunk_row


@triton.jit
def _load_block(
    q_ptr, sq_t, sq_h, sq_c, k_ptr, sk_t, sk_h, sk_c, v_ptr, sv_t, sv_h, sv_c,
    g_ptr, sg_t, sg_h, sg_c, b_ptr, sb_t, sb_h,
    h, t, valid,
    K: tl.constexpr, V: tl.constexpr, LOAD_V: tl.constexpr = True,
):
    """The memory reads of one 16-row sub-chunk (issued one sub-chunk ahead of its
    use, so they overlap the previous sub-chunk's arithmetic): ``q, k, v``, the raw
    gate and the raw beta, in their load dtypes; zero on invalid rows (and ``v``
    all zero, read from nowhere, without ``LOAD_V``)."""
    ck = tl.arange(0, K)
    cv = tl.arange(0, V)
    qr = tl.load(q_ptr + h * sq_h + t[:, None] * sq_t + ck[None, :] * sq_c, mask=valid[:, None], other=0.0)
    kr = tl.load(k_ptr + h * sk_h + t[:, None] * sk_t + ck[None, :] * sk_c, mask=valid[:, None], other=0.0)
    vr = tl.load(v_ptr + h * sv_h + t[:, None] * sv_t + cv[None, :] * sv_c, mask=valid[:, None] & LOAD_V, other=0.0)
    xr = tl.load(g_ptr + h * sg_h + t[:, None] * sg_t + ck[None, :] * sg_c, mask=valid[:, None], other=0.0)
    rb = tl.load(b_ptr + t * sb_t + h * sb_h, mask=valid, other=0.0)
    return qr, kr, vr, xr, rb


@triton.jit
def _prep_block(qr, kr, vr, xr, rb, valid, alog, dtb, lower_bound, GATE: tl.constexpr,
                QK_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """One 16-row sub-chunk: ``(q̂, k̂, lc, tot, beta, beta*v)`` with ``lc`` the
    sub-chunk-local inclusive cumsum of the gate (log2 units, 0 on invalid rows)
    and ``tot`` its total per channel (:func:`kda_engram.kda.gate.chunk_log2_gate` of
    the form ``GATE``); ``QK_L2NORM`` / ``BETA_SIGMOID`` off: q, k and beta are used as given."""
    qh = qr.to(tl.float32)
    kh = kr.to(tl.float32)
    if QK_L2NORM:
        qh = qh * tl.rsqrt(tl.sum(qh * qh, 1) + L2NORM_EPS_JIT)[:, None]
        kh = kh * tl.rsqrt(tl.sum(kh * kh, 1) + L2NORM_EPS_JIT)[:, None]
    a = tl.where(valid[:, None], chunk_log2_gate(xr.to(tl.float32), dtb[None, :], alog, lower_bound, GATE),
                 0.0)
    lc = tl.cumsum(a, 0)
    tot = tl.sum(a, 0)
    if BETA_SIGMOID:
        beta = tl.where(valid, tl.sigmoid(rb.to(tl.float32)), 0.0)
    else:
        beta = tl.where(valid, rb.to(tl.float32), 0.0)
    bv = beta[:, None] * vr.to(tl.float32)
    return qh, kh, lc, tot, beta, bv


#: The widest decay span (log2 units, ``max lc - min lc`` over a sub-chunk) the factored
#: diagonal product takes; centred by its shift, both factors stay within
#: ``[2^-63, 2^63]``.
_MAX_SPAN = tl.constexpr(MAX_ANCHOR_SPAN)


@triton.jit
def _halves(x):
    """The even and the odd channels of ``[rows, C]`` (a channel sum may take them apart)."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@triton.jit
def _exact_diag_leaf(qh, kh, lc, causal):
    """The diagonal block's sums over a subset of the channels, from the
    unfactored ``2^(g_i - g_j)`` ([BS, BS, channels]; masked before the exp2)."""
    e = tl.exp2(tl.where(causal, lc[:, None, :] - lc[None, :, :], float("-inf")))
    ke = kh[None, :, :] * e
    return tl.sum(qh[:, None, :] * ke, 2), tl.sum(kh[:, None, :] * ke, 2)


@triton.jit
def _exact_diag_split(qh, kh, lc, causal, LEVELS: tl.constexpr):
    """:func:`_exact_diag_leaf` summed over ``2^LEVELS`` parts of the channels (each
    level splits the even from the odd ones)."""
    if LEVELS == 0:
        aq, ak = _exact_diag_leaf(qh, kh, lc, causal)
    else:
        q0, q1 = _halves(qh)
        k0, k1 = _halves(kh)
        l0, l1 = _halves(lc)
        aq, ak = _exact_diag_split(q0, k0, l0, causal, LEVELS - 1)
        aq1, ak1 = _exact_diag_split(q1, k1, l1, causal, LEVELS - 1)
        aq += aq1
        ak += ak1
    return aq, ak


@triton.jit
def _exact_diag(qh, kh, lc, BS: tl.constexpr):
    """The diagonal blocks from the unfactored ``2^(g_i - g_j)`` per channel, exact for
    any decay: the channels summed an eighth at a time, so one ``[BS, BS, K/8]``
    product is live instead of ``[BS, BS, K]`` (in halves the intra launch spilled up
    to 1.3 KB per thread, in eighths 0.8: docs/design/kda_prefill.md)."""
    rows = tl.arange(0, BS)
    causal = (rows[None, :] <= rows[:, None])[:, :, None]
    return _exact_diag_split(qh, kh, lc, causal, 3)


@triton.jit
def _factored_diag(qd, kd, kf, tot, shift, two_shift, DOT: tl.constexpr):
    """The diagonal blocks as one product: ``kf = k̂ 2^(tot - lc)`` times ``2^(-tot - s)``
    gives ``k̂ 2^(-lc - s)``, the rows ``x̂ 2^(lc + s)``: with ``s`` centring the
    sub-chunk's span both lie in ``[2^-63, 2^63]``."""
    kct = tl.trans((kf * tl.exp2(-tot - shift)[None, :]).to(DOT))
    aq = tl.dot((qd * two_shift).to(DOT), kct, input_precision="ieee")
    ak = tl.dot((kd * two_shift).to(DOT), kct, input_precision="ieee")
    return aq, ak


@triton.jit
def _diag_block(qh, kh, lc, qd, kd, kf, tot, beta, shift, two_shift,
                BS: tl.constexpr, SPAN_CHECK: tl.constexpr, DOT: tl.constexpr):
    """Diagonal ``[BS, BS]`` blocks of ``A_qk`` (``j <= i``) and ``A_kk``
    (``j < i``, rows times beta) of one sub-chunk.

    Without ``SPAN_CHECK`` (a bounded gate: every span within ``_MAX_SPAN``)
    the factored product with the launch's ``shift``. With it (the unbounded gates)
    the sub-chunk's own span decides at run time: within the bound the factored
    product, centred on its ``lc`` range; past it the exact sums (16-64x the work)."""
    rows = tl.arange(0, BS)
    if SPAN_CHECK:
        lo = tl.min(tl.min(lc, 1), 0)
        hi = tl.max(tl.max(lc, 1), 0)
        if (hi - lo > _MAX_SPAN) | (lo < -_MAX_SPAN) | (hi > _MAX_SPAN):
            aq, ak = _exact_diag(qh, kh, lc, BS)
        else:
            centre = -0.5 * (lo + hi)
            aq, ak = _factored_diag(qd, kd, kf, tot, centre, tl.exp2(centre), DOT)
    else:
        aq, ak = _factored_diag(qd, kd, kf, tot, shift, two_shift, DOT)
    aq = tl.where(rows[None, :] <= rows[:, None], aq, 0.0)
    ak = tl.where(rows[None, :] < rows[:, None], ak, 0.0) * beta[:, None]
    return aq, ak


@triton.jit
def _off_block(qdD, kdD, kf_j, m, beta):
    """Off-diagonal block ``(I, J < I)``: ``qd_I (kf_J 2^m)^T`` with ``m = b_I - b_(J+1) <= 0``
    (the block totals of the sub-chunks strictly between J and I)."""
    kct = tl.trans((kf_j * tl.exp2(m)[None, :]).to(qdD.dtype))
    aq = tl.dot(qdD, kct, input_precision="ieee")
    ak = tl.dot(kdD, kct, input_precision="ieee") * beta[:, None]
    return aq, ak


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tri_inv(A, BS: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower ``[16, 16]`` block, fp32.

    Recursive doubling: the inverse of the 2x2 diagonal blocks is ``I - A``
    there; each doubling merges two inverted halves ``[[P, 0], [C, Q]]`` with
    ``X <- X - (X E) X`` (E the coupling block C), i.e. ``-Q C P`` below the
    diagonal. Six small products instead of a 15-step serial substitution, with
    the same accuracy (no powers of A beyond what the block formula forms).
    """
    ri = tl.arange(0, BS)[:, None]
    ci = tl.arange(0, BS)[None, :]
    X = (ri == ci).to(tl.float32) - tl.where(ri // 2 == ci // 2, A, 0.0)
    E = tl.where((ri // 4 == ci // 4) & (ri // 2 != ci // 2), A, 0.0)
    X = X - _mm(_mm(X, E), X)
    E = tl.where((ri // 8 == ci // 8) & (ri // 4 != ci // 4), A, 0.0)
    X = X - _mm(_mm(X, E), X)
    E = tl.where(ri // 8 != ci // 8, A, 0.0)
    X = X - _mm(_mm(X, E), X)
    return X


@triton.jit
def _store_rows(ptr, t, valid, row_stride, val, W: tl.constexpr, col0):
    cols = col0 + tl.arange(0, W)
    tl.store(ptr + t[:, None] * row_stride + cols[None, :], val.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _store_kg(ptr, kg, j0, BS: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """Block of ``BS`` token columns ``j0..`` of the ``[K, BT]`` slab at ``ptr``."""
    tok = j0 + tl.arange(0, BS)
    cols = tl.arange(0, K)
    tl.store(ptr + cols[None, :] * BT + tok[:, None], kg.to(ptr.dtype.element_ty))


@triton.jit
def _load_rows(ptr, t, valid, row_stride, W: tl.constexpr, col0):
    cols = col0 + tl.arange(0, W)
    return tl.load(ptr + t[:, None] * row_stride + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _sub_chunk_rows(qr, kr, vr, xr, rb, t, valid, b, alog, dtb, lower_bound, qg_h, w_h, u_h, o_qk, o_v,
                    K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr, QK_L2NORM: tl.constexpr,
                    BETA_SIGMOID: tl.constexpr, FOLDED: tl.constexpr, FIRST: tl.constexpr, DOT: tl.constexpr):
    """The per-row work of one sub-chunk of the intra launch, from its raw loads
    (:func:`_load_block`): :func:`_prep_block`, the decays ``d = 2^lc``, the column
    keys ``kf = k̂ 2^(tot - lc)`` and the rows ``qd = q̂ d``, ``kd = k̂ d``; stores its
    rows of ``qg`` (``qd 2^b``), ``w`` (``beta kd 2^b``, ``FOLDED``: ``kd 2^b``) and
    ``u`` (``beta v``, not ``FOLDED``), ``b`` the cumulative gate before the sub-chunk
    (``FIRST``: sub-chunk 0, the rows stored unscaled and ``b`` unread). Returns
    ``(q̂, k̂, lc, tot, beta, qd, kd, kf, qdD, kdD)``, ``qdD`` / ``kdD`` being ``qd`` /
    ``kd`` in ``DOT`` (the operands of its off-diagonal blocks)."""
    q, k, lc, s, be, bv = _prep_block(qr, kr, vr, xr, rb, valid, alog, dtb, lower_bound, GATE,
                                      QK_L2NORM, BETA_SIGMOID)
    d = tl.exp2(lc)
    kf = k * tl.exp2(s[None, :] - lc)
    qd = q * d
    kd = k * d
    qg = qd
    if not FIRST:
        e = tl.exp2(b)[None, :]
        qg = qd * e
    _store_rows(qg_h, t, valid, o_qk, qg, K, 0)
    wr = kd
    if not FOLDED:
        wr = be[:, None] * kd
    if not FIRST:
        wr = wr * e
    _store_rows(w_h, t, valid, o_qk, wr, K, 0)
    if not FOLDED:
        _store_rows(u_h, t, valid, o_v, bv, V, 0)
    return q, k, lc, s, be, qd, kd, kf, qd.to(DOT), kd.to(DOT)


@triton.jit
def _store_a_rows(aqk_h, akk_h, t, valid, o_a, aq0, aq1, aq2, aq3, ak0, ak1, ak2, ak3,
                  ROW: tl.constexpr, BS: tl.constexpr):
    """Row block ``ROW`` of ``A_qk`` (all four column blocks; the caller passes zeros
    past the diagonal) and of ``A_kk`` (column blocks ``J <= ROW`` only)."""
    _store_rows(aqk_h, t, valid, o_a, aq0, BS, 0)
    _store_rows(aqk_h, t, valid, o_a, aq1, BS, BS)
    _store_rows(aqk_h, t, valid, o_a, aq2, BS, 2 * BS)
    _store_rows(aqk_h, t, valid, o_a, aq3, BS, 3 * BS)
    _store_rows(akk_h, t, valid, o_a, ak0, BS, 0)
    if ROW >= 1:
        _store_rows(akk_h, t, valid, o_a, ak1, BS, BS)
    if ROW >= 2:
        _store_rows(akk_h, t, valid, o_a, ak2, BS, 2 * BS)
    if ROW >= 3:
        _store_rows(akk_h, t, valid, o_a, ak3, BS, 3 * BS)


@triton.jit
def _program_chunk(cu_ptr, ci_ptr, sci_r, sci_c, H, BT: tl.constexpr):
    """The chunk of this program in both prologue launches (grid ``chunks * H``,
    head fastest): ``(head, chunk row, sequence id, chunk index, bos, eos, first
    token)``; see :func:`~kda_engram.kda.metadata.chunk_row` (``seq < 0``: a
    padding row, to skip)."""
    pid = tl.program_id(0)
    h = pid % H
    r = (pid // H).to(tl.int64)
    seq, cidx, bos, eos, start = chunk_row(cu_ptr, ci_ptr, sci_r, sci_c, r, BT)
    return h, r, seq, cidx, bos, eos, start


@triton.jit
def _kda_prologue_intra_kernel(
    q_ptr, sq_t, sq_h, sq_c,
    k_ptr, sk_t, sk_h, sk_c,
    v_ptr, sv_t, sv_h, sv_c,
    g_ptr, sg_t, sg_h, sg_c,
    b_ptr, sb_t, sb_h,
    alog_ptr, salog,
    dtb_ptr, sdtb_h, sdtb_c,
    cu_ptr, ci_ptr, sci_r, sci_c,
    qg_ptr, w_ptr, u_ptr, kgt_ptr, aqk_ptr, decay_ptr, akk_ptr,
    H, lower_bound, shift, two_shift,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    GATE: tl.constexpr, SPAN_CHECK: tl.constexpr,
    DOT: tl.constexpr,
    QK_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    FOLDED: tl.constexpr = False, LOAD_V: tl.constexpr = True,
):
    """Launch 1 of 2: everything but the triangular solve. Writes ``qg, kg_t,
    aqk, decay`` (final), the solve's right-hand sides ``beta k̂ 2^g`` into ``w``
    and ``beta v`` into ``u``, and ``A_kk`` (fp32, row blocks ``J <= I`` only)
    into the ``akk`` workspace.

    ``FOLDED`` (with ``LOAD_V=False``) is the first launch of the folded prologue
    (:mod:`kda_engram.kda.hopper.folded_prologue`): ``kd = k̂ 2^g`` instead of ``beta kd``
    into ``w``, the ``kg`` rows ``[1, T, H, K]`` (not transposed) into ``kg_t``,
    and ``v`` / ``u`` untouched."""
    h, r, seq, cidx, bos, eos, start = _program_chunk(cu_ptr, ci_ptr, sci_r, sci_c, H, BT)
    if seq < 0:
        return
    rows = tl.arange(0, BS)

    colk = tl.arange(0, K)
    alog, dtb = gate_operands(alog_ptr, salog, dtb_ptr, sdtb_h, sdtb_c, h, colk, GATE)
    o_qk = H * K  # token stride of qg / w
    o_v = H * V
    o_a = H * BT  # token stride of aqk / akk
    qg_h = qg_ptr + h * K
    w_h = w_ptr + h * K
    u_h = u_ptr + h * V
    aqk_h = aqk_ptr + h * BT
    akk_h = akk_ptr + h * BT
    zero_blk = tl.zeros([BS, BS], dtype=tl.float32)
    zk = tl.zeros([K], dtype=tl.float32)

    # Sub-chunks stream in order (loads issued one sub-chunk ahead); each forms
    # its A_qk / A_kk row blocks against the column keys kf of the earlier ones.
    # ---------------------------------------------------------------- sub-chunk 0
    t0_ = start + rows
    m0 = t0_ < eos
    qr0, kr0, vr0, xr0, rb0 = _load_block(
        q_ptr, sq_t, sq_h, sq_c, k_ptr, sk_t, sk_h, sk_c, v_ptr, sv_t, sv_h, sv_c,
        g_ptr, sg_t, sg_h, sg_c, b_ptr, sb_t, sb_h, h, t0_, m0, K, V, LOAD_V)
    t1_ = t0_ + BS
    m1 = t1_ < eos
    qr1, kr1, vr1, xr1, rb1 = _load_block(
        q_ptr, sq_t, sq_h, sq_c, k_ptr, sk_t, sk_h, sk_c, v_ptr, sv_t, sv_h, sv_c,
        g_ptr, sg_t, sg_h, sg_c, b_ptr, sb_t, sb_h, h, t1_, m1, K, V, LOAD_V)
    q0, k0, lc0, s0, be0, qd0, kd0, kf0, qd0D, kd0D = _sub_chunk_rows(
        qr0, kr0, vr0, xr0, rb0, t0_, m0, zk, alog, dtb, lower_bound, qg_h, w_h, u_h, o_qk, o_v,
        K, V, GATE, QK_L2NORM, BETA_SIGMOID, FOLDED, True, DOT)
    aq00, ak00 = _diag_block(q0, k0, lc0, qd0, kd0, kf0, s0, be0, shift, two_shift, BS, SPAN_CHECK, DOT)
    _store_a_rows(aqk_h, akk_h, t0_, m0, o_a, aq00, zero_blk, zero_blk, zero_blk,
                  ak00, zero_blk, zero_blk, zero_blk, 0, BS)
    kf0 = kf0.to(DOT)

    # ---------------------------------------------------------------- sub-chunk 1
    t2_ = t1_ + BS
    m2 = t2_ < eos
    qr2, kr2, vr2, xr2, rb2 = _load_block(
        q_ptr, sq_t, sq_h, sq_c, k_ptr, sk_t, sk_h, sk_c, v_ptr, sv_t, sv_h, sv_c,
        g_ptr, sg_t, sg_h, sg_c, b_ptr, sb_t, sb_h, h, t2_, m2, K, V, LOAD_V)
    b1 = s0  # cumulative gate just before sub-chunk 1
    q1, k1, lc1, s1, be1, qd1, kd1, kf1, qd1D, kd1D = _sub_chunk_rows(
        qr1, kr1, vr1, xr1, rb1, t1_, m1, b1, alog, dtb, lower_bound, qg_h, w_h, u_h, o_qk, o_v,
        K, V, GATE, QK_L2NORM, BETA_SIGMOID, FOLDED, False, DOT)
    aq10, ak10 = _off_block(qd1D, kd1D, kf0, zk, be1)
    aq11, ak11 = _diag_block(q1, k1, lc1, qd1, kd1, kf1, s1, be1, shift, two_shift, BS, SPAN_CHECK, DOT)
    _store_a_rows(aqk_h, akk_h, t1_, m1, o_a, aq10, aq11, zero_blk, zero_blk,
                  ak10, ak11, zero_blk, zero_blk, 1, BS)
    kf1 = kf1.to(DOT)

    # ---------------------------------------------------------------- sub-chunk 2
    t3_ = t2_ + BS
    m3 = t3_ < eos
    qr3, kr3, vr3, xr3, rb3 = _load_block(
        q_ptr, sq_t, sq_h, sq_c, k_ptr, sk_t, sk_h, sk_c, v_ptr, sv_t, sv_h, sv_c,
        g_ptr, sg_t, sg_h, sg_c, b_ptr, sb_t, sb_h, h, t3_, m3, K, V, LOAD_V)
    b2 = s0 + s1
    q2, k2, lc2, s2, be2, qd2, kd2, kf2, qd2D, kd2D = _sub_chunk_rows(
        qr2, kr2, vr2, xr2, rb2, t2_, m2, b2, alog, dtb, lower_bound, qg_h, w_h, u_h, o_qk, o_v,
        K, V, GATE, QK_L2NORM, BETA_SIGMOID, FOLDED, False, DOT)
    aq20, ak20 = _off_block(qd2D, kd2D, kf0, s1, be2)
    aq21, ak21 = _off_block(qd2D, kd2D, kf1, zk, be2)
    aq22, ak22 = _diag_block(q2, k2, lc2, qd2, kd2, kf2, s2, be2, shift, two_shift, BS, SPAN_CHECK, DOT)
    _store_a_rows(aqk_h, akk_h, t2_, m2, o_a, aq20, aq21, aq22, zero_blk,
                  ak20, ak21, ak22, zero_blk, 2, BS)
    kf2 = kf2.to(DOT)

    # ---------------------------------------------------------------- sub-chunk 3
    b3 = b2 + s2
    q3, k3, lc3, s3, be3, qd3, kd3, kf3, qd3D, kd3D = _sub_chunk_rows(
        qr3, kr3, vr3, xr3, rb3, t3_, m3, b3, alog, dtb, lower_bound, qg_h, w_h, u_h, o_qk, o_v,
        K, V, GATE, QK_L2NORM, BETA_SIGMOID, FOLDED, False, DOT)
    aq30, ak30 = _off_block(qd3D, kd3D, kf0, s1 + s2, be3)
    aq31, ak31 = _off_block(qd3D, kd3D, kf1, s2, be3)
    aq32, ak32 = _off_block(qd3D, kd3D, kf2, zk, be3)
    aq33, ak33 = _diag_block(q3, k3, lc3, qd3, kd3, kf3, s3, be3, shift, two_shift, BS, SPAN_CHECK, DOT)
    _store_a_rows(aqk_h, akk_h, t3_, m3, o_a, aq30, aq31, aq32, aq33,
                  ak30, ak31, ak32, ak33, 3, BS)

    # ---------------------------------------------- kg_t, decay (need g_last)
    kg3 = kf3
    kg2 = kf2.to(tl.float32) * tl.exp2(s3)[None, :]
    kg1 = kf1.to(tl.float32) * tl.exp2(s2 + s3)[None, :]
    kg0 = kf0.to(tl.float32) * tl.exp2(s1 + s2 + s3)[None, :]
    if FOLDED:
        kg_h = kgt_ptr + h * K
        _store_rows(kg_h, t3_, m3, o_qk, kg3, K, 0)
        _store_rows(kg_h, t2_, m2, o_qk, kg2, K, 0)
        _store_rows(kg_h, t1_, m1, o_qk, kg1, K, 0)
        _store_rows(kg_h, t0_, m0, o_qk, kg0, K, 0)
    else:
        kg_slab = kgt_ptr + (r * H + h) * (K * BT)
        _store_kg(kg_slab, kg3, 3 * BS, BS, K, BT)
        _store_kg(kg_slab, kg2, 2 * BS, BS, K, BT)
        _store_kg(kg_slab, kg1, BS, BS, K, BT)
        _store_kg(kg_slab, kg0, 0, BS, K, BT)
    tl.store(decay_ptr + (r * H + h) * K + colk, tl.exp2(b3 + s3))


@triton.jit
def _kda_prologue_solve_kernel(
    cu_ptr, ci_ptr, sci_r, sci_c,
    w_ptr, u_ptr, akk_ptr,
    H,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr,
):
    """Launch 2 of 2: ``w = T rhs_w``, ``u = T rhs_u`` in place, ``T = (I + A_kk)^-1``,
    by block forward substitution ``x_I = T_II (rhs_I - sum_(J<I) A_IJ x_J)``.

    Each program reads and rewrites only its own chunk's rows of ``w`` / ``u``
    (row block ``I`` is read before anything that depends on it is stored), so
    the in-place update needs no second buffer; the solved blocks of earlier
    sub-chunks stay in registers."""
    h, r, seq, cidx, bos, eos, start = _program_chunk(cu_ptr, ci_ptr, sci_r, sci_c, H, BT)
    if seq < 0:
        return
    rows = tl.arange(0, BS)
    o_qk = H * K
    o_v = H * V
    o_a = H * BT
    w_h = w_ptr + h * K
    u_h = u_ptr + h * V
    akk_h = akk_ptr + h * BT

    t0_ = start + rows
    m0 = t0_ < eos
    rw0 = _load_rows(w_h, t0_, m0, o_qk, K, 0)
    ru0 = _load_rows(u_h, t0_, m0, o_v, V, 0)
    a00 = _load_rows(akk_h, t0_, m0, o_a, BS, 0)
    t1_ = t0_ + BS
    m1 = t1_ < eos
    rw1 = _load_rows(w_h, t1_, m1, o_qk, K, 0)
    ru1 = _load_rows(u_h, t1_, m1, o_v, V, 0)
    a10 = _load_rows(akk_h, t1_, m1, o_a, BS, 0).to(DOT)
    a11 = _load_rows(akk_h, t1_, m1, o_a, BS, BS)

    x0 = _tri_inv(a00, BS).to(DOT)
    w0 = _mm(x0, rw0.to(DOT))
    u0 = _mm(x0, ru0.to(DOT))
    _store_rows(w_h, t0_, m0, o_qk, w0, K, 0)
    _store_rows(u_h, t0_, m0, o_v, u0, V, 0)
    w0 = w0.to(DOT)
    u0 = u0.to(DOT)

    t2_ = t1_ + BS
    m2 = t2_ < eos
    rw2 = _load_rows(w_h, t2_, m2, o_qk, K, 0)
    ru2 = _load_rows(u_h, t2_, m2, o_v, V, 0)
    a20 = _load_rows(akk_h, t2_, m2, o_a, BS, 0).to(DOT)
    a21 = _load_rows(akk_h, t2_, m2, o_a, BS, BS).to(DOT)
    a22 = _load_rows(akk_h, t2_, m2, o_a, BS, 2 * BS)

    x1 = _tri_inv(a11, BS).to(DOT)
    w1 = _mm(x1, (rw1.to(tl.float32) - _mm(a10, w0)).to(DOT))
    u1 = _mm(x1, (ru1.to(tl.float32) - _mm(a10, u0)).to(DOT))
    _store_rows(w_h, t1_, m1, o_qk, w1, K, 0)
    _store_rows(u_h, t1_, m1, o_v, u1, V, 0)
    w1 = w1.to(DOT)
    u1 = u1.to(DOT)

    t3_ = t2_ + BS
    m3 = t3_ < eos
    rw3 = _load_rows(w_h, t3_, m3, o_qk, K, 0)
    ru3 = _load_rows(u_h, t3_, m3, o_v, V, 0)
    a30 = _load_rows(akk_h, t3_, m3, o_a, BS, 0).to(DOT)
    a31 = _load_rows(akk_h, t3_, m3, o_a, BS, BS).to(DOT)
    a32 = _load_rows(akk_h, t3_, m3, o_a, BS, 2 * BS).to(DOT)
    a33 = _load_rows(akk_h, t3_, m3, o_a, BS, 3 * BS)

    x2 = _tri_inv(a22, BS).to(DOT)
    w2 = _mm(x2, (rw2.to(tl.float32) - _mm(a20, w0) - _mm(a21, w1)).to(DOT))
    u2 = _mm(x2, (ru2.to(tl.float32) - _mm(a20, u0) - _mm(a21, u1)).to(DOT))
    _store_rows(w_h, t2_, m2, o_qk, w2, K, 0)
    _store_rows(u_h, t2_, m2, o_v, u2, V, 0)
    w2 = w2.to(DOT)
    u2 = u2.to(DOT)

    x3 = _tri_inv(a33, BS).to(DOT)
    w3 = _mm(x3, (rw3.to(tl.float32) - _mm(a30, w0) - _mm(a31, w1) - _mm(a32, w2)).to(DOT))
    u3 = _mm(x3, (ru3.to(tl.float32) - _mm(a30, u0) - _mm(a31, u1) - _mm(a32, u2)).to(DOT))
    _store_rows(w_h, t3_, m3, o_qk, w3, K, 0)
    _store_rows(u_h, t3_, m3, o_v, u3, V, 0)
