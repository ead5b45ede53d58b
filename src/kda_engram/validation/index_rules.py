"""Rules on device values in one launch each: a decode step's row indices
(range, distinctness, and the guarded copy the kernels index with), a varlen
batch's ``cu_seqlens``, a call's index sets (the rows it writes into each cache,
distinct across decode, prefill and checkpoint rows), and the guarded copies of a
call's index tensors.

As separate PyTorch ops (max, sort, compare, any, stack, where, ...) these rules
cost ~15 launches of host time per call, enough to make a default decode call
(0.29 ms of GPU time at B = 256, H = 32) host-bound on the H200; here each is one
Triton program writing a small int64 verdict for the one read-back. This module
launches them and reads their verdicts; the kernels are
:mod:`kda_engram.validation.index_rules_kernels`.
"""

from __future__ import annotations

import torch
import triton

from .index_rules_kernels import (
    _cu_seqlens_rules_kernel,
    _decode_multi_rules_kernel,
    _guard_kernel,
    _index_rules_kernel,
    _index_sets_kernel,
    _kda_batch_rules_kernel,
    _state_rules_kernel,
)

__all__ = ["MAX_ONE_PROGRAM_INDICES", "cu_seqlens_messages", "cu_seqlens_rules", "index_rule_messages", "index_rules",
           "fits_kda_batch_rules", "kda_batch_rules"]


def index_rule_messages(name: str, upper: int) -> tuple[str, str, str]:
    """The messages of the index rules (negative entries, range, distinct), ``{}``
    standing for the offending min / max: one wording for the one-launch rules
    here and the PyTorch rules of
    :func:`kda_engram.validation.common.check_index_values`."""
    return (f"{name}: expected non-negative entries, got min {{}}",
            f"{name}: entries must be < {upper} (rows available), got max {{}}",
            f"{name}: non-negative entries must be distinct (duplicates would race on one row)")


# One program sorts up to this many indices in registers (16 per thread at 8
# warps); larger index sets use the PyTorch rules.
MAX_ONE_PROGRAM_INDICES = 4096


def _width(n: int) -> int:
    """The register width of a one-program rule over ``n`` entries: a power of two
    >= ``n``, at least 64 (few compiled variants)."""
    return max(64, triton.next_power_of_2(max(1, n)))


def _warps(width: int) -> int:
    return 8 if width >= 1024 else 4


def index_rules(checks, name: str, idx: torch.Tensor, upper: int, *, allow_negative: bool = True,
                distinct: bool = True) -> torch.Tensor:
    """Queue the rules on a 1-d index tensor (``idx.numel() <=
    MAX_ONE_PROGRAM_INDICES``, checked by the caller) on ``checks`` (a
    :class:`~kda_engram.validation.common.DeviceChecks`): entries in
    ``[0, upper)``, negative ones allowed as "no row" when ``allow_negative``,
    non-negative ones distinct when ``distinct``. Returns the indices to launch
    with: a new contiguous tensor of ``idx``'s dtype, all -1 when one of these
    rules is broken (the kernel guards them itself: no ``checks.guard`` op). One
    launch, no host sync; :meth:`DeviceChecks.run` reads the verdict back."""
    n = idx.numel()
    guarded = torch.empty(n, dtype=idx.dtype, device=idx.device)
    verdict = torch.empty(5, dtype=torch.int64, device=idx.device)
    width = _width(n)
    _index_rules_kernel[(1,)](
        idx, n, idx.stride(0) if n else 1, upper, guarded, verdict,
        N=width, ALLOW_NEGATIVE=allow_negative, DISTINCT=distinct, num_warps=_warps(width),
    )
    negative, out_of_range, duplicate = index_rule_messages(name, upper)
    # verdict = [range, negative, duplicate, max, min]: rules in check_index_values' order.
    rules = [] if allow_negative else [(1, negative, (4,))]
    rules += [(0, out_of_range, (3,)), (2, duplicate, ())]
    checks.add_packed(verdict, rules)
    return guarded


