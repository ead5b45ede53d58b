"""Argument rules of the Engram entry points (gate, sharded gate, table, hashing,
history cache).

Host rules raise at once; rules about device values queue flags on a
:class:`~kda_engram.validation.common.DeviceChecks` read back once by the entry point.
Each entry point's host rules are one function here, which the entry point and its
op's Python wrapper (:mod:`kda_engram.ops.engram`, ``check_inputs=False``) both call.
An ``EngramLayout`` / ``EngramTable`` argument is read by its attributes (this module
sits below the kernel families); ``None`` stands for one known only by its op handle
(while ``torch.compile`` traces, where a registry lookup would break the graph): the
rules that need it are then skipped.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_kernel_device,
    check_real,
    check_index_range,
    check_index_values,
    check_int,
    check_same_dtype,
    check_tensor,
    value_at,
)

__all__ = [
    "check_gate_scalars",
    "check_tp_rank",
    "check_gate_common",
    "check_post_wkv_arguments",
    "check_tp_slice",
    "check_gate_partials_arguments",
    "check_gate_finish_arguments",
    "check_layer_gate",
    "pair_elems",
    "send_width",
    "check_column_sizes",
    "check_finite_weight",
    "check_hash_arguments",
    "check_ngram_hash_arguments",
    "check_next_history_arguments",
    "check_table_rows",
    "check_table_lookup",
    "check_rows_device",
    "lookup_devices",
    "check_history_cache",
    "check_history_cache_values",
    "check_history_values",
    "check_history_gather",
    "check_history_scatter",
    "check_history_checkpoint",
    "check_checkpoint_offsets",
    "check_engram_batch",
    "check_token_offsets",
]

#: Hash rows are written as int32: a layout's rows must fit.
MAX_HASH_ROWS = 2**31


def check_tp_rank(rank, tp_size) -> None:
    """``tp_size``: an int >= 1; ``rank``: an int in ``[0, tp_size)`` (bools refused:
    ``rank=True`` is a bug, not rank 1)."""
    check_int("tp_size", tp_size, low=1)
    check_int("rank", rank)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank: expected an int in [0, {tp_size}), got {rank!r}")


def check_gate_scalars(eps, clamp_value) -> None:
    """``eps`` (added to both mean squares before the rsqrt) and ``clamp_value``
    (lower bound on ``|dot|`` under the square root): finite numbers >= 0."""
    check_real("eps", eps, sign="non-negative")
    check_real("clamp_value", clamp_value, sign="non-negative")


def check_gate_common(hidden_states, q_weight, k_weight, token_mask, out, *, with_weights: bool = True):
    """Tensors shared by the single-rank and the sharded gate (``with_weights=False``:
    the entry point takes no weights). Returns ``(T, hc, dim)``."""
    check_tensor("hidden_states", hidden_states, shape=(None, None, None), dtypes=FLOAT_DTYPES)
    check_kernel_device("hidden_states", hidden_states)
    T, hc, dim = hidden_states.shape
    if hc < 1 or dim < 1:
        raise ValueError(f"hidden_states: expected hc >= 1 and dim >= 1, got shape {list(hidden_states.shape)}")
    device = hidden_states.device
    if with_weights:
        check_tensor("q_weight", q_weight, shape=(hc, dim), dtypes=FLOAT_DTYPES, device=device)
        check_tensor("k_weight", k_weight, shape=(hc, dim), dtypes=FLOAT_DTYPES, device=device)
    if token_mask is not None:
        check_tensor("token_mask", token_mask, shape=(T,), dtypes=(torch.bool,), device=device)
    if out is not None:
        check_tensor("out", out, shape=(T, hc, dim), dtypes=(hidden_states.dtype,), device=device)
    return T, hc, dim


def check_post_wkv_arguments(hidden_states, kv, q_weight, k_weight, eps, clamp_value, token_mask, num_kv_tokens,
                             out) -> tuple[int, int, int]:
    """:func:`~kda_engram.engram.gate.engram_post_wkv`'s host rules (no device read):
    the gate's tensors, ``kv [T_kv, (hc+1)*dim]`` in hidden's dtype, the scalars,
    ``0 <= num_kv_tokens <= T_kv``. Returns ``(T, hc, dim)``."""
    T, hc, dim = check_gate_common(hidden_states, q_weight, k_weight, token_mask, out)
    check_tensor("kv", kv, shape=(None, (hc + 1) * dim), dtypes=FLOAT_DTYPES, device=hidden_states.device)
    check_same_dtype(("hidden_states", "kv"), (hidden_states, kv))
    check_gate_scalars(eps, clamp_value)
    check_int("num_kv_tokens", num_kv_tokens, low=0, high=kv.shape[0], allow_none=True)
    return T, hc, dim


def pair_elems(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that store one fp32 pair (8 bytes): 4 for bf16/fp16, 2 for fp32."""
    size = torch.empty((), dtype=dtype).element_size()
    if 8 % size:
        raise TypeError(f"kv: element size {size} cannot pack fp32 pairs; expected bf16, fp16 or fp32")
    return 8 // size


