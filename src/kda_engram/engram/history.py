"""The Engram hash-history cache: gather, scatter and checkpoint its rows on the device.

The hash history is the last ``max_ngram - 1`` token ids of every sequence, which
the n-grams of a chunk's first tokens reach back into
(:func:`kda_engram.engram.hashing.ngram_hash`'s ``history``). It lives in a
caller-owned cache ``[slots, max_ngram - 1]`` (int32/int64, ids in the same space
as ``token_ids``; ``-1`` = none), indexed like the KDA state cache:

* :func:`gather_history`: the ``[N, H]`` rows of a batch's sequences (``-1`` for a
  sequence that starts fresh);
* :func:`scatter_history`: write each sequence's new history back;
* :func:`checkpoint_history`: the history *at* a prefix-cache offset ``p``.

Each is one launch of one program per sequence and touches only the rows its
indices name (negative: none); with ``check_inputs=False`` there is no host sync.
Why kernels and not ``index_select``/``index_copy_``: the negative "no row"
indices and the ``has_initial_state`` flags are handled on the device, so a step
stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..validation.common import check_index_range
from ..validation.engram import (
    check_checkpoint_offsets,
    check_history_checkpoint,
    check_history_gather,
    check_history_scatter,
)
from ..validation.entry import settle_pending

__all__ = [
    "gather_history",
    "scatter_history",
    "checkpoint_history",
    "run_gather_history",
    "run_scatter_history",
    "run_checkpoint_history",
]


@triton.jit
def _history_copy_kernel(
    src_ptr, s_src_n, s_src_j,
    src_idx_ptr, s_src_idx,
    has_ptr, s_has,
    dst_ptr, s_dst_n, s_dst_j,
    dst_idx_ptr, s_dst_idx,
    HIST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_FLAGS: tl.constexpr,
):
    """One program per sequence ``n``. ``GATHER``: ``dst[n] = src[src_idx[n]]`` (or -1
    when the index is negative or ``has[n]`` is false). Else (scatter):
    ``dst[dst_idx[n]] = src[n]`` when the index is non-negative."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    jm = j < HIST
    if GATHER:
        row = tl.load(src_idx_ptr + n * s_src_idx).to(tl.int64)
        ok = row >= 0
        if HAS_FLAGS:
            ok = ok & (tl.load(has_ptr + n * s_has) != 0)
        val = tl.load(src_ptr + tl.where(ok, row, 0) * s_src_n + j * s_src_j, mask=jm & ok, other=-1)
        tl.store(dst_ptr + n * s_dst_n + j * s_dst_j, val.to(dst_ptr.dtype.element_ty), mask=jm)
    else:
        row = tl.load(dst_idx_ptr + n * s_dst_idx).to(tl.int64)
        ok = row >= 0
        val = tl.load(src_ptr + n * s_src_n + j * s_src_j, mask=jm & ok, other=-1)
        tl.store(dst_ptr + tl.where(ok, row, 0) * s_dst_n + j * s_dst_j, val.to(dst_ptr.dtype.element_ty),
                 mask=jm & ok)


@triton.jit
def _history_checkpoint_kernel(
    tok_ptr, s_tok,
    cu_ptr, s_cu,
    hist_ptr, s_hist_n, s_hist_j,
    dead_ptr, s_dead,
    off_ptr, s_off,
    idx_ptr, s_idx,
    cache_ptr, s_cache_n, s_cache_j,
    HIST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    HAS_DEAD: tl.constexpr,
):
    """``cache[idx[n]]`` = the history after the first ``off[n]`` tokens of sequence
    ``n`` (``next_history`` of the truncated sequence), for ``0 < off <= length``."""
    n = tl.program_id(0).to(tl.int64)
    bos = tl.load(cu_ptr + n * s_cu).to(tl.int64)
    eos = tl.load(cu_ptr + (n + 1) * s_cu).to(tl.int64)
    p = tl.load(off_ptr + n * s_off).to(tl.int64)
    row = tl.load(idx_ptr + n * s_idx).to(tl.int64)
    on = (row >= 0) & (p > 0) & (p <= eos - bos)
    j = tl.arange(0, BLOCK_H)
    jm = (j < HIST) & on
    pos = bos + p - HIST + j
    inside = pos >= bos
    tok = tl.load(tok_ptr + tl.where(jm & inside, pos, 0) * s_tok, mask=jm & inside, other=-1).to(tl.int64)
    if HAS_DEAD:
        dead = tl.load(dead_ptr + tl.where(jm & inside, pos, 0) * s_dead, mask=jm & inside, other=0)
        tok = tl.where(dead != 0, -1, tok)
    jold = j + p
    if HAS_HISTORY:
        old = tl.load(hist_ptr + n * s_hist_n + jold * s_hist_j, mask=jm & (~inside) & (jold < HIST),
                      other=-1).to(tl.int64)
    else:
        old = tl.full([BLOCK_H], -1, tl.int64)
    new = tl.where(inside, tok, old)
    tl.store(cache_ptr + tl.where(on, row, 0) * s_cache_n + j * s_cache_j, new.to(cache_ptr.dtype.element_ty), mask=jm)


