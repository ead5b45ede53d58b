"""The call shapes of vLLM's KDA ops, served by kda-engram's kernels.

Plain functions (no vLLM import) that an engine, or a patch of vLLM's Kimi-Linear
layer, calls in place of vLLM's Triton ops:

* :func:`chunk_kda_with_fused_gate` -- prefill from the raw gate (``A_log``, ``g_bias``)
  and the raw beta; onto :func:`kda_engram.kda.chunk_kda_prefill`.
* :func:`fused_recurrent_kda` -- decode and speculative verification on the state
  pool, in place; onto :func:`kda_engram.kda.kda_decode_multi`.
* :func:`fused_kda_gate` -- the gate alone, ``[..., H*D] -> [..., H, D]`` fp32.

States are V-first ``[*, H, V, K]`` as in vLLM's KDA and in our kernels, so nothing is
transposed. Each adapter validates what it maps (one ``ValueError``/``TypeError`` line);
``check_inputs=False`` turns the device-value checks off for CUDA-graph capture.
"""

from __future__ import annotations

import torch

from ..kda.decode import kda_decode_multi
from ..kda.prefill import chunk_kda_prefill
from ..kda.reference import kda_gate
from ..validation.common import FLOAT_DTYPES, INDEX_DTYPES, can_read_back, check_int, check_real, check_tensor
from ..validation.kda_inputs import check_lower_bound
from ..validation.entry import EntryChecks
from ..validation.kda_decode import queue_accepted_tokens_rule
from .common import packed_varlen
from .vllm_kimi_k3 import recurrent_varlen

__all__ = ["chunk_kda_with_fused_gate", "fused_recurrent_kda", "fused_kda_gate"]


