"""The folded prologue: raw ``q, k, v, raw_g, raw_beta`` to the operands of the
folded walk (:mod:`kda_engram.kda.hopper.walk`), two launches.

The folded contract (:func:`kda_engram.kda.reference.naive_chunk_operands`, keys
``qg, kd, t_fold, a_fold, decay``) takes the triangular inverse into the operands:
with ``T = (I + A_kk)^-1`` and ``M = T diag(beta)``, ``t_fold = M^T kg`` and
``a_fold = A_qk M``, so the walk reads ``v`` itself and needs neither ``w`` nor
``u`` (``u - w S^T = M (v - kd S^T)``).

1. The first launch is the prologue's (:func:`~kda_engram.kda.prologue_kernels._kda_prologue_intra_kernel`
   with ``FOLDED``): L2 norms, gate, cumsum, ``qg``, ``kd``, ``decay``, ``A_qk``
   (into the ``a_fold`` buffer), the ``kg`` rows (into the ``t_fold`` buffer) and
   ``A_kk`` into an fp32 workspace; it never reads ``v``.
2. :func:`_kda_prologue_fold_kernel` (same grid) forms ``T`` from the four 16x16
   diagonal inverses by block forward substitution (fp32), then rewrites its own
   chunk's rows in place: ``t_fold = beta (T^T kg)`` and ``a_fold = (A_qk T) beta``.

Outputs are new ``torch.empty`` tensors; ``t_fold`` rows and ``a_fold`` columns
past a sequence's last token within its last chunk are not part of the contract
(the walk masks them). Inputs are read through their strides, never copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...bundles import ConvArgs, KDAInputs
from ...constants import CHUNK_SIZE, SUB_CHUNK
from ..prologue import intra_launcher, launch_warps, prologue_dot_dtype
from ..prologue_kernels import _load_rows, _mm, _program_chunk, _store_rows, _tri_inv

__all__ = ["FOLD_WARPS", "allocate_folded_operands", "prepare_folded_prologue"]

#: Warps of the fold launch: 4 compile to 253 registers and no spill on sm_90a
#: (2 spill 616 B per thread; 8 take 206 registers).
FOLD_WARPS = 4


@triton.jit
def _beta_rows(b_ptr, sb_t, sb_h, h, t, valid, BETA_SIGMOID: tl.constexpr):
    """beta of the rows ``t`` (0 on invalid rows): ``sigmoid(raw_beta)``, or ``raw_beta`` as given."""
    b = tl.load(b_ptr + t * sb_t + h * sb_h, mask=valid, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = tl.sigmoid(b)
    return tl.where(valid, b, 0.0)


@triton.jit
def _tdot(Tb, kg, acc, DOT: tl.constexpr):
    """``acc + Tb^T kg``: one term of ``T^T kg`` (``Tb`` fp32, rounded to the operand dtype)."""
    return tl.dot(tl.trans(Tb).to(DOT), kg, acc, input_precision="ieee")


@triton.jit
def _kda_prologue_fold_kernel(
    cu_ptr, ci_ptr, sci_r, sci_c,
    b_ptr, sb_t, sb_h,
    tf_ptr, af_ptr, akk_ptr,
    H,
    K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):
    """Launch 2 of 2 of the folded prologue: ``t_fold = beta (T^T kg)`` and
    ``a_fold = (A_qk T) diag(beta)`` in place over the ``kg`` / ``A_qk`` rows the
    first launch wrote, ``T = (I + A_kk)^-1`` (fp32, from the 16x16 diagonal
    inverses: ``T_IJ = -T_II sum_(J <= L < I) A_IL T_LJ``). Each program reads all
    of its chunk's rows before it writes any of them."""
    h, r, seq, cidx, bos, eos, start = _program_chunk(cu_ptr, ci_ptr, sci_r, sci_c, H, BT)
    if seq < 0:
        return
    rows = tl.arange(0, BS)
    o_qk = H * K
    o_a = H * BT
    tf_h = tf_ptr + h * K
    af_h = af_ptr + h * BT
    akk_h = akk_ptr + h * BT
    t0_ = start + rows
    t1_ = t0_ + BS
    t2_ = t1_ + BS
    t3_ = t2_ + BS
    m0 = t0_ < eos
    m1 = t1_ < eos
    m2 = t2_ < eos
    m3 = t3_ < eos

    # T, block by block (rows past the sequence end load as zeros: identity rows).
    a10 = _load_rows(akk_h, t1_, m1, o_a, BS, 0)
    a20 = _load_rows(akk_h, t2_, m2, o_a, BS, 0)
    a21 = _load_rows(akk_h, t2_, m2, o_a, BS, BS)
    a30 = _load_rows(akk_h, t3_, m3, o_a, BS, 0)
    a31 = _load_rows(akk_h, t3_, m3, o_a, BS, BS)
    a32 = _load_rows(akk_h, t3_, m3, o_a, BS, 2 * BS)
    T00 = _tri_inv(_load_rows(akk_h, t0_, m0, o_a, BS, 0), BS)
    T11 = _tri_inv(_load_rows(akk_h, t1_, m1, o_a, BS, BS), BS)
    T22 = _tri_inv(_load_rows(akk_h, t2_, m2, o_a, BS, 2 * BS), BS)
    T33 = _tri_inv(_load_rows(akk_h, t3_, m3, o_a, BS, 3 * BS), BS)
    T10 = -_mm(T11, _mm(a10, T00))
    T21 = -_mm(T22, _mm(a21, T11))
    T20 = -_mm(T22, _mm(a20, T00) + _mm(a21, T10))
    T32 = -_mm(T33, _mm(a32, T22))
    T31 = -_mm(T33, _mm(a31, T11) + _mm(a32, T21))
    T30 = -_mm(T33, _mm(a30, T00) + _mm(a31, T10) + _mm(a32, T20))

    b0 = _beta_rows(b_ptr, sb_t, sb_h, h, t0_, m0, BETA_SIGMOID)
    b1 = _beta_rows(b_ptr, sb_t, sb_h, h, t1_, m1, BETA_SIGMOID)
    b2 = _beta_rows(b_ptr, sb_t, sb_h, h, t2_, m2, BETA_SIGMOID)
    b3 = _beta_rows(b_ptr, sb_t, sb_h, h, t3_, m3, BETA_SIGMOID)

    # t_fold = beta (T^T kg): row block I sums T_JI^T kg_J over J >= I.
    kg0 = _load_rows(tf_h, t0_, m0, o_qk, K, 0).to(DOT)
    kg1 = _load_rows(tf_h, t1_, m1, o_qk, K, 0).to(DOT)
    kg2 = _load_rows(tf_h, t2_, m2, o_qk, K, 0).to(DOT)
    kg3 = _load_rows(tf_h, t3_, m3, o_qk, K, 0).to(DOT)
    z = tl.zeros([BS, K], dtype=tl.float32)
    tf0 = _tdot(T30, kg3, _tdot(T20, kg2, _tdot(T10, kg1, _tdot(T00, kg0, z, DOT), DOT), DOT), DOT) * b0[:, None]
    tf1 = _tdot(T31, kg3, _tdot(T21, kg2, _tdot(T11, kg1, z, DOT), DOT), DOT) * b1[:, None]
    tf2 = _tdot(T32, kg3, _tdot(T22, kg2, z, DOT), DOT) * b2[:, None]
    tf3 = _tdot(T33, kg3, z, DOT) * b3[:, None]
    _store_rows(tf_h, t0_, m0, o_qk, tf0, K, 0)
    _store_rows(tf_h, t1_, m1, o_qk, tf1, K, 0)
    _store_rows(tf_h, t2_, m2, o_qk, tf2, K, 0)
    _store_rows(tf_h, t3_, m3, o_qk, tf3, K, 0)

    # a_fold = (A_qk T) diag(beta): block (I, J) sums A_qk[I, L] T_LJ over J <= L <= I.
    q00 = _load_rows(af_h, t0_, m0, o_a, BS, 0).to(tl.float32)
    q10 = _load_rows(af_h, t1_, m1, o_a, BS, 0).to(tl.float32)
    q11 = _load_rows(af_h, t1_, m1, o_a, BS, BS).to(tl.float32)
    q20 = _load_rows(af_h, t2_, m2, o_a, BS, 0).to(tl.float32)
    q21 = _load_rows(af_h, t2_, m2, o_a, BS, BS).to(tl.float32)
    q22 = _load_rows(af_h, t2_, m2, o_a, BS, 2 * BS).to(tl.float32)
    q30 = _load_rows(af_h, t3_, m3, o_a, BS, 0).to(tl.float32)
    q31 = _load_rows(af_h, t3_, m3, o_a, BS, BS).to(tl.float32)
    q32 = _load_rows(af_h, t3_, m3, o_a, BS, 2 * BS).to(tl.float32)
    q33 = _load_rows(af_h, t3_, m3, o_a, BS, 3 * BS).to(tl.float32)
    c0 = b0[None, :]
    c1 = b1[None, :]
    c2 = b2[None, :]
    c3 = b3[None, :]
    _store_rows(af_h, t0_, m0, o_a, _mm(q00, T00) * c0, BS, 0)
    _store_rows(af_h, t1_, m1, o_a, (_mm(q10, T00) + _mm(q11, T10)) * c0, BS, 0)
    _store_rows(af_h, t1_, m1, o_a, _mm(q11, T11) * c1, BS, BS)
    _store_rows(af_h, t2_, m2, o_a, (_mm(q20, T00) + _mm(q21, T10) + _mm(q22, T20)) * c0, BS, 0)
    _store_rows(af_h, t2_, m2, o_a, (_mm(q21, T11) + _mm(q22, T21)) * c1, BS, BS)
    _store_rows(af_h, t2_, m2, o_a, _mm(q22, T22) * c2, BS, 2 * BS)
    _store_rows(af_h, t3_, m3, o_a, (_mm(q30, T00) + _mm(q31, T10) + _mm(q32, T20) + _mm(q33, T30)) * c0, BS, 0)
    _store_rows(af_h, t3_, m3, o_a, (_mm(q31, T11) + _mm(q32, T21) + _mm(q33, T31)) * c1, BS, BS)
    _store_rows(af_h, t3_, m3, o_a, (_mm(q32, T22) + _mm(q33, T32)) * c2, BS, 2 * BS)
    _store_rows(af_h, t3_, m3, o_a, _mm(q33, T33) * c3, BS, 3 * BS)


