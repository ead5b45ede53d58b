"""N-gram hashing for Engram: token ids -> table rows, and the tokenizer compression.

:func:`ngram_hash` maps every token of a varlen batch to, per Engram layer, the
``n_hash_cols`` table rows its n-grams (orders ``2..max_ngram``, ``n_heads``
hashes each) select::

    mix[n]   = XOR_{i < n} tok[t - i] * mult[l][i]          (int64, never overflows)
    row[c]   = mix[n] mod prime[l][n - 2][j] + offset[l][c]  c = (n - 2) * n_heads + j

``tok`` are *compressed* ids (:func:`build_compressed_token_map`); pass the raw
ids with ``token_map`` and the kernel maps them on the fly. A token's window
never reaches across its sequence's start: older positions read the sequence's
``history`` (the ids that came before, which is how chunked prefill and decode
continue a sequence exactly) or the pad id. A *dead* token (an image
placeholder, padding; ``dead_mask``) and a ``-1`` in ``history`` read as pad and
hide everything older, as if the sequence started right after them.

The kernel is one launch, computes everything it needs (which sequence a token
belongs to, by binary search of ``cu_seqlens``) on the device, and so is free of
host syncs and CUDA-graph capturable when ``check_inputs=False``. The work is a
few int64 multiplies and modulos per token, far below any memory bound; the
point of the kernel is not to round-trip the token ids through the host (the
Engram paper's reference hashes with NumPy on the CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..validation.common import check_instance
from ..validation.entry import EntryChecks
from ..validation.engram import check_next_history_arguments, check_ngram_hash_arguments
from .layout import EngramLayout

BLOCK_T = 128


@triton.jit
def hash_lag(mix, tok, lag: tl.constexpr, layer, mult_ptr, primes_ptr, offsets_ptr, out_ptr, t, out_stride_t,
             out_stride_l, out_stride_c, live, store_mask, MAX_NGRAM: tl.constexpr, N_HEADS: tl.constexpr):
    """Lag ``lag`` of the n-gram hash of tokens ``t`` (``[BLOCK]``): ``tok`` (the lag's
    compressed ids, pad where blocked) times the layer's multiplier XOR-ed into the
    running ``mix``; past lag 0, the n-gram of lags ``0..lag`` stored in its ``N_HEADS``
    columns of ``out[t, layer]``: ``mix`` floor-mod each head's prime plus its offset
    (``-1`` where not ``live``), where ``store_mask``. ``multipliers [L, MAX_NGRAM]``,
    ``primes`` and ``offsets`` ``[L, (MAX_NGRAM - 1) * N_HEADS]``, contiguous. Returns
    the new ``mix``."""
    N_COLS: tl.constexpr = (MAX_NGRAM - 1) * N_HEADS
    mix = mix ^ (tok * tl.load(mult_ptr + layer * MAX_NGRAM + lag))
    if lag > 0:
        for j in tl.static_range(N_HEADS):
            c = (lag - 1) * N_HEADS + j
            prime = tl.load(primes_ptr + layer * N_COLS + c)
            off = tl.load(offsets_ptr + layer * N_COLS + c)
            r = mix % prime
            # C-style remainder: make it floor-mod (the NumPy reference's) in
            # case ids outside the compressed vocabulary made mix negative.
            r = tl.where(r < 0, r + prime, r)
            row = tl.where(live, r + off, -1)
            tl.store(out_ptr + t * out_stride_t + layer * out_stride_l + c * out_stride_c, row.to(tl.int32),
                     mask=store_mask)
    return mix


@triton.jit
def _ngram_hash_kernel(
    tok_ptr,
    tok_stride,
    cu_ptr,
    cu_stride,
    map_ptr,
    map_stride,
    hist_ptr,
    hist_stride_n,
    hist_stride_j,
    dead_ptr,
    dead_stride,
    primes_ptr,
    offsets_ptr,
    mult_ptr,
    out_ptr,
    out_stride_t,
    out_stride_l,
    out_stride_c,
    num_tokens,
    num_seqs,
    pad_id,
    MAX_NGRAM: tl.constexpr,
    N_HEADS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: BLOCK tokens x all hash columns of one layer (grid axis 1)."""
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    t = pid * BLOCK + tl.arange(0, BLOCK)
    tmask = t < num_tokens
    t64 = t.to(tl.int64)

    # Sequence of each token: the last n in [0, N) with cu[n] <= t. Empty
    # sequences share their successor's start, and "last" steps past them.
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + (num_seqs - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        v = tl.load(cu_ptr + mid * cu_stride, mask=tmask, other=0).to(tl.int64)
        go = v <= t64
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    seq = lo
    start = tl.load(cu_ptr + seq * cu_stride, mask=tmask, other=0).to(tl.int64)
    end = tl.load(cu_ptr + (seq + 1) * cu_stride, mask=tmask, other=0).to(tl.int64)
    live = tmask & (t64 >= start) & (t64 < end)

    alive = live
    mix = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(MAX_NGRAM):
        pos = t64 - i
        inside = pos >= start
        tok = tl.load(tok_ptr + pos * tok_stride, mask=alive & inside, other=0).to(tl.int64)
        if HAS_DEAD:
            dead = tl.load(dead_ptr + pos * dead_stride, mask=alive & inside, other=0)
            ok_inside = dead == 0
        else:
            ok_inside = tl.full([BLOCK], 1, tl.int1)
        if i > 0:
            if HAS_HISTORY:
                # history[n, MAX_NGRAM - 1 - (start - pos)]: oldest first, the last
                # column is the token right before the sequence's first one.
                hj = (MAX_NGRAM - 1) - (start - pos)
                hmask = alive & (~inside) & (hj >= 0)
                h = tl.load(
                    hist_ptr + seq.to(tl.int64) * hist_stride_n + hj * hist_stride_j, mask=hmask, other=-1
                ).to(tl.int64)
                ok_outside = h >= 0
                tok = tl.where(inside, tok, h)
            else:
                ok_outside = tl.zeros([BLOCK], dtype=tl.int1)
            alive = alive & tl.where(inside, ok_inside, ok_outside)
        else:
            alive = alive & ok_inside
        if HAS_MAP:
            tok = tl.load(map_ptr + tok * map_stride, mask=alive, other=0).to(tl.int64)
        tok = tl.where(alive, tok, pad_id)
        mix = hash_lag(mix, tok, i, layer, mult_ptr, primes_ptr, offsets_ptr, out_ptr, t64, out_stride_t,
                       out_stride_l, out_stride_c, live, tmask, MAX_NGRAM, N_HEADS)


@triton.jit
def _next_history_kernel(
    tok_ptr,
    tok_stride,
    cu_ptr,
    cu_stride,
    hist_ptr,
    hist_stride_n,
    hist_stride_j,
    dead_ptr,
    dead_stride,
    out_ptr,
    out_stride_n,
    out_stride_j,
    HIST: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    HAS_DEAD: tl.constexpr,
):
    n = tl.program_id(0)
    start = tl.load(cu_ptr + n * cu_stride).to(tl.int64)
    end = tl.load(cu_ptr + (n + 1) * cu_stride).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    jmask = j < HIST
    pos = end - HIST + j
    inside = pos >= start
    tok = tl.load(tok_ptr + pos * tok_stride, mask=jmask & inside, other=-1).to(tl.int64)
    if HAS_DEAD:
        dead = tl.load(dead_ptr + pos * dead_stride, mask=jmask & inside, other=0)
        tok = tl.where(dead != 0, -1, tok)
    # Older entries shift left by the sequence's length.
    jold = j + (end - start)
    if HAS_HISTORY:
        old = tl.load(
            hist_ptr + n.to(tl.int64) * hist_stride_n + jold * hist_stride_j,
            mask=jmask & (~inside) & (jold < HIST),
            other=-1,
        ).to(tl.int64)
    else:
        old = tl.full([BLOCK_H], -1, tl.int64)
    new = tl.where(inside, tok, old)
    tl.store(out_ptr + n.to(tl.int64) * out_stride_n + j * out_stride_j, new, mask=jmask)


def _dead_view(dead_mask):
    return dead_mask.view(torch.uint8) if dead_mask.dtype == torch.bool else dead_mask


def ngram_hash(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    layout: EngramLayout,
    *,
    history: torch.Tensor | None = None,
    dead_mask: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
    global_rows: bool = False,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Table rows of every token's n-grams, for all Engram layers at once.

    Args:
        token_ids: int32/int64 ``[T]``, a flattened varlen batch (any stride).
            Compressed ids, or raw tokenizer ids when ``token_map`` is given.
        cu_seqlens: int32/int64 ``[N+1]``; tokens outside ``[cu[0], cu[N])`` get
            row ``-1`` (the lookup writes zeros for them).
        layout: the model's :class:`EngramLayout`.
        history: int32/int64 ``[N, max_ngram - 1]``, the ids (same space as
            ``token_ids``) that came before each sequence, oldest first;
            ``-1`` = none (reads as pad and hides everything older). ``None``:
            every sequence starts fresh. :func:`next_history` computes the
            history the next call of a continuing sequence needs.
        dead_mask: bool/uint8 ``[T]``; a dead token hashes as pad and hides all
            tokens before it from the n-grams of the tokens after it.
        token_map: int32/int64 ``[vocab]``, raw -> compressed id map, applied in
            the kernel (one gather per token and lag, L2-resident).
        global_rows: rows index all layers' tables concatenated (in
            ``layout.layer_ids`` order) instead of each layer's own table.
        out: optional int32 ``[T, n_layers, n_hash_cols]`` to write into (any strides).
        check_inputs: validate shapes, dtypes, devices and id ranges (reads
            device memory back, so it syncs); turn off under CUDA-graph capture.

    Returns:
        int32 ``[T, n_layers, n_hash_cols]``: ``out[t, l]`` are the rows of
        layer ``layout.layer_ids[l]``'s table, column ``c = (n - 2) * n_heads + j``
        for order ``n``, head ``j``; ``out[:, l, :]`` is what
        :meth:`kda_engram.engram.table.EngramTable.lookup` takes.
    """
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        check_ngram_hash_arguments(token_ids, cu_seqlens, check_instance("layout", layout, EngramLayout), token_map,
                                   history, dead_mask, global_rows, out, checks)
    # Launch, then read back: a broken rule makes every sequence empty (every
    # token's rows -1), every id 0 and the history "none", so no id reaches a
    # gather out of its range.
    g = checks.guard
    out = run_ngram_hash(g(token_ids, 0), g(cu_seqlens, 0), layout, history=g(history, -1), dead_mask=dead_mask,
                         token_map=token_map, global_rows=global_rows, out=out)
    checks.run()  # the verdict, after the launch (deferred by default: validation.entry)
    return out


def run_ngram_hash(token_ids, cu_seqlens, layout, *, history=None, dead_mask=None, token_map=None,
                   global_rows=False, out=None) -> torch.Tensor:
    """:func:`ngram_hash`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_ngram_hash_arguments`) and guarded the
    indices; the eager body of its op (:mod:`kda_engram.ops.engram`)."""
    num_tokens = token_ids.shape[0]
    num_seqs = cu_seqlens.numel() - 1
    L, C = layout.n_layers, layout.n_hash_cols
    device = token_ids.device
    if out is None:
        out = torch.empty((num_tokens, L, C), dtype=torch.int32, device=device)
    if num_tokens == 0 or num_seqs == 0:
        return out if num_tokens == 0 else out.fill_(-1)
    primes, offsets, mults = layout.device_arrays(device, global_rows=global_rows)
    return launch_ngram_hash(token_ids, cu_seqlens, primes, offsets, mults, out, layout.hash_pad_id,
                             max_ngram=layout.max_ngram, n_heads=layout.n_heads, history=history,
                             dead_mask=dead_mask, token_map=token_map)


def launch_ngram_hash(token_ids, cu_seqlens, primes, offsets, multipliers, out, pad_id, *, max_ngram, n_heads,
                      history=None, dead_mask=None, token_map=None) -> torch.Tensor:
    """The hash kernel's launch on explicit tables (no rule, no layout): ``primes``,
    ``offsets`` int64 contiguous ``[L, (max_ngram - 1) * n_heads]`` (any leading
    shape of that many elements per layer), ``multipliers`` int64 contiguous
    ``[L, max_ngram]``, ``out`` int32 ``[T, L, n_hash_cols]``, ``pad_id`` the
    compressed pad id; the other arguments as :func:`ngram_hash`'s. ``T`` and
    ``N`` must be non-zero. The layer count is ``out.shape[1]``."""
    num_tokens = token_ids.shape[0]
    num_seqs = cu_seqlens.numel() - 1
    dead = _dead_view(dead_mask) if dead_mask is not None else None
    steps = max(0, (num_seqs - 1).bit_length())
    grid = (triton.cdiv(num_tokens, BLOCK_T), out.shape[1])
    _ngram_hash_kernel[grid](
        token_ids,
        token_ids.stride(0),
        cu_seqlens,
        cu_seqlens.stride(0),
        token_map if token_map is not None else token_ids,
        token_map.stride(0) if token_map is not None else 0,
        history if history is not None else token_ids,
        history.stride(0) if history is not None else 0,
        history.stride(1) if history is not None else 0,
        dead if dead is not None else token_ids,
        dead.stride(0) if dead is not None else 0,
        primes,
        offsets,
        multipliers,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        num_tokens,
        num_seqs,
        pad_id,
        MAX_NGRAM=max_ngram,
        N_HEADS=n_heads,
        SEARCH_STEPS=steps,
        HAS_MAP=token_map is not None,
        HAS_HISTORY=history is not None,
        HAS_DEAD=dead is not None,
        BLOCK=BLOCK_T,
        num_warps=4,
    )
    return out


def next_history(
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    layout: EngramLayout,
    *,
    history: torch.Tensor | None = None,
    dead_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """The ``history`` each sequence's next :func:`ngram_hash` call needs.

    Returns ``[N, max_ngram - 1]`` in ``token_ids``' dtype: the last
    ``max_ngram - 1`` ids of each sequence so far (this call's tokens after the
    older ``history``), oldest first, ``-1`` where there are none or the token
    was dead. ``out`` may be ``history`` itself (each program reads its row
    before writing it), so an engine can keep one persistent buffer per slot.
    """
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        check_next_history_arguments(token_ids, cu_seqlens, check_instance("layout", layout, EngramLayout), history,
                                     dead_mask, out, checks)
    # Launch, then read back: a broken rule makes every sequence empty, whose next
    # history is its history unchanged (so ``out`` = ``history`` keeps its bits).
    out = run_next_history(token_ids, checks.guard(cu_seqlens, 0), layout, history=history, dead_mask=dead_mask,
                           out=out)
    checks.run()  # the verdict, after the launch (deferred by default: validation.entry)
    return out


def run_next_history(token_ids, cu_seqlens, layout, *, history=None, dead_mask=None, out=None) -> torch.Tensor:
    """:func:`next_history`'s launch without any rule: the caller has run them
    (:func:`~kda_engram.validation.engram.check_next_history_arguments`) and guarded
    ``cu_seqlens``; the eager body of its op (:mod:`kda_engram.ops.engram`)."""
    num_seqs = cu_seqlens.numel() - 1
    hist_len = layout.max_ngram - 1
    if out is None:
        out = torch.empty((num_seqs, hist_len), dtype=token_ids.dtype, device=token_ids.device)
    if num_seqs == 0:
        return out
    dead = _dead_view(dead_mask) if dead_mask is not None else None
    _next_history_kernel[(num_seqs,)](
        token_ids,
        token_ids.stride(0),
        cu_seqlens,
        cu_seqlens.stride(0),
        history if history is not None else token_ids,
        history.stride(0) if history is not None else 0,
        history.stride(1) if history is not None else 0,
        dead if dead is not None else token_ids,
        dead.stride(0) if dead is not None else 0,
        out,
        out.stride(0),
        out.stride(1),
        HIST=hist_len,
        BLOCK_H=triton.next_power_of_2(hist_len),
        HAS_HISTORY=history is not None,
        HAS_DEAD=dead is not None,
        num_warps=1,
    )
    return out


# -- tokenizer compression --------------------------------------------------------------

_SENTINEL = "\ue000"


class CompressedTokenMap(NamedTuple):
    """``token_map``: int64 ``[vocab]`` raw -> compressed id; ``num_compressed``: the
    compressed vocabulary's size (a config's ``engram_compressed_vocab_size``)."""

    token_map: torch.Tensor
    num_compressed: int


def compression_normalizer():
    """The Engram paper's normalizer as a ``tokenizers`` pipeline: NFKC, NFD, strip
    accents, lowercase, runs of ASCII whitespace -> one space, strip, except that a
    text that is exactly one space after the collapse stays one space."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            # Keep a whitespace-only token as " " through the Strip (else it
            # would normalise to nothing and keep its own id).
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def _vocab_size(tokenizer) -> int:
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)  # transformers tokenizers


def _id_to_token(tokenizer, tid: int) -> str:
    if hasattr(tokenizer, "id_to_token"):
        tok = tokenizer.id_to_token(tid)
    else:
        tok = tokenizer.convert_ids_to_tokens(tid)
    return "" if tok is None else tok


def build_compressed_token_map(tokenizer) -> CompressedTokenMap:
    """Engram's tokenizer compression (the paper's section on tokenizer compression).

    Every id's decoded text is normalised by :func:`compression_normalizer`;
    ids whose texts normalise alike share one compressed id, numbered in the
    order they are first seen walking ids from 0. A text that decodes to an
    invalid UTF-8 fragment (containing U+FFFD: a partial byte-level token) keys
    on its token string instead, so byte pieces stay apart; a text that
    normalises to nothing keys on itself.

    ``tokenizer``: a Hugging Face ``tokenizers.Tokenizer`` (or a ``transformers``
    tokenizer, which has ``decode``, ``convert_ids_to_tokens`` and ``len``).
    Needs the ``tokenizers`` package.
    """
    norm = compression_normalizer()
    vocab = _vocab_size(tokenizer)
    key_to_new: dict[str, int] = {}
    token_map = torch.empty(vocab, dtype=torch.int64)
    for tid in range(vocab):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = _id_to_token(tokenizer, tid)
        else:
            key = norm.normalize_str(text) or text
        new = key_to_new.setdefault(key, len(key_to_new))
        token_map[tid] = new
    return CompressedTokenMap(token_map, len(key_to_new))
