"""Kimi Delta Attention in plain PyTorch: the math every KDA kernel is tested against.

Three formulations of the same function, which the tests prove equal in fp64:

* :func:`naive_recurrent_kda` -- token by token, the definition.
* :func:`naive_chunk_kda` -- the chunk form the prefill kernels implement, with its
  per-chunk operands exposed (:func:`naive_chunk_operands`) so each kernel can be tested
  on its own: the prologue against :func:`naive_chunk_operands`, the chunk kernel
  against :func:`naive_chunk_walk`.
* :func:`naive_group_chunk_kda` -- the chunk walk cut into groups joined by the
  exact transfer-operator scan (parallel chunk groups).

The other kernels' references: :func:`naive_fused_kda_decode` (the fused layer
decode step), :func:`naive_conv_decode` and :func:`naive_conv_checkpoint` (the
short convolution). :func:`kda_gate`, :func:`l2norm` and :func:`stored_state` are
the building blocks they share.

Conventions: inputs ``[1, T, H, K]`` flattened over a varlen batch
described by ``cu_seqlens [N+1]`` (or ``[B, T, H, K]`` without ``cu_seqlens``);
``raw_beta [1, T, H]``; recurrent state fp32/fp64 and V-first ``[N, H, V, K]``.
Everything is computed in fp64 when any floating input is fp64, else in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..constants import CHUNK_SIZE, L2NORM_EPS, LOG2E
from .metadata import prepare_chunk_offsets


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The references' arithmetic dtype: fp64 when any given tensor is fp64, else
    fp32 (``None`` entries are skipped). The Engram references share it."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dim (the eps sits inside the sqrt)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
    *,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Per-channel log decay ``a`` (natural log, ``a <= 0``) from the raw gate: the
    reference of the kernels' gate (:mod:`kda_engram.kda.gate`).

    raw_g ``[..., H, K]``, A_log ``[H]``, dt_bias ``[H, K]`` or ``[H*K]``.

    * ``lower_bound is None``: ``a = -exp(A_log) * softplus(raw_g + dt_bias)``
      (torch's ``softplus_beta`` / ``softplus_threshold``; the kernels' softplus is
      the default 1 / 20, the other values serve vLLM's ``fused_kda_gate``).
    * ``lower_bound = L``: ``a = L * sigmoid(exp(A_log) * (raw_g + dt_bias))``,
      so ``L <= a <= 0``: a bounded gate keeps the chunk's cumulative decay
      within ``64 * |L| * log2(e)`` in log2 units, which the kernels rely on.
    """
    num_heads, head_dim = raw_g.shape[-2], raw_g.shape[-1]
    bias = dt_bias.reshape(num_heads, head_dim).to(raw_g.dtype)
    a_scale = torch.exp(A_log.reshape(num_heads, 1).to(raw_g.dtype))
    x = raw_g + bias
    if lower_bound is None:
        return -a_scale * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return lower_bound * torch.sigmoid(a_scale * x)


def _sequences(cu_seqlens: torch.Tensor | None, q: torch.Tensor) -> tuple[list[tuple[int, int, int]], bool]:
    """(batch row, start, end) per sequence, and whether the input is varlen."""
    if cu_seqlens is None:
        return [(b, 0, q.shape[1]) for b in range(q.shape[0])], False
    if q.shape[0] != 1:
        raise ValueError(f"q: with cu_seqlens the batch dim must be 1, got shape {tuple(q.shape)}")
    bounds = cu_seqlens.tolist()
    return [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)], True


def _prepare(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, scale, gate="raw", qk_l2norm=True,
             beta_sigmoid=True):
    """Compute-dtype operands; the input forms as in :func:`naive_recurrent_kda`."""
    dtype = compute_dtype(q, k, v, raw_g)
    qh, kh = q.to(dtype), k.to(dtype)
    if qk_l2norm:
        qh, kh = l2norm(qh), l2norm(kh)
    if gate == "log_decay":
        a = raw_g.to(dtype)
    elif gate == "raw":
        a = kda_gate(raw_g.to(dtype), A_log.to(dtype), dt_bias.to(dtype), lower_bound)
    else:
        raise ValueError(f"gate: expected 'raw' or 'log_decay', got {gate!r}")
    beta = raw_beta.to(dtype)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return dtype, qh, kh, v.to(dtype), a, beta, scale


