"""Rules of the KDA prefill's stages: the prologue's arguments, the chunk walk's operands
and offsets, and the recurrent state (:class:`~kda_engram.bundles.StateArgs`: argument
combinations, one storage dtype, shapes, and the queued rules on state rows and
checkpoint offsets)."""

from __future__ import annotations

import torch

from ..bundles import ConvArgs, KDAInputs, StateArgs
from ..constants import CHUNK_SIZE, KDA_CHECKPOINT_ALIGNMENT, STATE_DTYPES
from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_bool,
    check_index_values,
    check_kernel_device,
    check_same_dtype,
    check_tensor,
    value_at,
)
from .index_rules import fits_state_rules, snapshot_clash_message, state_rules
from .kda_conv import check_conv_arguments
from .kda_inputs import check_chunk_indices, check_cu_seqlens, check_head_dims, check_prefill_inputs, check_scale

__all__ = [
    "check_checkpoint_offsets",
    "check_chunk_offsets",
    "check_chunk_operands",
    "check_prologue_arguments",
    "check_state_arguments",
    "check_state_dtype_match",
    "check_state_structure",
    "checkpoint_offsets_message",
    "final_state_dtype",
    "owner_of_rows",
]


def check_state_structure(state: StateArgs) -> None:
    """Argument combinations of a call's state and checkpoint arguments (host only:
    the entry points run it even with ``check_inputs=False``, since a wrong
    combination would drop state silently)."""
    check_bool("output_final_state", state.output_final_state)  # "yes" would otherwise read as true
    if state.state_cache is not None:
        if state.initial_state is not None or state.output_final_state:
            raise ValueError(
                "state_cache replaces initial_state/output_final_state: pass either state_cache "
                "(with state_indices and has_initial_state) or initial_state/output_final_state"
            )
        if state.state_indices is None or state.has_initial_state is None:
            raise ValueError("state_cache needs state_indices and has_initial_state")
    elif state.state_indices is not None or state.has_initial_state is not None:
        raise ValueError("state_indices/has_initial_state are only meaningful with state_cache")
    if state.checkpoint_offsets is not None and state.checkpoint_state is None and state.state_cache is None:
        raise ValueError("checkpoint_offsets needs checkpoint_state or state_cache (the destination of the snapshots)")
    if state.checkpoint_offsets is None and (state.checkpoint_state is not None
                                             or state.checkpoint_state_indices is not None):
        raise ValueError("checkpoint_state/checkpoint_state_indices need checkpoint_offsets")
    # One storage dtype per state chain (a resumed checkpoint must equal the walk's state).
    check_state_dtype_match(["state_cache", "initial_state", "checkpoint_state"],
                            [state.state_cache, state.initial_state, state.checkpoint_state])
    if state.final_state_dtype is not None and state.final_state_dtype not in STATE_DTYPES:
        raise TypeError(f"final_state_dtype: expected float32 or bfloat16, got {state.final_state_dtype}")
    if state.output_final_state and state.checkpoint_offsets is not None and state.checkpoint_state is not None:
        final, ck = final_state_dtype(state), state.checkpoint_state.dtype
        if ck != final:
            raise TypeError(f"checkpoint_state: expected the dtype of final_state_dtype ({_dtype_name(final)}), "
                            f"got {_dtype_name(ck)}")


def final_state_dtype(state: StateArgs) -> torch.dtype:
    """The returned final state's dtype: ``final_state_dtype``, else ``initial_state``'s,
    else fp32."""
    if state.final_state_dtype is not None:
        return state.final_state_dtype
    return state.initial_state.dtype if state.initial_state is not None else torch.float32


def check_state_dtype_match(names: list[str], tensors: list[torch.Tensor | None]) -> None:
    """States that feed one another share one storage dtype (TypeError otherwise).

    ``names[0]`` is the reference argument (the cache / initial state)."""
    present = [(n, t) for n, t in zip(names, tensors) if t is not None]
    if len(present) < 2:
        return
    ref_name, ref = present[0]
    for n, t in present[1:]:
        if t.dtype != ref.dtype:
            raise TypeError(f"{n}: expected the dtype of {ref_name} ({_dtype_name(ref.dtype)}), "
                            f"got {_dtype_name(t.dtype)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_prologue_arguments(x: KDAInputs, cu_seqlens, conv: ConvArgs, chunk_indices, checks: DeviceChecks | None,
                             *, scale_optional: bool = False):
    """The rules of :func:`kda_prefill_prologue`'s arguments (and of the prefill's raw
    inputs; the inputs and the conv as their bundles) but ``lower_bound`` and the input
    forms, which the entry points check on every call (they pick kernel branches):
    host rules at once, value rules queued on ``checks`` (None: host rules only).
    ``scale_optional``: ``None`` stands for ``K ** -0.5`` (the prefill's default).
    Returns ``(T, H, K, V)``."""
    q = x.q
    T, H, K, V = check_prefill_inputs(q, x.k, x.v, x.raw_g, x.raw_beta, x.A_log, x.dt_bias)
    check_scale(x.scale, allow_none=scale_optional)
    lengths = check_cu_seqlens(cu_seqlens, T, q.device, checks, covers_all=True,
                               return_lengths=chunk_indices is not None)
    N = cu_seqlens.numel() - 1
    if chunk_indices is not None:
        check_chunk_indices(chunk_indices, N, q.device, checks, lengths)
    check_conv_arguments(conv.conv_weight, conv.conv_state, conv.conv_state_indices, conv.conv_has_initial_state,
                         channels=2 * H * K + H * V, num_seqs=N, device=q.device, checks=checks)
    return T, H, K, V


