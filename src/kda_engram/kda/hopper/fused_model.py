"""A torch model of the fused Hopper prefill's order of operations (issue 52,
``FUSED_PREFILL.md``): the CPU proof of the one-launch kernel, which Gluon cannot
run on a CPU. Its GPU tests compare the kernel against it; its CPU tests, it against fp64.

Per (sequence, head) the fp32 state ``S [V, K]`` stays on chip; per 64-token chunk (four
16-token sub-chunks ``I``; ``a`` the per-token log2 gate, ``lc`` its sub-chunk-local
inclusive cumsum, ``s_I`` the sub-chunk totals, ``b_I`` the totals before ``I``, ``G =
b_I + lc``):

1. **Gate and norms** (:func:`log2_gate`): the bounded, softplus or precomputed gate in
   log2 units; L2 norms of q and k; ``beta``. A chunk is *flagged* when some channel's
   gate spans more than :data:`MAX_ANCHOR_SPAN` in a sub-chunk (never for ``lower_bound >= -5.45``).
2. **Walk operands**: ``qg = q̂ 2^G``, ``kd = k̂ 2^G``, ``kg = k̂ 2^(G_last - G)``,
   ``decay = 2^G_last``: every factor at most 1, exact for any gate.
3. **A_kk, A_qk** by 16-column strips ``J``. Below the diagonal (``I > J``) the row
   operand is re-anchored at the strip's end ``b_(J+1)``: ``x̂_i 2^(G_i - b_(J+1))``
   times the column operand ``k̂_j 2^(b_(J+1) - G_j)``, both at most 1 (exact for any
   gate). The diagonal blocks use the same anchors when the chunk is not flagged (the
   row factor is then in ``[1, 2^span]``, a normal number); a flagged chunk's diagonal
   blocks take an FMA recurrence instead, ``P_(j+d) = P_(j+d-1) 2^(a_(j+d))``, which
   only ever multiplies numbers at most 1 (the softplus gate stays exact).
   At chunk 32 (the kernel's) the strips collapse into one product anchored at the
   sub-chunks' boundary ``b_1`` (:func:`_boundary_anchored`): every factor spans at
   most one sub-chunk from the anchor.
4. **Inverse**: each 16x16 diagonal block of ``I + A_kk`` by forward substitution in
   fp32, joined by ``T_IJ = -sum_(J <= L < I) (T_II A_IL) T_LJ``; ``M = T diag(beta)``.
5. **Fold**: ``t_fold = M^T kg``, ``a_fold = A_qk M`` (``M`` a bf16 operand split hi/lo
   when ``fold_split``, else rounded once).
6. **Walk** (the consumers, :func:`kda_engram.kda.reference.naive_folded_chunk_step`
   with the Gluon walk's roundings): ``R = v - kd S^T``, ``o = scale (qg S^T + a_fold R)``,
   ``S = S diag(decay) + R^T t_fold``; ``S`` and ``R`` rounded to bf16 as operands.

``round_bf16=True`` rounds at the kernel's points (the wgmma operands, the bf16 ring
tiles; accumulation in fp32); ``False`` keeps everything in the input's float dtype
(fp64 in: the model is then exact up to fp64 rounding, the check of the algebra).
``fault`` plants a known error (each must fail the model's tests): ``"anchor"`` anchors
the strips' row operand at the strip start, ``"flag"`` never takes the exact diagonal
path, ``"substitution"`` drops the block substitution's ``L > J`` terms, ``"decay"``
skips the state's decay.
"""

from __future__ import annotations

import torch

from ...constants import CHUNK_SIZE, L2NORM_EPS, LOG2E, MAX_ANCHOR_SPAN, SUB_CHUNK
from ..reference import kda_gate

__all__ = ["FAULTS", "log2_gate", "model_fused_prefill"]

FAULTS = (None, "anchor", "flag", "substitution", "decay")


def _r(x: torch.Tensor, on: bool) -> torch.Tensor:
    """``x`` rounded to bf16 and back (a wgmma operand or a bf16 tile), when ``on``."""
    return x.to(torch.bfloat16).to(x.dtype) if on else x


