"""Rules of a KDA layer step: the :class:`~kda_engram.layers.kda_batch.KDABatch` (its fields
and, queued in one launch, its device values) and the layer's inputs and caches."""

from __future__ import annotations

import torch

from ..constants import CONV_WIDTH, KDA_CHECKPOINT_ALIGNMENT, STATE_DTYPES
from .common import FLOAT_DTYPES, INDEX_DTYPES, DeviceChecks, check_tensor, queue_index_sets, value_at
from .index_rules import cu_seqlens_messages, cu_seqlens_rules, fits_kda_batch_rules, kda_batch_rules
from .kda_prefill import check_checkpoint_offsets, check_state_dtype_match, checkpoint_offsets_message

__all__ = [
    "KDA_BATCH_GUARDS",
    "check_checkpoint_pair",
    "check_index_rows",
    "check_kda_batch",
    "check_kda_layer_inputs",
    "check_kda_requests",
]


#: The index fields of a ``KDABatch`` the layer's launches read, with the value a
#: guarded copy takes when a rule is broken (-1: no row; 0: no token, no checkpoint).
KDA_BATCH_GUARDS = (("decode_state_indices", -1), ("decode_conv_indices", -1), ("prefill_cu_seqlens", 0),
                    ("prefill_state_indices", -1), ("prefill_conv_indices", -1), ("checkpoint_offsets", 0),
                    ("checkpoint_indices", -1))


def check_index_rows(name: str, x, rows: int, device: torch.device | None) -> None:
    """An index tensor of one entry per row or request: int32/int64 ``[rows]`` on
    ``device`` (None: any)."""
    check_tensor(name, x, shape=[rows], dtypes=INDEX_DTYPES, device=device)


def check_checkpoint_pair(offsets, indices, prefix: str = "") -> bool:
    """Checkpoint offsets and rows come together: both or neither (``prefix`` names
    their owner, e.g. ``"batch."``). Returns whether they are given."""
    if (offsets is None) != (indices is None):
        raise ValueError(f"{prefix}checkpoint_offsets and {prefix}checkpoint_indices: give both or neither")
    return offsets is not None


def check_kda_requests(query_lens, state_indices, has_initial_state, num_decode, conv_state_indices,
                       checkpoint_offsets, checkpoint_indices) -> int:
    """The per-request tensors ``KDABatch.from_query_lens`` takes, in engine order
    (host only): ``query_lens [N]``, ``state_indices`` / ``conv_state_indices`` (None:
    the state rows) ``[N]``, ``has_initial_state`` bool ``[N]`` (optional), the
    checkpoint pair ``[N]`` (both or neither), all on ``query_lens``' device, and
    ``0 <= num_decode <= N``. Returns ``num_decode`` as an int."""
    check_tensor("query_lens", query_lens, shape=[None], dtypes=INDEX_DTYPES)
    N, dev = query_lens.shape[0], query_lens.device
    num_decode = int(num_decode)
    if not 0 <= num_decode <= N:
        raise ValueError(f"num_decode: expected 0 <= num_decode <= {N} requests, got {num_decode}")
    check_index_rows("state_indices", state_indices, N, dev)
    if conv_state_indices is not None:
        check_index_rows("conv_state_indices", conv_state_indices, N, dev)
    if has_initial_state is not None:
        check_tensor("has_initial_state", has_initial_state, shape=[N], dtypes=(torch.bool,), device=dev)
    if check_checkpoint_pair(checkpoint_offsets, checkpoint_indices):
        check_index_rows("checkpoint_offsets", checkpoint_offsets, N, dev)
        check_index_rows("checkpoint_indices", checkpoint_indices, N, dev)
    return num_decode


