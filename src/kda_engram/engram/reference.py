"""Engram in plain NumPy/PyTorch: the math every Engram kernel is tested against.

Written for clarity, per token, per sequence and per lag, with none of the kernels'
tricks (binary search of ``cu_seqlens``, bit-level fp8 decoding).

The gate (:func:`naive_engram_post_wkv`, and :func:`naive_engram_gate_sharded`, the
dim-sharded gate simulated over ``tp_size`` ranks), per token ``t`` and
hyper-connection stream ``h``, all in fp32 (fp64 when the inputs are fp64)::

    dot  = sum_d hidden * q_w[h] * k_w[h] * key_h
           * rsqrt(mean(hidden^2) + eps) * rsqrt(mean(key_h^2) + eps) / sqrt(dim)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp_value)))     (sign(0) = +1)
    out  = hidden + gate * value                 (gate = 0 where token_mask is false)

``kv`` rows are ``[key_0 | ... | key_{hc-1} | value]``, each ``dim`` wide; rows
``t >= num_kv_tokens`` read key = value = 0, so their output is ``hidden``.

The memory (hashing, history and table kernels):

* :func:`naive_ngram_hash` - the varlen hash with history and dead tokens.
* :func:`naive_ngram_hash_padded` - the Engram paper's batch formulation
  (shift-with-pad, no varlen), a second, independent statement of the hash.
* :func:`naive_next_history` - the history rows a prefill leaves behind.
* :func:`naive_quantize_fp8_ue8m0` / :func:`naive_dequantize_fp8_ue8m0` - fp8 e4m3
  with one power-of-two (ue8m0) scale per 32 values, decoded by PyTorch's own
  ``float8_e4m3fn``.
* :func:`naive_lookup` - the gather with TP column ownership.
* :func:`naive_compressed_token_map` - the tokenizer compression with
  :mod:`unicodedata` instead of the ``tokenizers`` normalizers.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import torch

from ..kda.reference import compute_dtype
from .layout import EngramLayout

FP8_MAX = 448.0
SCALE_BLOCK = 32


def _np(x, dtype=np.int64):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype)


def naive_ngram_hash(
    token_ids,
    cu_seqlens,
    layout: EngramLayout,
    *,
    history=None,
    dead_mask=None,
    token_map=None,
    global_rows: bool = False,
) -> np.ndarray:
    """int32 ``[T, n_layers, n_hash_cols]``; same contract as
    :func:`kda_engram.engram.hashing.ngram_hash` (tokens outside every sequence: -1)."""
    tok = _np(token_ids)
    cu = _np(cu_seqlens)
    hist = _np(history)
    dead = None if dead_mask is None else _np(dead_mask, bool)
    tmap = _np(token_map)
    T, M = tok.shape[0], layout.max_ngram
    L, C = layout.n_layers, layout.n_hash_cols
    primes = layout.primes.reshape(L, C)
    offsets = layout.row_offsets(global_rows=global_rows)
    out = np.full((T, L, C), -1, dtype=np.int64)
    for n in range(cu.shape[0] - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        if e <= s:
            continue
        h = hist[n] if hist is not None else np.full(M - 1, -1, dtype=np.int64)
        ext = np.concatenate([h, tok[s:e]])
        ok = np.concatenate([h >= 0, ~dead[s:e] if dead is not None else np.ones(e - s, bool)])
        p = np.arange(M - 1, M - 1 + e - s)
        alive = np.ones(e - s, bool)
        lag_tokens = []
        for i in range(M):
            alive = alive & ok[p - i]
            ids = np.where(alive, ext[p - i], 0)
            if tmap is not None:
                ids = tmap[ids]
            lag_tokens.append(np.where(alive, ids, layout.hash_pad_id))
        for li in range(L):
            mult = layout.multipliers[li]
            mix = lag_tokens[0] * mult[0]
            for i in range(1, M):
                mix = np.bitwise_xor(mix, lag_tokens[i] * mult[i])
                for j in range(layout.n_heads):
                    c = (i - 1) * layout.n_heads + j
                    out[s:e, li, c] = mix % primes[li, c] + offsets[li, c]
    return out.astype(np.int32)


def naive_ngram_hash_padded(input_ids, layout: EngramLayout, layer_index: int) -> np.ndarray:
    """The paper's batch form: ``input_ids [B, T]`` (compressed ids), every row a
    sequence that starts at column 0; returns the per-column hash ``mix mod prime``
    (no row offsets), int64 ``[B, T, n_hash_cols]``."""
    x = _np(input_ids)
    B, T = x.shape
    mult = layout.multipliers[layer_index]
    shifted = [x] + [
        np.pad(x, ((0, 0), (k, 0)), constant_values=layout.hash_pad_id)[:, :T] for k in range(1, layout.max_ngram)
    ]
    cols = []
    for n in range(2, layout.max_ngram + 1):
        mix = shifted[0] * mult[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifted[k] * mult[k])
        for j in range(layout.n_heads):
            cols.append(mix % int(layout.primes[layer_index, n - 2, j]))
    return np.stack(cols, axis=2)


def naive_next_history(token_ids, cu_seqlens, layout: EngramLayout, *, history=None, dead_mask=None) -> np.ndarray:
    """The last ``max_ngram - 1`` ids of every sequence so far (-1 = none / dead), ``[N, M-1]``."""
    tok = _np(token_ids)
    cu = _np(cu_seqlens)
    H = layout.max_ngram - 1
    hist = _np(history) if history is not None else np.full((cu.shape[0] - 1, H), -1, dtype=np.int64)
    dead = None if dead_mask is None else _np(dead_mask, bool)
    out = np.empty_like(hist)
    for n in range(cu.shape[0] - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        seq = tok[s:e].copy()
        if dead is not None:
            seq[dead[s:e]] = -1
        out[n] = np.concatenate([hist[n], seq])[-H:]
    return out


# -- fp8 e4m3 with ue8m0 scales ----------------------------------------------------------


def naive_quantize_fp8_ue8m0(x: torch.Tensor, block: int = SCALE_BLOCK):
    """``x [R, D]`` -> (``q`` uint8 ``[R, D]`` = e4m3fn bits, ``scale`` uint8 ``[R, D/block]``
    = biased exponents): scale ``2^e`` with the least ``e`` such that the block's
    ``amax / 2^e <= 448`` (blocks of zeros: ``e = 0``), ``e + 127`` clamped to ``[1, 254]``."""
    R, D = x.shape
    xb = x.detach().cpu().to(torch.float64).numpy().reshape(R, D // block, block)
    amax = np.abs(xb).max(axis=-1)
    # The least integer e with amax <= 448 * 2^e, by exact comparisons.
    e = np.ceil(np.log2(np.maximum(amax, 1e-300) / FP8_MAX)).astype(np.int64).clip(-126, 127)
    e = e + (np.ldexp(amax, -e) > FP8_MAX)
    e = e - (np.ldexp(amax, 1 - e) <= FP8_MAX)
    e = np.where(amax > 0, e, 0)
    biased = np.clip(e + 127, 1, 254)
    scaled = xb / np.exp2(biased - 127.0)[..., None]
    scaled = np.clip(scaled, -FP8_MAX, FP8_MAX)
    q = torch.from_numpy(scaled.reshape(R, D)).to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, torch.from_numpy(biased.astype(np.uint8))


def naive_dequantize_fp8_ue8m0(q: torch.Tensor, scale: torch.Tensor, block: int = SCALE_BLOCK) -> torch.Tensor:
    """fp32 ``[R, D]`` from e4m3fn bits and biased ue8m0 exponents (PyTorch decodes the fp8)."""
    vals = q.cpu().view(torch.float8_e4m3fn).to(torch.float32)
    mult = torch.pow(2.0, scale.cpu().to(torch.float32) - 127.0)
    return vals * mult.repeat_interleave(block, dim=-1)


def naive_lookup(
    weight: torch.Tensor,
    rows,
    *,
    column_sizes=None,
    col_start: int = 0,
    col_end: int | None = None,
    local: bool = False,
) -> torch.Tensor:
    """``weight [R, D]`` (the whole layer's table, any float dtype), ``rows [T, C]`` ->
    fp32 ``[T, C, D]`` (``local``: ``[T, col_end - col_start, D]``). Columns outside
    ``[col_start, col_end)``, negative rows, and rows outside their column's own table
    (``column_sizes`` given) read zeros."""
    r = torch.as_tensor(_np(rows))
    T, C = r.shape
    col_end = C if col_end is None else col_end
    w = weight.detach().cpu().to(torch.float32)
    valid = r >= 0
    if column_sizes is not None:
        sizes = torch.as_tensor(_np(column_sizes))
        starts = torch.cumsum(sizes, 0) - sizes
        valid &= (r >= starts[None]) & (r < (starts + sizes)[None])
    owned = torch.zeros(C, dtype=torch.bool)
    owned[col_start:col_end] = True
    valid &= owned[None]
    out = torch.where(valid[..., None], w[r.clamp(min=0, max=w.shape[0] - 1)], torch.zeros(()))
    return out[:, col_start:col_end] if local else out


# -- tokenizer compression -----------------------------------------------------------------


def naive_normalize(text: str) -> str:
    """NFKC, NFD, drop combining marks, lowercase, ASCII whitespace runs -> one space,
    strip (a lone space survives)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if not unicodedata.category(ch).startswith("M"))
    s = re.sub(r"[ \t\r\n]+", " ", s.lower())
    return s if s == " " else s.strip()