def log2_gate(raw_g, A_log, dt_bias, lower_bound, gate="raw"):
    """The per-token log2 decay (``<= 0``) of ``raw_g [..., H, K]``: the reference's
    gate (:func:`kda_engram.kda.reference.kda_gate`: bounded with ``lower_bound``,
    softplus without) times log2(e); ``gate="log_decay"``: ``raw_g`` is the natural-log
    decay itself."""
    if gate == "log_decay":
        return raw_g * LOG2E
    return kda_gate(raw_g, A_log, dt_bias, lower_bound) * LOG2E


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _blocks(x, NB):
    """``[H, 64, ...]`` -> ``[H, NB, 16, ...]``."""
    return x.reshape(x.shape[0], NB, SUB_CHUNK, *x.shape[2:])


def _strips(xh, kh, a, G, bI, s, flagged, on, fault, inclusive):
    """``sum_c x̂_i k̂_j 2^(G_i - G_j)`` for ``j < i`` (``j <= i`` when ``inclusive``),
    ``[H, 64, 64]``, in the kernel's anchoring (module docstring, step 3)."""
    Hh, BT, K = xh.shape
    NB = BT // SUB_CHUNK
    BS = SUB_CHUNK
    out = torch.zeros(Hh, BT, BT, dtype=xh.dtype)
    blk = torch.arange(BT) // BS
    ends = bI + s  # b_(J+1) [H, NB, K]
    exact_diagonal = flagged and fault != "flag"
    for J in range(NB):
        anchor = (bI[:, J] if fault == "anchor" else ends[:, J])[:, None, :]  # [H, 1, K]
        col = _r(kh[:, J * BS:(J + 1) * BS] * torch.exp2(anchor - G[:, J * BS:(J + 1) * BS]), on)  # <= 1
        rows = blk > J if exact_diagonal else blk >= J  # the exact diagonal block is filled below
        row_op = torch.where(rows[None, :, None], xh * torch.exp2(G - anchor), torch.zeros_like(xh))
        out[:, :, J * BS:(J + 1) * BS] = _r(row_op, on) @ col.transpose(1, 2)
        if exact_diagonal:
            # The exact diagonal block: P_(j+d) = P_(j+d-1) 2^(a_(j+d)), factors <= 1.
            xs, ks, As = (t[:, J * BS:(J + 1) * BS] for t in (xh, kh, a))
            P = torch.ones_like(ks)  # row j: 2^(G_(j+d) - G_j), rows j < 16 - d
            for d in range(BS):
                if d > 0:
                    P = P[:, :-1] * torch.exp2(As[:, d:])
                j = torch.arange(BS - d)
                out[:, J * BS + j + d, J * BS + j] = (xs[:, j + d] * ks[:, j] * P).sum(-1)
    keep = torch.ones(BT, BT, dtype=torch.bool).tril(0 if inclusive else -1)
    return torch.where(keep[None], out, torch.zeros_like(out))


def _inverse(akk, fault):
    """``T = (I + akk)^-1`` (strictly lower ``akk [H, 64, 64]``) by per-block forward
    substitution and block forward substitution, in ``akk``'s dtype."""
    Hh, BT, _ = akk.shape
    BS = SUB_CHUNK
    NB = BT // BS
    blk = lambda t, I, J: t[:, I * BS:(I + 1) * BS, J * BS:(J + 1) * BS]  # noqa: E731
    T = torch.zeros_like(akk)
    eye = torch.eye(BS, dtype=akk.dtype)
    for I in range(NB):
        A = blk(akk, I, I)
        X = torch.zeros(Hh, BS, BS, dtype=akk.dtype)
        for i in range(BS):
            X[:, i] = eye[i][None] - (A[:, i, :, None] * X).sum(1)
        T[:, I * BS:(I + 1) * BS, I * BS:(I + 1) * BS] = X
    for I in range(1, NB):
        for J in range(I - 1, -1, -1):
            terms = range(J, I) if fault != "substitution" else range(J, J + 1)
            # (T_II A_IL) T_LJ, the kernel's association: its substitution of block row I
            # runs on [A_IL, I] and yields T_II A_IL beside T_II.
            acc = sum((blk(T, I, I) @ blk(akk, I, L)) @ blk(T, L, J) for L in terms)
            T[:, I * BS:(I + 1) * BS, J * BS:(J + 1) * BS] = -acc
    return T