def cu_seqlens_rules(cu_seqlens: torch.Tensor, total_tokens: int, *, covers_all: bool, name: str = "cu_seqlens",
                     tokens: str = "the tokens of the inputs"):
    """``(verdict, rules)`` for :meth:`~kda_engram.validation.common.DeviceChecks.add_packed`:
    ``cu_seqlens [N+1]`` (N >= 0, checked by the caller) starts at 0, never
    decreases, and ends at ``total_tokens`` (``covers_all``) or at most there;
    ``name`` is the argument the messages blame, ``tokens`` what ``total_tokens`` counts. One launch, no host sync."""
    num_seqs = cu_seqlens.numel() - 1
    verdict = torch.empty(6, dtype=torch.int64, device=cu_seqlens.device)
    block = 1024 if num_seqs > 256 else 256
    _cu_seqlens_rules_kernel[(1,)](
        cu_seqlens, num_seqs, cu_seqlens.stride(0), total_tokens, verdict,
        BLOCK=block, NUM_BLOCKS=triton.next_power_of_2(max(1, triton.cdiv(num_seqs, block))),
        COVERS_ALL=covers_all, num_warps=4,
    )
    start, decreasing, end = cu_seqlens_messages(name, total_tokens, covers_all=covers_all, tokens=tokens)
    return verdict, [(0, start, (3,)), (1, decreasing, (4,)), (2, end, (5,))]


def cu_seqlens_messages(name: str, total_tokens: int, *, covers_all: bool,
                        tokens: str = "the tokens of the inputs") -> tuple[str, str, str]:
    """The messages of the ``cu_seqlens`` rules (starts at 0, non-decreasing, ends at
    ``total_tokens`` or at most there), ``{}`` standing for ``cu[0]``, the shortest
    length and ``cu[N]``: one wording for every launch that checks them."""
    end = (f"{name}: must end at T={total_tokens} ({tokens}), got {{}}" if covers_all else
           f"{name}: last entry {{}} exceeds the {total_tokens} tokens of the inputs")
    return (f"{name}: must start at 0, got {{}}", f"{name}: must be non-decreasing, got a sequence of length {{}}",
            end)


# ----------------------------------------------------------------- a call's index sets

#: ``index_set_rules``: sets per launch, segments per set.
MAX_SETS = 3
MAX_SEGMENTS = 3


def fits_index_set_rules(sets) -> bool:
    """Whether :func:`index_set_rules` takes ``sets`` in one launch: at most
    :data:`MAX_SETS` sets of at most :data:`MAX_SEGMENTS` 1-d segments, each set at
    most ``MAX_ONE_PROGRAM_INDICES`` entries (the in-register sort of one program)."""
    return len(sets) <= MAX_SETS and all(
        len(segments) <= MAX_SEGMENTS and all(s.dim() == 1 for s in segments)
        and sum(s.numel() for s in segments) <= MAX_ONE_PROGRAM_INDICES
        for _, segments, _ in sets)


def index_set_rules(checks, sets) -> None:
    """Queue, in one launch, the rules :func:`~kda_engram.validation.common.check_index_values`
    queues per set (``allow_negative=True``, ``distinct=True``) on ``checks``:
    ``sets`` is a list of ``(name, segments, upper)``, a set's entries being the
    concatenation of its 1-d ``segments`` (the rows a call writes into one cache:
    they must be distinct across segments too). Negative entries mean "no row".
    The caller checks :func:`fits_index_set_rules` first. Replaces about seven
    PyTorch ops per set (cat, max, sort, compare, any, stack) with one program."""
    device = sets[0][1][0].device
    verdict = torch.empty(3 * len(sets), dtype=torch.int64, device=device)
    args, rules = [], []
    for k, (name, segments, upper) in enumerate(sets):
        padded = list(segments) + [segments[0]] * (MAX_SEGMENTS - len(segments))
        for j, seg in enumerate(padded):
            args += [seg, seg.numel() if j < len(segments) else 0, seg.stride(0) if seg.numel() else 1]
        args += [sum(seg.numel() for seg in segments), upper]
        _, out_of_range, duplicate = index_rule_messages(name, upper)
        rules += [(2 * k, out_of_range, (2 * len(sets) + k,)), (2 * k + 1, duplicate, ())]
    args += ([None, 0, 1] * MAX_SEGMENTS + [0, 0]) * (MAX_SETS - len(sets))  # unused sets (skipped: NUM_SETS)
    largest = max(sum(s.numel() for s in segments) for _, segments, _ in sets)
    width = _width(largest)
    _index_sets_kernel[(1,)](verdict, *args, NUM_SETS=len(sets), N=width, num_warps=_warps(width))
    checks.add_packed(verdict, rules)


# ----------------------------------------------------------------------- the guards

#: Tensors one :func:`guard_tensors` launch copies.
MAX_GUARDED = 8


