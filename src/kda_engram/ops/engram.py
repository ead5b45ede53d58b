"""The Engram entry points as custom ops: the gate (whole and sharded), hashing,
the table lookup and the history cache. An ``EngramLayout`` / ``EngramTable``
crosses an op as its integer :func:`~kda_engram.ops.common.handle`."""

from typing import Optional

import torch

from ..engram.gate import engram_post_wkv as _engram_post_wkv
from ..engram.hashing import next_history as _next_history
from ..engram.hashing import ngram_hash as _ngram_hash
from ..engram.history import checkpoint_history as _checkpoint_history
from ..engram.history import gather_history as _gather_history
from ..engram.history import scatter_history as _scatter_history
from ..engram.layout import EngramLayout
from ..engram.sharded_gate import engram_gate_finish as _engram_gate_finish
from ..engram.sharded_gate import engram_gate_partials as _engram_gate_partials
from ..engram.sharded_gate import send_width
from ..engram.table import EngramTable
from ..validation.common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from ..validation.engram import check_gate_common, check_gate_scalars, check_hash_arguments, check_tp_rank
from .common import entry_checks, handle, kernel_op, resolve

Tensor = torch.Tensor

__all__ = [
    "engram_gate_finish",
    "engram_gate_partials",
    "engram_history_checkpoint",
    "engram_history_gather",
    "engram_history_scatter",
    "engram_lookup",
    "engram_post_wkv",
    "next_history",
    "ngram_hash",
]

# ------------------------------------------------------------------------ Engram gate


@kernel_op("engram_post_wkv", mutates_args=(), fake=lambda a: torch.empty_like(a.hidden_states))
def _engram_post_wkv_op(
    hidden_states: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, clamp_value: float,
    token_mask: Optional[Tensor], num_kv_tokens: Optional[int],
) -> Tensor:
    return _engram_post_wkv(hidden_states, kv, q_weight, k_weight, eps=eps, clamp_value=clamp_value,
                            token_mask=token_mask, num_kv_tokens=num_kv_tokens, check_inputs=False)


def engram_post_wkv(hidden_states, kv, q_weight, k_weight, *, eps: float, clamp_value: float = 1e-6,
                    token_mask=None, num_kv_tokens: int | None = None, check_inputs=True) -> Tensor:
    """:func:`kda_engram.engram.gate.engram_post_wkv` as an op. ``check_inputs`` as in
    the function (:func:`~kda_engram.ops.common.entry_checks`); ``False``: the host
    rules only (they read no device memory)."""
    if entry_checks(check_inputs):
        return _engram_post_wkv(hidden_states, kv, q_weight, k_weight, eps=eps, clamp_value=clamp_value,
                                token_mask=token_mask, num_kv_tokens=num_kv_tokens, check_inputs=check_inputs)
    check_gate_common(hidden_states, q_weight, k_weight, token_mask, None)
    check_gate_scalars(eps, clamp_value)
    check_tensor("kv", kv, shape=[None, (hidden_states.shape[1] + 1) * hidden_states.shape[2]], dtypes=FLOAT_DTYPES,
                 device=hidden_states.device)
    return _engram_post_wkv_op(hidden_states, kv, q_weight, k_weight, float(eps), float(clamp_value), token_mask,
                               None if num_kv_tokens is None else int(num_kv_tokens))


def _partials_fake(a):
    T, hc, dim = a.hidden_states.shape
    return torch.empty(T, send_width(dim, hc, a.tp_size, a.kv_local.dtype), dtype=a.kv_local.dtype,
                       device=a.kv_local.device)


@kernel_op("engram_gate_partials", mutates_args=(), fake=_partials_fake)
def _engram_gate_partials_op(
    hidden_states: Tensor, kv_local: Tensor, q_weight: Tensor, k_weight: Tensor, rank: int, tp_size: int,
) -> Tensor:
    return _engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, rank=rank, tp_size=tp_size,
                                 check_inputs=False)


def engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, *, rank: int, tp_size: int,
                         check_inputs=True) -> Tensor:
    """:func:`kda_engram.engram.sharded_gate.engram_gate_partials` as an op;
    ``check_inputs`` as in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        return _engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, rank=rank, tp_size=tp_size,
                                     check_inputs=check_inputs)
    check_gate_common(hidden_states, q_weight, k_weight, None, None)
    check_tp_rank(rank, tp_size)
    return _engram_gate_partials_op(hidden_states, kv_local, q_weight, k_weight, rank, tp_size)


@kernel_op("engram_gate_finish", mutates_args=(), fake=lambda a: torch.empty_like(a.hidden_states))
def _engram_gate_finish_op(
    hidden_states: Tensor, gathered: Tensor, tp_size: int, eps: float, clamp_value: float,
    token_mask: Optional[Tensor],
) -> Tensor:
    return _engram_gate_finish(hidden_states, gathered, tp_size=tp_size, eps=eps, clamp_value=clamp_value,
                               token_mask=token_mask, check_inputs=False)


def engram_gate_finish(hidden_states, gathered, *, tp_size: int, eps: float, clamp_value: float = 1e-6,
                       token_mask=None, check_inputs=True) -> Tensor:
    """:func:`kda_engram.engram.sharded_gate.engram_gate_finish` as an op;
    ``check_inputs`` as in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        return _engram_gate_finish(hidden_states, gathered, tp_size=tp_size, eps=eps, clamp_value=clamp_value,
                                   token_mask=token_mask, check_inputs=check_inputs)
    check_gate_common(hidden_states, None, None, token_mask, None, with_weights=False)
    check_gate_scalars(eps, clamp_value)
    check_tensor("gathered", gathered, shape=[None, None], dtypes=FLOAT_DTYPES, device=hidden_states.device)
    return _engram_gate_finish_op(hidden_states, gathered, int(tp_size), float(eps), float(clamp_value), token_mask)


# --------------------------------------------------------------------- Engram memory


def _hash_fake(a):
    lay = resolve(a.layout, EngramLayout)
    return torch.empty(a.token_ids.shape[0], lay.n_layers, lay.n_hash_cols, dtype=torch.int32,
                       device=a.token_ids.device)


@kernel_op("ngram_hash", mutates_args=(), fake=_hash_fake)
def _ngram_hash_op(
    token_ids: Tensor, cu_seqlens: Tensor, layout: int, history: Optional[Tensor], dead_mask: Optional[Tensor],
    token_map: Optional[Tensor], global_rows: bool,
) -> Tensor:
    return _ngram_hash(token_ids, cu_seqlens, resolve(layout, EngramLayout), history=history, dead_mask=dead_mask,
                       token_map=token_map, global_rows=global_rows, check_inputs=False)


def _layout(layout) -> EngramLayout:
    """The layout behind a handle (eager only: the functions take the object)."""
    return resolve(layout, EngramLayout) if isinstance(layout, int) else layout


def _max_ngram(layout) -> int | None:
    # A handle is not resolved here (a weakref lookup breaks a Dynamo graph); the
    # history width is then not checked on the host.
    return layout.max_ngram if isinstance(layout, EngramLayout) else None