def check_chunk_operands(qg, w, u, kg_t, aqk, decay, out) -> tuple[int, int, int, int]:
    """The chunk walk's operands (host only; ``out`` None: allocated by the caller's
    wrapper). Returns ``(T, H, K, V)``."""
    check_tensor("qg", qg, shape=[1, None, None, None], dtypes=FLOAT_DTYPES)
    check_kernel_device("qg", qg)
    device = qg.device
    _, T, H, K = qg.shape
    check_tensor("u", u, shape=[1, T, H, None], dtypes=FLOAT_DTYPES, device=device)
    V = u.shape[3]
    check_head_dims(K, V)
    check_tensor("w", w, shape=[1, T, H, K], dtypes=FLOAT_DTYPES, device=device)
    check_tensor("aqk", aqk, shape=[1, T, H, CHUNK_SIZE], dtypes=FLOAT_DTYPES, device=device)
    check_tensor("kg_t", kg_t, shape=[None, H, K, CHUNK_SIZE], dtypes=FLOAT_DTYPES, device=device)
    check_same_dtype(["qg", "w", "u", "aqk", "kg_t"], [qg, w, u, aqk, kg_t])
    # Each operand's rows against the batch's chunk count, by name (check_chunk_offsets):
    # a shape rule tying decay's rows to kg_t's blamed decay for a short kg_t.
    check_tensor("decay", decay, shape=[None, H, K], dtypes=FLOAT_DTYPES, device=device)
    if out is not None:
        check_tensor("out", out, shape=[1, T, H, V], dtypes=FLOAT_DTYPES, device=device)
    return T, H, K, V


def check_chunk_offsets(chunk_offsets, expected: torch.Tensor, rows: dict[str, int], checks: DeviceChecks) -> None:
    """A caller's ``chunk_offsets`` equal ``expected`` (from ``cu_seqlens``), and the
    batch's chunk count fits the rows of each operand in ``rows`` (``{name: rows}``,
    ``kg_t`` and ``decay``; queued, each naming its operand)."""
    if chunk_offsets is not None:
        check_tensor("chunk_offsets", chunk_offsets, shape=[expected.numel()], dtypes=INDEX_DTYPES,
                     device=expected.device)
        checks.add((chunk_offsets.to(torch.int64) != expected.to(torch.int64)).any(),
                   "chunk_offsets: does not match prepare_chunk_offsets(cu_seqlens)")
    for name, n in rows.items():
        checks.add(expected[-1] > n, f"{name}: the batch has {{}} chunks, got {n} rows", expected[-1])


def check_checkpoint_offsets(checks: DeviceChecks, name: str, offsets: torch.Tensor,
                             lengths: torch.Tensor | None) -> torch.Tensor:
    """The state-checkpoint offset rule (queued): every entry of ``offsets [N]``
    (N >= 1) is 0 (none) or a multiple of :data:`KDA_CHECKPOINT_ALIGNMENT` at most
    its sequence's length (``lengths [N]``; None: not checked). Returns the
    offsets as int64 (the callers' next rules need them)."""
    offs = offsets.to(torch.int64)
    bad = (offs < 0) | (offs % KDA_CHECKPOINT_ALIGNMENT != 0)
    if lengths is not None:
        bad = bad | (offs > lengths)
    first = torch.argmax(bad.to(torch.int8))
    length = value_at(lengths if lengths is not None else offs, first)
    checks.add(bad.any(), checkpoint_offsets_message(name), first, length, value_at(offs, first))
    return offs


def checkpoint_offsets_message(name: str) -> str:
    """The checkpoint-offset rule's message; ``{}`` stand for the sequence, its
    length and its offset."""
    return (f"{name}[{{}}]: expected 0 (none) or a multiple of {KDA_CHECKPOINT_ALIGNMENT} "
            "(KDA_CHECKPOINT_ALIGNMENT) at most the sequence length {}, got {}")


def owner_of_rows(indices: torch.Tensor, slots: int) -> torch.Tensor:
    """``owner[r]`` = the position ``n`` with ``indices[n] == r`` (-1: none), int64
    ``[slots + 1]``; negative indices land on the spare entry ``slots``. With
    duplicate indices one of the positions wins (the distinctness rule reports them)."""
    idx = indices.reshape(-1).to(torch.int64)
    idx = torch.where((idx >= 0) & (idx < slots), idx, slots)
    owner = torch.full((slots + 1,), -1, dtype=torch.int64, device=indices.device)
    owner.scatter_(0, idx, torch.arange(idx.numel(), dtype=torch.int64, device=indices.device))
    owner[slots:].fill_(-1)  # a view and a fill: no host-to-device copy, no sync
    return owner