def send_width(dim: int, hc: int, tp_size: int, dtype: torch.dtype) -> int:
    """Elements per ``send`` row of the dim-sharded gate
    (:mod:`kda_engram.engram.sharded_gate`): ``dim / tp_size`` value columns +
    ``pair_elems * hc``."""
    return dim // tp_size + pair_elems(dtype) * hc


def check_tp_slice(dim: int, tp_size, dtype: torch.dtype, name: str = "kv_local") -> int:
    """``tp_size`` a positive int dividing ``dim``, and the slice ``dim / tp_size`` of
    ``dtype`` a multiple of 4 bytes (the fp32 partial sums follow it in a ``send``
    row). Returns the slice width."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: expected a positive int, got {tp_size!r}")
    if dim % tp_size:
        raise ValueError(f"hidden_states: dim {dim} is not divisible by tp_size {tp_size}")
    width = dim // tp_size
    size = torch.empty((), dtype=dtype).element_size()
    if (width * size) % 4:
        raise ValueError(
            f"{name}: the slice width dim/tp_size = {width} of {str(dtype).replace('torch.', '')} is {width * size} bytes; "
            "the fp32 partial sums that follow it need a multiple of 4 bytes (an even width for 16-bit dtypes)"
        )
    return width


def check_gate_partials_arguments(hidden_states, kv_local, q_weight, k_weight, rank, tp_size, out) -> None:
    """:func:`~kda_engram.engram.sharded_gate.engram_gate_partials`' host rules (no
    device read): the gate's tensors, the rank, the slice, ``kv_local [T,
    (hc+1)*width]`` in hidden's dtype, ``out [T, send_width]`` with a unit last stride."""
    T, hc, dim = check_gate_common(hidden_states, q_weight, k_weight, None, None)
    check_tp_rank(rank, tp_size)
    width = check_tp_slice(dim, tp_size, kv_local.dtype if isinstance(kv_local, torch.Tensor) else hidden_states.dtype)
    check_tensor("kv_local", kv_local, shape=(T, (hc + 1) * width), dtypes=FLOAT_DTYPES, device=hidden_states.device)
    check_same_dtype(("hidden_states", "kv_local"), (hidden_states, kv_local))
    if out is not None:
        check_tensor("out", out, shape=(T, send_width(dim, hc, tp_size, kv_local.dtype)), dtypes=(kv_local.dtype,),
                     device=hidden_states.device, last_dim_contiguous=True)


def check_gate_finish_arguments(hidden_states, gathered, tp_size, eps, clamp_value, token_mask, out) -> None:
    """:func:`~kda_engram.engram.sharded_gate.engram_gate_finish`'s host rules (no
    device read): hidden, the mask and ``out``, the scalars, ``gathered [tp_size*T,
    send_width]`` in hidden's dtype with a unit last stride."""
    T, hc, dim = check_gate_common(hidden_states, None, None, token_mask, out, with_weights=False)
    check_gate_scalars(eps, clamp_value)
    check_tensor("gathered", gathered, shape=(None, None), dtypes=FLOAT_DTYPES, device=hidden_states.device)
    check_same_dtype(("hidden_states", "gathered"), (hidden_states, gathered))
    check_tp_slice(dim, tp_size, gathered.dtype, "gathered")
    want = (tp_size * T, send_width(dim, hc, tp_size, gathered.dtype))
    if tuple(gathered.shape) != want:
        raise ValueError(
            f"gathered: expected shape [tp_size*T, dim/tp_size + pair_elems*hc] = {list(want)}, got {list(gathered.shape)}"
        )
    check_tensor("gathered", gathered, last_dim_contiguous=True)


