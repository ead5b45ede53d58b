"""A torch model of the Gluon prologue's order of operations
(:mod:`kda_engram.kda.hopper.prologue`), for the CPU: Gluon has no interpreter in
Triton 3.6, so this is the kernel's arithmetic written out, checked against the fp64
folded contract and the Triton folded prologue (``tests/kda/test_hopper_prologue.py``).

Same tiles (64-row chunks, four 16-row sub-chunks, 16-column strips), same anchors
(each strip's row operand anchored at the strip's end ``b_(J+1)``), the same operand
roundings to bf16 at the same points (``round_bf16=True``: the wgmma operands, the
hi/lo splits of the bf16x3 products and the bf16 stores), fp32 accumulations, and
the same inverse algorithm (per-block forward substitution in fp32, then
``T = (I - N + N^2 - N^3) D``). Not modelled: the tensor cores' accumulation order
inside one product (fp32 either way) and ex2.approx's last-bit error.

``fault`` plants a known error (the tests check that each is caught):
``"anchor"`` anchors the strips' row operand at the strip start instead of its end,
``"inverse"`` drops the ``N^3`` term of ``T``, ``"mask"`` drops ``A_qk``'s diagonal.
"""

from __future__ import annotations

import torch

from ...constants import CHUNK_SIZE, L2NORM_EPS, LOG2E, SUB_CHUNK
from ..reference import kda_gate

__all__ = ["model_folded_prologue"]

FAULTS = (None, "anchor", "inverse", "mask")


def _r(x: torch.Tensor, on: bool) -> torch.Tensor:
    """Round to bf16 and back (a wgmma operand or a bf16 store), when ``on``."""
    return x.to(torch.bfloat16).to(x.dtype) if on else x


def _mm3(a, b, on):
    """The kernel's bf16x3 product ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` (fp32 sums)."""
    if not on:
        return a @ b
    ah, bh = _r(a, True), _r(b, True)
    al, bl = _r(a - ah, True), _r(b - bh, True)
    return ah @ bh + ah @ bl + al @ bh


