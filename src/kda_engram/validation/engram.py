"""Argument rules of the Engram entry points (gate, sharded gate, table, hashing).

Host rules raise at once; rules about device values queue flags on a
:class:`~kda_engram.validation.common.DeviceChecks` read back once by the entry point.
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
    check_tensor,
    value_at,
)

__all__ = [
    "check_gate_scalars",
    "check_gate_common",
    "check_column_sizes",
    "check_finite_weight",
    "check_hash_arguments",
    "check_table_rows",
]


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
                         checks: DeviceChecks | None, *, check_ids: bool = True) -> None:
    """``ngram_hash`` / ``next_history``: ``token_ids [T]``; ``cu_seqlens [N+1]``
    non-decreasing within ``[0, T]``; ``token_map [vocab]`` with compressed ids in
    ``[0, vocab)``; ``history [N, max_ngram - 1]`` (any width when
    ``layout_max_ngram`` is None); ``dead_mask [T]``. With
    ``checks``, the values are queued (ids of the live tokens and history entries
    must index the map or the compressed vocabulary)."""
    check_tensor("token_ids", token_ids, dtypes=INDEX_DTYPES)
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids: expected shape [T] (a flattened varlen batch), got {list(token_ids.shape)}")
    check_kernel_device("token_ids", token_ids)
    device = token_ids.device
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, device=device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 0, got {list(cu_seqlens.shape)}")
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
    cu = cu_seqlens.to(torch.int64)
    bad_cu = (cu[0] < 0) | (cu[-1] > num_tokens)
    if num_seqs:
        bad_cu = bad_cu | (cu[1:] < cu[:-1]).any()
    checks.add(bad_cu, f"cu_seqlens: expected non-decreasing offsets in [0, {num_tokens}] (T = token_ids.shape[0]), "
               "got first {} last {}", cu[0], cu[-1])
    if token_map is not None and token_map.numel():
        low, high = token_map.min(), token_map.max()
        checks.add((low < 0) | (high >= vocab), f"token_map: expected compressed ids in [0, {vocab}), got [{{}}, {{}}]",
                   low, high)
        vocab = token_map.numel()
    if not check_ids:
        return
    # Ids of live tokens must index the map (or the compressed vocabulary, whose
    # bound is what keeps tok * mult inside int64): masked min/max, no boolean indexing.
    big = torch.iinfo(torch.int64).max
    ids = token_ids.to(torch.int64)
    pos = torch.arange(num_tokens, device=device)
    live = (pos >= cu[0]) & (pos < cu[-1]) if num_seqs else torch.zeros_like(pos, dtype=torch.bool)
    lows = [torch.where(live, ids, big).min() if num_tokens else torch.full((), big, dtype=torch.int64, device=device)]
    highs = [torch.where(live, ids, -1).max() if num_tokens else torch.full((), -1, dtype=torch.int64, device=device)]
    if history is not None and history.numel():
        hist = history.to(torch.int64)
        lows.append(torch.where(hist >= 0, hist, big).min())
        highs.append(hist.max())
    low, high = torch.stack(lows).min(), torch.stack(highs).max()
    what = "token_map's size" if token_map is not None else "layout.compressed_vocab_size"
    checks.add((low < 0) | (high >= vocab),
               f"token_ids: expected ids in [0, {vocab}) ({what}; history may also hold -1), got [{{}}, {{}}]",
               low, high)


def check_table_rows(rows, n_cols: int, allowed_devices, bounds, checks: DeviceChecks | None) -> None:
    """``EngramTable`` lookups: ``rows [T, n_cols]`` int32/int64 on one of
    ``allowed_devices``; with ``checks``, every non-negative entry of column ``c``
    lies in ``[starts[c], ends[c])`` (queued; negative = no row), where
    ``bounds(device)`` gives the ``(starts, ends)`` column bounds on ``rows``' device."""
    check_tensor("rows", rows, dtypes=INDEX_DTYPES)
    if rows.dim() != 2 or rows.shape[1] != n_cols:
        raise ValueError(f"rows: expected shape [T, {n_cols}] (all hash columns), got {list(rows.shape)}")
    if rows.device not in allowed_devices:
        want = " or ".join(sorted(str(d) for d in allowed_devices))
        raise ValueError(f"rows: expected a tensor on {want}, got one on {rows.device}")
    if checks is None or rows.numel() == 0:
        return
    starts, ends = bounds(rows.device)
    bad = ((rows >= 0) & ((rows < starts) | (rows >= ends))).reshape(-1)
    first = torch.argmax(bad.to(torch.int8))
    t, c = torch.div(first, n_cols, rounding_mode="floor"), first % n_cols
    checks.add(bad.any(), "rows: entry [{}, {}] = {} lies outside hash column {}'s table [{}, {})",
               t, c, value_at(rows.reshape(-1), first), c, value_at(starts.reshape(-1), c),
               value_at(ends.reshape(-1), c))