def guard_tensors(flags: torch.Tensor, pairs, n_flags: int | None = None) -> list:
    """``[x if no flag is set else x filled with none for (x, none) in pairs]``, new
    1-d tensors of each ``x``'s dtype, in one launch; ``flags`` is a contiguous 1-d
    int64 verdict whose first ``n_flags`` entries (default all) are the flags
    (nonzero = a broken rule: read in place, no slice op), ``pairs`` at most
    :data:`MAX_GUARDED` 1-d tensors with their "none" values. No host sync."""
    n_flags = flags.numel() if n_flags is None else n_flags
    outs, args, largest = [], [], 1  # (loops, not comprehensions: no call each on the serving path)
    for x, none in pairs:
        y = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        outs.append(y)
        args += [x, y, x.numel(), x.stride(0) if x.numel() else 1, none]
        largest = max(largest, x.numel())
    args += [None, None, 0, 1, 0] * (MAX_GUARDED - len(pairs))  # unused slots (skipped: COUNT)
    _guard_kernel[(1,)](flags, n_flags, *args, COUNT=len(pairs), BLOCK=128,
                        NUM_BLOCKS=triton.next_power_of_2(triton.cdiv(largest, 128)),
                        FLAG_BLOCK=triton.next_power_of_2(max(1, n_flags)), num_warps=4)
    return outs


# ------------------------------------------------ a prefill's state and checkpoint rules

#: :func:`state_rules` takes up to this many sequences in one program (two keys
#: per sequence are sorted in registers).
MAX_STATE_RULE_SEQS = 2048
#: Bits of a sort key below the row: the owner (sequence) and the kind bit.
_OWNER_BITS = 21


def fits_state_rules(num_seqs: int, *tensors) -> bool:
    """Whether :func:`state_rules` takes a call of ``num_seqs`` sequences whose
    per-sequence index tensors are ``tensors`` (None = absent)."""
    return 1 <= num_seqs <= MAX_STATE_RULE_SEQS and all(t is None or t.dim() == 1 for t in tensors)


def snapshot_clash_message() -> str:
    """The message of the rule that no sequence's snapshot lands on another
    sequence's state row; ``{}`` stand for the sequence, its checkpoint row and the
    sequence owning that row."""
    return "checkpoint_state_indices[{}]={} is the state_cache row of sequence {}"


def state_rules(checks, *, num_seqs: int, cu_seqlens, state_indices, slots: int, checkpoint_offsets,
                checkpoint_state_indices, checkpoint_rows: int, same_cache: bool, alignment: int,
                offsets_message: str) -> None:
    """Queue, in one launch, the device rules of a prefill's state and checkpoint
    arguments on ``checks`` (the same rules, order and messages as the PyTorch
    rules of :func:`kda_engram.validation.kda_prefill.check_state_arguments`): state rows
    in ``[0, slots)`` and distinct (``state_indices``, None: no cache); checkpoint
    offsets 0 or multiples of ``alignment`` within the sequence (``cu_seqlens``,
    None: not bounded); the rows of the sequences that export (offset > 0) in
    ``[0, checkpoint_rows)`` and distinct (``checkpoint_state_indices``, None: row
    n for sequence n); with ``same_cache``, no snapshot on another sequence's state
    row. ``offsets_message`` takes the sequence, its length and its offset. The
    caller checks :func:`fits_state_rules` first. Replaces about 35 PyTorch ops."""
    device = (state_indices if state_indices is not None else checkpoint_offsets).device
    verdict = torch.empty(14, dtype=torch.int64, device=device)
    has_ckpt = checkpoint_offsets is not None
    has_ck_idx = has_ckpt and checkpoint_state_indices is not None
    has_state = state_indices is not None
    same_cache = same_cache and has_state and has_ckpt
    width = _width(num_seqs)

    def ptr(t):
        return (t, t.stride(0)) if t is not None else (verdict, 1)  # never read (its part is off)

    _state_rules_kernel[(1,)](
        verdict, num_seqs, *ptr(state_indices), slots, *ptr(checkpoint_state_indices), checkpoint_rows,
        *ptr(checkpoint_offsets), *ptr(cu_seqlens if has_ckpt else None),
        HAS_STATE=has_state, HAS_CKPT=has_ckpt, HAS_CK_IDX=has_ck_idx, HAS_LENGTHS=cu_seqlens is not None,
        SAME_CACHE=same_cache, ALIGN=alignment, OWNER_BITS=_OWNER_BITS, N=width, num_warps=_warps(width))
    rules = []
    if has_state:
        _, out_of_range, duplicate = index_rule_messages("state_indices", slots)
        rules += [(0, out_of_range, (6,)), (1, duplicate, ())]
    if has_ckpt:
        rules.append((2, offsets_message, (7, 8, 9)))
    if has_ck_idx:
        _, out_of_range, duplicate = index_rule_messages("checkpoint_state_indices", checkpoint_rows)
        rules += [(3, out_of_range, (10,)), (4, duplicate, ())]
    if same_cache:
        rules.append((5, snapshot_clash_message(), (11, 12, 13)))
    checks.add_packed(verdict, rules)