def _boundary_anchored(xh, kh, G, anchor, on, inclusive):
    """``sum_c x̂_i k̂_j 2^(G_i - G_j)`` (``j < i``, or ``j <= i`` when ``inclusive``) as
    the chunk-32 kernel forms it: one product anchored at the boundary of its two
    sub-chunks, ``bf16(x̂ 2^(G - anchor)) bf16(k̂ 2^(anchor - G))^T`` (every factor spans at
    most one sub-chunk from the anchor). The upper triangle, where both factors may be
    large, is selected away, never multiplied in."""
    row = _r(xh * torch.exp2(G - anchor[:, None, :]), on)
    col = _r(kh * torch.exp2(anchor[:, None, :] - G), on)
    out = row @ col.transpose(1, 2)
    BT = xh.shape[1]
    keep = torch.ones(BT, BT, dtype=torch.bool).tril(0 if inclusive else -1)
    return torch.where(keep[None], out, torch.zeros_like(out))


def _prepare_chunk(qf, kf, a, beta, nvalid, on, qk_l2norm, fold_split, fault):
    """Steps 1-5 for one chunk of every head: inputs ``[H, 64, K]`` and ``beta [H, 64]``
    (rows past ``nvalid`` are another sequence's and may hold anything). Returns the
    ring tiles ``qg, kd, t_fold [H, 64, K]``,
    ``a_fold [H, 64, 64]``, ``decay [H, K]`` and whether the chunk was flagged."""
    Hh, BT, K = qf.shape
    NB = BT // SUB_CHUNK
    valid = (torch.arange(BT) < nvalid)[None, :, None]
    a = torch.where(valid, a, torch.zeros_like(a))
    # The kernel's producer reads beta masked (0 past the end), so the ring's t_fold rows
    # and a_fold columns there are zero: the walk reading its ring masks no tile.
    beta = torch.where(valid[..., 0], beta, torch.zeros_like(beta))
    a4 = _blocks(a, NB)
    lc = torch.cumsum(a4, 2)
    s = a4.sum(2)  # [H, NB, K]
    bI = torch.cumsum(s, 1) - s  # b_I: the totals before I
    G = (bI[:, :, None] + lc).reshape(Hh, BT, K)
    g_last = bI[:, -1] + s[:, -1]
    flagged = bool((-s).max() > MAX_ANCHOR_SPAN)
    if qk_l2norm:
        qf, kf = _l2(qf), _l2(kf)
    qf, kf = torch.where(valid, qf, torch.zeros_like(qf)), torch.where(valid, kf, torch.zeros_like(kf))
    qg, kd = qf * torch.exp2(G), kf * torch.exp2(G)
    kg = kf * torch.exp2(g_last[:, None] - G)
    if NB == 2 and not flagged:  # the chunk-32 kernel's one product
        anchor = bI[:, 0] if fault == "anchor" else bI[:, 1]
        akk = _boundary_anchored(kf, kf, G, anchor, on, inclusive=False) * beta[:, :, None]
        aqk = _boundary_anchored(qf, kf, G, anchor, on, inclusive=True)
    else:
        akk = _strips(kf, kf, a, G, bI, s, flagged, on, fault, inclusive=False) * beta[:, :, None]
        aqk = _strips(qf, kf, a, G, bI, s, flagged, on, fault, inclusive=True)
    M = _inverse(akk, fault) * beta[:, None, :]
    Mh = _r(M, on)
    Ml = _r(M - Mh, on) if (on and fold_split) else torch.zeros_like(M)
    kg_b, aqk_b = _r(kg, on), _r(aqk, on)
    t_fold = Mh.transpose(1, 2) @ kg_b + Ml.transpose(1, 2) @ kg_b
    a_fold = aqk_b @ Mh + aqk_b @ Ml
    tiles = dict(qg=qg, kd=kd, t_fold=t_fold, a_fold=a_fold)
    return {key: _r(t, on) for key, t in tiles.items()}, torch.exp2(g_last), flagged


