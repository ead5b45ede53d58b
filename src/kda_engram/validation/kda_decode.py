"""Rules of the KDA decode entry points: one step, S steps (speculative decoding) and
the fused layer step."""

from __future__ import annotations

import torch

from ..constants import CONV_WIDTH, DECODE_MAX_HEAD_DIM, KDA_HEAD_DIMS, STATE_DTYPES
from ..launch_config import is_pow2
from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_index_values,
    check_int,
    check_kernel_device,
    check_real,
    check_same_dtype,
    check_tensor,
    queue_index_sets,
    value_at,
)
from .index_rules import (
    MAX_ONE_PROGRAM_INDICES,
    decode_multi_clash_message,
    decode_multi_rules,
    fits_decode_multi_rules,
    index_rules,
)
from .kda_conv import check_out_dtype
from .kda_inputs import check_log_decay_values, check_lower_bound, check_scale
from .kda_prefill import owner_of_rows

__all__ = [
    "check_decode_indices",
    "check_decode_inputs",
    "check_decode_multi_arguments",
    "check_decode_multi_indices",
    "check_decode_multi_layout",
    "check_fused_decode_arguments",
    "guard_decode_indices",
    "null_rows_as_negative",
    "queue_accepted_tokens_rule",
    "queue_decode_multi_index_rules",
]