def check_layer_gate(hidden_states, q_weight, k_weight, eps, clamp_value, tp_size: int | None) -> None:
    """The gate kernels' host rules that a serving layer answers once per step, its
    ``kv`` being its own ``wkv`` output (so ``kv``, ``kv_local`` and the gathered
    partials are not checked): ``hidden_states`` on a kernel device (the layer has
    checked its shape and its float dtype against the weights), ``q_weight`` and
    ``k_weight [hc, dim]`` in its dtype on its device, the scalars, and with
    ``tp_size`` (the dim-sharded gate) the slice ``dim / tp_size``."""
    check_kernel_device("hidden_states", hidden_states)
    _, hc, dim = hidden_states.shape
    check_tensor("q_weight", q_weight, shape=(hc, dim), dtypes=(hidden_states.dtype,), device=hidden_states.device)
    check_tensor("k_weight", k_weight, shape=(hc, dim), dtypes=(hidden_states.dtype,), device=hidden_states.device)
    check_gate_scalars(eps, clamp_value)
    if tp_size is not None:
        check_tp_slice(dim, tp_size, hidden_states.dtype)


def check_column_sizes(column_sizes: Sequence[int]) -> list[int]:
    """Rows of every hash column's table: a non-empty sequence of ints >= 1 (a float
    such as 5.5 is a ``TypeError``, not truncated)."""
    try:
        sizes = list(column_sizes)
    except TypeError:
        raise TypeError(f"column_sizes: expected a sequence of ints, got {type(column_sizes).__name__}") from None
    for s in sizes:
        integral = isinstance(s, numbers.Integral) or (isinstance(s, torch.Tensor) and s.dim() == 0
                                                        and not s.dtype.is_floating_point and s.dtype != torch.bool)
        if isinstance(s, bool) or not integral:
            raise TypeError(f"column_sizes: expected ints, got {s!r} ({type(s).__name__}) in {sizes}")
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"column_sizes: expected positive sizes, one per hash column, got {sizes}")
    return sizes


def check_finite_weight(name: str, weight: torch.Tensor, rows: slice, chunk_rows: int) -> None:
    """Every value of ``weight[rows]`` is finite (a table row must not turn NaN into
    a number, as fp8 quantisation would). Reads one flag back per chunk of rows."""
    for a in range(rows.start, rows.stop, chunk_rows):
        part = weight[a: min(rows.stop, a + chunk_rows)]
        if not bool(torch.isfinite(part).all()):
            raise ValueError(f"{name}: expected finite values, got NaN or inf in rows [{a}, {a + part.shape[0]})")