def gather_history(cache: torch.Tensor, slot_indices: torch.Tensor, has_initial_state: torch.Tensor | None = None,
                   *, check_inputs: bool = True) -> torch.Tensor:
    """The hash history of a batch's sequences: ``[N, H]`` rows of ``cache [slots, H]``.

    Row ``n`` is ``cache[slot_indices[n]]``, or all ``-1`` (no history: the sequence
    starts fresh) where the index is negative or ``has_initial_state[n]`` is false --
    a new sequence never reads a stale row. One launch, no host sync. Returns a new
    tensor in ``cache``'s dtype."""
    settle_pending()  # raises an earlier call's pending error first
    if check_inputs:
        check_history_gather(cache, slot_indices, has_initial_state)
        check_index_range("slot_indices", slot_indices, cache.shape[0])
    return run_gather_history(cache, slot_indices, has_initial_state)


def run_gather_history(cache, slot_indices, has_initial_state=None) -> torch.Tensor:
    """:func:`gather_history`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_history_gather`); the eager body of
    its op (:mod:`kda_engram.ops.engram`)."""
    N, H = slot_indices.shape[0], cache.shape[1]
    out = torch.empty(N, H, dtype=cache.dtype, device=cache.device)
    if N == 0 or H == 0:
        return out
    flags = has_initial_state.view(torch.uint8) if has_initial_state is not None else slot_indices
    _history_copy_kernel[(N,)](
        cache, cache.stride(0), cache.stride(1),
        slot_indices, slot_indices.stride(0),
        flags, flags.stride(0) if has_initial_state is not None else 0,
        out, out.stride(0), out.stride(1),
        slot_indices, 0,
        HIST=H, BLOCK_H=triton.next_power_of_2(H), GATHER=True, HAS_FLAGS=has_initial_state is not None,
        num_warps=1,
    )
    return out


def scatter_history(cache: torch.Tensor, slot_indices: torch.Tensor, history: torch.Tensor, *,
                    check_inputs: bool = True) -> torch.Tensor:
    """Write ``history [N, H]`` to rows ``slot_indices`` of ``cache`` in place (negative:
    not written; rows no index names are never touched). Returns ``cache``."""
    settle_pending()  # raises an earlier call's pending error first
    if check_inputs:
        check_history_scatter(cache, slot_indices, history)
        check_index_range("slot_indices", slot_indices, cache.shape[0])
    return run_scatter_history(cache, slot_indices, history)


def run_scatter_history(cache, slot_indices, history) -> torch.Tensor:
    """:func:`scatter_history`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_history_scatter`); the eager body of
    its op (:mod:`kda_engram.ops.engram`). Returns ``cache``."""
    N, H = slot_indices.shape[0], cache.shape[1]
    if N == 0 or H == 0:
        return cache
    _history_copy_kernel[(N,)](
        history, history.stride(0), history.stride(1),
        slot_indices, 0,
        slot_indices, 0,
        cache, cache.stride(0), cache.stride(1),
        slot_indices, slot_indices.stride(0),
        HIST=H, BLOCK_H=triton.next_power_of_2(H), GATHER=False, HAS_FLAGS=False,
        num_warps=1,
    )
    return cache


def checkpoint_history(token_ids: torch.Tensor, cu_seqlens: torch.Tensor, history: torch.Tensor | None,
                       dead_mask: torch.Tensor | None, checkpoint_offsets: torch.Tensor,
                       checkpoint_indices: torch.Tensor, cache: torch.Tensor, *,
                       check_inputs: bool = True) -> torch.Tensor:
    """Prefix-cache checkpoint of the hash history: row ``checkpoint_indices[n]`` of
    ``cache`` gets the history after the first ``p = checkpoint_offsets[n]`` tokens of
    sequence ``n`` of this call (``history`` is what came before the call, as given
    to ``ngram_hash``), for ``0 < p <= length``; ``p = 0`` or a negative row: nothing.
    Returns ``cache``."""
    settle_pending()  # raises an earlier call's pending error first
    if check_inputs:
        check_history_checkpoint(token_ids, cu_seqlens, history, checkpoint_offsets, checkpoint_indices, cache)
        check_checkpoint_offsets(cu_seqlens, checkpoint_offsets, checkpoint_indices, cache.shape[0])
    return run_checkpoint_history(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices,
                                  cache)


def run_checkpoint_history(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices,
                           cache) -> torch.Tensor:
    """:func:`checkpoint_history`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_history_checkpoint` and
    :func:`~kda_engram.validation.engram.check_checkpoint_offsets`); the eager body of
    its op (:mod:`kda_engram.ops.engram`). Returns ``cache``."""
    N, H = cu_seqlens.shape[0] - 1, cache.shape[1]
    if N <= 0 or H == 0:
        return cache
    dead = None if dead_mask is None else (dead_mask.view(torch.uint8) if dead_mask.dtype == torch.bool else dead_mask)
    _history_checkpoint_kernel[(N,)](
        token_ids, token_ids.stride(0),
        cu_seqlens, cu_seqlens.stride(0),
        history if history is not None else token_ids,
        history.stride(0) if history is not None else 0, history.stride(1) if history is not None else 0,
        dead if dead is not None else token_ids, dead.stride(0) if dead is not None else 0,
        checkpoint_offsets, checkpoint_offsets.stride(0),
        checkpoint_indices, checkpoint_indices.stride(0),
        cache, cache.stride(0), cache.stride(1),
        HIST=H, BLOCK_H=triton.next_power_of_2(H), HAS_HISTORY=history is not None, HAS_DEAD=dead is not None,
        num_warps=1,
    )
    return cache
