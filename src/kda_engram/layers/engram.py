"""The whole Engram layer for serving: token ids in, gated residual streams out.

One Engram layer of DeepSeek-V4.1 is four steps, each a kernel of this package:

1. hash every token's n-grams (:func:`~kda_engram.engram.hashing.ngram_hash`, all
   Engram layers in one launch per model step);
2. gather and dequantise this layer's table rows (:class:`~kda_engram.engram.table.EngramTable`);
3. project them with ``wkv`` to ``hc`` keys and a value, and 4. gate them into the
   ``hc`` streams (fused or dim-sharded gate: :class:`~kda_engram.layers.engram_gate.Engram`).

Serving adds the one piece of state Engram has: the **hash history**, the last
``max_ngram - 1`` token ids of every sequence, which the n-grams of a chunk's
first tokens reach back into. It lives in a caller-owned cache ``[slots,
max_ngram - 1]`` (int32/int64, ids in the same space as ``token_ids``; ``-1`` =
none), indexed like the KDA state cache, so chunked prefill and decode continue a
sequence exactly: :func:`engram_hash_step` gathers the rows of the batch's
sequences, hashes, and writes each sequence's new history back, all on the
device. A prefix-cache checkpoint at offset ``p`` writes the history *at* ``p``
(:func:`~kda_engram.engram.history.checkpoint_history`) so a later prefill
resumes there exactly, as the KDA layer does for its recurrent state and conv
window. The cache kernels live in :mod:`kda_engram.engram.history` (re-exported
here).

Every kernel on the forward path is a ``torch.ops.kda_engram`` custom op called
without device reads (CUDA-graph capturable, ``torch.compile(fullgraph=True)``-able);
:meth:`EngramBatch.validate` reads the batch back and is for eager use.

Weights (DeepSeek-V4.1 checkpoint names, under ``layers.{layer_id}.engram.``):

======================= ============================================ =======================
name                    shape                                        notes
======================= ============================================ =======================
``embed.weight``        ``[engram_num_embeddings[l], engram_head_dim]`` fp8 e4m3 (or any float)
``embed.scale``         ``[rows, head_dim / 32]``                    ue8m0, with fp8 weights
``wkv.weight``          ``[(hc_mult + 1) * hidden_size, n_hash_cols * head_dim]``
``q_weight``            ``[hc_mult, hidden_size]``
``k_weight``            ``[hc_mult, hidden_size]``
======================= ============================================ =======================

:meth:`EngramLayer.load_weights` takes them full (unsharded); each rank keeps its
hash columns of the table and its shard of ``wkv``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .. import ops
from ..validation.common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    can_read_back,
    check_instance,
    check_kernel_device,
    check_parameters_forward_only,
    check_tensor,
)
from ..validation.entry import EntryChecks
from ..validation.engram import (check_engram_batch, check_history_cache_values, check_history_scatter,
                                 check_layer_gate, check_ngram_hash_arguments, check_rows_device, lookup_devices)
from ..engram.history import checkpoint_history, gather_history, scatter_history
from ..engram.layout import EngramLayout, config_value
from ..engram.table import EngramTable
from ..parallel import TensorParallelGroup
from .engram_gate import Engram, GateKernels

__all__ = [
    "EngramBatch",
    "EngramLayer",
    "engram_hash_step",
    "gather_history",
    "scatter_history",
    "checkpoint_history",
]


# ------------------------------------------------------------------------- batch


@dataclasses.dataclass(frozen=True)
class EngramBatch:
    """Which sequences a step's tokens belong to, for the Engram layer.

    Fields (device tensors; ``T`` tokens flattened over ``N`` sequences):

    * ``cu_seqlens`` int ``[N+1]``: offsets of every sequence, decode rows (length 1)
      included -- the hash does not care which tokens decode.
    * ``slot_indices`` int ``[N]``: the sequence's row of the history cache (negative:
      none, e.g. a padding row of a captured batch: nothing is read or written).
    * ``has_initial_state`` bool ``[N]``: false starts the sequence's n-grams from the
      pad id (a new prompt) without reading its row.
    * ``dead_mask`` ``[T]`` (optional): tokens that hash as pad and hide everything
      older (image placeholders, padding).
    * ``token_mask`` bool ``[T]`` (optional): false rows keep ``out = hidden``.
    * ``checkpoint_offsets`` / ``checkpoint_indices`` int ``[N]`` (optional): write the
      history at offset ``p`` (0 = none) of sequence ``n`` to that cache row.

    Build it with :meth:`from_query_lens` or :meth:`from_kda_batch` (device ops only,
    no host sync); :meth:`validate` checks it against the host (syncs).
    """

    cu_seqlens: torch.Tensor
    slot_indices: torch.Tensor
    has_initial_state: torch.Tensor
    dead_mask: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    checkpoint_offsets: torch.Tensor | None = None
    checkpoint_indices: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.slot_indices.shape[0]

    @classmethod
    def from_query_lens(
        cls,
        query_lens: torch.Tensor,
        slot_indices: torch.Tensor,
        has_initial_state: torch.Tensor | None = None,
        *,
        dead_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
        checkpoint_indices: torch.Tensor | None = None,
    ) -> EngramBatch:
        """From per-sequence query lengths ``[N]`` (device), slots ``[N]`` and flags
        ``[N]`` (default all true: every sequence continues its history)."""
        check_tensor("query_lens", query_lens, shape=[None], dtypes=INDEX_DTYPES)
        N, dev = query_lens.shape[0], query_lens.device
        check_tensor("slot_indices", slot_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
        cu = torch.zeros(N + 1, dtype=torch.int64, device=dev)
        torch.cumsum(query_lens.to(torch.int64), 0, out=cu[1:])
        if has_initial_state is None:
            has_initial_state = torch.ones(N, dtype=torch.bool, device=dev)
        return cls(cu, slot_indices, has_initial_state, dead_mask, token_mask, checkpoint_offsets, checkpoint_indices)

    @classmethod
    def from_kda_batch(
        cls,
        batch,
        *,
        slot_indices: torch.Tensor | None = None,
        dead_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> EngramBatch:
        """The same step as a :class:`~kda_engram.layers.kda_batch.KDABatch` (decode rows
        first, then the prefill sequences): decode rows become length-1 sequences
        that continue their history; slots default to the KDA state slots (one
        numbering for every per-sequence cache); checkpoints carry over."""
        B = batch.num_decode
        cu_p = batch.prefill_cu_seqlens.to(torch.int64)
        dev = cu_p.device
        cu = torch.cat([torch.arange(B, dtype=torch.int64, device=dev), cu_p + B])
        if slot_indices is None:
            slot_indices = torch.cat([batch.decode_state_indices.to(torch.int64),
                                      batch.prefill_state_indices.to(torch.int64)])
        has = torch.cat([torch.ones(B, dtype=torch.bool, device=dev), batch.prefill_has_initial_state])
        ck_off = ck_idx = None
        if batch.checkpoint_offsets is not None:
            ck_off = torch.cat([torch.zeros(B, dtype=torch.int64, device=dev), batch.checkpoint_offsets.to(torch.int64)])
            ck_idx = torch.cat([torch.full((B,), -1, dtype=torch.int64, device=dev),
                                batch.checkpoint_indices.to(torch.int64)])
        return cls(cu, slot_indices, has, dead_mask, token_mask, ck_off, ck_idx)

    def validate(self, num_tokens: int, history_slots: int | None = None) -> None:
        """Checks of every field: the host rules at once, the rules on device values
        (offsets, slots, checkpoints) read back in one transfer (a sync; eager only).
        The rules are :func:`kda_engram.validation.engram.check_engram_batch`, the
        ones :func:`engram_hash_step` runs by default."""
        checks = DeviceChecks()
        check_engram_batch(self, num_tokens, None, checks, history_slots=history_slots)
        checks.run()


def _host_rules_only(op):
    return functools.partial(op, check_inputs=False)


def engram_hash_step(
    token_ids: torch.Tensor,
    batch: EngramBatch,
    layout: EngramLayout | int,
    history_cache: torch.Tensor,
    *,
    token_map: torch.Tensor | None = None,
    global_rows: bool = False,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Hash one step's tokens for every Engram layer and advance the hash history.

    Call it once per model step (it moves the history on) and pass its result to
    every :class:`EngramLayer` of the model.

    Args:
        token_ids: int ``[T]`` (raw ids with ``token_map``, else compressed ids).
        batch: the step's :class:`EngramBatch`.
        layout: the model's :class:`~kda_engram.engram.layout.EngramLayout`, or its
            :func:`kda_engram.ops.handle` (what :meth:`EngramLayer.hash_step` passes,
            so that a compiled step traces no registry lookup).
        history_cache: int ``[slots, max_ngram - 1]`` (same id space as
            ``token_ids``), read at and written back to the batch's slots in place;
            checkpoint rows are written too.
        token_map, global_rows: as in :func:`~kda_engram.engram.hashing.ngram_hash`.
        check_inputs: every rule before any write: host rules at once; the rules on
            device values (:func:`~kda_engram.validation.engram.check_engram_batch`
            and the token ids against the vocabulary) queued, the launches run on
            guarded copies of the batch (every row "none", every sequence empty,
            token ids 0 when a rule is broken: the history cache is not touched),
            one read-back after them. While a CUDA graph is captured or
            ``torch.compile`` traces, host rules only (the device values are then
            the caller's contract; :meth:`EngramBatch.validate` checks them eagerly).
            These cover every host rule of the step's ops, which then run
            unchecked (``.unchecked``: each rule once). ``False``: no rule of the
            step; the ops run their own host rules (no device read).

    Returns int32 ``[T, n_layers, n_hash_cols]`` table rows.
    """
    # Raises an earlier call's pending error first. While a CUDA graph is captured
    # or torch.compile traces (no read-back there): host rules only, and the
    # kernels' entry points raise a pending error when they run.
    checks = EntryChecks(check_inputs) if can_read_back() else None
    rows = _hash_step(token_ids, batch, layout, history_cache, checks, token_map=token_map, global_rows=global_rows,
                      check_inputs=check_inputs)
    if checks is not None:
        checks.run()  # the verdict, after the guarded launches (deferred by default)
    return rows


