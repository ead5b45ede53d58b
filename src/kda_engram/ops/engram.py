"""The Engram entry points as custom ops: the gate (whole and sharded), hashing,
the table lookup and the history cache. Each op and its Python wrapper are made
from the entry point's own signature (:class:`~kda_engram.ops.common.EntryOp`): the
host rules are the entry point's validation function, the eager body its launch
without rules (``run_*``). An ``EngramLayout`` / ``EngramTable`` crosses an op as
its integer :func:`~kda_engram.ops.common.handle`."""

import torch

from ..engram.gate import engram_post_wkv as _engram_post_wkv
from ..engram.gate import run_engram_post_wkv
from ..engram.hashing import run_next_history, run_ngram_hash
from ..engram.hashing import next_history as _next_history
from ..engram.hashing import ngram_hash as _ngram_hash
from ..engram.history import checkpoint_history as _checkpoint_history
from ..engram.history import gather_history as _gather_history
from ..engram.history import run_checkpoint_history, run_gather_history, run_scatter_history
from ..engram.history import scatter_history as _scatter_history
from ..engram.layout import EngramLayout
from ..engram.sharded_gate import engram_gate_finish as _engram_gate_finish
from ..engram.sharded_gate import engram_gate_partials as _engram_gate_partials
from ..engram.sharded_gate import run_engram_gate_finish, run_engram_gate_partials, send_width
from ..engram.table import EngramTable, run_engram_lookup
from ..engram.table import engram_lookup as _engram_lookup
from ..validation.engram import (
    check_gate_finish_arguments,
    check_gate_partials_arguments,
    check_history_checkpoint,
    check_history_gather,
    check_history_scatter,
    check_next_history_arguments,
    check_ngram_hash_arguments,
    check_post_wkv_arguments,
    check_table_lookup,
)
from .common import EntryOp, resolve

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

#: The gate entry points' launch overrides (tuning only, Python ints and bools) and
#: ``out`` (an op allocates its outputs: an output cannot alias an input) stay on
#: the host.
_GATE_HOST_ONLY = ("out", "chunk", "num_warps")


def _known(name: str, value, cls):
    """The object behind an argument that crosses as a handle, for the host rules:
    ``value`` itself, the object its handle names, or None while ``torch.compile``
    traces (a registry lookup would break the graph; the rules that need the object
    are then skipped, :mod:`kda_engram.validation.engram`)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an {cls.__name__} or its handle, got {type(value).__name__}")
    return None if torch.compiler.is_compiling() else resolve(value, cls)


def _no_value(run):
    """An eager body for an op that only mutates (its entry point returns the cache:
    an op cannot return an alias of an input)."""
    def body(a):
        run(**vars(a))
    return body


def _the_cache(a, value):
    """What the entry points that write a cache return: the cache."""
    return a["cache"]


# ------------------------------------------------------------------------ Engram gate


def _post_wkv_rules(a):
    """:func:`~kda_engram.engram.gate.engram_post_wkv`'s host rules (no device read)."""
    check_post_wkv_arguments(a["hidden_states"], a["kv"], a["q_weight"], a["k_weight"], a["eps"], a["clamp_value"],
                             a["token_mask"], a["num_kv_tokens"], None)
    a["eps"], a["clamp_value"] = float(a["eps"]), float(a["clamp_value"])
    a["num_kv_tokens"] = None if a["num_kv_tokens"] is None else int(a["num_kv_tokens"])


engram_post_wkv = EntryOp(
    "engram_post_wkv", _engram_post_wkv, host_only=(*_GATE_HOST_ONLY, "tokens", "l2_hints", "programs"),
    returns="Tensor", rules=_post_wkv_rules, run=lambda a: run_engram_post_wkv(**vars(a)),
    fake=lambda a: torch.empty_like(a.hidden_states),
    doc=""":func:`kda_engram.engram.gate.engram_post_wkv` as an op (its signature
    less ``out`` and the launch overrides). ``check_inputs`` as in the function
    (:class:`~kda_engram.ops.common.EntryOp`); ``False`` runs the host rules only
    (they read no device memory).""",
).function