def model_fused_prefill(q, k, v, raw_g, raw_beta, A_log, dt_bias, *, scale, cu_seqlens, lower_bound=None, gate="raw",
                        initial_state=None, qk_l2norm=True, beta_sigmoid=True, round_bf16=True, fold_split=True,
                        fault=None, chunk_size=CHUNK_SIZE):
    """The fused prefill in the kernel's order (module docstring), on the CPU.

    ``q, k, raw_g [1, T, H, K]``, ``v [1, T, H, V]``, ``raw_beta [1, T, H]``, ``A_log [H]``,
    ``dt_bias [H*K]`` or ``[H, K]`` (unused for ``gate="log_decay"``), ``cu_seqlens
    [N+1]``, ``initial_state [N, H, V, K]`` or ``None`` (zeros). Computes in the dtype of
    ``q`` promoted to at least fp32. Returns ``(o [1, T, H, V], final_state [N, H, V, K],
    flagged_chunks)``. ``chunk_size``: 64 (the design's chunk) or 32 (the kernel's,
    :mod:`kda_engram.kda.hopper.fused`): a multiple of the 16-token sub-chunk."""
    if fault not in FAULTS:
        raise ValueError(f"fault: expected one of {FAULTS}, got {fault!r}")
    dt = torch.promote_types(q.dtype, torch.float32)
    on = bool(round_bf16)
    _, T, H, K = q.shape
    V = v.shape[3]
    if chunk_size % SUB_CHUNK or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive multiple of {SUB_CHUNK}, got {chunk_size!r}")
    BT = int(chunk_size)
    a_all = log2_gate(raw_g.to(dt), A_log.to(dt) if A_log is not None else None,
                      dt_bias.to(dt) if dt_bias is not None else None, lower_bound, gate)
    beta_all = torch.sigmoid(raw_beta.to(dt)) if beta_sigmoid else raw_beta.to(dt)
    bounds = cu_seqlens.tolist()
    N = len(bounds) - 1
    o = torch.zeros(1, T, H, V, dtype=dt)
    final = torch.zeros(N, H, V, K, dtype=dt)
    flagged_chunks = 0
    for n in range(N):
        S = initial_state[n].to(dt).clone() if initial_state is not None else torch.zeros(H, V, K, dtype=dt)
        for s0 in range(bounds[n], bounds[n + 1], BT):
            e0 = min(s0 + BT, bounds[n + 1])
            L = e0 - s0

            def tile(x):
                t = torch.zeros(H, BT, x.shape[-1], dtype=dt)
                t[:, :L] = x[0, s0:e0].to(dt).transpose(0, 1)
                return t

            beta = torch.zeros(H, BT, dtype=dt)
            beta[:, :L] = beta_all[0, s0:e0].transpose(0, 1)
            ops, decay, flagged = _prepare_chunk(tile(q), tile(k), tile(a_all), beta, L, on, qk_l2norm, fold_split,
                                                   fault)
            flagged_chunks += int(flagged)
            vv = tile(v)
            St = _r(S, on).transpose(1, 2)  # [H, K, V]
            R = vv - ops["kd"] @ St
            R = torch.where((torch.arange(BT) < L)[None, :, None], R, torch.zeros_like(R))
            Rb = _r(R, on)
            oc = scale * (ops["qg"] @ St + ops["a_fold"] @ Rb)
            o[0, s0:e0] = _r(oc, on)[:, :L].transpose(0, 1)
            S = (S if fault == "decay" else S * decay[:, None, :]) + Rb.transpose(1, 2) @ ops["t_fold"]
        final[n] = S
    return o, final, flagged_chunks