def _chunk(qf, kf, a, rb, nvalid, round_bf16, qk_l2norm, beta_sigmoid, fault):
    """One chunk of every head: inputs ``[H, 64, K]`` (zero rows past ``nvalid``), fp32."""
    Hh, BT, K = qf.shape
    BS = SUB_CHUNK
    NB = BT // BS
    on = round_bf16
    valid = (torch.arange(BT) < nvalid)[None, :, None]
    # 1. gate, norms, cumsum by sub-chunk
    a = torch.where(valid, a, torch.zeros_like(a))  # the log2 gate, 0 on rows past the end
    a4 = a.view(Hh, NB, BS, K)
    lc = torch.cumsum(a4, 2)
    s = a4.sum(2)  # [H, 4, K]
    b = [torch.zeros_like(s[:, 0])]
    for i in range(NB):
        b.append(b[-1] + s[:, i])  # b_0 = 0, b_1 = s_0, ..., b_4 = g_last
    bI = torch.stack(b[:NB], 1)  # [H, 4, K]
    g_last = b[NB]
    u = lc - s[:, :, None]  # g - b_(I+1), in [0, span]
    e_g = (bI + s)[:, :, None]
    e_kg = torch.exp2(g_last[:, None] - (bI + s))[:, :, None]
    if qk_l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2NORM_EPS)
    q4, k4 = qf.view(Hh, NB, BS, K), kf.view(Hh, NB, BS, K)
    out = {}
    out["kd"] = (k4 * torch.exp2(u + e_g)).reshape(Hh, BT, K)
    kfac = k4 * torch.exp2(-u)  # k̂ 2^(b_(I+1) - g) <= 1
    kf_b = _r(kfac, on).reshape(Hh, BT, K)
    kg_b = _r(kfac * e_kg, on).reshape(Hh, BT, K)
    KE = k4 * torch.exp2(u)  # k̂ 2^(g - b_(I+1)) in [k̂, k̂ 2^span]
    out["qg"] = (q4 * torch.exp2(u + e_g)).reshape(Hh, BT, K)
    QE = q4 * torch.exp2(u)
    out["decay"] = torch.exp2(g_last)
    beta = rb.clone()
    if beta_sigmoid:
        beta = 1.0 / (1.0 + torch.exp(-beta))
    beta = torch.where(valid[:, :, 0], beta, torch.zeros_like(beta))  # [H, 64]

    # 2. strips: row operand anchored at the strip end b_(J+1)
    es = torch.exp2(s)[:, :, None]
    blk = torch.arange(NB)[None, :, None, None]
    ri = torch.arange(BT)[:, None]
    aqk = torch.zeros(Hh, BT, BT)
    akk = torch.zeros(Hh, BT, BT)
    for J in range(NB):
        bJ1 = b[J + 1] if fault != "anchor" else b[J]
        cv = torch.exp2(torch.clamp(bI - bJ1[:, None], max=0.0))[:, :, None]
        kJ = kf_b[:, J * BS:(J + 1) * BS]  # [H, 16, K]
        cj = J * BS + torch.arange(BS)[None, :]
        for XE, dst, strict in ((KE, akk, True), (QE, aqk, False)):
            rx = torch.where(blk == J, XE, torch.where(blk > J, (XE * es) * cv, torch.zeros_like(XE)))
            acc = _r(rx, on).reshape(Hh, BT, K) @ kJ.transpose(1, 2)  # [H, 64, 16]
            keep = (cj < ri) if (strict or fault == "mask") else (cj <= ri)
            acc = torch.where(keep, acc, torch.zeros_like(acc))
            if strict:
                acc = acc * beta[:, :, None]
            dst[:, :, J * BS:(J + 1) * BS] = acc

    # 3. diagonal inverses (forward substitution, fp32), then T = (I - N + N^2 - N^3) D
    D = torch.zeros(Hh, BT, BT)
    eye16 = torch.eye(BS)
    for blk_i in range(NB):
        A = akk[:, blk_i * BS:(blk_i + 1) * BS, blk_i * BS:(blk_i + 1) * BS]
        X = torch.zeros(Hh, BS, BS)
        for i in range(BS):
            X[:, i] = eye16[i][None] - (A[:, i, :, None] * X).sum(1)
        D[:, blk_i * BS:(blk_i + 1) * BS, blk_i * BS:(blk_i + 1) * BS] = X
    same = (ri // BS) == (torch.arange(BT)[None, :] // BS)
    Aoff = torch.where(same, torch.zeros_like(akk), akk)
    N1 = _mm3(D, Aoff, on)
    N2 = _mm3(N1, N1, on)
    N3 = _mm3(N1, N2, on) if fault != "inverse" else torch.zeros_like(N1)
    P = torch.eye(BT)[None] - N1 + N2 - N3
    T = _mm3(P, D, on)

    # 4. fold
    TT = T.transpose(1, 2)
    th = _r(TT, on)
    tf = th @ kg_b + (_r(TT - th, on) @ kg_b if on else 0.0)
    out["t_fold"] = tf * beta[:, :, None]
    out["a_fold"] = _mm3(aqk, T, on) * beta[:, None, :]
    for key in ("qg", "kd", "t_fold", "a_fold"):
        out[key] = _r(out[key], on)
    return out


def model_folded_prologue(q, k, raw_g, raw_beta, A_log, dt_bias, lower_bound, cu_seqlens, *, round_bf16=True,
                          qk_l2norm=True, beta_sigmoid=True, fault=None):
    """The Gluon prologue's outputs, computed on the CPU in the kernel's order (fp32).

    ``q, k, raw_g [1, T, H, K]``, ``raw_beta [1, T, H]``, ``A_log [H]``, ``dt_bias
    [H*K]`` or ``[H, K]``, ``cu_seqlens [N+1]``. Returns fp32 ``qg, kd, t_fold [1, T, H, K]``,
    ``a_fold [1, T, H, 64]`` and ``decay [chunks, H, K]`` (chunk rows in sequence order,
    as :func:`kda_engram.kda.metadata.prepare_chunk_offsets` numbers them); ``a_fold``
    columns past a sequence's end are zero here (not part of the contract).
    ``round_bf16=False`` drops every bf16 rounding (compare with fp32 kernels)."""
    if fault not in FAULTS:
        raise ValueError(f"fault: expected one of {FAULTS}, got {fault!r}")
    _, T, H, K = q.shape
    BT = CHUNK_SIZE
    f = torch.float32
    a_log2 = kda_gate(raw_g.to(f), A_log.to(f), dt_bias.to(f), float(lower_bound)) * LOG2E  # the kernel's gate
    out = {n: torch.zeros(1, T, H, K) for n in ("qg", "kd", "t_fold")}
    out["a_fold"] = torch.zeros(1, T, H, BT)
    decays = []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        for s0 in range(bounds[n], bounds[n + 1], BT):
            e0 = min(s0 + BT, bounds[n + 1])
            L_ = e0 - s0

            def tile(x, width):
                t = torch.zeros(H, BT, width)
                t[:, :L_] = x[0, s0:e0].to(f).transpose(0, 1).reshape(H, L_, width)
                return t

            rb = torch.zeros(H, BT)
            rb[:, :L_] = raw_beta[0, s0:e0].to(f).transpose(0, 1)
            c = _chunk(tile(q, K), tile(k, K), tile(a_log2, K), rb, L_, round_bf16,
                       qk_l2norm, beta_sigmoid, fault)
            for key in ("qg", "kd", "t_fold"):
                out[key][0, s0:e0] = c[key][:, :L_].transpose(0, 1)
            af = c["a_fold"][:, :L_].clone()
            af[:, :, L_:] = 0.0
            out["a_fold"][0, s0:e0] = af.transpose(0, 1)
            decays.append(c["decay"])
    out["decay"] = torch.stack(decays, 0) if decays else torch.zeros(0, H, K)
    return out