# ---------------------------------------------------- kda_decode_multi's rules


def fits_decode_multi_rules(batch: int, steps: int) -> bool:
    """Whether :func:`decode_multi_rules` takes ``[batch, steps]`` written rows in
    one program."""
    return 1 <= batch * steps <= MAX_STATE_RULE_SEQS


def decode_multi_rules(checks, state_indices: torch.Tensor, initial_state_indices: torch.Tensor, slots: int) -> None:
    """Queue, in one launch, ``kda_decode_multi``'s device rules on ``checks`` (the
    same rules, order and messages as the PyTorch rules of
    :func:`kda_engram.validation.kda_decode.check_decode_multi_indices`): the written rows
    ``state_indices [B, S]`` and the initial rows ``initial_state_indices [B]`` each
    in range (negative = none) and distinct, and no sequence starting from a row
    another sequence writes. The caller checks :func:`fits_decode_multi_rules`
    first. Replaces about 25 PyTorch ops."""
    B, S = state_indices.shape
    verdict = torch.empty(10, dtype=torch.int64, device=state_indices.device)
    width = _width(B * S)
    _decode_multi_rules_kernel[(1,)](
        verdict, B, S, state_indices, state_indices.stride(0), state_indices.stride(1), initial_state_indices,
        initial_state_indices.stride(0), slots, OWNER_BITS=_OWNER_BITS, N=width, num_warps=_warps(width))
    _, w_range, w_dup = index_rule_messages("state_indices", slots)
    _, r_range, r_dup = index_rule_messages("initial_state_indices", slots)
    checks.add_packed(verdict, [
        (0, w_range, (5,)), (1, w_dup, ()), (2, r_range, (6,)), (3, r_dup, ()),
        (4, decode_multi_clash_message(), (7, 8)),
    ])


def decode_multi_clash_message() -> str:
    """The message of the rule that no sequence starts from a row another sequence
    writes; ``{}`` stand for the sequence and its initial row."""
    return ("initial_state_indices: sequence {} starts from row {}, which another sequence's state_indices writes "
            "(the write would race with the read)")


# ------------------------------------------------------- a serving layer step's batch

#: Index sets one :func:`kda_batch_rules` launch takes: per cache, its rows and the
#: checkpoint rows of a separate checkpoint buffer.
MAX_BATCH_SETS = 4
#: The words of its verdict: flags ``[0]`` decode query lengths, ``[1..3]``
#: ``cu_seqlens`` start / non-decreasing / end, ``[4]`` checkpoint offsets, ``[5 + 2k,
#: 6 + 2k]`` set ``k``'s range and distinctness; details ``[13, 14]`` the first bad
#: query length's row and value, ``[15..17]`` ``cu[0]``, the shortest length,
#: ``cu[N]``, ``[18..20]`` the first bad offset's sequence, length and offset,
#: ``[21 + k]`` set ``k``'s max.
_BATCH_WORDS = 25
_SET_KINDS = {"state": 1, "conv": 2, "checkpoint": 3}


def fits_kda_batch_rules(num_decode: int, num_prefill: int, checkpoints: bool, num_sets: int) -> bool:
    """Whether :func:`kda_batch_rules` takes a batch of ``num_decode`` decode rows and
    ``num_prefill`` prefill sequences (with checkpoints or not) and ``num_sets``
    index sets in one program: every set (at most decode + prefill + checkpoint
    rows) sorted in registers."""
    rows = num_decode + num_prefill * (2 if checkpoints else 1)
    return num_sets <= MAX_BATCH_SETS and max(rows, num_prefill + 1) <= MAX_ONE_PROGRAM_INDICES