def check_hash_arguments(token_ids, cu_seqlens, layout_max_ngram: int | None, vocab: int, token_map, history, dead_mask,
                         checks: DeviceChecks | None, *, check_ids: bool = True, batch_checked: bool = False) -> None:
    """``ngram_hash`` / ``next_history``: ``token_ids [T]``; ``cu_seqlens [N+1]``
    non-decreasing within ``[0, T]``; ``token_map [vocab]`` with compressed ids in
    ``[0, vocab)``; ``history [N, max_ngram - 1]`` (any width when
    ``layout_max_ngram`` is None); ``dead_mask [T]``. With
    ``checks``, the values are queued (ids of the live tokens and history entries
    must index the map or the compressed vocabulary). ``batch_checked``: the caller
    (the Engram hash step) has checked ``token_ids``' form and ``cu_seqlens``, its form
    and its queued rules (:func:`check_engram_batch`); they are not checked again."""
    if not batch_checked:
        check_tensor("token_ids", token_ids, dtypes=INDEX_DTYPES)
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids: expected shape [T] (a flattened varlen batch), got {list(token_ids.shape)}")
        check_kernel_device("token_ids", token_ids)
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, device=token_ids.device)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 0, got {list(cu_seqlens.shape)}")
    device = token_ids.device
    num_seqs, num_tokens = cu_seqlens.numel() - 1, token_ids.shape[0]
    if token_map is not None:
        check_tensor("token_map", token_map, dtypes=INDEX_DTYPES, device=device)
        if token_map.dim() != 1:
            raise ValueError(f"token_map: expected shape [vocab], got {list(token_map.shape)}")
    if history is not None:
        width = None if layout_max_ngram is None else layout_max_ngram - 1
        check_tensor("history", history, shape=[num_seqs, width], dtypes=INDEX_DTYPES, device=device)
    if dead_mask is not None:
        check_tensor("dead_mask", dead_mask, shape=[num_tokens], dtypes=(torch.bool, torch.uint8, torch.int8),
                     device=device)
    if checks is None:
        return
    if not batch_checked:
        check_token_offsets(checks, "cu_seqlens", cu_seqlens, num_tokens, covers_all=False)
    if token_map is not None and token_map.numel():
        low, high = token_map.min(), token_map.max()
        checks.add((low < 0) | (high >= vocab), f"token_map: expected compressed ids in [0, {vocab}), got [{{}}, {{}}]",
                   low, high)
        vocab = token_map.numel()
    what = "token_map's size" if token_map is not None else "layout.compressed_vocab_size"
    if history is not None:
        check_history_values(checks, "history", history, vocab if check_ids else None, what)
    if not check_ids:
        return
    # Ids of live tokens must index the map (or the compressed vocabulary, whose
    # bound is what keeps tok * mult inside int64): masked min/max, no boolean indexing.
    big = torch.iinfo(torch.int64).max
    cu = cu_seqlens.to(torch.int64)
    ids = token_ids.to(torch.int64)
    pos = torch.arange(num_tokens, device=device)
    live = (pos >= cu[0]) & (pos < cu[-1]) if num_seqs else torch.zeros_like(pos, dtype=torch.bool)
    lows = [torch.where(live, ids, big).min() if num_tokens else torch.full((), big, dtype=torch.int64, device=device)]
    highs = [torch.where(live, ids, -1).max() if num_tokens else torch.full((), -1, dtype=torch.int64, device=device)]
    low, high = torch.stack(lows).min(), torch.stack(highs).max()
    checks.add((low < 0) | (high >= vocab), f"token_ids: expected ids in [0, {vocab}) ({what}), got [{{}}, {{}}]",
               low, high)


def check_history_values(checks: DeviceChecks, name: str, history: torch.Tensor, vocab: int | None, what: str,
                         live: torch.Tensor | None = None) -> None:
    """A hash history's entries (queued): ids in ``[0, vocab)`` or ``-1`` ("none",
    read as pad); ``vocab`` None: only ``>= -1`` (:func:`next_history` knows no
    vocabulary). ``live`` (bool, broadcast against ``history``): the entries that
    are read; the others are not checked."""
    if not history.numel():
        return
    hist = history.to(torch.int64)
    if live is None:
        low, high = hist.min(), hist.max()
    else:
        low = torch.where(live, hist, -1).min()
        high = torch.where(live, hist, -1).max()
    if vocab is None:
        checks.add(low < -1, f"{name}: expected ids >= 0 or -1 (none), got {{}}", low)
        return
    checks.add((low < -1) | (high >= vocab),
               f"{name}: expected ids in [0, {vocab}) ({what}) or -1 (none), got [{{}}, {{}}]", low, high)


def check_history_cache_values(checks: DeviceChecks, cache: torch.Tensor, slot_indices: torch.Tensor,
                               has_initial_state: torch.Tensor, compressed_vocab: int, token_map) -> None:
    """The history rows a hash step reads (queued): row ``slot_indices[n]`` of
    ``cache`` where it is in range and ``has_initial_state[n]``, each entry an id
    (``[0, token_map size)`` with a map, else ``[0, compressed_vocab)``) or -1, as
    :func:`~kda_engram.engram.hashing.ngram_hash` checks a ``history`` it is given
    (the slots' own range is :func:`check_engram_batch`'s)."""
    slots, rows = slot_indices.to(torch.int64), cache.shape[0]
    if rows == 0 or slots.numel() == 0:
        return
    vocab, what = ((token_map.shape[0], "token_map's size") if token_map is not None else
                   (compressed_vocab, "layout.compressed_vocab_size"))
    read = (slots >= 0) & (slots < rows) & has_initial_state.to(torch.bool)
    check_history_values(checks, "history_cache", cache[slots.clamp(0, rows - 1)], vocab,
                         f"{what}; the rows this step reads", live=read[:, None])