def ngram_hash(token_ids, cu_seqlens, layout, *, history=None, dead_mask=None, token_map=None,
               global_rows: bool = False, check_inputs=True) -> Tensor:
    """:func:`kda_engram.engram.hashing.ngram_hash` as an op; ``layout`` (an
    ``EngramLayout`` or its :func:`handle`) travels as a handle. Call it once
    eagerly before a CUDA-graph capture: the layout's device arrays are copied to
    the device on first use. ``check_inputs`` as in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        return _ngram_hash(token_ids, cu_seqlens, _layout(layout), history=history, dead_mask=dead_mask,
                           token_map=token_map, global_rows=global_rows, check_inputs=check_inputs)
    check_hash_arguments(token_ids, cu_seqlens, _max_ngram(layout), 0, token_map, history, dead_mask, None)
    return _ngram_hash_op(token_ids, cu_seqlens, handle(layout), history, dead_mask, token_map, bool(global_rows))


def _next_history_fake(a):
    lay = resolve(a.layout, EngramLayout)
    return torch.empty(a.cu_seqlens.shape[0] - 1, lay.max_ngram - 1, dtype=a.token_ids.dtype,
                       device=a.token_ids.device)


@kernel_op("next_history", mutates_args=(), fake=_next_history_fake)
def _next_history_op(
    token_ids: Tensor, cu_seqlens: Tensor, layout: int, history: Optional[Tensor], dead_mask: Optional[Tensor],
) -> Tensor:
    return _next_history(token_ids, cu_seqlens, resolve(layout, EngramLayout), history=history, dead_mask=dead_mask,
                         check_inputs=False)


def next_history(token_ids, cu_seqlens, layout, *, history=None, dead_mask=None, check_inputs=True) -> Tensor:
    """:func:`kda_engram.engram.hashing.next_history` as an op (a new tensor: the
    in-place ``out=history`` form is :func:`engram_history_scatter`'s job);
    ``check_inputs`` as in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        return _next_history(token_ids, cu_seqlens, _layout(layout), history=history, dead_mask=dead_mask,
                             check_inputs=check_inputs)
    check_hash_arguments(token_ids, cu_seqlens, _max_ngram(layout), 0, None, history, dead_mask, None)
    return _next_history_op(token_ids, cu_seqlens, handle(layout), history, dead_mask)


def _lookup_fake(a):
    tab = resolve(a.table, EngramTable)
    cols = tab.n_local_cols if a.local else tab.n_cols
    return torch.empty(a.rows.shape[0], cols, tab.head_dim, dtype=tab.out_dtype, device=tab.device)


@kernel_op("engram_lookup", mutates_args=(), fake=_lookup_fake)
def _engram_lookup_op(rows: Tensor, table: int, local: bool) -> Tensor:
    tab = resolve(table, EngramTable)
    if local:
        return tab.lookup_local(rows, check_inputs=False)
    return tab.lookup(rows, check_inputs=False)


def engram_lookup(rows, table, *, local: bool = False, check_inputs=True) -> Tensor:
    """:meth:`EngramTable.lookup` (``local=False``: all columns, zeros where other
    ranks own them) or :meth:`EngramTable.lookup_local` as an op; ``rows [T, n_cols]``;
    ``table`` an ``EngramTable`` or its :func:`handle`; ``check_inputs`` as in
    :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        tab = resolve(table, EngramTable) if isinstance(table, int) else table
        if not isinstance(tab, EngramTable):
            raise TypeError(f"table: expected an EngramTable or its handle, got {type(table).__name__}")
        return (tab.lookup_local if local else tab.lookup)(rows, check_inputs=check_inputs)
    check_tensor("rows", rows, shape=[None, None], dtypes=INDEX_DTYPES)
    return _engram_lookup_op(rows, handle(table), bool(local))


# ------------------------------------------------------------ Engram history cache


@kernel_op("engram_history_gather", mutates_args=(),
           fake=lambda a: torch.empty(a.slot_indices.shape[0], a.cache.shape[1], dtype=a.cache.dtype,
                                      device=a.cache.device))
def _engram_history_gather_op(cache: Tensor, slot_indices: Tensor, has_initial_state: Optional[Tensor]) -> Tensor:
    return _gather_history(cache, slot_indices, has_initial_state, check_inputs=False)


def engram_history_gather(cache, slot_indices, has_initial_state=None, *, check_inputs=True) -> Tensor:
    """:func:`kda_engram.engram.history.gather_history` as an op; ``check_inputs`` as
    in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        return _gather_history(cache, slot_indices, has_initial_state, check_inputs=check_inputs)
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES)
    check_tensor("slot_indices", slot_indices, shape=[None], dtypes=INDEX_DTYPES, device=cache.device)
    return _engram_history_gather_op(cache, slot_indices, has_initial_state)


@kernel_op("engram_history_scatter", mutates_args=("cache",), fake=lambda a: None)
def _engram_history_scatter_op(cache: Tensor, slot_indices: Tensor, history: Tensor) -> None:
    _scatter_history(cache, slot_indices, history, check_inputs=False)


def engram_history_scatter(cache, slot_indices, history, *, check_inputs=True) -> None:
    """:func:`kda_engram.engram.history.scatter_history` as an op (``cache``
    mutated); ``check_inputs`` as in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        _scatter_history(cache, slot_indices, history, check_inputs=check_inputs)
        return
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES)
    check_tensor("history", history, shape=[slot_indices.shape[0], cache.shape[1]], dtypes=INDEX_DTYPES,
                 device=cache.device)
    _engram_history_scatter_op(cache, slot_indices, history)


@kernel_op("engram_history_checkpoint", mutates_args=("cache",), fake=lambda a: None)
def _engram_history_checkpoint_op(
    token_ids: Tensor, cu_seqlens: Tensor, history: Optional[Tensor], dead_mask: Optional[Tensor],
    checkpoint_offsets: Tensor, checkpoint_indices: Tensor, cache: Tensor,
) -> None:
    _checkpoint_history(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices, cache,
                        check_inputs=False)


def engram_history_checkpoint(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices,
                              cache, *, check_inputs=True) -> None:
    """:func:`kda_engram.engram.history.checkpoint_history` as an op (``cache``
    mutated); ``check_inputs`` as in :func:`engram_post_wkv`."""
    if entry_checks(check_inputs):
        _checkpoint_history(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices, cache,
                            check_inputs=check_inputs)
        return
    check_tensor("token_ids", token_ids, shape=[None], dtypes=INDEX_DTYPES)
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES, device=token_ids.device)
    _engram_history_checkpoint_op(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices,
                                  cache)