def kda_batch_rules(checks, batch, prefill_tokens: int, sets, *, query_lens_message: str | None,
                    cu_messages: tuple[str, str, str], offsets_message: str | None, alignment: int,
                    guard: bool) -> dict:
    """Queue, in one launch, every device rule of a layer step's ``batch`` (a
    :class:`~kda_engram.layers.kda_batch.KDABatch`, its host rules checked) on ``checks``,
    as one verdict, the same rules in the same order with the same messages as the
    PyTorch path of :func:`kda_engram.validation.kda_batch.check_kda_batch`:

    * the decode query lengths are 1 (``query_lens_message``; None: not given);
    * ``prefill_cu_seqlens`` from 0, non-decreasing, to ``prefill_tokens``
      (``cu_messages``, :func:`cu_seqlens_messages`);
    * the checkpoint offsets 0 or multiples of ``alignment`` within their sequence
      (``offsets_message``; None: no checkpoints or no prefill sequence);
    * ``sets``: ``(name, kind, with_checkpoints, rows available)`` in rule order,
      ``kind`` ``"state"`` / ``"conv"`` (that cache's decode then prefill rows,
      then the checkpoint rows when ``with_checkpoints``) or ``"checkpoint"`` (the
      checkpoint rows alone): rows in range and distinct (negative = none; a
      checkpoint row counts only where its offset is > 0).

    With ``guard``, the same launch writes the copies of the index tensors the
    step's launches read (the decode fields when ``num_decode > 0``; the prefill
    ``cu_seqlens`` and rows when there are prefill sequences, and the checkpoint
    fields when given), int64, every row -1, every sequence empty and every offset
    0 when a rule is broken; returned as ``{field: copy}``. One allocation (the
    verdict and the copies) and one split: no other device op, no host sync. The
    caller checks :func:`fits_kda_batch_rules` first."""
    B, N = batch.num_decode, batch.prefill_state_indices.shape[0]
    lens = batch.decode_query_lens if query_lens_message is not None else None
    ckpt = offsets_message is not None
    parts = []  # (field, size) of the copies, in the kernel's order
    if guard and B:
        parts += [("decode_state_indices", B), ("decode_conv_indices", B)]
    if guard and N:
        parts += [("prefill_cu_seqlens", N + 1), ("prefill_state_indices", N), ("prefill_conv_indices", N)]
    if guard and N and ckpt:
        parts += [("checkpoint_offsets", N), ("checkpoint_indices", N)]
    cu = batch.prefill_cu_seqlens
    sizes = [_BATCH_WORDS]
    for _, n in parts:
        sizes.append(n)
    out = torch.empty(sum(sizes), dtype=torch.int64, device=cu.device)
    width = _width(max(B + N * (2 if ckpt else 1), N + 1))
    pointers = []  # (tensor, stride) per index field; absent or empty: ``out``, never read
    for t in (batch.decode_state_indices, batch.decode_conv_indices, batch.prefill_state_indices,
              batch.prefill_conv_indices, cu, lens, batch.checkpoint_offsets if ckpt else None,
              batch.checkpoint_indices if ckpt else None):
        pointers += (t, t.stride(0)) if t is not None and t.numel() else (out, 1)
    kinds, with_ck, uppers = [0] * MAX_BATCH_SETS, [False] * MAX_BATCH_SETS, [0] * MAX_BATCH_SETS
    for i, (_, kind, w, upper) in enumerate(sets):
        kinds[i], with_ck[i], uppers[i] = _SET_KINDS[kind], bool(w), upper
    _kda_batch_rules_kernel[(1,)](
        out, B, N, prefill_tokens, *pointers,
        *uppers, HAS_LENS=lens is not None, HAS_CKPT=ckpt,
        SET0=kinds[0], SET1=kinds[1], SET2=kinds[2], SET3=kinds[3],
        CK0=with_ck[0], CK1=with_ck[1], CK2=with_ck[2], CK3=with_ck[3],
        GUARD_DECODE=guard and B > 0, GUARD_PREFILL=guard and N > 0, GUARD_CKPT=guard and N > 0 and ckpt,
        ALIGN=alignment, WORDS=_BATCH_WORDS, N_REG=width, num_warps=_warps(width),
    )
    rules = [] if lens is None else [(0, query_lens_message, (13, 14))]
    rules += [(1, cu_messages[0], (15,)), (2, cu_messages[1], (16,)), (3, cu_messages[2], (17,))]
    if ckpt:
        rules.append((4, offsets_message, (18, 19, 20)))
    for k, (name, _, _, upper) in enumerate(sets):
        _, out_of_range, duplicate = index_rule_messages(name, upper)
        rules += [(5 + 2 * k, out_of_range, (21 + k,)), (6 + 2 * k, duplicate, ())]
    if not parts:
        checks.add_packed(out, rules)
        return {}
    views = out.split(sizes)
    checks.add_packed(views[0], rules)
    copies = {}
    for (field_name, _), view in zip(parts, views[1:]):
        copies[field_name] = view
    return copies