def stored_state(S: torch.Tensor, state_dtype: torch.dtype | None) -> torch.Tensor:
    """``S`` as it reads back from storage of ``state_dtype`` (bf16: RTNE, as the
    kernels store it; ``None``/fp32/fp64: unchanged), in ``S``'s own dtype."""
    if state_dtype is None or state_dtype in (torch.float32, torch.float64):
        return S
    if state_dtype != torch.bfloat16:
        raise TypeError(f"state_dtype: expected None, float32 or bfloat16, got {state_dtype}")
    return S.to(torch.bfloat16).to(S.dtype)


def _state_shape(num_seqs, v, k):
    return num_seqs, k.shape[2], v.shape[3], k.shape[3]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    checkpoint_offsets: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    gate: str = "raw",
    qk_l2norm: bool = True,
    beta_sigmoid: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The KDA recurrence, one token at a time.

    Per head, with ``S`` the V-first state ``[V, K]``::

        S' = S * exp(a_t)                       (column c decays by exp(a_t[c]))
        S  = S' + beta_t (v_t - S' k_t) k_t^T
        o_t = scale * S q_t

    Returns ``(o [B, T, H, V], final_state [N, H, V, K] | None, checkpoints | None)``.
    ``checkpoints[n]`` is the state after the first ``checkpoint_offsets[n]``
    tokens of sequence ``n`` (any offset here; the kernels require multiples of
    64), zeros where the offset is 0.

    ``state_dtype=torch.bfloat16`` models a bf16 state store (what the kernels
    do): the state is rounded to bf16 (RTNE) at every store point, i.e. at the
    checkpoint (the walk carries the rounded value on) and at the sequence end;
    arithmetic stays in the compute dtype. Called one token at a time, that is a
    rounding after every decode step.

    Input forms (the kernels take the same): ``gate="log_decay"`` makes ``raw_g``
    the log decay ``a`` itself (``A_log``/``dt_bias`` unused, None);
    ``qk_l2norm=False`` skips the L2 norms; ``beta_sigmoid=False`` takes
    ``raw_beta`` as beta.
    """
    dtype, qh, kh, vv, a, beta, scale = _prepare(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, scale,
                                                 gate, qk_l2norm, beta_sigmoid)
    seqs, _ = _sequences(cu_seqlens, q)
    shape = _state_shape(len(seqs), v, k)
    o = torch.zeros(*q.shape[:3], v.shape[3], dtype=dtype, device=q.device)
    final = torch.zeros(shape, dtype=dtype, device=q.device)
    ckpt = None if checkpoint_offsets is None else torch.zeros(shape, dtype=dtype, device=q.device)
    offsets = None if checkpoint_offsets is None else checkpoint_offsets.tolist()
    decay = torch.exp(a)
    for n, (b, start, end) in enumerate(seqs):
        S = torch.zeros(shape[1:], dtype=dtype, device=q.device)
        if initial_state is not None:
            S = initial_state[n].to(dtype).clone()
        for t in range(start, end):
            if offsets is not None and offsets[n] == t - start and t > start:
                S = stored_state(S, state_dtype)
                ckpt[n] = S
            S = S * decay[b, t][:, None, :]
            kt = kh[b, t]
            pred = torch.einsum("hvk,hk->hv", S, kt)
            S = S + torch.einsum("hv,hk->hvk", beta[b, t][:, None] * (vv[b, t] - pred), kt)
            o[b, t] = scale * torch.einsum("hvk,hk->hv", S, qh[b, t])
        S = stored_state(S, state_dtype)
        if offsets is not None and offsets[n] == end - start and end > start:
            ckpt[n] = S
        final[n] = S
    return o, (final if output_final_state else None), ckpt


def naive_chunk_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    lower_bound: float | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> dict[str, torch.Tensor]:
    """The per-chunk operands the fused prologue produces, computed directly.

    Inputs are varlen ``[1, T, H, *]``. Within each chunk of ``chunk_size`` tokens
    (a sequence's last chunk may be partial), with ``g`` the chunk-local inclusive
    cumulative sum of ``a * log2(e)`` (log2 units, ``g <= 0``, non-increasing):

    ====== =============================== =========================================
    key    shape                           contents
    ====== =============================== =========================================
    g      ``[1, T, H, K]``                ``g_i`` (log2 units, chunk-local)
    beta   ``[1, T, H]``                   ``sigmoid(raw_beta)``
    qg     ``[1, T, H, K]``                ``q̂_i * 2^g_i`` (no ``scale``)
    kg     ``[1, T, H, K]``                ``k̂_i * 2^(g_last - g_i)``
    kg_t   ``[chunks, H, K, C]``           ``kg`` of the chunk, transposed; zero past
                                           the chunk's last token
    akk    ``[1, T, H, C]``                row ``i``: ``beta_i * sum_c k̂_i k̂_j 2^(g_i-g_j)``
                                           for ``j < i``, else 0
    aqk    ``[1, T, H, C]``                row ``i``: ``sum_c q̂_i k̂_j 2^(g_i-g_j)`` for
                                           ``j <= i`` (inclusive), else 0; no ``scale``
    w      ``[1, T, H, K]``                ``(I + akk)^-1 (beta k̂ 2^g)``
    u      ``[1, T, H, V]``                ``(I + akk)^-1 (beta v)``
    decay  ``[chunks, H, K]``              ``2^g_last``
    kd     ``[1, T, H, K]``                ``k̂_i * 2^g_i``
    t_fold ``[1, T, H, K]``                rows of ``M^T kg``, ``M = (I + akk)^-1 diag(beta)``
    a_fold ``[1, T, H, C]``                row ``i`` of ``aqk M`` (lower triangular)
    ====== =============================== =========================================

    The last three are the folded contract (the inverse folded into the operands,
    :func:`naive_folded_chunk_step`): ``w = M kd`` and ``u = M v``, so a walk that reads
    ``v`` itself needs neither ``w`` nor ``u``.

    ``chunks`` rows are ordered by :func:`prepare_chunk_offsets`: sequence ``n``'s
    chunk ``c`` is row ``offsets[n] + c``.
    """
    dtype, qh, kh, vv, a, beta, _ = _prepare(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, None)
    seqs, _ = _sequences(cu_seqlens, q)
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size, check_inputs=False).tolist()
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    V = v.shape[3]
    n_chunks = offsets[-1]
    dev = q.device
    out = {
        "g": torch.zeros(1, T, H, K, dtype=dtype, device=dev),
        "beta": beta.clone(),
        "qg": torch.zeros(1, T, H, K, dtype=dtype, device=dev),
        "kg": torch.zeros(1, T, H, K, dtype=dtype, device=dev),
        "kg_t": torch.zeros(n_chunks, H, K, chunk_size, dtype=dtype, device=dev),
        "akk": torch.zeros(1, T, H, chunk_size, dtype=dtype, device=dev),
        "aqk": torch.zeros(1, T, H, chunk_size, dtype=dtype, device=dev),
        "w": torch.zeros(1, T, H, K, dtype=dtype, device=dev),
        "u": torch.zeros(1, T, H, V, dtype=dtype, device=dev),
        "decay": torch.zeros(n_chunks, H, K, dtype=dtype, device=dev),
        "kd": torch.zeros(1, T, H, K, dtype=dtype, device=dev),
        "t_fold": torch.zeros(1, T, H, K, dtype=dtype, device=dev),
        "a_fold": torch.zeros(1, T, H, chunk_size, dtype=dtype, device=dev),
    }
    for n, (_, start, end) in enumerate(seqs):
        for c, s in enumerate(range(start, end, chunk_size)):
            e = min(s + chunk_size, end)
            L = e - s
            row = offsets[n] + c
            g = torch.cumsum(a[0, s:e] * LOG2E, dim=0)  # [L, H, K]
            qc, kc, vc, bc = qh[0, s:e], kh[0, s:e], vv[0, s:e], beta[0, s:e]
            diff = g[:, None] - g[None, :]  # [L(i), L(j), H, K]
            causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
            # Mask before exp2: 2^(g_i - g_j) overflows for j > i.
            diff = torch.where(causal[:, :, None, None], diff, torch.full_like(diff, -math.inf))
            decay_ij = torch.exp2(diff)
            aqk = torch.einsum("ihc,jhc,ijhc->hij", qc, kc, decay_ij)
            akk = torch.einsum("ihc,jhc,ijhc->hij", kc, kc, decay_ij)
            akk = akk.tril(-1) * bc.transpose(0, 1)[:, :, None]
            eye = torch.eye(L, dtype=dtype, device=dev)
            inv = torch.linalg.inv(eye + akk)  # [H, L, L]
            kbg = (bc[:, :, None] * kc * torch.exp2(g)).transpose(0, 1)  # [H, L, K]
            vb = (bc[:, :, None] * vc).transpose(0, 1)
            out["w"][0, s:e] = (inv @ kbg).transpose(0, 1)
            out["u"][0, s:e] = (inv @ vb).transpose(0, 1)
            out["g"][0, s:e] = g
            out["qg"][0, s:e] = qc * torch.exp2(g)
            kg = kc * torch.exp2(g[-1:] - g)
            out["kg"][0, s:e] = kg
            out["kg_t"][row, :, :, :L] = kg.permute(1, 2, 0)
            out["akk"][0, s:e, :, :L] = akk.transpose(0, 1)
            out["aqk"][0, s:e, :, :L] = aqk.tril().transpose(0, 1)
            out["decay"][row] = torch.exp2(g[-1])
            fold = inv * bc.transpose(0, 1)[:, None, :]  # M = (I + akk)^-1 diag(beta)   [H, L, L]
            out["kd"][0, s:e] = kc * torch.exp2(g)
            out["t_fold"][0, s:e] = (fold.transpose(1, 2) @ kg.transpose(0, 1)).transpose(0, 1)
            out["a_fold"][0, s:e, :, :L] = (aqk.tril() @ fold).transpose(0, 1)
    return out


def _chunk_rows(cu_seqlens: torch.Tensor, chunk_size: int):
    """Per sequence: list of (chunk row, start, end) token ranges."""
    bounds = cu_seqlens.tolist()
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size, check_inputs=False).tolist()
    out = []
    for n in range(len(bounds) - 1):
        starts = range(bounds[n], bounds[n + 1], chunk_size)
        out.append([(offsets[n] + c, s, min(s + chunk_size, bounds[n + 1])) for c, s in enumerate(starts)])
    return out


def _w_u_kg(S, ops, row, s, e):
    """The chunk's ``w [H, L, K]``, ``u [H, L, V]`` and ``kg [H, L, K]`` in ``S``'s dtype."""
    w = ops["w"][0, s:e].transpose(0, 1).to(S.dtype)
    u = ops["u"][0, s:e].transpose(0, 1).to(S.dtype)
    kg = ops["kg_t"][row, :, :, : e - s].transpose(1, 2).to(S.dtype)
    return w, u, kg


def naive_chunk_step(S, ops, row, s, e, scale):
    """One chunk of the walk: returns ``(o [L, H, V], S_next)``.

    ``v_new = u - w S^T``; ``o = scale (qg S^T + aqk v_new)``;
    ``S_next = S diag(decay) + v_new^T kg``.
    """
    L = e - s
    w, u, kg = _w_u_kg(S, ops, row, s, e)
    qg = ops["qg"][0, s:e].transpose(0, 1).to(S.dtype)
    aqk = ops["aqk"][0, s:e, :, :L].transpose(0, 1).to(S.dtype)  # [H, L, L]
    St = S.transpose(1, 2)  # [H, K, V]
    v_new = u - w @ St
    o = scale * (qg @ St + aqk @ v_new)
    S_next = S * ops["decay"][row].to(S.dtype)[:, None, :] + v_new.transpose(1, 2) @ kg
    return o.transpose(0, 1), S_next


def naive_folded_chunk_step(S, ops, v, row, s, e, scale):
    """:func:`naive_chunk_step` over the folded contract: ``(o [L, H, V], S_next)``.

    ``R = v - kd S^T``; ``o = scale (qg S^T + a_fold R)``;
    ``S_next = S diag(decay) + R^T t_fold``. The same four products as
    :func:`naive_chunk_step`, reading the raw ``v [1, T, H, V]`` instead of ``u`` and
    ``w``: the prologue writes kd and t_fold instead of w, u and kg_t (about
    0.5 KB less per token-head in all at K = V = 128, bf16 operands), and the
    walk needs no operand it did not get.
    """
    L = e - s
    kd = ops["kd"][0, s:e].transpose(0, 1).to(S.dtype)  # [H, L, K]
    qg = ops["qg"][0, s:e].transpose(0, 1).to(S.dtype)
    tf = ops["t_fold"][0, s:e].transpose(0, 1).to(S.dtype)
    af = ops["a_fold"][0, s:e, :, :L].transpose(0, 1).to(S.dtype)  # [H, L, L]
    vv = v[0, s:e].transpose(0, 1).to(S.dtype)  # [H, L, V]
    St = S.transpose(1, 2)  # [H, K, V]
    R = vv - kd @ St
    o = scale * (qg @ St + af @ R)
    S_next = S * ops["decay"][row].to(S.dtype)[:, None, :] + R.transpose(1, 2) @ tf
    return o.transpose(0, 1), S_next


def naive_chunk_transfer(S, ops, row, s, e):
    """``(M_c, H_c)`` with ``S_end = S_start M_c + H_c``: ``M_c = diag(d_c) - w_c^T kg_c``
    ``[H, K, K]`` and ``H_c = u_c^T kg_c`` ``[H, V, K]``."""
    w, u, kg = _w_u_kg(S, ops, row, s, e)
    M = torch.diag_embed(ops["decay"][row].to(S.dtype)) - w.transpose(1, 2) @ kg
    return M, u.transpose(1, 2) @ kg


def naive_chunk_walk(
    ops: dict[str, torch.Tensor],
    *,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    groups: int = 1,
    chunk_size: int = CHUNK_SIZE,
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Walk the chunks of every sequence over the operands of :func:`naive_chunk_operands`.

    With ``groups > 1`` each sequence's chunks are cut into ``groups`` contiguous
    groups (``ceil(chunks / groups)`` each, the last ones possibly empty). Every
    group first composes its transfer operator ``M_g = prod_c M_c`` and local state
    ``H_g`` (walk from zero); the scan ``S_{g+1} = S_g M_g + H_g`` gives each group
    its true start state, and the groups are walked again from it. The result is
    exactly the ``groups = 1`` walk.

    Returns ``(o [1, T, H, V], final_state [N, H, V, K], checkpoints | None)``;
    checkpoint offsets must be multiples of ``chunk_size`` (0 = none).

    ``state_dtype=torch.bfloat16`` rounds the state (RTNE) where the kernel
    stores it: at the checkpoint (the walk carries the rounded state on) and at
    the sequence end. Not with ``groups > 1`` and checkpoints (the kernel runs
    bf16 checkpoints serially).
    """
    if groups > 1 and checkpoint_offsets is not None and state_dtype == torch.bfloat16:
        raise ValueError("groups: bf16 checkpoints need the serial walk (groups=1)")
    u = ops["u"]
    dtype = torch.float64 if u.dtype == torch.float64 else torch.float32
    T, H, V = u.shape[1], u.shape[2], u.shape[3]
    K = ops["w"].shape[3]
    per_seq = _chunk_rows(cu_seqlens, chunk_size)
    N = len(per_seq)
    o = torch.zeros(1, T, H, V, dtype=dtype, device=u.device)
    final = torch.zeros(N, H, V, K, dtype=dtype, device=u.device)
    ckpt = None if checkpoint_offsets is None else torch.zeros_like(final)
    offsets = None if checkpoint_offsets is None else checkpoint_offsets.tolist()
    for n, chunks in enumerate(per_seq):
        S = torch.zeros(H, V, K, dtype=dtype, device=u.device)
        if initial_state is not None:
            S = initial_state[n].to(dtype).clone()
        per_group = max(1, -(-len(chunks) // groups))
        group_chunks = [chunks[i : i + per_group] for i in range(0, len(chunks), per_group)]
        starts = [S]
        if groups > 1:
            for grp in group_chunks[:-1]:
                M = torch.eye(K, dtype=dtype, device=u.device).expand(H, K, K).clone()
                Hg = torch.zeros(H, V, K, dtype=dtype, device=u.device)
                for row, s, e in grp:
                    Mc, Hc = naive_chunk_transfer(Hg, ops, row, s, e)
                    M, Hg = M @ Mc, Hg @ Mc + Hc
                starts.append(starts[-1] @ M + Hg)
        for gi, grp in enumerate(group_chunks):
            S = starts[gi] if groups > 1 else S
            for row, s, e in grp:
                o[0, s:e], S = naive_chunk_step(S, ops, row, s, e, scale)
                if offsets is not None and offsets[n] > 0 and offsets[n] == e - chunks[0][1]:
                    S = stored_state(S, state_dtype)
                    ckpt[n] = S
        final[n] = stored_state(S, state_dtype)
    return o, final, ckpt


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    checkpoint_offsets: torch.Tensor | None = None,
    groups: int = 1,
    chunk_size: int = CHUNK_SIZE,
    return_operands: bool = False,
    state_dtype: torch.dtype | None = None,
):
    """:func:`naive_recurrent_kda` through the chunk form (:func:`naive_chunk_operands`
    then :func:`naive_chunk_walk`). Same arguments and returns; ``return_operands=True``
    appends the operand dict as a fourth element."""
    if cu_seqlens is None:
        B, T = q.shape[0], q.shape[1]
        flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
        cu = torch.arange(0, B * T + 1, T, dtype=torch.int64, device=q.device) if T > 0 else torch.zeros(B + 1, dtype=torch.int64)
        res = naive_chunk_kda(
            flat(q), flat(k), flat(v), flat(raw_g), flat(raw_beta), A_log, dt_bias,
            scale=scale, lower_bound=lower_bound, cu_seqlens=cu, initial_state=initial_state,
            output_final_state=output_final_state, checkpoint_offsets=checkpoint_offsets,
            groups=groups, chunk_size=chunk_size, return_operands=return_operands, state_dtype=state_dtype,
        )
        return (res[0].reshape(B, T, *res[0].shape[2:]),) + tuple(res[1:])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    ops = naive_chunk_operands(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, cu_seqlens=cu_seqlens, lower_bound=lower_bound, chunk_size=chunk_size
    )
    o, final, ckpt = naive_chunk_walk(
        ops, cu_seqlens=cu_seqlens, scale=scale, initial_state=initial_state,
        checkpoint_offsets=checkpoint_offsets, groups=groups, chunk_size=chunk_size, state_dtype=state_dtype,
    )
    res = (o, final if output_final_state else None, ckpt)
    return res + (ops,) if return_operands else res


def naive_group_chunk_kda(*args, groups: int, **kwargs):
    """:func:`naive_chunk_kda` with every sequence cut into ``groups`` chunk groups
    joined by the transfer-operator scan (see :func:`naive_chunk_walk`)."""
    return naive_chunk_kda(*args, groups=groups, **kwargs)


def naive_fused_kda_decode(
    x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias, o_norm_weight,
    state_cache, state_indices, *, initial_state_indices=None, initial_conv_indices=None, scale=None,
    lower_bound=None, norm_eps=1e-5, out_dtype=None,
):
    """:func:`kda_layer_decode_step` in plain PyTorch (fp32 math, caches updated in
    place with the same store points and bf16 rounding). Returns ``out``."""
    multi = x.dim() == 3
    if not multi:
        x, raw_g, raw_beta, g_out = (t[:, None] for t in (x, raw_g, raw_beta, g_out))
        state_indices, conv_state_indices = state_indices[:, None], conv_state_indices[:, None]
    B, S, _ = x.shape
    _, H, V, K = state_cache.shape
    scale = K**-0.5 if scale is None else scale
    init = state_indices[:, 0] if initial_state_indices is None else initial_state_indices
    cinit = conv_state_indices[:, 0] if initial_conv_indices is None else initial_conv_indices
    out = torch.zeros(B, S, H * V, dtype=out_dtype or x.dtype, device=x.device)
    f = lambda t: t.float()  # noqa: E731
    cw = f(conv_weight)
    for b in range(B):
        r0, c0 = int(init[b]), int(cinit[b])
        win = f(conv_state[c0]) if c0 >= 0 else torch.zeros(conv_state.shape[1:], device=x.device)
        S_ = f(state_cache[r0]) if r0 >= 0 else None
        hist = win  # [C, 3] raw inputs, oldest first
        for s in range(S):
            xs = f(x[b, s])
            taps = torch.cat([hist, xs[:, None]], dim=1)  # [C, 4]
            y = (taps * cw).sum(1)
            y = F.silu(y)
            hist = taps[:, 1:]
            crow = int(conv_state_indices[b, s])
            if crow >= 0:
                conv_state[crow] = hist.to(conv_state.dtype)
            if S_ is None:
                continue  # padding sequence: output zero, no state
            q = l2norm(y[: H * K].view(H, K))
            k = l2norm(y[H * K: 2 * H * K].view(H, K))
            v = y[2 * H * K:].view(H, V)
            a = kda_gate(f(raw_g[b, s]).view(1, 1, H, K), f(A_log), f(dt_bias), lower_bound)[0, 0]
            beta = torch.sigmoid(f(raw_beta[b, s]))
            S_ = S_ * torch.exp(a)[:, None, :]
            d = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S_, k))
            S_ = S_ + d[:, :, None] * k[:, None, :]
            o = scale * torch.einsum("hvk,hk->hv", S_, q)  # from the fp32 state, before the store
            S_ = stored_state(S_, state_cache.dtype)
            o = f(o.to(out.dtype))
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps) * f(o_norm_weight)
            o = o * torch.sigmoid(f(g_out[b, s]).view(H, V))
            out[b, s] = o.reshape(-1).to(out.dtype)
            row = int(state_indices[b, s])
            if row >= 0:
                state_cache[row] = S_.to(state_cache.dtype)
    return out if multi else out[:, 0]