def naive_compressed_token_map(texts: list[str], tokens: list[str]):
    """From each id's decoded text and token string: (int64 map ``[V]``, compressed size)."""
    key_to_new: dict[str, int] = {}
    out = np.empty(len(texts), dtype=np.int64)
    for tid, (text, token) in enumerate(zip(texts, tokens)):
        key = token if "\ufffd" in text else (naive_normalize(text) or text)
        out[tid] = key_to_new.setdefault(key, len(key_to_new))
    return out, len(key_to_new)


def _keys_values(kv: torch.Tensor, num_tokens: int, hc: int, dim: int, num_kv_tokens: int | None, dtype):
    """kv rows padded/truncated to ``num_tokens``: keys ``[T, hc, dim]``, value ``[T, dim]``."""
    valid = kv.shape[0] if num_kv_tokens is None else min(num_kv_tokens, kv.shape[0])
    full = torch.zeros(num_tokens, (hc + 1) * dim, dtype=dtype, device=kv.device)
    rows = min(valid, num_tokens)
    full[:rows] = kv[:rows].to(dtype)
    return full[:, : hc * dim].reshape(num_tokens, hc, dim), full[:, hc * dim :]


def gate_from_sums(hidden, key_sq, dot, dim, eps, clamp_value, token_mask):
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


def naive_engram_post_wkv(
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
    dtype = compute_dtype(hidden_states, kv)
    hidden = hidden_states.to(dtype)
    keys, value = _keys_values(kv, T, hc, dim, num_kv_tokens, dtype)
    qk = (q_weight.to(dtype) * k_weight.to(dtype))[None]
    key_sq = (keys * keys).sum(-1)
    dot = (hidden * qk * keys).sum(-1)
    gate = gate_from_sums(hidden, key_sq, dot, dim, eps, clamp_value, token_mask)
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


def naive_engram_gate_sharded(
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
    Equal to :func:`naive_engram_post_wkv` up to summation order.
    """
    T, hc, dim = hidden_states.shape
    if dim % tp_size:
        raise ValueError(f"dim {dim} is not divisible by tp_size {tp_size}")
    width = dim // tp_size
    dtype = compute_dtype(hidden_states, kv)
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
    gate = gate_from_sums(hidden, key_sq, dot, dim, eps, clamp_value, token_mask)
    return (hidden + gate[..., None] * value[:, None, :]).to(hidden_states.dtype)
