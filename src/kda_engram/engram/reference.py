"""Engram in plain PyTorch: the math the Engram kernels are tested against.

The gate, per token ``t`` and hyper-connection stream
``h``, all in fp32 (fp64 when the inputs are fp64)::

    dot  = sum_d hidden * q_w[h] * k_w[h] * key_h
           * rsqrt(mean(hidden^2) + eps) * rsqrt(mean(key_h^2) + eps) / sqrt(dim)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp_value)))     (sign(0) = +1)
    out  = hidden + gate * value                 (gate = 0 where token_mask is false)

``kv`` rows are ``[key_0 | ... | key_{hc-1} | value]``, each ``dim`` wide; rows
``t >= num_kv_tokens`` read key = value = 0, so their output is ``hidden``.
"""

from __future__ import annotations

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _keys_values(kv: torch.Tensor, num_tokens: int, hc: int, dim: int, num_kv_tokens: int | None, dtype):
    """kv rows padded/truncated to ``num_tokens``: keys ``[T, hc, dim]``, value ``[T, dim]``."""
    valid = kv.shape[0] if num_kv_tokens is None else min(num_kv_tokens, kv.shape[0])
    full = torch.zeros(num_tokens, (hc + 1) * dim, dtype=dtype, device=kv.device)
    rows = min(valid, num_tokens)
    full[:rows] = kv[:rows].to(dtype)
    return full[:, : hc * dim].reshape(num_tokens, hc, dim), full[:, hc * dim :]


def _gate_from_sums(hidden, key_sq, dot, dim, eps, clamp_value, token_mask):
    """Gate ``[T, hc]`` from the full-dim sums ``key_sq = sum key^2`` and
    ``dot = sum hidden*q*k*key``."""
    hidden_rms = torch.rsqrt((hidden * hidden).mean(-1) + eps)
    key_rms = torch.rsqrt(key_sq / dim + eps)
    dot = dot * hidden_rms * key_rms * dim**-0.5
    mag = torch.sqrt(torch.clamp(dot.abs(), min=clamp_value))
    gate = torch.sigmoid(torch.where(dot < 0, -mag, mag))
    if token_mask is not None:
        gate = torch.where(token_mask[:, None].to(torch.bool), gate, torch.zeros_like(gate))
    return gate


def engram_post_wkv_ref(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    eps: float,
    clamp_value: float = 1e-6,
    token_mask: torch.Tensor | None = None,
    num_kv_tokens: int | None = None,
) -> torch.Tensor:
    """The fused post-wkv gate: hidden ``[T, hc, dim]``, kv ``[T_kv, (hc+1)*dim]``,
    q_weight/k_weight ``[hc, dim]``, token_mask bool ``[T]``. Returns ``[T, hc, dim]``
    in hidden's dtype."""
    T, hc, dim = hidden_states.shape
    dtype = _compute_dtype(hidden_states, kv)
    hidden = hidden_states.to(dtype)
    keys, value = _keys_values(kv, T, hc, dim, num_kv_tokens, dtype)
    qk = (q_weight.to(dtype) * k_weight.to(dtype))[None]
    key_sq = (keys * keys).sum(-1)
    dot = (hidden * qk * keys).sum(-1)
    gate = _gate_from_sums(hidden, key_sq, dot, dim, eps, clamp_value, token_mask)
    return (hidden + gate[..., None] * value[:, None, :]).to(hidden_states.dtype)


def shard_kv_by_dim(kv: torch.Tensor, hc: int, tp_size: int) -> list[torch.Tensor]:
    """Split full ``kv [T, (hc+1)*dim]`` into the dim-sharded layout: rank ``r``
    gets ``[T, (hc+1)*width]`` = its ``width = dim / tp_size`` columns of every key
    and of the value, in ``[key_0 | ... | value]`` order (what a merged
    column-parallel ``wkv`` over ``[dim] * (hc+1)`` produces on that rank)."""
    T = kv.shape[0]
    dim = kv.shape[1] // (hc + 1)
    width = dim // tp_size
    blocks = kv.reshape(T, hc + 1, tp_size, width)
    return [blocks[:, :, r, :].reshape(T, (hc + 1) * width) for r in range(tp_size)]


def engram_gate_sharded_ref(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    tp_size: int,
    eps: float,
    clamp_value: float = 1e-6,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dim-sharded gate simulated over ``tp_size`` ranks in one process.

    Each rank computes, over its dim slice only, ``sum key^2`` and
    ``sum hidden*q*k*key`` per stream, plus its value slice; the partials are
    summed in rank order (what every real rank does after the all-gather, so all
    of them get the same bits) and the value is reassembled from the slices.
    Equal to :func:`engram_post_wkv_ref` up to summation order.
    """
    T, hc, dim = hidden_states.shape
    if dim % tp_size:
        raise ValueError(f"dim {dim} is not divisible by tp_size {tp_size}")
    width = dim // tp_size
    dtype = _compute_dtype(hidden_states, kv)
    hidden = hidden_states.to(dtype)
    qk = (q_weight.to(dtype) * k_weight.to(dtype))[None]
    key_sq = torch.zeros(T, hc, dtype=dtype, device=kv.device)
    dot = torch.zeros(T, hc, dtype=dtype, device=kv.device)
    value_slices = []
    for r, local in enumerate(shard_kv_by_dim(kv, hc, tp_size)):
        cols = slice(r * width, (r + 1) * width)
        keys = local[:, : hc * width].reshape(T, hc, width).to(dtype)
        key_sq = key_sq + (keys * keys).sum(-1)
        dot = dot + (hidden[..., cols] * qk[..., cols] * keys).sum(-1)
        value_slices.append(local[:, hc * width :].to(dtype))
    value = torch.cat(value_slices, dim=1)
    gate = _gate_from_sums(hidden, key_sq, dot, dim, eps, clamp_value, token_mask)
    return (hidden + gate[..., None] * value[:, None, :]).to(hidden_states.dtype)