def allocate_folded_operands(q: torch.Tensor, v: torch.Tensor, num_chunks: int) -> dict:
    """New tensors of the folded contract for ``q [1, T, H, K]``: ``qg, kd, t_fold``
    ``[1, T, H, K]`` and ``a_fold [1, T, H, 64]`` in ``q``'s dtype, ``decay [num_chunks,
    H, K]`` fp32, and ``v`` (the value band the walk reads) as given. Shared by every
    prologue that writes the contract (the Triton one here, the Gluon one in
    :mod:`kda_engram.kda.hopper.prologue`)."""
    _, T, H, K = q.shape
    dev = q.device
    return dict(
        qg=torch.empty(1, T, H, K, dtype=q.dtype, device=dev),
        kd=torch.empty(1, T, H, K, dtype=q.dtype, device=dev),
        t_fold=torch.empty(1, T, H, K, dtype=q.dtype, device=dev),
        a_fold=torch.empty(1, T, H, CHUNK_SIZE, dtype=q.dtype, device=dev),
        decay=torch.empty(num_chunks, H, K, dtype=torch.float32, device=dev),
        v=v,
    )


def prepare_folded_prologue(x: KDAInputs, cu_seqlens, chunk_indices, conv: ConvArgs = ConvArgs(), *,
                            num_warps=None):
    """The host half of the folded prologue (the arguments of
    :func:`kda_engram.kda.prologue.kda_prefill_prologue` as bundles, assumed valid and
    guarded). Returns ``launch()``, which makes the launches (the conv's first, when
    on) and returns ``dict(qg, kd, t_fold, a_fold, decay, v)``: ``v`` is the value band
    the walk must read (the conv's output when the conv is on, else ``v`` itself)."""
    q, v, raw_beta = x.q, x.v, x.raw_beta
    _, T, H, K = q.shape
    V = v.shape[3]
    dev = q.device
    num_chunks = chunk_indices.shape[0]
    intra_warps = launch_warps(num_warps, dev, K, V)[0]
    fold_warps = FOLD_WARPS if num_warps is None else launch_warps(num_warps, dev, K, V)[1]
    out = allocate_folded_operands(q, v, num_chunks)
    if num_chunks == 0 or H == 0:
        return lambda: out
    dot_dtype = prologue_dot_dtype(q)
    launch_intra = intra_launcher(x, cu_seqlens, chunk_indices, conv, num_warps=intra_warps)
    akk = torch.empty(1, T, H, CHUNK_SIZE, dtype=torch.float32, device=dev)
    grid = (num_chunks * H,)

    def launch():
        # kd into the w slot, the kg rows into t_fold, A_qk into a_fold (the fold
        # launch rewrites the last two in place); u is never written.
        out["v"] = launch_intra(out["qg"], out["kd"], out["kd"], out["t_fold"], out["a_fold"], out["decay"], akk,
                                folded=True)
        _kda_prologue_fold_kernel[grid](
            cu_seqlens, chunk_indices, chunk_indices.stride(0), chunk_indices.stride(1),
            raw_beta, raw_beta.stride(1), raw_beta.stride(2),
            out["t_fold"], out["a_fold"], akk,
            H,
            K=K, BT=CHUNK_SIZE, BS=SUB_CHUNK, DOT=dot_dtype, BETA_SIGMOID=bool(x.beta_sigmoid),
            num_warps=fold_warps, num_stages=1,
        )
        return out

    return launch