def _hash_step(token_ids, batch, layout, history_cache, checks: EntryChecks | None, *, token_map, global_rows,
               check_inputs, num_tokens: int | None = None, device=None):
    """:func:`engram_hash_step` on the caller's ``checks`` (their verdict is the
    caller's to run: the layer runs it after its gate, so that no op of its step
    waits for the hash's verdict). ``num_tokens``, ``device``: what ``token_ids``
    must match besides (the layer's ``hidden_states``)."""
    known = True
    if check_inputs:
        check_tensor("token_ids", token_ids, shape=[num_tokens], dtypes=INDEX_DTYPES, device=device)
        if device is None:  # else the caller's tensor on that device was checked for the kernels
            check_kernel_device("token_ids", token_ids)
        if not isinstance(batch, EngramBatch):
            raise TypeError(f"batch: expected an EngramBatch, got {type(batch).__name__}")
        # A handle is resolved unless torch.compile traces (a registry lookup breaks
        # a Dynamo graph); there the rules that need the layout wait for its output.
        if isinstance(layout, int) and not isinstance(layout, bool):
            lay = None if torch.compiler.is_compiling() else ops.resolve(layout, EngramLayout)
        else:
            lay = check_instance("layout", layout, EngramLayout)
        known = lay is not None
        check_tensor("history_cache", history_cache, shape=[None, lay.max_ngram - 1 if known else None],
                     dtypes=INDEX_DTYPES, device=token_ids.device)
        check_engram_batch(batch, token_ids.shape[0], token_ids.device, checks, history_slots=history_cache.shape[0])
        # The hash's rules (its history is gathered from the cache just checked).
        check_ngram_hash_arguments(token_ids, batch.cu_seqlens, lay, token_map, None, batch.dead_mask, global_rows,
                                   None, checks, batch_checked=True)
        if checks is not None and known:  # the history the hash reads, as ngram_hash checks a given one
            check_history_cache_values(checks, history_cache, batch.slot_indices, batch.has_initial_state,
                                       lay.compressed_vocab_size, token_map)
        if checks is not None:  # one guard launch for the five
            token_ids, cu, slots, ck_offsets, ck_rows = checks.guard_many(
                (token_ids, 0), (batch.cu_seqlens, 0), (batch.slot_indices, -1), (batch.checkpoint_offsets, 0),
                (batch.checkpoint_indices, -1))
            batch = dataclasses.replace(batch, cu_seqlens=cu, slot_indices=slots, checkpoint_offsets=ck_offsets,
                                        checkpoint_indices=ck_rows)
    # Checked above: the step's rules cover every host rule of these ops (the cache,
    # the batch, the tokens, the layout; the histories are made from the checked
    # cache), so the ops run unchecked, each rule once per step. Unchecked step
    # (check_inputs=False): the ops run their host rules.
    step_ops = (ops.engram_history_gather, ops.ngram_hash, ops.next_history, ops.engram_history_checkpoint,
                ops.engram_history_scatter)
    gather, hash_, advance, checkpoint, scatter = step_ops  # (unpacked, not mapped: Dynamo traces it)
    if check_inputs:
        gather, hash_, advance = gather.unchecked, hash_.unchecked, advance.unchecked
        checkpoint, scatter = checkpoint.unchecked, scatter.unchecked
    else:
        gather, hash_, advance = _host_rules_only(gather), _host_rules_only(hash_), _host_rules_only(advance)
        checkpoint, scatter = _host_rules_only(checkpoint), _host_rules_only(scatter)
    hist = gather(history_cache, batch.slot_indices, batch.has_initial_state)
    rows = hash_(token_ids, batch.cu_seqlens, layout, history=hist, dead_mask=batch.dead_mask, token_map=token_map,
                 global_rows=global_rows)
    new = advance(token_ids, batch.cu_seqlens, layout, history=hist, dead_mask=batch.dead_mask)
    if not known:
        # Only the layout's handle was known: the cache's width against the layout's,
        # by the scatter's rule on next_history's output, before any cache write.
        check_history_scatter(history_cache, batch.slot_indices, new)
    if batch.checkpoint_offsets is not None:
        checkpoint(token_ids, batch.cu_seqlens, hist, batch.dead_mask, batch.checkpoint_offsets,
                   batch.checkpoint_indices, history_cache)
    scatter(history_cache, batch.slot_indices, new)
    return rows