def naive_conv_decode(x, conv_weight, conv_state, conv_state_indices):
    """Plain PyTorch :func:`~kda_engram.kda.conv.kda_conv_decode` (fp64): ``(out [B, C], new conv_state)``,
    the input state left untouched."""
    new_state = conv_state.clone()
    B, C = x.shape
    W = conv_weight.shape[1]
    out = torch.zeros(B, C, dtype=torch.float64)
    for b in range(B):
        row = int(conv_state_indices[b])
        window = conv_state[row].double().cpu() if row >= 0 else torch.zeros(C, W - 1, dtype=torch.float64)
        taps = torch.cat([window, x[b].double().cpu()[:, None]], dim=1)  # [C, W]
        y = F.conv1d(taps[None], conv_weight.double().cpu()[:, None, :], groups=C)[0, :, 0]
        out[b] = F.silu(y)
        if row >= 0:
            new_state[row] = taps[:, 1:].to(new_state.dtype)
    return out, new_state


def naive_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state):
    """Plain PyTorch :func:`~kda_engram.kda.conv.kda_conv_checkpoint` on a copy of ``conv_state``."""
    new_state = conv_state.clone()
    W = conv_state.shape[2] + 1
    cu = [int(c) for c in cu_seqlens]
    for n in range(len(cu) - 1):
        p, row = int(checkpoint_offsets[n]), int(checkpoint_indices[n])
        if row < 0 or p <= 0 or p < W - 1 or p > cu[n + 1] - cu[n]:
            continue
        s = cu[n] + p - (W - 1)
        new_state[row] = x[s : s + W - 1].t().to(new_state.dtype)
    return new_state