def check_ngram_hash_arguments(token_ids, cu_seqlens, layout, token_map, history, dead_mask, global_rows, out,
                               checks: DeviceChecks | None, *, batch_checked: bool = False) -> None:
    """:func:`~kda_engram.engram.hashing.ngram_hash`'s rules: :func:`check_hash_arguments`
    against ``layout`` (its ``max_ngram`` and ``compressed_vocab_size``), the layout's
    rows fitting the int32 output (``global_rows``: all layers' tables), ``out [T,
    n_layers, n_hash_cols]`` int32. ``layout=None`` (a handle): the rules that need
    it are skipped, and so is the id range (``checks`` wants the layout).
    ``batch_checked``: as in :func:`check_hash_arguments`."""
    known = layout is not None
    check_hash_arguments(token_ids, cu_seqlens, layout.max_ngram if known else None,
                         layout.compressed_vocab_size if known else 0, token_map, history, dead_mask, checks,
                         check_ids=known, batch_checked=batch_checked)
    if not known:
        return
    rows = layout.total_rows(global_rows=global_rows)
    if rows >= MAX_HASH_ROWS:
        raise ValueError(f"layout: {rows} rows do not fit the int32 output")
    if out is not None:
        check_tensor("out", out, shape=[token_ids.shape[0], layout.n_layers, layout.n_hash_cols],
                     dtypes=(torch.int32,), device=token_ids.device)


def check_next_history_arguments(token_ids, cu_seqlens, layout, history, dead_mask, out,
                                 checks: DeviceChecks | None) -> None:
    """:func:`~kda_engram.engram.hashing.next_history`'s rules: :func:`check_hash_arguments`
    without the id range (ids are only copied, in whatever space the caller hashes
    them), ``out [N, max_ngram - 1]`` int32/int64. ``layout=None``: as in
    :func:`check_ngram_hash_arguments`."""
    max_ngram = layout.max_ngram if layout is not None else None
    check_hash_arguments(token_ids, cu_seqlens, max_ngram, 0, None, history, dead_mask, checks, check_ids=False)
    if out is not None:
        width = None if max_ngram is None else max_ngram - 1
        check_tensor("out", out, shape=[cu_seqlens.numel() - 1, width], dtypes=INDEX_DTYPES, device=token_ids.device)


def check_table_rows(rows, n_cols: int | None, allowed_devices, bounds, checks: DeviceChecks | None) -> None:
    """``EngramTable`` lookups: ``rows [T, n_cols]`` int32/int64 on one of
    ``allowed_devices``; with ``checks``, every non-negative entry of column ``c``
    lies in ``[starts[c], ends[c])`` (queued; negative = no row), where
    ``bounds(device)`` gives the ``(starts, ends)`` column bounds on ``rows``' device.
    ``n_cols`` / ``allowed_devices`` None: any width / device (the table is unknown)."""
    check_tensor("rows", rows, dtypes=INDEX_DTYPES)
    if rows.dim() != 2 or (n_cols is not None and rows.shape[1] != n_cols):
        raise ValueError(f"rows: expected shape [T, {'*' if n_cols is None else n_cols}] (all hash columns), "
                         f"got {list(rows.shape)}")
    if allowed_devices is not None:
        check_rows_device(rows.device, allowed_devices)
    if checks is None or rows.numel() == 0:
        return
    starts, ends = bounds(rows.device)
    bad = ((rows >= 0) & ((rows < starts) | (rows >= ends))).reshape(-1)
    first = torch.argmax(bad.to(torch.int8))
    t, c = torch.div(first, n_cols, rounding_mode="floor"), first % n_cols
    checks.add(bad.any(), "rows: entry [{}, {}] = {} lies outside hash column {}'s table [{}, {})",
               t, c, value_at(rows.reshape(-1), first), c, value_at(starts.reshape(-1), c),
               value_at(ends.reshape(-1), c))


def check_rows_device(device: torch.device, allowed_devices) -> None:
    """Table rows on ``device`` are read by a table on one of ``allowed_devices``
    (:meth:`lookup_devices`)."""
    if device not in allowed_devices:
        want = " or ".join(sorted(str(d) for d in allowed_devices))
        raise ValueError(f"rows: expected a tensor on {want}, got one on {device}")


