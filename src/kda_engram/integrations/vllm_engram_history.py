"""vLLM 0.33's DeepSeek-V4.1 n-gram ids, one row per token, in one launch.

:func:`~kda_engram.integrations.vllm_deepseek_v41.hash_ids` serves vLLM's
``_hash_ids_kernel`` with kda-engram's n-gram hash kernel, each token its own
one-token sequence: its own id and a ``history`` row holding, per lag, the
compressed id vLLM's kernel selects. :func:`vllm_engram_rows` builds those rows
(and the hash launch's dead mask and ``cu_seqlens``) on the device in one launch;
no host sync, no copy of an input. No vLLM import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_T", "vllm_engram_rows"]

BLOCK_T = 128


@triton.jit
def _vllm_engram_rows_kernel(
    ids_ptr,
    ids_stride,
    map_ptr,
    map_stride,
    vocab,
    dead_ptr,
    dead_stride,
    pos_ptr,
    pos_stride,
    qsl_ptr,
    qsl_stride,
    lb_ptr,
    lb_stride_r,
    lb_stride_c,
    lbd_ptr,
    lbd_stride_r,
    lbd_stride_c,
    depth,
    table_ptr,
    table_stride_r,
    table_stride_c,
    table_rows,
    cache_span,
    block_size,
    cache_ptr,
    cache_stride,
    num_slots,
    dead_id,
    own_ptr,
    own_stride,
    hist_ptr,
    hist_stride_t,
    hist_stride_j,
    own_dead_ptr,
    own_dead_stride,
    cu_ptr,
    cu_stride,
    num_tokens,
    num_reqs,
    pad_id,
    MAX_NGRAM: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: BLOCK tokens, every lag; and ``cu[t] = t`` for ``t <= T``."""
    t = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    tl.store(cu_ptr + t * cu_stride, t, mask=t <= num_tokens)
    live = t < num_tokens

    # The request: the first r in [0, R) with query_start_loc[r+1] > t (torch's
    # searchsorted(right=True) on the ends, step for step), the last one past them.
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        active = live & (lo < hi)
        mid = (lo + hi) // 2
        end = tl.load(qsl_ptr + (mid + 1) * qsl_stride, mask=active, other=0).to(tl.int64)
        right = t >= end
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    req = tl.minimum(lo, num_reqs - 1)
    first = tl.load(qsl_ptr + req * qsl_stride, mask=live, other=0).to(tl.int64)
    first = tl.maximum(tl.minimum(first, num_tokens - 1), 0)
    chunk_start = tl.load(pos_ptr + first * pos_stride, mask=live, other=0).to(tl.int64)
    position = tl.load(pos_ptr + t * pos_stride, mask=live, other=0).to(tl.int64)

    for s in tl.static_range(MAX_NGRAM):
        lookback = position - s
        readable = live & (lookback >= 0)
        in_batch = lookback >= chunk_start
        # Membership by position, source by index: the batch token t - s (token 0 below).
        from_batch = readable & in_batch
        b = tl.maximum(t - s, 0)
        raw = tl.load(ids_ptr + b * ids_stride, mask=from_batch, other=0).to(tl.int64)
        dead = tl.load(dead_ptr + b * dead_stride, mask=from_batch, other=0) != 0
        mapped = tl.load(map_ptr + raw * map_stride, mask=from_batch & ~dead & (raw >= 0) & (raw < vocab),
                         other=pad_id).to(tl.int64)
        value = tl.where(dead, -1, mapped)
        # Before the chunk: the lookback window (newest first), else the cache or pad.
        before = readable & ~in_batch
        fallback = tl.zeros([BLOCK], dtype=tl.int64) + pad_id
        if HAS_CACHE:
            clamped = tl.minimum(tl.maximum(lookback, 0), cache_span - 1)
            row = tl.minimum(req, table_rows - 1)
            block = tl.load(table_ptr + row * table_stride_r + (clamped // block_size) * table_stride_c,
                            mask=before, other=0).to(tl.int64)
            slot = tl.minimum(tl.maximum(block * block_size + clamped % block_size, 0), num_slots - 1)
            cached = tl.load(cache_ptr + slot * cache_stride, mask=before, other=0).to(tl.int64)
            fallback = tl.where(cached == dead_id, -1, cached)
        if HAS_WINDOW:
            col = chunk_start - 1 - lookback
            in_window = before & (col >= 0) & (col < depth)
            col = tl.minimum(tl.maximum(col, 0), depth - 1)
            window = tl.load(lb_ptr + req * lb_stride_r + col * lb_stride_c, mask=in_window, other=-1).to(tl.int64)
            known = in_window & (window >= 0)
            window_dead = tl.load(lbd_ptr + req * lbd_stride_r + col * lbd_stride_c, mask=known, other=0) != 0
            window_id = tl.load(map_ptr + window * map_stride, mask=known & ~window_dead & (window < vocab),
                                other=pad_id).to(tl.int64)
            fallback = tl.where(known, tl.where(window_dead, -1, window_id), fallback)
        shift = tl.where(lookback < 0, -1, tl.where(in_batch, value, fallback))
        if s == 0:
            tl.store(own_ptr + t * own_stride, shift, mask=live)
            tl.store(own_dead_ptr + t * own_dead_stride, (shift < 0).to(tl.uint8), mask=live)
        else:
            # history: lags MAX_NGRAM-1 .. 1, oldest first.
            tl.store(hist_ptr + t * hist_stride_t + (MAX_NGRAM - 1 - s) * hist_stride_j, shift, mask=live)


def _flags(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bytes (a view, not a copy); any other dtype as it is (non-zero = set)."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def vllm_engram_rows(input_ids, token_map, dead_mask, positions, query_start_loc, lookback_token_ids,
                     lookback_dead_mask, *, max_ngram: int, pad_id: int, cache=None, block_table=None,
                     cache_block_size: int = 1, dead_id: int = -1):
    """Each token's own id and history row under vLLM 0.33's ``_hash_ids_kernel``
    conventions (:func:`~kda_engram.integrations.vllm_deepseek_v41.hash_ids`), in
    one launch.

    Shapes: ``input_ids`` ``[>= T]`` raw ids, ``T = input_ids.shape[0]``;
    ``token_map`` ``[vocab]`` raw -> compressed; ``dead_mask`` ``[>= T]`` (bool, or
    non-zero = dead); ``positions`` int32/int64 ``[>= T]``; ``query_start_loc``
    ``[R+1]``, ``R >= 1``; ``lookback_token_ids`` / ``lookback_dead_mask`` ``[>= R,
    depth]``, newest first (``depth`` may be 0); ``cache`` int32 ``[num_slots >= 1]``
    with ``block_table`` ``[>= 1, >= 1]`` and ``cache_block_size >= 1`` (vLLM's V1
    runner), or ``None`` (V2: pad). Any strides; nothing is copied.

    Returns ``(own, history, own_dead, cu_seqlens)``: ``own`` int64 ``[T]``, the id
    vLLM's kernel selects at lag 0; ``history`` int64 ``[T, max_ngram - 1]``, lags
    ``max_ngram - 1 .. 1`` (oldest first); ``-1`` in either where the lag is dead
    (``dead_mask``, ``lookback_dead_mask``, a cache ``dead_id``) or its position is
    negative, so ``-1`` pads and hides the older lags; an unknown (``-1``) lookback
    id reads the cache or pad. ``own_dead`` uint8 ``[T]`` is ``own < 0``;
    ``cu_seqlens`` int64 ``[T + 1]`` is ``arange(T + 1)``: the arguments of
    :func:`~kda_engram.engram.hashing.launch_ngram_hash` with each token its own
    sequence. The request of token ``t`` is the first ``r`` with
    ``query_start_loc[r+1] > t``, the last one for tokens past every end. A raw id
    outside ``[0, vocab)`` reads as ``pad_id`` (no read out of the map), a
    ``query_start_loc`` entry below 0 as token 0.
    """
    T, R = input_ids.shape[0], query_start_loc.numel() - 1
    if R < 1:
        raise ValueError(f"query_start_loc: expected at least 2 boundaries, got {query_start_loc.numel()}")
    depth = lookback_token_ids.shape[1]
    if lookback_token_ids.shape[0] < R or lookback_dead_mask.shape != lookback_token_ids.shape:
        raise ValueError(f"lookback_token_ids, lookback_dead_mask: expected [>= {R}, depth] each, got "
                         f"{list(lookback_token_ids.shape)} and {list(lookback_dead_mask.shape)}")
    if cache is not None and (block_table is None or block_table.dim() != 2 or min(block_table.shape) < 1
                              or cache.numel() < 1 or cache_block_size < 1):
        raise ValueError("cache: needs a non-empty block table, at least one slot and cache_block_size >= 1")
    device = input_ids.device
    own = torch.empty(T, dtype=torch.int64, device=device)
    history = torch.empty(T, max_ngram - 1, dtype=torch.int64, device=device)
    own_dead = torch.empty(T, dtype=torch.uint8, device=device)
    cu_seqlens = torch.empty(T + 1, dtype=torch.int64, device=device)
    dead = _flags(dead_mask)
    window, window_dead = (lookback_token_ids, _flags(lookback_dead_mask)) if depth > 0 else (own, own_dead)
    table = block_table if cache is not None else own
    slots = cache if cache is not None else own
    _vllm_engram_rows_kernel[(triton.cdiv(T + 1, BLOCK_T),)](
        input_ids, input_ids.stride(0),
        token_map, token_map.stride(0), token_map.shape[0],
        dead, dead.stride(0),
        positions, positions.stride(0),
        query_start_loc, query_start_loc.stride(0),
        window, window.stride(0), window.stride(-1),
        window_dead, window_dead.stride(0), window_dead.stride(-1), depth,
        table, table.stride(0), table.stride(-1), table.shape[0],
        table.shape[-1] * cache_block_size if cache is not None else 1, cache_block_size,
        slots, slots.stride(0), slots.shape[0], dead_id,
        own, own.stride(0),
        history, history.stride(0), history.stride(1),
        own_dead, own_dead.stride(0),
        cu_seqlens, cu_seqlens.stride(0),
        T, R, pad_id,
        MAX_NGRAM=max_ngram,
        SEARCH_STEPS=R.bit_length(),
        HAS_WINDOW=depth > 0,
        HAS_CACHE=cache is not None,
        BLOCK=BLOCK_T,
        num_warps=4,
    )
    return own, history, own_dead, cu_seqlens
