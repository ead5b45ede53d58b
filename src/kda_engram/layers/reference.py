"""The serving layers in plain PyTorch/NumPy, from full (unsharded) weights: what
:class:`~kda_engram.layers.kda.KimiDeltaAttention` and
:class:`~kda_engram.layers.engram.EngramLayer` are tested against.

Each composes the kernel families' references (:mod:`kda_engram.kda.reference`,
:mod:`kda_engram.engram.reference`) with the layer's own projections, conv and
norms, one sequence at a time on the CPU. They live beside the layers, not in the
families' ``reference.py``: they read the layers' checkpoint names and a family
module must not import from the layers above it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..engram.layout import EngramLayout
from ..engram.reference import naive_dequantize_fp8_ue8m0, naive_engram_post_wkv, naive_lookup, naive_ngram_hash
from ..kda.reference import naive_recurrent_kda

__all__ = ["naive_engram_layer", "naive_kda_layer"]


def naive_kda_layer(
    weights: Mapping[str, torch.Tensor],
    hidden_states: torch.Tensor,
    cu_seqlens,
    *,
    num_heads: int,
    head_dim: int,
    lower_bound: float | None = None,
    norm_eps: float = 1e-5,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_conv: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """The layer in plain PyTorch, from the full Kimi-Linear weights (the names of
    :meth:`~kda_engram.layers.kda.KimiDeltaAttention.load_weights`): separate projections, ``F.conv1d`` from
    the conv window, :func:`~kda_engram.kda.reference.naive_recurrent_kda`, the
    gated RMSNorm and ``o_proj``, every sequence of ``cu_seqlens`` (over all tokens;
    decode rows are length-1 sequences) on its own, in ``dtype`` on the CPU.

    ``initial_state [N, H, V, K]`` / ``initial_conv [N, 2HK + HV, 3]`` (raw inputs,
    oldest first): per sequence, zeros when ``None``.

    Returns ``(y [T, hidden], final_state [N, H, V, K], final_conv [N, C, 3])``.
    """
    w = {n: t.detach().to("cpu", dtype) for n, t in weights.items()}
    x = hidden_states.detach().to("cpu", dtype)
    H, K = num_heads, head_dim
    T = x.shape[0]
    cu = [int(c) for c in cu_seqlens]
    N = len(cu) - 1
    q_raw, k_raw, v_raw = x @ w["q_proj.weight"].t(), x @ w["k_proj.weight"].t(), x @ w["v_proj.weight"].t()
    g = (x @ w["f_a_proj.weight"].t()) @ w["f_b_proj.weight"].t() if "f_a_proj.weight" in w else x @ w["f_proj.weight"].t()
    beta = x @ w["b_proj.weight"].t()
    g_out = ((x @ w["g_a_proj.weight"].t()) @ w["g_b_proj.weight"].t() if "g_a_proj.weight" in w
             else x @ w["g_proj.weight"].t())
    raw = torch.cat([q_raw, k_raw, v_raw], dim=1)  # [T, C]
    Cc = raw.shape[1]
    cw = torch.cat([w[n].reshape(H * K, -1) for n in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")])
    W = cw.shape[1]
    conv = torch.zeros_like(raw)
    final_conv = torch.zeros(N, Cc, W - 1, dtype=dtype)
    for n in range(N):
        s, e = cu[n], cu[n + 1]
        window = initial_conv[n].to("cpu", dtype) if initial_conv is not None else torch.zeros(Cc, W - 1, dtype=dtype)
        xs = torch.cat([window, raw[s:e].t()], dim=1)
        if e > s:
            conv[s:e] = F.silu(F.conv1d(xs[None], cw[:, None, :], groups=Cc)[0]).t()
        final_conv[n] = xs[:, -(W - 1):]
    q = conv[:, : H * K].reshape(1, T, H, K)
    k = conv[:, H * K : 2 * H * K].reshape(1, T, H, K)
    v = conv[:, 2 * H * K :].reshape(1, T, H, K)
    h0 = None if initial_state is None else initial_state.to("cpu", dtype)
    o, final, _ = naive_recurrent_kda(
        q, k, v, g.reshape(1, T, H, K), beta.reshape(1, T, H), w["A_log"].reshape(-1), w["dt_bias"].reshape(-1),
        scale=scale, lower_bound=lower_bound, cu_seqlens=torch.tensor(cu), initial_state=h0, output_final_state=True,
    )
    o = o[0]  # [T, H, V]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps) * w["o_norm.weight"]
    o = o * torch.sigmoid(g_out.reshape(T, H, K))
    y = o.reshape(T, H * K) @ w["o_proj.weight"].t()
    return y, final, final_conv


def naive_engram_layer(
    layout: EngramLayout,
    layer_id: int,
    weights: Mapping[str, torch.Tensor],
    hidden_states: torch.Tensor,
    token_ids,
    cu_seqlens,
    *,
    eps: float,
    clamp_value: float = 1e-6,
    history=None,
    dead_mask=None,
    token_mask=None,
    token_map=None,
) -> torch.Tensor:
    """The layer in plain NumPy/PyTorch (fp32 on the CPU) from full weights: the
    reference hash, gather, projection and gate of :mod:`kda_engram.engram`."""
    rows = naive_ngram_hash(token_ids, cu_seqlens, layout, history=history, dead_mask=dead_mask, token_map=token_map)
    table = weights["embed.weight"]
    if "embed.scale" in weights:
        table = naive_dequantize_fp8_ue8m0(table.view(torch.uint8), weights["embed.scale"].view(torch.uint8))
    emb = naive_lookup(table, rows[:, layout.layer_index(layer_id)]).reshape(rows.shape[0], -1)
    kv = emb @ weights["wkv.weight"].float().t()
    mask = None if token_mask is None else token_mask.cpu()
    return naive_engram_post_wkv(hidden_states.float().cpu(), kv, weights["q_weight"].float(),
                               weights["k_weight"].float(), eps=eps, clamp_value=clamp_value, token_mask=mask)