def check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, out, scale, lower_bound,
                        lead: int) -> tuple[int, ...]:
    """Host rules shared by both decode entry points; ``lead`` is 1 (``[B]``) or 2
    (``[B, S]``). Returns the leading sizes."""
    check_tensor("state_cache", state_cache, dtypes=STATE_DTYPES)
    check_kernel_device("state_cache", state_cache)
    if state_cache.dim() != 4:
        raise ValueError(f"state_cache: expected shape [slots, H, V, K], got {list(state_cache.shape)}")
    dev = state_cache.device
    _, H, V, K = state_cache.shape
    check_tensor("q", q, dtypes=FLOAT_DTYPES, device=dev)
    if q.dim() != lead + 2:
        want = "[B, S, H, K]" if lead == 2 else "[B, H, K]"
        raise ValueError(f"q: expected shape {want}, got {list(q.shape)}")
    lead_sizes = [q.shape[i] for i in range(lead)]
    check_tensor("q", q, shape=[*lead_sizes, H, K])
    check_tensor("k", k, shape=[*lead_sizes, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("v", v, shape=[*lead_sizes, H, V], dtypes=FLOAT_DTYPES, device=dev)
    check_same_dtype(["q", "k", "v"], [q, k, v])
    check_tensor("raw_g", raw_g, shape=[*lead_sizes, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("raw_beta", raw_beta, shape=[*lead_sizes, H], dtypes=FLOAT_DTYPES, device=dev)
    if A_log is not None or dt_bias is not None:  # both None: gate='log_decay' (check_input_forms)
        check_tensor("A_log", A_log, shape=[H], dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=dev)
        if list(dt_bias.shape) not in ([H, K], [H * K]):
            raise ValueError(f"dt_bias: expected shape [{H}, {K}] or [{H * K}], got {list(dt_bias.shape)}")
    if not (is_pow2(K) and is_pow2(V) and 16 <= K <= DECODE_MAX_HEAD_DIM and 16 <= V <= DECODE_MAX_HEAD_DIM):
        raise ValueError(
            f"state_cache: head dims K and V must be powers of two in [16, {DECODE_MAX_HEAD_DIM}], got K={K}, V={V}"
        )
    if out is not None:
        check_tensor("out", out, shape=[*lead_sizes, H, V], dtypes=FLOAT_DTYPES, device=dev)
    check_scale(scale)
    check_lower_bound(lower_bound)
    return tuple(lead_sizes)


def check_decode_indices(state_indices, batch: int, state_cache, checks: DeviceChecks | None) -> None:
    """``kda_decode``'s ``state_indices [B]``: in range, negative = padding,
    distinct (queued)."""
    check_tensor("state_indices", state_indices, shape=[batch], dtypes=INDEX_DTYPES, device=state_cache.device)
    if checks is not None:
        check_index_values(checks, "state_indices", state_indices, state_cache.shape[0])


def null_rows_as_negative(state_indices, null_row: int) -> torch.Tensor:
    """``kda_decode``'s checked ``state_indices [B]`` with the rows ``<= null_row`` as
    -1, the padding the index rules know (``null_row``: an int ``>= -1``; the kernel
    reads the null row itself, so only a checked call pays this ``torch.where``)."""
    check_int("null_row", null_row, low=-1)
    return torch.where(state_indices > null_row, state_indices, torch.full_like(state_indices, -1))


def guard_decode_indices(state_indices, batch: int, state_cache, checks: DeviceChecks,
                         null_row: int = -1) -> torch.Tensor:
    """:func:`check_decode_indices` for a launch-then-read-back call: queues the
    value rules on ``checks`` and returns the indices to launch with (all -1 when
    a rule is broken), with ``checks`` sealed (the last rule of the call). An index
    ``<= null_row`` (an int ``>= -1``) is padding: such rows are -1 for the rules and
    in the indices returned (:func:`null_rows_as_negative`). One Triton launch for up
    to ``MAX_ONE_PROGRAM_INDICES`` rows (:mod:`kda_engram.validation.index_rules`),
    the PyTorch rules and :meth:`DeviceChecks.guard` beyond."""
    check_decode_indices(state_indices, batch, state_cache, None)
    if null_row != -1:  # the rules know negative rows as padding
        state_indices = null_rows_as_negative(state_indices, null_row)
    slots = state_cache.shape[0]
    if state_indices.numel() <= MAX_ONE_PROGRAM_INDICES:
        guarded = index_rules(checks, "state_indices", state_indices, slots)
        checks.seal()  # the verdict complete before the decode launch (the next call waits for it only)
        return guarded
    check_index_values(checks, "state_indices", state_indices, slots)
    return checks.guard(state_indices, -1)


def check_decode_multi_indices(state_indices, initial_state_indices, batch: int, steps: int, state_cache,
                               checks: DeviceChecks | None) -> None:
    """``kda_decode_multi``: ``state_indices [B, S]`` written rows in range and
    distinct; ``initial_state_indices [B]`` (default ``state_indices[:, 0]``) in
    range and distinct; no sequence starts from a row another sequence writes (the
    write could land before the read). Value rules queued on ``checks``: one
    launch (:func:`~kda_engram.validation.index_rules.decode_multi_rules`) up to
    :data:`~kda_engram.validation.index_rules.MAX_STATE_RULE_SEQS` written rows,
    PyTorch ops beyond."""
    dev = state_cache.device
    check_tensor("state_indices", state_indices, shape=[batch, steps], dtypes=INDEX_DTYPES, device=dev)
    if initial_state_indices is not None:
        check_tensor("initial_state_indices", initial_state_indices, shape=[batch], dtypes=INDEX_DTYPES, device=dev)
    if checks is not None:
        queue_decode_multi_index_rules(checks, state_indices, initial_state_indices, state_cache.shape[0])


def queue_decode_multi_index_rules(checks: DeviceChecks, state_indices, initial_state_indices, slots: int) -> None:
    """Queue on ``checks`` the value rules of :func:`check_decode_multi_indices` on rows
    whose shapes, dtypes and device are already checked: ``state_indices [B, S]``,
    ``initial_state_indices [B]`` or ``None`` (``state_indices[:, 0]``), ``slots``
    rows in the cache. Nothing to check when ``B`` or ``S`` is 0."""
    batch, steps = state_indices.shape
    if steps == 0 or batch == 0:
        return
    dev = state_indices.device
    init = state_indices[:, 0] if initial_state_indices is None else initial_state_indices
    if fits_decode_multi_rules(batch, steps):
        decode_multi_rules(checks, state_indices, init, slots)  # one launch
        return
    check_index_values(checks, "state_indices", state_indices, slots)
    check_index_values(checks, "initial_state_indices", init, slots)
    # owner[r] = the flat position b * S + s writing row r; its sequence is position // S.
    owner = owner_of_rows(state_indices, slots)
    start = init.to(torch.int64)
    who = owner[torch.where((start >= 0) & (start < slots), start, slots)]
    seq = torch.arange(batch, device=dev)
    clash = (who >= 0) & (torch.div(who, steps, rounding_mode="floor") != seq)
    b = torch.argmax(clash.to(torch.int8))
    checks.add(clash.any(), decode_multi_clash_message(), b, value_at(start, b))


def check_decode_multi_arguments(checks: DeviceChecks | None, q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache,
                                 state_indices, initial_state_indices, out, scale, lower_bound, gate, cu_seqlens,
                                 num_accepted_tokens, null_row, *, rows_name: str = "state_indices") -> None:
    """``kda_decode_multi``'s rules (its input forms apart: they pick kernel branches,
    so they run even unchecked): host rules raise at once, the rules on device values
    are queued on ``checks`` (``None``: host rules only). ``rows_name``: what the
    caller calls ``state_indices`` (an adapter's own name, in its messages)."""
    check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, out, scale, lower_bound, lead=2)
    check_decode_multi_layout(q, state_indices, initial_state_indices, cu_seqlens, num_accepted_tokens, null_row,
                              state_cache, checks, rows_name=rows_name)
    check_log_decay_values(gate, raw_g, checks)


def queue_accepted_tokens_rule(checks: DeviceChecks, num_accepted_tokens: torch.Tensor, width: int,
                               rows_name: str = "state_indices") -> None:
    """Queue on ``checks`` the rule on ``num_accepted_tokens``' values: each in ``[1, width]``
    (``width``: the columns of ``rows_name``, one per token)."""
    lo, hi = num_accepted_tokens.min(), num_accepted_tokens.max()
    checks.add((lo < 1) | (hi > width), f"num_accepted_tokens: expected entries in [1, {width}] (the tokens "
               f"accepted per sequence, at most {rows_name}' width), got min {{}} and max {{}}", lo, hi)


def check_decode_multi_layout(q, state_indices, initial_state_indices, cu_seqlens, num_accepted_tokens,
                              null_row, state_cache, checks: DeviceChecks | None, *,
                              rows_name: str = "state_indices") -> tuple[int, int]:
    """``kda_decode_multi``'s sequences and rows: returns ``(N, W)``, the sequences
    and the most tokens one has (the width of ``state_indices``).

    Without ``cu_seqlens``, ``q [B, S, ...]`` gives ``N, W = B, S``; with it ``q`` is
    ``[1, T, ...]`` (``T``: ``q``'s second size), ``cu_seqlens`` int ``[N+1]`` and
    ``state_indices [N, W]``. ``num_accepted_tokens [N]`` replaces
    ``initial_state_indices``; ``null_row`` is an int ``>= -1``. Queued on ``checks``
    (``None``: host rules only): ``cu_seqlens`` 0 first, non-decreasing, at most ``T``
    last, no sequence longer than ``W``; ``num_accepted_tokens`` in ``[1, W]``; the rows
    the walk really reads and writes (a row ``<= null_row``, a step past the
    sequence's length and the start of a sequence of no token are none) in range
    and distinct, none read by one sequence and written by another
    (:func:`queue_decode_multi_index_rules` on those rows)."""
    check_int("null_row", null_row, low=-1)
    dev = state_cache.device
    if cu_seqlens is None:
        N, W = q.shape[0], q.shape[1]
    else:
        if q.shape[0] != 1:
            raise ValueError(f"q: with cu_seqlens the batch dim must be 1 (the sequences are packed along T), "
                             f"got {list(q.shape)}")
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, device=dev)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens: expected [N+1] with N >= 0, got {list(cu_seqlens.shape)}")
        check_tensor(rows_name, state_indices, dtypes=INDEX_DTYPES, device=dev)
        if state_indices.dim() != 2 or state_indices.shape[0] != cu_seqlens.numel() - 1:
            raise ValueError(f"{rows_name}: expected [{cu_seqlens.numel() - 1}, W] (one row per sequence, a "
                             f"column per token), got {list(state_indices.shape)}")
        N, W = state_indices.shape
    if num_accepted_tokens is not None:
        if initial_state_indices is not None:
            raise ValueError("num_accepted_tokens: the start row comes from it or from initial_state_indices, "
                             "not both")
        check_tensor("num_accepted_tokens", num_accepted_tokens, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    if cu_seqlens is None:  # with cu_seqlens, checked above (its shape gives N, W)
        check_tensor(rows_name, state_indices, shape=[N, W], dtypes=INDEX_DTYPES, device=dev)
    if initial_state_indices is not None:
        check_tensor("initial_state_indices", initial_state_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    if checks is None or N == 0 or W == 0:
        return N, W
    slots = state_cache.shape[0]
    if cu_seqlens is None and num_accepted_tokens is None and null_row == -1:  # the rows given are the rows walked
        queue_decode_multi_index_rules(checks, state_indices, initial_state_indices, slots)
        return N, W
    rows = state_indices.to(torch.int64)
    if num_accepted_tokens is None:
        start = rows[:, 0] if initial_state_indices is None else initial_state_indices.to(torch.int64)
    else:
        accepted = num_accepted_tokens.to(torch.int64)
        queue_accepted_tokens_rule(checks, accepted, W, rows_name)
        start = rows.gather(1, (accepted - 1).clamp(0, W - 1)[:, None])[:, 0]
    none = torch.full_like(rows, -1)
    written = rows > null_row
    started = start > null_row
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        T = q.shape[1]
        checks.add((cu[0] != 0) | (lengths < 0).any() | (cu[-1] > T), f"cu_seqlens: expected 0 first, "
                   f"non-decreasing, at most T={T} last, got first {{}} and last {{}}", cu[0], cu[-1])
        checks.add((lengths > W).any(), f"cu_seqlens: a sequence has more tokens than {rows_name}' width W={W} "
                   f"(one row per token), got {{}}", lengths.max())
        written = written & (torch.arange(W, device=dev)[None, :] < lengths[:, None])
        started = started & (lengths > 0)
    # The walked rows: derived from the rows checked above (same shapes, int64, same device).
    queue_decode_multi_index_rules(checks, torch.where(written, rows, none), torch.where(started, start, none[:, 0]),
                                   slots)
    return N, W


def check_fused_decode_arguments(checks: DeviceChecks | None, x, raw_g, raw_beta, g_out, conv_weight, conv_state,
                                 conv_state_indices, A_log, dt_bias, o_norm_weight, state_cache, state_indices,
                                 initial_state_indices, initial_conv_indices, scale, lower_bound, norm_eps,
                                 out, *, out_dtype=None) -> None:
    """``kda_layer_decode_step``: host rules raise at once; the index rules (rows
    in range, distinct, no sequence starting from a row another one writes) are
    queued on ``checks`` for the caller's one read-back (``None``: host rules only)."""
    check_tensor("state_cache", state_cache, dtypes=STATE_DTYPES)
    check_kernel_device("state_cache", state_cache)
    if state_cache.dim() != 4 or state_cache.shape[2] != state_cache.shape[3] or state_cache.shape[3] not in KDA_HEAD_DIMS:
        raise ValueError(f"state_cache: expected [slots, H, D, D] with D in {KDA_HEAD_DIMS}, "
                         f"got {list(state_cache.shape)}")
    _, H, V, K = state_cache.shape
    C = 2 * H * K + H * V
    dev = state_cache.device
    check_tensor("x", x, dtypes=FLOAT_DTYPES, device=dev)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected shape [B, {C}] or [B, S, {C}], got {list(x.shape)}")
    multi = x.dim() == 3
    lead = list(x.shape[:-1])
    check_tensor("x", x, shape=[*lead, C])
    check_tensor("raw_g", raw_g, shape=[*lead, H * K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("raw_beta", raw_beta, shape=[*lead, H], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("g_out", g_out, shape=[*lead, H * V], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("conv_weight", conv_weight, shape=[C, CONV_WIDTH], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("conv_state", conv_state, shape=[None, C, CONV_WIDTH - 1], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("A_log", A_log, shape=[H], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=dev)
    if list(dt_bias.shape) not in ([H, K], [H * K]):
        raise ValueError(f"dt_bias: expected shape [{H}, {K}] or [{H * K}], got {list(dt_bias.shape)}")
    check_tensor("o_norm_weight", o_norm_weight, shape=[V], dtypes=FLOAT_DTYPES, device=dev)
    if out is not None:
        check_tensor("out", out, shape=[*lead, H * V], dtypes=FLOAT_DTYPES, device=dev)
    check_out_dtype(out_dtype)
    check_scale(scale)
    check_lower_bound(lower_bound)
    check_real("norm_eps", norm_eps, sign="non-negative")
    if not multi:
        for name, t in (("initial_state_indices", initial_state_indices),
                        ("initial_conv_indices", initial_conv_indices)):
            if t is not None:
                raise ValueError(f"{name}: only with S tokens per sequence (x [B, S, C])")
        check_decode_indices(state_indices, lead[0], state_cache, None)
        check_tensor("conv_state_indices", conv_state_indices, shape=lead, dtypes=INDEX_DTYPES, device=dev)
        if checks is not None:  # both index sets in one launch
            queue_index_sets(checks, [("state_indices", [state_indices], state_cache.shape[0]),
                                      ("conv_state_indices", [conv_state_indices], conv_state.shape[0])])
        return
    B, S = lead
    check_decode_multi_indices(state_indices, initial_state_indices, B, S, state_cache, checks)
    check_tensor("conv_state_indices", conv_state_indices, shape=lead, dtypes=INDEX_DTYPES, device=dev)
    if initial_conv_indices is not None:
        check_tensor("initial_conv_indices", initial_conv_indices, shape=[B], dtypes=INDEX_DTYPES, device=dev)
    if checks is not None and B and S:
        cinit = conv_state_indices[:, 0] if initial_conv_indices is None else initial_conv_indices
        queue_index_sets(checks, [("conv_state_indices", [conv_state_indices], conv_state.shape[0]),
                                  ("initial_conv_indices", [cinit], conv_state.shape[0])])  # one launch