def _partials_rules(a):
    """:func:`~kda_engram.engram.sharded_gate.engram_gate_partials`' host rules."""
    check_gate_partials_arguments(a["hidden_states"], a["kv_local"], a["q_weight"], a["k_weight"], a["rank"],
                                  a["tp_size"], None)


def _partials_fake(a):
    T, hc, dim = a.hidden_states.shape
    return torch.empty(T, send_width(dim, hc, a.tp_size, a.kv_local.dtype), dtype=a.kv_local.dtype,
                       device=a.kv_local.device)


engram_gate_partials = EntryOp(
    "engram_gate_partials", _engram_gate_partials, host_only=(*_GATE_HOST_ONLY, "tokens"), returns="Tensor",
    rules=_partials_rules, run=lambda a: run_engram_gate_partials(**vars(a)), fake=_partials_fake,
    doc=""":func:`kda_engram.engram.sharded_gate.engram_gate_partials` as an op (its
    signature less ``out`` and the launch overrides); ``check_inputs`` as in
    :func:`engram_post_wkv`.""",
).function


def _finish_rules(a):
    """:func:`~kda_engram.engram.sharded_gate.engram_gate_finish`'s host rules."""
    check_gate_finish_arguments(a["hidden_states"], a["gathered"], a["tp_size"], a["eps"], a["clamp_value"],
                                a["token_mask"], None)
    a["tp_size"], a["eps"], a["clamp_value"] = int(a["tp_size"]), float(a["eps"]), float(a["clamp_value"])


engram_gate_finish = EntryOp(
    "engram_gate_finish", _engram_gate_finish, host_only=_GATE_HOST_ONLY, returns="Tensor", rules=_finish_rules,
    run=lambda a: run_engram_gate_finish(**vars(a)), fake=lambda a: torch.empty_like(a.hidden_states),
    doc=""":func:`kda_engram.engram.sharded_gate.engram_gate_finish` as an op (its
    signature less ``out`` and the launch overrides); ``check_inputs`` as in
    :func:`engram_post_wkv`.""",
).function


# --------------------------------------------------------------------- Engram memory


def _hash_rules(a):
    """:func:`~kda_engram.engram.hashing.ngram_hash`'s host rules."""
    layout = _known("layout", a["layout"], EngramLayout)
    check_ngram_hash_arguments(a["token_ids"], a["cu_seqlens"], layout, a["token_map"], a["history"], a["dead_mask"],
                               a["global_rows"], None, None)
    a["global_rows"] = bool(a["global_rows"])


def _hash_fake(a):
    lay = resolve(a.layout, EngramLayout)
    return torch.empty(a.token_ids.shape[0], lay.n_layers, lay.n_hash_cols, dtype=torch.int32,
                       device=a.token_ids.device)


ngram_hash = EntryOp(
    "ngram_hash", _ngram_hash, host_only=("out",), handles={"layout": EngramLayout}, returns="Tensor",
    rules=_hash_rules, run=lambda a: run_ngram_hash(**vars(a)), fake=_hash_fake,
    doc=""":func:`kda_engram.engram.hashing.ngram_hash` as an op (its signature less
    ``out``); ``layout`` (an ``EngramLayout`` or its :func:`handle`) travels as a
    handle. Call it once eagerly before a CUDA-graph capture: the layout's device
    arrays are copied to the device on first use. ``check_inputs`` as in
    :func:`engram_post_wkv`.""",
).function


def _next_history_rules(a):
    """:func:`~kda_engram.engram.hashing.next_history`'s host rules."""
    layout = _known("layout", a["layout"], EngramLayout)
    check_next_history_arguments(a["token_ids"], a["cu_seqlens"], layout, a["history"], a["dead_mask"], None, None)