def lookup_devices(table) -> set:
    """Where ``table``'s lookups take their rows: its device, and the host too for a
    staged host-resident table."""
    return {table.device, torch.device("cpu")} if table.host_mode == "staged" else {table.device}


def check_table_lookup(table, rows, out, local: bool, checks: DeviceChecks | None) -> None:
    """:func:`~kda_engram.engram.table.engram_lookup`'s rules (the table's ``lookup``
    and ``lookup_local``): :func:`check_table_rows` (rows on the table's device, or
    also on the host for a staged host-resident table), ``out [T, n_cols or
    n_local_cols, head_dim]`` in the table's ``out_dtype`` on its device with a unit
    last stride. ``table=None`` (a handle): the rows' form only."""
    if table is None:
        check_table_rows(rows, None, None, None, None)
        return
    check_table_rows(rows, table.n_cols, lookup_devices(table), table.column_bounds, checks)
    if out is not None:
        width = table.n_local_cols if local else table.n_cols
        check_tensor("out", out, shape=[rows.shape[0], width, table.head_dim], dtypes=(table.out_dtype,),
                     device=table.device, last_dim_contiguous=True)


def check_history_cache(cache, slot_indices) -> None:
    """A hash-history cache ``[slots, H]`` int32/int64 and its ``slot_indices [N]``
    (int, on the cache's device)."""
    check_tensor("history_cache", cache, shape=[None, None], dtypes=INDEX_DTYPES)
    check_tensor("slot_indices", slot_indices, shape=[None], dtypes=INDEX_DTYPES, device=cache.device)


def check_history_gather(cache, slot_indices, has_initial_state) -> None:
    """:func:`~kda_engram.engram.history.gather_history`'s host rules: the cache, its
    indices, ``has_initial_state`` bool ``[N]``."""
    check_history_cache(cache, slot_indices)
    if has_initial_state is not None:
        check_tensor("has_initial_state", has_initial_state, shape=[slot_indices.shape[0]], dtypes=(torch.bool,),
                     device=cache.device)


def check_history_scatter(cache, slot_indices, history) -> None:
    """:func:`~kda_engram.engram.history.scatter_history`'s host rules: the cache, its
    indices, ``history [N, H]`` int32/int64 (``H`` the cache's width)."""
    check_history_cache(cache, slot_indices)
    check_tensor("history", history, shape=[slot_indices.shape[0], cache.shape[1]], dtypes=INDEX_DTYPES,
                 device=cache.device)


