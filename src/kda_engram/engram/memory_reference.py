"""Engram memory in plain NumPy/PyTorch: what the hashing and table kernels are tested against.

Kept apart from :mod:`kda_engram.engram.reference` (the gate's reference).
Everything here is written for clarity, per sequence and per lag, with none of
the kernels' tricks (binary search of ``cu_seqlens``, bit-level fp8 decoding):

* :func:`ngram_hash_ref` - the varlen hash with history and dead tokens.
* :func:`ngram_hash_padded_ref` - the Engram paper's batch formulation
  (shift-with-pad, no varlen), a second, independent statement of the hash.
* :func:`quantize_fp8_ue8m0_ref` / :func:`dequantize_fp8_ue8m0_ref` - fp8 e4m3
  with one power-of-two (ue8m0) scale per 32 values, decoded by PyTorch's own
  ``float8_e4m3fn``.
* :func:`lookup_ref` - the gather with TP column ownership.
* :func:`compressed_token_map_ref` - the tokenizer compression with
  :mod:`unicodedata` instead of the ``tokenizers`` normalizers.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import torch

from kda_engram.engram.layout import EngramLayout

FP8_MAX = 448.0
SCALE_BLOCK = 32


def _np(x, dtype=np.int64):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype)


def ngram_hash_ref(
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


def ngram_hash_padded_ref(input_ids, layout: EngramLayout, layer_index: int) -> np.ndarray:
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


def next_history_ref(token_ids, cu_seqlens, layout: EngramLayout, *, history=None, dead_mask=None) -> np.ndarray:
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


def quantize_fp8_ue8m0_ref(x: torch.Tensor, block: int = SCALE_BLOCK):
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


def dequantize_fp8_ue8m0_ref(q: torch.Tensor, scale: torch.Tensor, block: int = SCALE_BLOCK) -> torch.Tensor:
    """fp32 ``[R, D]`` from e4m3fn bits and biased ue8m0 exponents (PyTorch decodes the fp8)."""
    vals = q.cpu().view(torch.float8_e4m3fn).to(torch.float32)
    mult = torch.pow(2.0, scale.cpu().to(torch.float32) - 127.0)
    return vals * mult.repeat_interleave(block, dim=-1)


def lookup_ref(
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


def normalize_ref(text: str) -> str:
    """NFKC, NFD, drop combining marks, lowercase, ASCII whitespace runs -> one space,
    strip (a lone space survives)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if not unicodedata.category(ch).startswith("M"))
    s = re.sub(r"[ \t\r\n]+", " ", s.lower())
    return s if s == " " else s.strip()


def compressed_token_map_ref(texts: list[str], tokens: list[str]):
    """From each id's decoded text and token string: (int64 map ``[V]``, compressed size)."""
    key_to_new: dict[str, int] = {}
    out = np.empty(len(texts), dtype=np.int64)
    for tid, (text, token) in enumerate(zip(texts, tokens)):
        key = token if "\ufffd" in text else (normalize_ref(text) or text)
        out[tid] = key_to_new.setdefault(key, len(key_to_new))
    return out, len(key_to_new)