# ------------------------------------------------------------------------- layer


def _text_config(cfg: Any) -> dict:
    """The text config as a dict (V4.1 nests it under ``text_config``), with the pad
    id under the key :meth:`EngramLayout.from_config` reads."""
    inner = config_value(cfg, "text_config", None)
    src = inner if inner is not None else cfg
    if isinstance(src, Mapping):
        out = dict(src)
    elif hasattr(src, "to_dict"):
        out = dict(src.to_dict())
    else:
        out = dict(vars(src))
    if "engram_pad_token_id" not in out and "engram_pad_id" in out:
        out["engram_pad_token_id"] = out["engram_pad_id"]
    return out


class EngramLayer(nn.Module):
    """One Engram layer from table rows (or token ids) to the gated ``hc`` streams.

    Args:
        layout: the model's :class:`~kda_engram.engram.layout.EngramLayout` (shared by
            its Engram layers).
        layer_id: this layer's id (one of ``layout.layer_ids``).
        dim: hidden size of each stream; hc_mult: number of streams.
        eps, clamp_value: the gate's RMS epsilon and ``|dot|`` floor.
        tp: tensor-parallel group (``None``: one process). The table is sharded by
            hash columns (each rank gathers its columns, then one all-gather), the
            projection and gate as :class:`~kda_engram.layers.engram_gate.Engram` decides.
        shard_gate: force the dim-sharded gate on/off (``None``: the policy).
        storage: table storage, ``"bf16"``, ``"fp16"``, ``"fp32"`` or ``"fp8"`` (e4m3 +
            ue8m0 scales, V4.1's checkpoint format: 101 GB instead of 196 GB per layer).
        host_resident, host_mode: keep the table in (pinned) host memory, see
            :class:`~kda_engram.engram.table.EngramTable`.
        dtype, device: of the projection/gate parameters and of the lookup output.

    The table (``self.table``) is a plain object, not a submodule: a host-resident
    table must not follow ``module.to(...)``. Fill everything with
    :meth:`load_weights` (or :meth:`reset_parameters` for a random layer).
    """

    def __init__(
        self,
        layout: EngramLayout,
        layer_id: int,
        dim: int,
        hc_mult: int,
        *,
        eps: float = 1e-6,
        clamp_value: float = 1e-6,
        tp: TensorParallelGroup | None = None,
        shard_gate: bool | None = None,
        storage: str = "bf16",
        host_resident: bool = False,
        host_mode: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.layout = check_instance("layout", layout, EngramLayout)
        self.layer_id = int(layer_id)
        self.layer_index = layout.layer_index(layer_id)
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        dtype = dtype or torch.get_default_dtype()
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.engram = Engram(dim, hc_mult, layout.embedding_dim, eps=eps, clamp_value=clamp_value, tp=self.tp,
                             shard_gate=shard_gate, dtype=dtype, device=device)
        self.table = EngramTable.for_layer(
            layout, layer_id, storage=storage, device=device, host_resident=host_resident, host_mode=host_mode,
            group=self.tp if self.tp.world_size > 1 else None, out_dtype=dtype,
        )
        # Op handles, taken once: the forward passes plain ints to the ops.
        self._layout_handle = ops.handle(layout)
        self._table_handle = ops.handle(self.table)
        self._lookup_devices = lookup_devices(self.table)  # where its lookups take rows (fixed with the table)

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        layer_id: int,
        *,
        layout: EngramLayout | None = None,
        token_map: torch.Tensor | None = None,
        **kwargs,
    ) -> EngramLayer:
        """From a DeepSeek-V4.1 config (dict or object; a nested ``text_config`` is
        used when present): ``hidden_size``, ``hc_mult``, ``rms_norm_eps`` and the
        ``engram_*`` keys of :meth:`EngramLayout.from_config` (``engram_pad_id`` is
        accepted for ``engram_pad_token_id``; ``engram_clamp_value`` optional, default
        1e-6). Pass ``layout`` to share one layout between the model's Engram layers.
        Other keyword arguments go to the constructor."""
        text = _text_config(cfg)
        if layout is None:
            layout = EngramLayout.from_config(text, token_map=token_map)
        kwargs.setdefault("eps", float(config_value(text, "rms_norm_eps", 1e-6)))
        kwargs.setdefault("clamp_value", float(config_value(text, "engram_clamp_value", 1e-6)))
        return cls(layout, layer_id, int(config_value(text, "hidden_size")), int(config_value(text, "hc_mult")),
                   **kwargs)

    @staticmethod
    def checkpoint_prefix(layer_id: int) -> str:
        """Where V4.1 checkpoints keep this layer's tensors: ``layers.{layer_id}.engram.``."""
        return f"layers.{int(layer_id)}.engram."

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     prefix: str = "") -> set[str]:
        """Load full (unsharded) checkpoint tensors named as in the module docstring,
        each under ``prefix`` (e.g. :meth:`checkpoint_prefix`); names outside the
        prefix are ignored, a missing or unknown name under it is a ``ValueError``.
        Returns the names loaded."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        mine = {name[len(prefix):]: t for name, t in items if name.startswith(prefix)}
        need = {"embed.weight", "wkv.weight", "q_weight", "k_weight"}
        missing = need - mine.keys()
        unknown = mine.keys() - need - {"embed.scale"}
        if missing or unknown:
            raise ValueError(f"weights: under prefix {prefix!r} missing {sorted(missing)}, unknown {sorted(unknown)}")
        emb = mine["embed.weight"]
        check_tensor(f"{prefix}embed.weight", emb, shape=[self.table.num_rows, self.table.head_dim])
        self.table.load_(emb, mine.get("embed.scale"))
        self.engram.load_checkpoint(mine["wkv.weight"], mine["q_weight"], mine["k_weight"])
        return {prefix + n for n in mine}

    @torch.no_grad()
    def random_weights(self, generator: torch.Generator | None = None, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Random full checkpoint tensors (CPU, fp32) under this layer's names, for tests."""
        g = generator
        hc, dim, in_dim = self.engram.hc_mult, self.engram.dim, self.engram.in_dim
        return {
            "embed.weight": torch.randn(self.table.num_rows, self.table.head_dim, generator=g) * scale,
            "wkv.weight": torch.randn((hc + 1) * dim, in_dim, generator=g) * in_dim**-0.5,
            "q_weight": 1.0 + 0.1 * torch.randn(hc, dim, generator=g),
            "k_weight": 1.0 + 0.1 * torch.randn(hc, dim, generator=g),
        }

    def reset_parameters(self, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Load :meth:`random_weights`; returns them (the reference needs the full tensors)."""
        w = self.random_weights(generator)
        self.load_weights(w)
        return w

    # -- forward --------------------------------------------------------------------

    def hash_step(self, token_ids: torch.Tensor, batch: EngramBatch, history_cache: torch.Tensor, *,
                  token_map: torch.Tensor | None = None, check_inputs: bool = True) -> torch.Tensor:
        """:func:`engram_hash_step` with this layer's layout (once per model step; the
        rows serve every Engram layer of the model)."""
        return engram_hash_step(token_ids, batch, self._layout_handle, history_cache, token_map=token_map,
                                check_inputs=check_inputs)

    def embeddings(self, rows: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        """``rows [T, n_layers, n_hash_cols]`` (all layers, from :func:`engram_hash_step`)
        -> this layer's looked-up rows ``[T, n_hash_cols * head_dim]``, replicated.
        ``checked``: the caller ran the lookup's host rules (:meth:`forward` does), so
        the op runs unchecked; otherwise it runs its host rules."""
        mine = rows[:, self.layer_index]
        lookup = ops.engram_lookup.unchecked if checked else functools.partial(ops.engram_lookup, check_inputs=False)
        if self.tp.world_size == 1:
            emb = lookup(mine, self._table_handle)
        else:
            emb = self.tp.all_gather(lookup(mine, self._table_handle, local=True), dim=1)
        return emb.flatten(1)  # [T, cols * head_dim]; T = 0 too (reshape(0, -1) is ambiguous)

    def forward(
        self,
        hidden_states: torch.Tensor,
        batch: EngramBatch | None = None,
        *,
        rows: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        history_cache: torch.Tensor | None = None,
        token_map: torch.Tensor | None = None,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """``hidden_states [T, hc, dim]`` -> ``[T, hc, dim]``: ``hidden + gate * value``.

        Pass ``rows`` (``[T, n_layers, n_hash_cols]`` from :func:`engram_hash_step`,
        shared by all Engram layers of the step), or ``token_ids`` with ``batch`` and
        ``history_cache`` to hash here (this advances the history: only for a model
        with a single Engram layer, or once per step). ``batch.token_mask`` (if any)
        switches the gate off per token. ``check_inputs``: every host rule of the
        layer (the streams, the token mask, the rows or token ids) runs before the
        hash writes the history cache, then the hash step's own rules
        (:func:`engram_hash_step`): a refused call leaves the cache as it was.
        """
        # An earlier call's broken verdict first, as every entry point does; the
        # step's own verdict (the hash's device rules) is run after the gate.
        checks = EntryChecks(check_inputs) if can_read_back() else None
        eng = self.engram
        hashing = rows is None
        if hashing and (token_ids is None or batch is None or history_cache is None):
            raise ValueError("rows: pass rows, or token_ids with batch and history_cache to hash them here")
        token_mask = batch.token_mask if batch is not None else None
        if check_inputs:
            check_parameters_forward_only(self)
            w = eng.wkv.weight
            check_tensor("hidden_states", hidden_states, shape=[None, eng.hc_mult, eng.dim],
                         dtypes=(w.dtype,) if w.dtype in FLOAT_DTYPES else FLOAT_DTYPES, device=w.device)
            # The lookup's and the gate's host rules, once: their other operands are
            # this layer's own (the rows' form is checked below or made by the hash,
            # kv is wkv's output), so both ops then run unchecked.
            check_rows_device(hidden_states.device, self._lookup_devices)
            check_layer_gate(hidden_states, eng.q_weight, eng.k_weight, eng.eps, eng.clamp_value,
                             eng.tp.world_size if eng.shard_gate else None)
            T = hidden_states.shape[0]
            if not hashing:  # token_ids: checked by the hash step below, against T and the device
                check_tensor("rows", rows, shape=[T, self.layout.n_layers, self.layout.n_hash_cols],
                             dtypes=INDEX_DTYPES, device=hidden_states.device)
            if token_mask is not None:
                check_tensor("batch.token_mask", token_mask, shape=[T], dtypes=(torch.bool,),
                             device=hidden_states.device)
        if hashing:
            rows = _hash_step(token_ids, batch, self._layout_handle, history_cache, checks, token_map=token_map,
                              global_rows=False, check_inputs=check_inputs, num_tokens=hidden_states.shape[0],
                              device=hidden_states.device)
        emb = self.embeddings(rows, checked=check_inputs)
        # The module's gate branch, through the torch.ops wrappers (capturable,
        # compilable): unchecked after the layer's rules above; with check_inputs=False
        # the ops run their own host rules.
        if check_inputs:
            kernels = GateKernels(ops.engram_post_wkv.unchecked, ops.engram_gate_partials.unchecked,
                                  ops.engram_gate_finish.unchecked)
        else:
            kernels = GateKernels(functools.partial(ops.engram_post_wkv, check_inputs=False),
                                  functools.partial(ops.engram_gate_partials, check_inputs=False),
                                  functools.partial(ops.engram_gate_finish, check_inputs=False))
        out = eng.gate(hidden_states, eng.wkv(emb), token_mask, num_kv_tokens=emb.shape[0], kernels=kernels)
        if checks is not None:
            checks.run()
        return out

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, n_hash_cols={self.layout.n_hash_cols}, head_dim={self.layout.head_dim}, "
                f"storage={self.table.storage}, tp_size={self.tp.world_size}")