def _next_history_fake(a):
    lay = resolve(a.layout, EngramLayout)
    return torch.empty(a.cu_seqlens.shape[0] - 1, lay.max_ngram - 1, dtype=a.token_ids.dtype,
                       device=a.token_ids.device)


next_history = EntryOp(
    "next_history", _next_history, host_only=("out",), handles={"layout": EngramLayout}, returns="Tensor",
    rules=_next_history_rules, run=lambda a: run_next_history(**vars(a)), fake=_next_history_fake,
    doc=""":func:`kda_engram.engram.hashing.next_history` as an op (a new tensor: the
    in-place ``out=history`` form is :func:`engram_history_scatter`'s job);
    ``check_inputs`` as in :func:`engram_post_wkv`.""",
).function


def _lookup_rules(a):
    """:func:`~kda_engram.engram.table.engram_lookup`'s host rules."""
    check_table_lookup(_known("table", a["table"], EngramTable), a["rows"], None, a["local"], None)
    a["local"] = bool(a["local"])


def _lookup_fake(a):
    tab = resolve(a.table, EngramTable)
    cols = tab.n_local_cols if a.local else tab.n_cols
    return torch.empty(a.rows.shape[0], cols, tab.head_dim, dtype=tab.out_dtype, device=tab.device)


engram_lookup = EntryOp(
    "engram_lookup", _engram_lookup, host_only=("out",), handles={"table": EngramTable}, returns="Tensor",
    rules=_lookup_rules, run=lambda a: run_engram_lookup(**vars(a)), fake=_lookup_fake,
    doc=""":meth:`EngramTable.lookup` (``local=False``: all columns, zeros where other
    ranks own them) or :meth:`EngramTable.lookup_local` as an op
    (:func:`kda_engram.engram.table.engram_lookup`); ``rows [T, n_cols]``; ``table`` an
    ``EngramTable`` or its :func:`handle`; ``check_inputs`` as in :func:`engram_post_wkv`.""",
).function


# ------------------------------------------------------------ Engram history cache


def _gather_fake(a):
    return torch.empty(a.slot_indices.shape[0], a.cache.shape[1], dtype=a.cache.dtype, device=a.cache.device)


engram_history_gather = EntryOp(
    "engram_history_gather", _gather_history, returns="Tensor",
    rules=lambda a: check_history_gather(a["cache"], a["slot_indices"], a["has_initial_state"]),
    run=lambda a: run_gather_history(**vars(a)), fake=_gather_fake,
    doc=""":func:`kda_engram.engram.history.gather_history` as an op; ``check_inputs``
    as in :func:`engram_post_wkv`.""",
).function


engram_history_scatter = EntryOp(
    "engram_history_scatter", _scatter_history, mutates_args=("cache",), returns="()",
    rules=lambda a: check_history_scatter(a["cache"], a["slot_indices"], a["history"]),
    run=_no_value(run_scatter_history), fake=lambda a: None, result=_the_cache,
    doc=""":func:`kda_engram.engram.history.scatter_history` as an op (``cache``
    mutated, and returned as the function returns it); ``check_inputs`` as in
    :func:`engram_post_wkv`.""",
).function


engram_history_checkpoint = EntryOp(
    "engram_history_checkpoint", _checkpoint_history, mutates_args=("cache",), returns="()",
    rules=lambda a: check_history_checkpoint(a["token_ids"], a["cu_seqlens"], a["history"], a["checkpoint_offsets"],
                                             a["checkpoint_indices"], a["cache"]),
    run=_no_value(run_checkpoint_history), fake=lambda a: None, result=_the_cache,
    doc=""":func:`kda_engram.engram.history.checkpoint_history` as an op (``cache``
    mutated, and returned as the function returns it); ``check_inputs`` as in
    :func:`engram_post_wkv`.""",
).function