def check_history_checkpoint(token_ids, cu_seqlens, history, checkpoint_offsets, checkpoint_indices, cache) -> None:
    """:func:`~kda_engram.engram.history.checkpoint_history`'s host rules:
    ``token_ids [T]``, the cache ``[slots, H]``, ``history [N, H]``, the checkpoint
    offsets and rows ``[N]`` (``N = cu_seqlens.numel() - 1``), all int on token_ids'
    device. The value rules: :func:`check_checkpoint_offsets`."""
    check_tensor("token_ids", token_ids, shape=[None], dtypes=INDEX_DTYPES)
    dev = token_ids.device
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES, device=dev)
    N = cu_seqlens.numel() - 1
    if history is not None:
        check_tensor("history", history, shape=[N, cache.shape[1]], dtypes=INDEX_DTYPES, device=dev)
    check_tensor("checkpoint_offsets", checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    check_tensor("checkpoint_indices", checkpoint_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)


def check_checkpoint_offsets(cu_seqlens, checkpoint_offsets, checkpoint_indices, slots: int) -> None:
    """The value rules of :func:`~kda_engram.engram.history.checkpoint_history` (reads
    back: one sync each): ``0 <= p <= length`` for every sequence's offset ``p``, and
    the rows of the sequences that take one (``p > 0``) in ``[0, slots)`` and distinct."""
    cu = cu_seqlens.tolist()
    for n, p in enumerate(checkpoint_offsets.tolist()):
        if p < 0 or p > cu[n + 1] - cu[n]:
            raise ValueError(f"checkpoint_offsets[{n}]: expected 0 <= p <= the sequence length "
                             f"{cu[n + 1] - cu[n]}, got {p}")
    check_index_range("checkpoint_indices", checkpoint_indices[checkpoint_offsets > 0], slots)


def check_token_offsets(checks: DeviceChecks, name: str, cu_seqlens: torch.Tensor, num_tokens: int, *,
                        covers_all: bool) -> None:
    """Queue: ``cu_seqlens [N+1]`` starts at 0 and ends at ``num_tokens``
    (``covers_all``) or lies in ``[0, num_tokens]``, and never decreases (the
    message points at the first decrease)."""
    cu = cu_seqlens.to(torch.int64)
    if covers_all:
        checks.add((cu[0] != 0) | (cu[-1] != num_tokens), f"{name}: expected offsets from 0 to T={num_tokens}, "
                   "got first {} last {}", cu[0], cu[-1])
    else:
        checks.add((cu[0] < 0) | (cu[-1] > num_tokens), f"{name}: expected offsets in [0, {num_tokens}] "
                   "(T = token_ids.shape[0]), got first {} last {}", cu[0], cu[-1])
    if cu.numel() > 1:
        drop = cu[1:] < cu[:-1]
        i = torch.argmax(drop.to(torch.int8))
        checks.add(drop.any(), f"{name}: expected non-decreasing offsets, got {name}[{{}}] = {{}} after {{}}",
                   i + 1, value_at(cu[1:], i), value_at(cu[:-1], i))


def check_engram_batch(batch, num_tokens: int, device: torch.device | None, checks: DeviceChecks | None, *,
                       history_slots: int | None = None) -> None:
    """An ``EngramBatch`` (:mod:`kda_engram.layers.engram`) of a step of
    ``num_tokens`` tokens: host rules at once; with ``checks``, the value rules
    queued: ``cu_seqlens`` from 0 to T, non-decreasing; checkpoint offsets within
    their sequence; with ``history_slots``, the history rows the step writes
    (slots and checkpoint rows) in range and distinct.

    Why one function: :meth:`EngramBatch.validate` and :func:`engram_hash_step` run
    the same rules (the step launches on guarded copies, then reads back)."""
    check_tensor("batch.cu_seqlens", batch.cu_seqlens, shape=[None], dtypes=INDEX_DTYPES, device=device)
    dev = batch.cu_seqlens.device
    N = batch.cu_seqlens.numel() - 1
    if N < 0:
        raise ValueError("batch.cu_seqlens: expected shape [N+1] with N >= 0, got [0]")
    check_tensor("batch.slot_indices", batch.slot_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    check_tensor("batch.has_initial_state", batch.has_initial_state, shape=[N], dtypes=(torch.bool,), device=dev)
    if batch.dead_mask is not None:
        check_tensor("batch.dead_mask", batch.dead_mask, shape=[num_tokens], dtypes=(torch.bool, torch.uint8, torch.int8),
                     device=dev)
    if batch.token_mask is not None:
        check_tensor("batch.token_mask", batch.token_mask, shape=[num_tokens], dtypes=(torch.bool,), device=dev)
    if (batch.checkpoint_offsets is None) != (batch.checkpoint_indices is None):
        raise ValueError("batch.checkpoint_offsets and batch.checkpoint_indices: give both or neither")
    if batch.checkpoint_offsets is not None:
        check_tensor("batch.checkpoint_offsets", batch.checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=dev)
        check_tensor("batch.checkpoint_indices", batch.checkpoint_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    if checks is None:
        return
    check_token_offsets(checks, "batch.cu_seqlens", batch.cu_seqlens, num_tokens, covers_all=True)
    rows = batch.slot_indices.to(torch.int64)
    if batch.checkpoint_offsets is not None and N:
        cu = batch.cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        offs = batch.checkpoint_offsets.to(torch.int64)
        bad = (offs < 0) | (offs > lengths)
        first = torch.argmax(bad.to(torch.int8))
        checks.add(bad.any(), "batch.checkpoint_offsets[{}]: expected 0 <= p <= the sequence length {}, got {}",
                   first, value_at(lengths, first), value_at(offs, first))
        # Only sequences that take a checkpoint claim a row.
        rows = torch.cat([rows, torch.where(offs > 0, batch.checkpoint_indices.to(torch.int64), -1)])
    if history_slots is not None:
        check_index_values(checks, "batch.slot_indices/checkpoint_indices (history rows written this step)", rows,
                           history_slots)