def check_state_arguments(
    checks: DeviceChecks | None,
    state: StateArgs,
    *,
    num_seqs: int,
    num_heads: int,
    head_v: int,
    head_k: int,
    device: torch.device,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """The state and checkpoint arguments (:class:`~kda_engram.bundles.StateArgs`) of
    the prefill and the chunk walk: shapes and
    dtypes at once; with ``checks``, queued: state rows in range and distinct,
    checkpoint offsets 0 or multiples of :data:`KDA_CHECKPOINT_ALIGNMENT` within
    the sequence (from ``cu_seqlens``; None: not bounded), active checkpoint rows
    in range and distinct, and, when the snapshots go into the state cache itself,
    no snapshot on another sequence's state row. The value rules run as one
    launch (:func:`~kda_engram.validation.index_rules.state_rules`) up to
    :data:`~kda_engram.validation.index_rules.MAX_STATE_RULE_SEQS` sequences, as
    PyTorch ops beyond."""
    initial_state, state_cache, state_indices = state.initial_state, state.state_cache, state.state_indices
    has_initial_state, checkpoint_state = state.has_initial_state, state.snapshots
    checkpoint_offsets, checkpoint_state_indices = state.checkpoint_offsets, state.checkpoint_state_indices
    N, H, V, K = num_seqs, num_heads, head_v, head_k
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=[N, H, V, K], dtypes=STATE_DTYPES, device=device)
    if state_cache is not None:
        check_tensor("state_cache", state_cache, shape=[None, H, V, K], dtypes=STATE_DTYPES, device=device)
        check_tensor("state_indices", state_indices, shape=[N], dtypes=INDEX_DTYPES, device=device)
        check_tensor("has_initial_state", has_initial_state, shape=[N], dtypes=[torch.bool], device=device)
    if checkpoint_offsets is not None:
        check_tensor("checkpoint_offsets", checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=device)
        check_tensor("checkpoint_state", checkpoint_state, shape=[None, H, V, K], dtypes=STATE_DTYPES,
                     device=device)
        rows = checkpoint_state.shape[0]
        if checkpoint_state_indices is not None:
            check_tensor("checkpoint_state_indices", checkpoint_state_indices, shape=[N], dtypes=INDEX_DTYPES,
                         device=device)
        elif rows < N:
            raise ValueError(f"checkpoint_state: without checkpoint_state_indices it needs N={N} rows, got {rows}")
    if checks is None or N == 0 or (state_cache is None and checkpoint_offsets is None):
        return
    same_cache = (state_cache is not None and checkpoint_offsets is not None
                  and checkpoint_state.data_ptr() == state_cache.data_ptr())
    if fits_state_rules(N, cu_seqlens, state_indices, checkpoint_offsets, checkpoint_state_indices):
        state_rules(checks, num_seqs=N, cu_seqlens=cu_seqlens,
                    state_indices=None if state_cache is None else state_indices,
                    slots=0 if state_cache is None else state_cache.shape[0], checkpoint_offsets=checkpoint_offsets,
                    checkpoint_state_indices=checkpoint_state_indices,
                    checkpoint_rows=0 if checkpoint_offsets is None else checkpoint_state.shape[0],
                    same_cache=same_cache, alignment=KDA_CHECKPOINT_ALIGNMENT,
                    offsets_message=checkpoint_offsets_message("checkpoint_offsets"))
        return
    if state_cache is not None:
        check_index_values(checks, "state_indices", state_indices, state_cache.shape[0])
    if checkpoint_offsets is None:
        return
    rows = checkpoint_state.shape[0]
    lengths = None
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
    offs = check_checkpoint_offsets(checks, "checkpoint_offsets", checkpoint_offsets, lengths)
    active = offs > 0
    if checkpoint_state_indices is not None:
        # Only sequences that actually export claim their row.
        ck_rows = torch.where(active, checkpoint_state_indices.to(torch.int64), -1)
        check_index_values(checks, "checkpoint_state_indices", ck_rows, rows)
    else:
        ck_rows = torch.where(active, torch.arange(N, device=device), -1)
    if same_cache:
        # Snapshots into the paged cache itself: one sequence's snapshot must not
        # land on another sequence's state row (two programs would race on it).
        owner = owner_of_rows(state_indices, state_cache.shape[0])
        slot = torch.where((ck_rows >= 0) & (ck_rows < state_cache.shape[0]), ck_rows, state_cache.shape[0])
        who = owner[slot]
        clash = (who >= 0) & (who != torch.arange(N, device=device))
        n = torch.argmax(clash.to(torch.int8))
        checks.add(clash.any(), snapshot_clash_message(), n, value_at(ck_rows, n), value_at(who, n))