def check_kda_batch(batch, num_tokens: int, device: torch.device | None, checks: DeviceChecks | None, *,
                    state_slots: int | None = None, conv_slots: int | None = None,
                    checkpoint_rows: int | None = None, conv_checkpoint_rows: int | None = None,
                    guard: bool = False) -> dict:
    """A ``KDABatch`` (:mod:`kda_engram.layers.kda_batch`) of a step of ``num_tokens``
    tokens: host rules (field types, dtypes, shapes, devices, the token count) at
    once; with ``checks``, the value rules queued: decode query lengths 1;
    ``prefill_cu_seqlens`` from 0, non-decreasing, to the prefill tokens;
    checkpoint offsets; and with the cache sizes, every row in range and, per
    cache, all rows the step writes distinct (decode, prefill and the checkpoints
    that land in the cache itself: ``checkpoint_rows`` / ``conv_checkpoint_rows``
    None). Rules that cannot apply to the batch's shapes queue nothing (no
    checkpoint rule without prefill sequences, no empty index set).

    With ``guard`` (launch, then read back) it returns ``{field: copy}``, the
    guarded copies of the fields the step's launches read (:data:`KDA_BATCH_GUARDS`:
    all "none" when a rule is broken), with ``checks`` sealed; else ``{}``.

    One launch for all of it (:func:`~kda_engram.validation.index_rules.kda_batch_rules`)
    up to ``MAX_ONE_PROGRAM_INDICES`` rows per set, PyTorch rules and
    :meth:`DeviceChecks.guard_many` beyond: the same rules, order and messages.
    Why one function: :meth:`KDABatch.validate` and the layer's forward run the
    same rules."""
    B = batch.num_decode
    if isinstance(B, bool) or not isinstance(B, int) or B < 0:
        raise TypeError(f"batch.num_decode: expected a non-negative Python int, got {B!r}")
    check_index_rows("batch.decode_state_indices", batch.decode_state_indices, B, device)
    dev = batch.decode_state_indices.device
    check_index_rows("batch.decode_conv_indices", batch.decode_conv_indices, B, dev)
    cu = batch.prefill_cu_seqlens
    check_tensor("batch.prefill_cu_seqlens", cu, dtypes=INDEX_DTYPES, device=dev)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"batch.prefill_cu_seqlens: expected shape [N_p+1] with N_p >= 0, got {list(cu.shape)}")
    N = cu.numel() - 1
    check_index_rows("batch.prefill_state_indices", batch.prefill_state_indices, N, dev)
    check_index_rows("batch.prefill_conv_indices", batch.prefill_conv_indices, N, dev)
    check_tensor("batch.prefill_has_initial_state", batch.prefill_has_initial_state, shape=[N],
                 dtypes=(torch.bool,), device=dev)
    ck_off, ck_idx = batch.checkpoint_offsets, batch.checkpoint_indices
    if check_checkpoint_pair(ck_off, ck_idx, "batch."):
        check_index_rows("batch.checkpoint_offsets", ck_off, N, dev)
        check_index_rows("batch.checkpoint_indices", ck_idx, N, dev)
    lens = getattr(batch, "decode_query_lens", None)
    if lens is not None:
        check_index_rows("batch.decode_query_lens", lens, B, dev)
    if num_tokens < B or (N == 0 and num_tokens != B):
        raise ValueError(f"hidden_states: {num_tokens} tokens do not match num_decode={B} decode rows and "
                         f"{N} prefill sequences")
    if checks is None:
        return {}
    lens_message = None
    if lens is not None and B:
        lens_message = (f"query_lens[{{}}]: the first num_decode={B} requests are decode rows of one token, "
                        "got {}")
    checkpoints = ck_off is not None and N > 0  # no sequence, no checkpoint
    cu_names = dict(name="batch.prefill_cu_seqlens", tokens=f"the prefill tokens: {num_tokens} tokens - num_decode={B}")
    # The index sets in rule order: (name, kind, with the checkpoint rows, rows available).
    sets = []
    for kind, slots, ck_slots in (("state", state_slots, checkpoint_rows), ("conv", conv_slots, conv_checkpoint_rows)):
        if ck_slots is not None and checkpoints:
            sets.append(("batch.checkpoint_indices", "checkpoint", False, ck_slots))
        if slots is None or B + N == 0:
            continue
        if ck_slots is None and checkpoints:  # the checkpoints land in this cache itself
            sets.append((f"batch.decode_{kind}_indices/prefill_{kind}_indices/checkpoint_indices "
                         f"({kind} rows written this step)", kind, True, slots))
        else:
            sets.append((f"batch.decode_{kind}_indices/prefill_{kind}_indices", kind, False, slots))
    offsets_message = checkpoint_offsets_message("batch.checkpoint_offsets") if checkpoints else None
    if fits_kda_batch_rules(B, N, checkpoints, len(sets)):
        guarded = kda_batch_rules(checks, batch, num_tokens - B, sets, query_lens_message=lens_message,
                                  cu_messages=cu_seqlens_messages(total_tokens=num_tokens - B, covers_all=True,
                                                                  **cu_names),
                                  offsets_message=offsets_message,
                                  alignment=KDA_CHECKPOINT_ALIGNMENT, guard=guard)
        if guard:
            checks.seal()  # the verdict complete before the step's launches (the next call waits for it only)
        return guarded
    # Past one program: the same rules as PyTorch ops and one-launch rules, then the guards.
    if lens_message is not None:
        bad = lens != 1
        first = torch.argmax(bad.to(torch.int8))
        checks.add(bad.any(), lens_message, first, value_at(lens, first))
    checks.add_packed(*cu_seqlens_rules(cu, num_tokens - B, covers_all=True, **cu_names))
    ck_rows = None
    if checkpoints:
        cu64 = cu.to(torch.int64)
        offs = check_checkpoint_offsets(checks, "batch.checkpoint_offsets", ck_off, cu64[1:] - cu64[:-1])
        ck_rows = torch.where(offs > 0, ck_idx.to(torch.int64), -1)  # only sequences taking a checkpoint
    segments = {"checkpoint": []}
    for kind in ("state", "conv"):
        segments[kind] = [getattr(batch, f"decode_{kind}_indices"), getattr(batch, f"prefill_{kind}_indices")]
    queue_index_sets(checks, [(name, segments[kind] + ([ck_rows] if with_ck or kind == "checkpoint" else []), upper)
                              for name, kind, with_ck, upper in sets])
    if not guard:
        return {}
    read = {"decode": B > 0, "prefill": N > 0, "checkpoint": checkpoints}  # by the step's launches
    fields = [(f, none) for f, none in KDA_BATCH_GUARDS if read[f.split("_")[0]]]
    return dict(zip((f for f, _ in fields), checks.guard_many(*((getattr(batch, f), none) for f, none in fields))))


