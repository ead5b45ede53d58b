"""vLLM 0.33's DeepSeek-V4.1 n-gram hash ids in one launch.

:func:`~kda_engram.integrations.vllm_deepseek_v41.hash_ids` serves vLLM's
``_hash_ids_kernel`` with :func:`vllm_engram_hash`: per token and lag, the compressed
id vLLM's kernel selects (membership by position, the newest-first lookback window,
the V1 slot cache, its dead masks), hashed on the spot as kda-engram's n-gram hash
kernel hashes a sequence's ids (:mod:`kda_engram.engram.hashing`: the XOR of id x
multiplier, the blocking to pad, each head's prime and offset). One launch, no
host sync, no copy of an input. No vLLM import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..engram.hashing import hash_lag

__all__ = ["BLOCK_T", "vllm_engram_hash"]

BLOCK_T = 128


@triton.jit
def _vllm_lag_id(s: tl.constexpr, t, live, req, chunk_start, position, ids_ptr, ids_stride, map_ptr, map_stride,
                 vocab, dead_ptr, dead_stride, lb_ptr, lb_stride_r, lb_stride_c, lbd_ptr, lbd_stride_r,
                 lbd_stride_c, depth, table_ptr, table_stride_r, table_stride_c, table_rows, cache_span, block_size,
                 cache_ptr, cache_stride, num_slots, dead_id, pad_id, HAS_WINDOW: tl.constexpr,
                 HAS_CACHE: tl.constexpr, BLOCK: tl.constexpr):
    """The compressed id vLLM's kernel reads at lag ``s`` of tokens ``t``; -1 where the
    lag is dead (a dead mask, a cache ``dead_id``) or its position is negative, which
    blocks it and every older lag."""
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
    return tl.where(lookback < 0, -1, tl.where(in_batch, value, fallback))


@triton.jit
def _vllm_engram_hash_kernel(
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
    mult_ptr,
    primes_ptr,
    offsets_ptr,
    out_ptr,
    out_stride_t,
    out_stride_l,
    out_stride_c,
    num_tokens,
    num_reqs,
    pad_id,
    MAX_NGRAM: tl.constexpr,
    N_HEADS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: BLOCK tokens x every hash column of one layer (grid axis 1)."""
    layer = tl.program_id(1)
    t = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
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

    # Lags 0 .. MAX_NGRAM-1 (newest first): a blocked lag (-1) reads pad and so does
    # every older one; the n-gram of lags 0..s hashed into its N_HEADS columns.
    alive = live
    mix = tl.zeros([BLOCK], dtype=tl.int64)
    for s in tl.static_range(MAX_NGRAM):
        lag_id = _vllm_lag_id(s, t, live, req, chunk_start, position, ids_ptr, ids_stride, map_ptr, map_stride,
                              vocab, dead_ptr, dead_stride, lb_ptr, lb_stride_r, lb_stride_c, lbd_ptr, lbd_stride_r,
                              lbd_stride_c, depth, table_ptr, table_stride_r, table_stride_c, table_rows, cache_span,
                              block_size, cache_ptr, cache_stride, num_slots, dead_id, pad_id, HAS_WINDOW, HAS_CACHE,
                              BLOCK)
        alive = alive & (lag_id >= 0)
        mix = hash_lag(mix, tl.where(alive, lag_id, pad_id), s, layer, mult_ptr, primes_ptr, offsets_ptr, out_ptr, t,
                       out_stride_t, out_stride_l, out_stride_c, live, live, MAX_NGRAM, N_HEADS)


def _flags(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bytes (a view, not a copy); any other dtype as it is (non-zero = set)."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def vllm_engram_hash(input_ids, token_map, dead_mask, positions, query_start_loc, lookback_token_ids,
                     lookback_dead_mask, multipliers, primes, offsets, output, *, max_ngram: int, n_heads: int,
                     pad_id: int, cache=None, block_table=None, cache_block_size: int = 1, dead_id: int = -1) -> None:
    """vLLM 0.33's ``_hash_ids_kernel`` results into ``output``, in one launch.

    Shapes: ``input_ids`` ``[>= T]`` raw ids, ``T = output.shape[0]``; ``token_map``
    ``[vocab]`` raw -> compressed; ``dead_mask`` ``[>= T]`` (bool, or non-zero = dead);
    ``positions`` int32/int64 ``[>= T]``; ``query_start_loc`` ``[R+1]``, ``R >= 1``;
    ``lookback_token_ids`` / ``lookback_dead_mask`` ``[>= R, depth]``, newest first
    (``depth`` may be 0); ``cache`` int32 ``[num_slots >= 1]`` with ``block_table``
    ``[>= 1, >= 1]`` and ``cache_block_size >= 1`` (vLLM's V1 runner), or ``None``
    (V2: pad); ``multipliers`` int64 contiguous ``[L, max_ngram]``, ``primes`` and
    ``offsets`` int64 contiguous, ``L * (max_ngram - 1) * n_heads`` elements;
    ``output`` int32 ``[T, L, (max_ngram - 1) * n_heads]``, any strides. The inputs
    are read through their strides; nothing is copied.

    Per token ``t`` and lag ``s`` the id is the one vLLM's kernel selects: the request
    of ``t`` is the first ``r`` with ``query_start_loc[r+1] > t`` (the last one for
    tokens past every end); a lag whose position is in the request's chunk reads the
    batch token ``t - s``, an earlier one the lookback window, else the slot cache or
    ``pad_id``; an unknown (``-1``) window id falls through to the cache or pad; a
    dead lag or a negative position blocks itself and every older lag (pad). A raw
    id outside ``[0, vocab)`` reads as ``pad_id`` (no read out of the map), a
    ``query_start_loc`` entry below 0 as token 0. The ids are then hashed as
    :func:`kda_engram.engram.hashing.launch_ngram_hash` hashes a sequence's."""
    T, R = output.shape[0], query_start_loc.numel() - 1
    L = output.shape[1]
    if R < 1:
        raise ValueError(f"query_start_loc: expected at least 2 boundaries, got {query_start_loc.numel()}")
    depth = lookback_token_ids.shape[1]
    if lookback_token_ids.shape[0] < R or lookback_dead_mask.shape != lookback_token_ids.shape:
        raise ValueError(f"lookback_token_ids, lookback_dead_mask: expected [>= {R}, depth] each, got "
                         f"{list(lookback_token_ids.shape)} and {list(lookback_dead_mask.shape)}")
    if cache is not None and (block_table is None or block_table.dim() != 2 or min(block_table.shape) < 1
                              or cache.numel() < 1 or cache_block_size < 1):
        raise ValueError("cache: needs a non-empty block table, at least one slot and cache_block_size >= 1")
    if T == 0 or L == 0:
        return
    dead = _flags(dead_mask)
    window, window_dead = (lookback_token_ids, _flags(lookback_dead_mask)) if depth > 0 else (input_ids, dead)
    table = block_table if cache is not None else input_ids
    slots = cache if cache is not None else input_ids
    _vllm_engram_hash_kernel[(triton.cdiv(T, BLOCK_T), L)](
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
        multipliers, primes, offsets,
        output, output.stride(0), output.stride(1), output.stride(2),
        T, R, pad_id,
        MAX_NGRAM=max_ngram,
        N_HEADS=n_heads,
        SEARCH_STEPS=R.bit_length(),
        HAS_WINDOW=depth > 0,
        HAS_CACHE=cache is not None,
        BLOCK=BLOCK_T,
        num_warps=4,
    )