def chunk_kda_with_fused_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA prefill from raw projections (vLLM's ``chunk_kda_with_fused_gate``).

    ``q, k, v, raw_g``: ``[B, T, H, K|V]`` (``B = 1`` with ``cu_seqlens``);
    ``raw_beta``: ``[B, T, H]`` before its sigmoid; ``A_log [H]``; ``g_bias``
    (``dt_bias``) ``[H*K]`` or None (zeros). Gate ``-exp(A_log) softplus(raw_g + g_bias)``,
    or ``lower_bound * sigmoid(exp(A_log) (raw_g + g_bias))`` with ``lower_bound``.
    ``initial_state``: V-first ``[N, H, V, K]``, fp32 or bf16; the final state has its
    dtype (fp32 without one). Returns ``(o [B, T, H, V], final_state | None)``.
    """
    if g_bias is None:
        g_bias = torch.zeros(q.shape[2] * q.shape[3], dtype=torch.float32, device=q.device)
    B, T = q.shape[0], q.shape[1]
    cu_seqlens, flat = packed_varlen(q, cu_seqlens, (("q", q), ("k", k), ("v", v), ("raw_g", raw_g),
                                                     ("raw_beta", raw_beta)))
    o, final = chunk_kda_prefill(
        *flat, A_log, g_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
        initial_state=initial_state, output_final_state=output_final_state,
        qk_l2norm=bool(use_qk_l2norm_in_kernel), check_inputs=check_inputs,
    )
    return o.view(B, T, *o.shape[2:]), final


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    *,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode steps on the state pool, in place (vLLM's ``fused_recurrent_kda``).

    ``g`` is the per-channel log decay (``fused_kda_gate``'s output), ``beta`` is
    after its sigmoid. ``initial_state`` is the V-first pool ``[slots, H, V, K]``
    (fp32 or bf16), updated in place and returned. Tokens: ``[N, S, H, *]`` (every
    sequence ``S`` tokens), or ``[1, T, H, *]`` with ``cu_seqlens [N+1]``: any count
    per sequence from 0 (padding: nothing read or written) to the width of
    ``ssm_state_indices`` (1 for decode, the draft length plus one for speculative
    verification; without ``ssm_state_indices`` any count), one launch
    (:func:`kda_engram.integrations.vllm_kimi_k3.recurrent_varlen`; tokens past
    ``cu_seqlens[N]`` get zero output). ``cu_seqlens``' values are checked on the
    device unless ``check_inputs=False``.

    ``ssm_state_indices``: ``[N]`` (one token per sequence) or ``[N, >= S]``; the state after
    token ``s`` of sequence ``n`` is written to row ``ssm_state_indices[n, s]``
    (negative: not written). The walk starts from row
    ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
    ``num_accepted_tokens``); a negative start row is a padding sequence (zero
    output, no row touched). Without ``ssm_state_indices`` sequence ``n`` reads and
    writes row ``n`` after its last token. ``inplace_final_state=False`` (per-token
    states into a new buffer) is not served: ``ValueError``.
    ``num_accepted_tokens``: int ``[N]``, each in ``[1, ssm_state_indices.shape[1]]``
    (checked on the device as the kernels' rules are: a call that breaks it touches
    no row and its error comes with the next call, see
    :func:`kda_engram.raise_pending_errors`).

    Returns ``(o, initial_state)``: ``o`` ``[*q.shape[:3], V]`` in ``v``'s dtype.
    """
    checks = None
    if not inplace_final_state:
        raise ValueError("inplace_final_state: only True is served (the state pool is updated in place)")
    if not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"initial_state: expected the state pool tensor [slots, H, V, K], got "
                        f"{type(initial_state).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected [N, S, H, K] or [1, T, H, K], got {list(q.shape)}")
    if cu_seqlens is not None:
        return _varlen(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, ssm_state_indices,
                       num_accepted_tokens, check_inputs)
    N, S = q.shape[0], q.shape[1]
    tokens = (q, k, v, g, beta)
    if ssm_state_indices is None:
        rows = torch.arange(N, device=q.device)
        state_indices = torch.full((N, S), -1, dtype=torch.int64, device=q.device)
        state_indices[:, -1:] = rows[:, None]
        start = rows
    else:
        if check_inputs:
            check_tensor("ssm_state_indices", ssm_state_indices, dtypes=INDEX_DTYPES, device=q.device)
        if ssm_state_indices.dim() == 1:
            if S != 1:
                raise ValueError(f"ssm_state_indices: a 1-D [N] index serves one token per sequence, got S={S}")
            ssm_state_indices = ssm_state_indices[:, None]
        if ssm_state_indices.dim() != 2 or ssm_state_indices.shape[0] != N or ssm_state_indices.shape[1] < S:
            raise ValueError(f"ssm_state_indices: expected [{N}] or [{N}, >= {S}], got {list(ssm_state_indices.shape)}")
        state_indices = ssm_state_indices[:, :S]
        if num_accepted_tokens is None:
            start = ssm_state_indices[:, 0]
        else:
            W = ssm_state_indices.shape[1]
            if check_inputs:
                check_tensor("num_accepted_tokens", num_accepted_tokens, shape=[N], dtypes=INDEX_DTYPES,
                             device=q.device)
            col = (num_accepted_tokens.to(torch.int64) - 1).clamp(0, W - 1)
            start = ssm_state_indices.gather(1, col[:, None])[:, 0]
            if check_inputs and N > 0 and can_read_back():
                # A rule on device values: queued, the walk started from no row (padding)
                # when it is broken, the verdict deferred like the kernels' own.
                checks = EntryChecks(check_inputs)
                queue_accepted_tokens_rule(checks, num_accepted_tokens, W, "ssm_state_indices")
                start = checks.guard(start, -1)
    o = kda_decode_multi(*tokens, None, None, state_cache=initial_state, state_indices=state_indices,
                         initial_state_indices=start, scale=scale, gate="log_decay",
                         qk_l2norm=bool(use_qk_l2norm_in_kernel), beta_sigmoid=False, check_inputs=check_inputs)
    if checks is not None:
        checks.run()
    return o.view(*q.shape[:3], o.shape[-1]), initial_state