def check_kda_layer_inputs(hidden_states, state_cache, conv_state, checkpoint_state, checkpoint_conv_state, *,
                           hidden_size: int, heads: int, head_dim: int, conv_channels: int, dtype: torch.dtype,
                           device: torch.device) -> None:
    """The tensors of a ``KimiDeltaAttention`` forward (host only): ``hidden_states
    [T, hidden]`` in the weights' dtype, the caches ``[slots, H, K, K]`` /
    ``[slots, C, 3]`` and the optional checkpoint buffers of the same row shapes,
    all on the weights' device, every state of one storage dtype."""
    check_tensor("hidden_states", hidden_states, shape=[None, hidden_size], dtypes=(dtype,), device=device)
    H, K = heads, head_dim
    check_tensor("state_cache", state_cache, shape=[None, H, K, K], dtypes=STATE_DTYPES, device=device)
    check_tensor("conv_state", conv_state, shape=[None, conv_channels, CONV_WIDTH - 1], dtypes=FLOAT_DTYPES,
                 device=device)
    if checkpoint_state is not None:
        check_tensor("checkpoint_state", checkpoint_state, shape=[None, H, K, K], dtypes=STATE_DTYPES, device=device)
        check_state_dtype_match(["state_cache", "checkpoint_state"], [state_cache, checkpoint_state])
    if checkpoint_conv_state is not None:
        check_tensor("checkpoint_conv_state", checkpoint_conv_state, shape=[None, conv_channels, CONV_WIDTH - 1],
                     dtypes=FLOAT_DTYPES, device=device)