def _varlen(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, ssm_state_indices,
            num_accepted_tokens, check_inputs):
    """:func:`fused_recurrent_kda` on ``[1, T, ...]`` tokens with ``cu_seqlens``: any
    token counts per sequence (one launch, :func:`~kda_engram.integrations.vllm_kimi_k3.recurrent_varlen`;
    negative rows are none)."""
    if q.shape[0] != 1:
        raise ValueError(f"q: with cu_seqlens the batch dim must be 1, got {list(q.shape)}")
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, device=q.device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected [N+1] with N >= 1, got {list(cu_seqlens.shape)}")
    N, T = cu_seqlens.numel() - 1, q.shape[1]
    start_rows = None
    if ssm_state_indices is None:
        # Row n, written after the sequence's last token (W = T: any length fits).
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: needs ssm_state_indices (the rows it picks from)")
        cu = cu_seqlens.to(torch.int64)
        last = cu[1:] - cu[:-1] - 1
        seq = torch.arange(N, device=q.device)
        ssm_state_indices = torch.where(torch.arange(max(T, 1), device=q.device)[None, :] == last[:, None],
                                        seq[:, None], -1)
        start_rows = seq
    else:
        check_tensor("ssm_state_indices", ssm_state_indices, dtypes=INDEX_DTYPES, device=q.device)
        if ssm_state_indices.dim() == 1:
            if T != N:
                raise ValueError(f"ssm_state_indices: a 1-D [N] index serves one token per sequence (T == N), got "
                                 f"{list(ssm_state_indices.shape)} for T={T} tokens")
            ssm_state_indices = ssm_state_indices[:, None]
    return recurrent_varlen(q, k, v, g, beta, None, None, initial_state, cu_seqlens, ssm_state_indices,
                            num_accepted_tokens, None, scale=scale, gate="log_decay",
                            qk_l2norm=bool(use_qk_l2norm_in_kernel), beta_sigmoid=False, null_row=-1,
                            start_rows=start_rows, check_inputs=check_inputs)


def fused_kda_gate(
    g: torch.Tensor,
    A: torch.Tensor,
    head_k_dim: int,
    g_bias: torch.Tensor | None = None,
    beta: float = 1.0,
    threshold: float = 20.0,
    *,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The KDA gate alone (vLLM's ``fused_kda_gate``): ``g [..., H*D]`` -> fp32 ``[..., H, D]``.

    ``-exp(A) softplus_{beta, threshold}(g + g_bias)`` (softplus with torch's
    ``beta``/``threshold`` semantics), or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A) (g + g_bias))``. ``A``: ``[H]`` or any shape of
    ``H`` elements; ``g_bias``: ``[H*D]`` or None. ``g``, ``A`` and ``g_bias`` are float
    tensors (bf16, fp16 or fp32) on one device; ``lower_bound`` is None or a finite
    number <= 0 (as every entry point: a positive one would give positive log decays);
    ``beta`` is a finite number > 0 and ``threshold`` a finite number. Host checks only
    (no device values are read). Computed by the package's one gate reference,
    :func:`kda_engram.kda.reference.kda_gate`.
    """
    check_tensor("g", g, dtypes=FLOAT_DTYPES)
    check_tensor("A", A, dtypes=FLOAT_DTYPES, device=g.device)
    check_int("head_k_dim", head_k_dim, low=1)
    check_lower_bound(lower_bound)
    check_real("beta", beta, sign="positive")
    check_real("threshold", threshold)
    H = A.numel()
    if g.dim() < 1 or g.shape[-1] != H * head_k_dim:
        raise ValueError(f"g: last dim must be H*head_k_dim = {H}*{head_k_dim}, got shape {list(g.shape)}")
    if g_bias is not None:
        check_tensor("g_bias", g_bias, dtypes=FLOAT_DTYPES, device=g.device)
        if g_bias.numel() != H * head_k_dim:
            raise ValueError(f"g_bias: expected H*head_k_dim = {H * head_k_dim} elements ([{H * head_k_dim}] or "
                             f"[{H}, {head_k_dim}]), got shape {list(g_bias.shape)}")
    x = g.float().view(*g.shape[:-1], H, head_k_dim)
    A_log = A.reshape(H).float()
    bias = torch.zeros(H * head_k_dim, device=g.device) if g_bias is None else g_bias.reshape(-1).float()
    return kda_gate(x, A_log, bias, lower_bound, softplus_beta=beta, softplus_threshold=threshold)
