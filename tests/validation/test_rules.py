"""The argument rules of kda_engram.validation, on their own (CPU, no kernels)."""

import dataclasses
import math

import pytest
import torch

from kda_engram import constants, platform
from kda_engram.validation import common
from kda_engram.validation.common import DeviceChecks, check_index_values, check_instance, check_int, check_real
from kda_engram.validation.engram import check_column_sizes, check_gate_scalars
from kda_engram.bundles import StateArgs
from kda_engram.validation.kda_decode import check_decode_multi_indices
from kda_engram.validation.kda_inputs import check_cu_seqlens, check_lower_bound, check_scale
from kda_engram.validation.kda_prefill import check_state_arguments


@pytest.mark.parametrize("value, sign, exc", [
    (math.nan, None, ValueError), (math.inf, None, ValueError), (-math.inf, None, ValueError),
    (True, None, TypeError), ("1.0", None, TypeError), (torch.tensor(1.0), None, TypeError),
    (0.0, "positive", ValueError), (-1e-9, "non-negative", ValueError), (1e-9, "non-positive", ValueError),
])
def test_check_real_refuses(value, sign, exc):
    with pytest.raises(exc, match="^x: "):
        check_real("x", value, sign=sign)


def test_check_real_accepts():
    check_real("x", 3, sign="positive")
    check_real("x", 0.0, sign="non-negative")
    check_real("x", -5.0, sign="non-positive")
    check_real("x", None, allow_none=True)


def test_scalar_rules():
    check_scale(None)
    check_scale(0.25)
    for bad in (math.nan, 0.0, -1.0):
        with pytest.raises(ValueError, match="scale"):
            check_scale(bad)
    check_lower_bound(None)
    check_lower_bound(-5.0)
    check_lower_bound(0.0)
    with pytest.raises(ValueError, match="lower_bound"):
        check_lower_bound(1.0)
    with pytest.raises(ValueError, match="lower_bound"):
        check_lower_bound(math.nan)
    check_gate_scalars(1e-6, 0.0)
    with pytest.raises(ValueError, match="eps"):
        check_gate_scalars(math.nan, 1e-6)
    with pytest.raises(ValueError, match="clamp_value"):
        check_gate_scalars(1e-6, -1.0)
    with pytest.raises(TypeError, match="eps"):
        check_gate_scalars(None, 1e-6)


def test_check_int():
    check_int("n", 3, low=0, high=3)
    with pytest.raises(TypeError, match="n"):
        check_int("n", 3.0)
    with pytest.raises(TypeError, match="n"):
        check_int("n", True)
    with pytest.raises(ValueError, match="n"):
        check_int("n", 4, high=3)


def test_check_instance():
    class EngramThing:
        pass

    class KDAThing:
        pass

    thing = EngramThing()
    assert check_instance("layout", thing, EngramThing) is thing
    with pytest.raises(TypeError, match="^layout: expected an EngramThing, got str$"):
        check_instance("layout", "x", EngramThing)
    with pytest.raises(TypeError, match="^batch: expected a KDAThing, got EngramThing$"):
        check_instance("batch", thing, KDAThing)


def test_column_sizes():
    assert check_column_sizes([5, 3]) == [5, 3]
    with pytest.raises(TypeError, match="column_sizes"):
        check_column_sizes([5.5, 3])
    with pytest.raises(ValueError, match="column_sizes"):
        check_column_sizes([])
    with pytest.raises(ValueError, match="column_sizes"):
        check_column_sizes([4, 0])


def test_device_checks_read_back_once(monkeypatch):
    """All queued flags travel in one tensor: one .tolist(), no other read."""
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.shape) or real(self))
    checks = DeviceChecks()
    idx = torch.tensor([3, -1, 0, 7])
    check_index_values(checks, "a", idx, 8)
    check_index_values(checks, "b", idx, 8, allow_negative=False)
    assert len(calls) == 0
    with pytest.raises(ValueError, match="^b: expected non-negative entries, got min -1$"):
        checks.run()
    assert len(calls) == 1


@pytest.mark.parametrize("idx, upper, msg", [
    ([0, 5], 5, "entries must be < 5 .* got max 5"),
    ([2, -1, 2], 5, "non-negative entries must be distinct"),
])
def test_index_values(idx, upper, msg):
    checks = DeviceChecks()
    check_index_values(checks, "rows", torch.tensor(idx), upper)
    with pytest.raises(ValueError, match="^rows: " + msg):
        checks.run()


def test_index_values_accept_negatives_repeated():
    checks = DeviceChecks()
    check_index_values(checks, "rows", torch.tensor([-1, 4, -1, 0, -3]), 5)
    checks.run()


@pytest.mark.parametrize("cu, covers_all, msg", [
    ([1, 4], False, "must start at 0, got 1"),
    ([0, 4, 3], False, "must be non-decreasing"),
    ([0, 4, 9], False, "last entry 9 exceeds the 8 tokens"),
    ([0, 4, 7], True, "must end at T=8.*got 7"),
])
def test_cu_seqlens_one_validator(cu, covers_all, msg):
    checks = DeviceChecks()
    check_cu_seqlens(torch.tensor(cu), 8, torch.device("cpu"), checks, covers_all=covers_all)
    with pytest.raises(ValueError, match="^cu_seqlens: " + msg):
        checks.run()


def test_cu_seqlens_host_rules():
    with pytest.raises(TypeError, match="cu_seqlens"):
        check_cu_seqlens(torch.tensor([0.0, 1.0]), 1, torch.device("cpu"), None, covers_all=False)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected shape \[N\+1\]"):
        check_cu_seqlens(torch.zeros(0, dtype=torch.int64), 0, torch.device("cpu"), None, covers_all=False)


def _check_state(checks, **kw):
    """:func:`check_state_arguments` on keyword arguments: the state's as its bundle."""
    state = StateArgs.pick(kw)
    return check_state_arguments(checks, state, **{n: v for n, v in kw.items() if n not in StateArgs.names})


def _state_args(**kw):
    N, H, V, K = 3, 1, 16, 16
    base = dict(num_seqs=N, num_heads=H, head_v=V, head_k=K, device=torch.device("cpu"),
                cu_seqlens=torch.tensor([0, 128, 192, 202]))  # lengths 128, 64, 10
    base.update(kw)
    return base


def test_checkpoint_offsets_rules():
    ck = torch.zeros(3, 1, 16, 16)
    for offs, msg in (([64, 0, 0], None), ([32, 0, 0], r"checkpoint_offsets\[0\]"),
                      ([0, 128, 0], r"checkpoint_offsets\[1\].*length 64, got 128"),
                      ([0, 0, -64], r"checkpoint_offsets\[2\]")):
        checks = DeviceChecks()
        _check_state(checks, **_state_args(checkpoint_state=ck, checkpoint_offsets=torch.tensor(offs)))
        if msg is None:
            checks.run()
        else:
            with pytest.raises(ValueError, match=msg):
                checks.run()


def test_checkpoint_rows_only_for_exporting_sequences():
    """A sequence without a checkpoint may name any row (it is not written)."""
    ck = torch.zeros(2, 1, 16, 16)
    checks = DeviceChecks()
    _check_state(checks, **_state_args(checkpoint_state=ck, checkpoint_offsets=torch.tensor([64, 0, 0]),
                                                checkpoint_state_indices=torch.tensor([1, 1, 99])))
    checks.run()
    checks = DeviceChecks()
    _check_state(checks, **_state_args(checkpoint_state=ck, checkpoint_offsets=torch.tensor([64, 64, 0]),
                                                checkpoint_state_indices=torch.tensor([1, 1, 0])))
    with pytest.raises(ValueError, match="checkpoint_state_indices: non-negative entries must be distinct"):
        checks.run()


def test_checkpoint_into_another_sequences_state_row():
    cache = torch.zeros(4, 1, 16, 16)
    common_kw = dict(state_cache=cache, state_indices=torch.tensor([0, 1, 2]),
                     has_initial_state=torch.tensor([True, True, True]), checkpoint_state=cache)
    checks = DeviceChecks()
    _check_state(checks, **_state_args(**common_kw, checkpoint_offsets=torch.tensor([64, 0, 0]),
                                                checkpoint_state_indices=torch.tensor([0, 3, 3])))
    checks.run()  # own row, or a row no sequence owns
    checks = DeviceChecks()
    _check_state(checks, **_state_args(**common_kw, checkpoint_offsets=torch.tensor([64, 0, 0]),
                                                checkpoint_state_indices=torch.tensor([2, 3, 3])))
    with pytest.raises(ValueError, match=r"checkpoint_state_indices\[0\]=2 is the state_cache row of sequence 2"):
        checks.run()


def test_decode_multi_clash():
    cache = torch.zeros(8, 1, 16, 16)
    idx = torch.tensor([[0, 1], [2, 3]])
    checks = DeviceChecks()
    check_decode_multi_indices(idx, torch.tensor([2, 5]), 2, 2, cache, checks)
    with pytest.raises(ValueError, match="initial_state_indices: sequence 0 starts from row 2"):
        checks.run()
    checks = DeviceChecks()
    check_decode_multi_indices(idx, torch.tensor([1, 5]), 2, 2, cache, checks)  # its own row / a free row
    checks.run()


def test_kernel_device_rule(monkeypatch):
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="^x: the kernels need tensors on a CUDA/ROCm device, got one on cpu; "
                                         ".*TRITON_INTERPRET=1"):
        common.check_kernel_device("x", torch.zeros(1))


def test_constants_defined_once():
    from kda_engram.kda import chunk, decode, gate, metadata, reference

    assert metadata.CHUNK_SIZE is constants.CHUNK_SIZE
    assert chunk.KDA_CHECKPOINT_ALIGNMENT == constants.KDA_CHECKPOINT_ALIGNMENT
    assert reference.LOG2E is gate.LOG2E is constants.LOG2E  # the span rule's (it left the prologue)
    assert reference.L2NORM_EPS == decode.L2NORM_EPS == constants.L2NORM_EPS


def test_is_amd():
    assert platform.is_amd() == (torch.version.hip is not None)


def test_kernels_take_constants_from_constants():
    """No kernel module reaches up into a reference module for its constants."""
    import importlib
    import inspect

    for name in ("kda.chunk", "kda.chunk_kernels", "kda.decode", "kda.prologue", "kda.prologue_kernels", "kda.conv",
                 "kda.metadata", "kda.prefill", "engram.gate", "engram.sharded_gate", "engram.table", "engram.hashing"):
        source = inspect.getsource(importlib.import_module(f"kda_engram.{name}"))
        assert "from .reference import" not in source and "reference import" not in source, name


# ---------------------------------------------------------------- decode index rules in one launch


@pytest.mark.parametrize("n", [1, 5, 64, 65, 300, 4096])
def test_index_rules_kernel_matches_the_rules(n):
    """The one-program rules agree with the PyTorch rules on valid, duplicate,
    out-of-range and negative indices, and guard every entry to -1 on a refusal."""
    from kda_engram.validation.index_rules import index_rules

    gen = torch.Generator().manual_seed(n)
    valid = torch.randperm(2 * n, generator=gen)[:n].to(torch.int32)
    valid[::7] = -1  # padding rows
    cases = [(valid, None)]
    if n > 1:
        dup = valid.clone()
        dup[n - 1] = dup[n // 2] = 2 * n - 1
        cases.append((dup, "distinct"))
    high = valid.clone()
    high[n // 3] = 2 * n
    cases.append((high, f"got max {2 * n}"))
    for idx, error in cases:
        verdict = DeviceChecks()
        guarded = index_rules(verdict, "state_indices", idx, 2 * n)
        if error is None:
            verdict.run()
            assert torch.equal(guarded, idx)
        else:
            with pytest.raises(ValueError, match=f"state_indices: .*{error}"):
                verdict.run()
            assert torch.equal(guarded, torch.full_like(idx, -1))
    verdict = DeviceChecks()
    guarded = index_rules(verdict, "rows", valid, 2 * n, allow_negative=False)
    with pytest.raises(ValueError, match="rows: expected non-negative entries, got min -1"):
        verdict.run()
    # Strided input, int64: read through its stride, guarded copy contiguous.
    wide = torch.stack([valid.long(), valid.long()], 1)[:, 0]
    verdict = DeviceChecks()
    guarded = index_rules(verdict, "state_indices", wide, 2 * n)
    verdict.run()
    assert guarded.dtype == torch.int64 and torch.equal(guarded, valid.long())


def test_index_rules_sort_keys_never_wrap():
    """The distinct rule sorts int32 keys: int64 entries past 2^31 (or far below 0)
    must neither wrap onto a real row nor hide a duplicate."""
    from kda_engram.validation.index_rules import index_rules, index_set_rules

    def error(idx, upper, sets=False):
        checks = DeviceChecks()
        if sets:
            index_set_rules(checks, [("rows", [idx[:2], idx[2:]], upper)])
        else:
            index_rules(checks, "rows", idx, upper)
        try:
            checks.run()
        except ValueError as exc:
            return str(exc)
        return None

    for sets in (False, True):
        # -2^32 + 5 is "no row" (negative), not row 5 after a wrap.
        assert error(torch.tensor([5, -(2**32) + 5, 3, 1]), 8, sets) is None
        # 2^32 + 5 is out of range (reported as such), not a duplicate of row 5.
        assert "must be < 8 (rows available), got max 4294967301" in error(torch.tensor([5, 2**32 + 5, 3, 1]), 8, sets)
        # A real duplicate beside huge values is still found.
        assert "distinct" in error(torch.tensor([-(2**40), 3, 1, 3]), 8, sets)
        # Padding past n (the register width is a power of two) never counts.
        assert error(torch.tensor([0, 1, 2]), 3, sets) is None


def test_device_checks_mix_packed_and_plain_rules():
    """Plain rules and kernel verdicts share one read-back; each broken rule
    reports its own details, in the order the rules were added."""
    from kda_engram.validation.index_rules import cu_seqlens_rules

    def first_error(cu, plain_bad):
        checks = DeviceChecks()
        checks.add(torch.tensor(plain_bad[0]), "first: {} {}", torch.tensor(11), torch.tensor(12, dtype=torch.int32))
        checks.add_packed(*cu_seqlens_rules(torch.tensor(cu), 10, covers_all=True))
        checks.add(torch.tensor(plain_bad[1]), "last: {}", torch.tensor(13))
        guarded = checks.guard(torch.tensor([4, 5]), -1)
        try:
            checks.run()
        except ValueError as exc:
            return str(exc), guarded.tolist()
        return None, guarded.tolist()

    assert first_error([0, 4, 10], (False, False)) == (None, [4, 5])
    assert first_error([0, 4, 10], (True, True)) == ("first: 11 12", [-1, -1])
    assert first_error([1, 4, 10], (False, True)) == ("cu_seqlens: must start at 0, got 1", [-1, -1])
    assert first_error([0, 6, 4, 10], (False, False))[0] == "cu_seqlens: must be non-decreasing, got a sequence of length -2"
    assert first_error([0, 4, 9], (False, False))[0] == (
        "cu_seqlens: must end at T=10 (the tokens of the inputs), got 9")
    assert first_error([0, 4, 10], (False, True)) == ("last: 13", [-1, -1])
    # One packed verdict alone: no gathering op, the verdict itself is read back.
    checks = DeviceChecks()
    checks.add_packed(*cu_seqlens_rules(torch.tensor([0, 3, 2]), 2, covers_all=False))
    with pytest.raises(ValueError, match="length -1"):
        checks.run()


# ------------------------------------------------- a call's index sets and guards in one launch


def _first_error(queue):
    checks = DeviceChecks()
    queue(checks)
    try:
        checks.run()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("sizes", [(3, 0, 0), (5, 60, 0), (64, 1, 2), (40, 200, 60)])
def test_index_set_rules_match_the_pytorch_rules(sizes):
    """Sets of up to three segments (int32 and int64, strided), up to three sets:
    the one-launch rules give the error the PyTorch rules give on the
    concatenation, on valid rows, a duplicate across segments, a row out of range."""
    from kda_engram.validation.index_rules import fits_index_set_rules, index_set_rules

    total = sum(sizes)
    gen = torch.Generator().manual_seed(total)
    rows = torch.randperm(2 * total, generator=gen)[:total]
    rows[::5] = -1  # "no row", repeated
    a, b = sizes[0], sizes[0] + sizes[1]
    wide = torch.stack([rows, rows], 1)[:, 1]  # strided
    segments = [rows[:a].to(torch.int32), wide[a:b], rows[b:]]
    segments = [s for s in segments if s.numel()] or [rows[:0]]
    dup = [s.clone() for s in segments]
    if total > 1:
        dup[-1][-1] = 2 * total - 1
        dup[0][0] = 2 * total - 1
    high = [s.clone() for s in segments]
    high[-1][0] = 2 * total + 3
    for case in (segments, dup, high):
        sets = [("first", case, 2 * total), ("second", [torch.arange(4)], 4), ("third", case[:1], 4 * total)]
        assert fits_index_set_rules(sets)
        one_launch = _first_error(lambda c: index_set_rules(c, sets))
        pytorch = _first_error(lambda c: [check_index_values(c, name, torch.cat([s.long() for s in segs]), upper)
                                          for name, segs, upper in sets])
        assert one_launch == pytorch
    assert _first_error(lambda c: index_set_rules(c, [("first", high, 2 * total)])) == (
        f"first: entries must be < {2 * total} (rows available), got max {2 * total + 3}")
    if total > 1:
        assert "first: non-negative entries must be distinct" in _first_error(
            lambda c: index_set_rules(c, [("first", dup, 2 * total)]))


def test_index_sets_too_large_for_one_launch_take_the_pytorch_rules():
    from kda_engram.validation.index_rules import MAX_ONE_PROGRAM_INDICES, fits_index_set_rules
    from kda_engram.validation.common import queue_index_sets

    big = torch.arange(MAX_ONE_PROGRAM_INDICES + 1)
    assert not fits_index_set_rules([("rows", [big], big.numel())])
    assert not fits_index_set_rules([("rows", [big[:1]], 2)] * 4)
    big[-1] = 0
    assert "rows: non-negative entries must be distinct" in _first_error(
        lambda c: queue_index_sets(c, [("rows", [big[:10], big[10:]], big.numel())]))
    assert _first_error(lambda c: queue_index_sets(c, [("rows", [big[:0]], 1)])) is None  # empty: no rule


def test_guard_many_guards_every_tensor_by_every_rule():
    """One launch guards up to eight tensors of their own dtypes and shapes, each
    by the OR of all the call's rules; None stays None; more than eight and
    non-contiguous tensors take the per-tensor guard."""
    def guarded(bad_rule):
        checks = DeviceChecks()
        checks.add(torch.tensor(False), "fine")
        checks.add(torch.tensor(bad_rule), "broken")
        xs = [(torch.arange(5, dtype=torch.int32), -1), (None, -1), (torch.arange(6).view(3, 2), 0),
              (torch.arange(8)[::2], -1)] + [(torch.arange(3), k) for k in range(7)]
        xs.append((torch.arange(12).view(3, 4).t(), -1))  # non-contiguous 2-d
        out = checks.guard_many(*xs)
        assert out[1] is None
        for (x, _), y in zip(xs, out):
            if x is not None:
                assert y.dtype == x.dtype and y.shape == x.shape
        return xs, out

    xs, out = guarded(False)
    assert all(y is None or torch.equal(x, y) for (x, _), y in zip(xs, out))
    xs, out = guarded(True)
    assert all(y is None or torch.equal(y, torch.full_like(x, none)) for (x, none), y in zip(xs, out))
    checks = DeviceChecks()  # no rule: the tensors themselves
    x = torch.arange(3)
    assert checks.guard_many((x, -1))[0] is x


# ------------------------------------------- a prefill's state and checkpoint rules in one launch


def _state_rule_cases(N: int, gen: torch.Generator):
    """(name, kwargs of check_state_arguments) for valid calls and one broken rule
    each: rows out of range, duplicated, a bad offset, a snapshot on another
    sequence's state row, with and without checkpoint rows and lengths."""
    H, D = 1, 16
    slots = 3 * N + 2
    cache = torch.zeros(slots, H, D, D)
    other = torch.zeros(2 * N + 1, H, D, D)
    lengths = torch.randint(0, 300, (N,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    perm = torch.randperm(slots, generator=gen)
    rows, ck_rows = perm[:N].to(torch.int32), perm[N:2 * N]
    offs = (lengths // 64 * 64) * (torch.arange(N) % 3 != 0)  # some export, some not
    has = torch.ones(N, dtype=torch.bool)

    def call(**kw):
        base = dict(num_seqs=N, num_heads=H, head_v=D, head_k=D, device=torch.device("cpu"), cu_seqlens=cu)
        return {**base, **kw}

    state = dict(state_cache=cache, state_indices=rows, has_initial_state=has)
    yield "state only", call(**state)
    yield "cache + own rows", call(**state, checkpoint_state=cache, checkpoint_offsets=offs,
                                   checkpoint_state_indices=ck_rows)
    yield "staging buffer, row n", call(**state, checkpoint_state=other, checkpoint_offsets=offs)
    yield "no cache, unbounded", call(cu_seqlens=None, checkpoint_state=other, checkpoint_offsets=offs,
                                      checkpoint_state_indices=ck_rows.to(torch.int32))
    wide = torch.stack([rows.long(), rows.long()], 1)[:, 1]  # strided int64
    yield "strided", call(state_cache=cache, state_indices=wide, has_initial_state=has)
    high = rows.clone()
    high[N // 2] = slots + 5
    yield "state row out of range", call(**{**state, "state_indices": high})
    if N > 1:
        dup = rows.clone()
        dup[-1] = dup[0]
        yield "duplicate state row", call(**{**state, "state_indices": dup}, checkpoint_state=cache,
                                          checkpoint_offsets=offs, checkpoint_state_indices=ck_rows)
    bad = offs.clone()
    bad[N - 1] = 65
    yield "unaligned offset", call(**state, checkpoint_state=cache, checkpoint_offsets=bad,
                                   checkpoint_state_indices=ck_rows)
    past = offs.clone()
    past[0] = (int(lengths[0]) // 64 + 1) * 64
    yield "offset past its sequence", call(**state, checkpoint_state=cache, checkpoint_offsets=past,
                                           checkpoint_state_indices=ck_rows)
    active = (offs > 0).nonzero().flatten().tolist()
    if len(active) >= 1 and N > 1:
        n = active[-1]
        clash = ck_rows.clone()
        clash[n] = rows[(n + 1) % N]
        yield "snapshot on another sequence's row", call(**state, checkpoint_state=cache, checkpoint_offsets=offs,
                                                         checkpoint_state_indices=clash)
        own = ck_rows.clone()
        own[n] = rows[n]
        yield "snapshot on its own row", call(**state, checkpoint_state=cache, checkpoint_offsets=offs,
                                              checkpoint_state_indices=own)
        inactive = [i for i in range(N) if i not in active]
        if inactive:
            idle = ck_rows.clone()
            idle[inactive[0]] = 10**6  # a sequence that does not export: its row is never checked
            yield "idle sequence's row ignored", call(**state, checkpoint_state=cache, checkpoint_offsets=offs,
                                                      checkpoint_state_indices=idle)
        if len(active) >= 2:
            ck_dup = ck_rows.clone()
            ck_dup[active[0]] = ck_dup[active[1]]
            yield "duplicate checkpoint row", call(**state, checkpoint_state=cache, checkpoint_offsets=offs,
                                                   checkpoint_state_indices=ck_dup)


@pytest.mark.parametrize("N", [1, 2, 7, 70, 300])
def test_state_rules_match_the_pytorch_rules(N, monkeypatch):
    """The one-launch state and checkpoint rules give the error (message and
    details) the PyTorch rules give, case by case, and none on valid calls."""
    from kda_engram.validation import kda_prefill as kda_rules

    gen = torch.Generator().manual_seed(N)
    seen = []
    for name, kw in _state_rule_cases(N, gen):
        assert kda_rules.fits_state_rules(N, kw.get("cu_seqlens"), kw.get("state_indices"))
        one_launch = _first_error(lambda c: _check_state(c, **kw))
        with monkeypatch.context() as m:
            m.setattr(kda_rules, "fits_state_rules", lambda *a: False)
            pytorch = _first_error(lambda c: _check_state(c, **kw))
        assert one_launch == pytorch, name
        seen.append((name, one_launch))
    errors = dict(seen)
    assert errors["state only"] is None and errors["cache + own rows"] is None
    assert errors.get("snapshot on its own row") is None and errors.get("idle sequence's row ignored") is None
    if N > 1:
        assert "snapshot on another sequence's row" in errors  # the seeds give every N > 1 an exporting sequence
    assert "state_indices: entries must be <" in errors["state row out of range"]
    assert "multiple of 64" in errors["unaligned offset"] and f"[{N - 1}]" in errors["unaligned offset"]
    if N > 1 and "snapshot on another sequence's row" in errors:
        assert "is the state_cache row of sequence" in errors["snapshot on another sequence's row"]


def test_state_rules_past_the_one_program_size_take_the_pytorch_rules():
    from kda_engram.validation.index_rules import MAX_STATE_RULE_SEQS, fits_state_rules

    assert fits_state_rules(MAX_STATE_RULE_SEQS, torch.zeros(MAX_STATE_RULE_SEQS + 1))
    assert not fits_state_rules(MAX_STATE_RULE_SEQS + 1, None)
    assert not fits_state_rules(4, torch.zeros(2, 2))


@pytest.mark.parametrize("B,S", [(1, 1), (3, 2), (16, 4), (100, 3)])
def test_decode_multi_rules_match_the_pytorch_rules(B, S, monkeypatch):
    """``kda_decode_multi``'s one-launch rules give the error the PyTorch rules give:
    valid rows (a sequence may start from a row it writes itself), written and
    initial rows out of range or duplicated, and a start on another sequence's row."""
    from kda_engram.validation import kda_decode as kda_rules

    gen = torch.Generator().manual_seed(B * S)
    slots = B * S + B + 3
    cache = torch.zeros(slots, 1, 16, 16)
    perm = torch.randperm(slots, generator=gen)
    written = perm[: B * S].view(B, S).to(torch.int32)
    fresh = perm[B * S: B * S + B]
    written[::3, -1] = -1  # padding steps
    cases = {"default start": (written, None), "own row": (written, written[:, S - 1].clone()),
             "fresh rows": (written, fresh), "strided int64": (written.long().t().contiguous().t(), fresh)}
    high = written.clone()
    high[B // 2, 0] = slots
    cases["written out of range"] = (high, None)
    cases["initial out of range"] = (written, torch.where(torch.arange(B) == B - 1, slots + 7, fresh))
    if B * S > 1:
        dup = written.clone()
        dup.view(-1)[-1] = dup.view(-1)[0]
        cases["written duplicate"] = (dup, fresh)
    if B > 1:
        cases["initial duplicate"] = (written, torch.cat([fresh[:1], fresh[:1], fresh[2:]]))
        steal = fresh.clone()
        steal[B - 1] = written[0, 0]
        cases["start on another sequence's row"] = (written, steal)
    errors = {}
    for name, (w, init) in cases.items():
        def queue(c):
            kda_rules.check_decode_multi_indices(w, init, B, S, cache, c)
        one_launch = _first_error(queue)
        with monkeypatch.context() as m:
            m.setattr(kda_rules, "fits_decode_multi_rules", lambda *a: False)
            pytorch = _first_error(queue)
        assert one_launch == pytorch, name
        errors[name] = one_launch
    assert errors["default start"] is None and errors["own row"] is None and errors["fresh rows"] is None
    assert errors["strided int64"] is None
    assert "initial_state_indices: entries must be <" in errors["initial out of range"]
    if B > 1:
        assert f"sequence {B - 1} starts from row {int(written[0, 0])}" in errors["start on another sequence's row"]


# ------------------------------------------------- a layer step's batch rules in one launch


def _batch_cases(B: int, N: int, gen: torch.Generator):
    """(name, batch, num_tokens, cache sizes) of a layer step: valid batches (decode
    only, prefill only, mixed, with checkpoints into the caches or separate buffers,
    without cache sizes as ``KDABatch.validate`` may run) and one broken rule each
    (several in one, where the first in rule order must win)."""
    from kda_engram.layers.kda import KDABatch

    lens = [1] * B + torch.randint(0, 140, (N,), generator=gen).tolist()
    if N:
        lens[B] = 100  # the first sequence exports a checkpoint at 64
    slots = 2 * (B + N) + 4
    rows = torch.randperm(slots, generator=gen)[: B + N]
    rows[:: 4] = -1  # padding decode rows and sequences without a row, repeated
    conv = torch.randperm(slots, generator=gen)[: B + N].to(torch.int32)
    has = torch.rand(B + N, generator=gen) > 0.5
    offs = torch.tensor([length // 64 * 64 for length in lens]) * ((torch.arange(B + N) - B) % 2 == 0)
    spare = torch.randperm(slots, generator=gen)[: B + N]
    ck_rows = torch.where(torch.isin(spare, rows), spare + slots, spare)  # never a row written this step
    T = sum(lens)
    sizes = dict(state_slots=slots, conv_slots=slots)

    def batch(**kw):
        return KDABatch.from_query_lens(torch.tensor(lens), rows, has, num_decode=B, **kw)

    def replace(b, **fields):
        return dataclasses.replace(b, **fields)

    into_caches = dict(checkpoint_offsets=offs, checkpoint_indices=ck_rows)
    yield "plain", batch(conv_state_indices=conv), T, sizes
    yield "checkpoints into the caches", batch(**into_caches), T, {**sizes, "state_slots": 3 * slots,
                                                                    "conv_slots": 3 * slots}
    yield "separate checkpoint buffers", batch(**into_caches), T, {**sizes, "checkpoint_rows": 2 * slots,
                                                                    "conv_checkpoint_rows": 2 * slots}
    yield "no cache sizes", batch(**into_caches), T, {}
    wide = torch.stack([rows, rows], 1)[:, 1]  # strided int64
    yield "strided", batch(conv_state_indices=wide), T, sizes
    if B:
        bad_lens = list(lens)
        bad_lens[B - 1] = 3
        yield "decode query length 3", KDABatch.from_query_lens(torch.tensor(bad_lens), rows, num_decode=B), T, sizes
        high = rows.clone()
        high[B // 2] = slots + 7
        yield "decode row out of range", KDABatch.from_query_lens(torch.tensor(lens), high, num_decode=B), T, sizes
        both = list(bad_lens)
        dup = rows.clone()
        dup[-1] = dup[0] = 1
        yield "query length and duplicate: the first rule", KDABatch.from_query_lens(
            torch.tensor(both), dup, num_decode=B), T, sizes
    if B + N > 1:
        dup = conv.clone()
        dup[-1] = dup[0] = 2
        yield "duplicate conv rows", batch(conv_state_indices=dup), T, sizes
    plain = batch()
    cu = plain.prefill_cu_seqlens
    yield "cu_seqlens from 1", replace(plain, prefill_cu_seqlens=cu + 1), T, sizes
    if N:  # (without prefill sequences a token count off is a host rule)
        yield "token count", plain, T + 1, sizes
    if N > 1:
        down = cu.clone()
        down[1] = down[2] + 1
        yield "cu_seqlens decreasing", replace(plain, prefill_cu_seqlens=down), T, sizes
        past = offs.clone()
        past[B + 1] = (lens[B + 1] // 64 + 1) * 64
        yield "offset past its sequence", batch(checkpoint_offsets=past, checkpoint_indices=ck_rows), T, sizes
        odd = offs.clone()
        odd[B] = 32
        yield "unaligned offset", batch(checkpoint_offsets=odd, checkpoint_indices=ck_rows), T, sizes
        active = [n for n in range(B, B + N) if offs[n] > 0]
        if active:
            clash = ck_rows.clone()
            clash[active[0]] = rows[rows >= 0][-1]  # a state row this step writes
            yield "checkpoint on a written row", batch(checkpoint_offsets=offs, checkpoint_indices=clash), T, sizes
            far = ck_rows.clone()
            far[active[0]] = 10**12
            yield "checkpoint row past its buffer", batch(checkpoint_offsets=offs, checkpoint_indices=far), T, \
                {**sizes, "checkpoint_rows": 2 * slots}


@pytest.mark.parametrize("B,N", [(4, 0), (0, 3), (3, 4), (64, 9), (1, 1)])
def test_kda_batch_rules_match_the_pytorch_rules(B, N, monkeypatch):
    """The layer's batch rules in one launch give the error (message and details)
    of its PyTorch rules, case by case, none on valid batches, and the same guarded
    copies: the fields the launches read, unchanged when every rule holds, all
    "none" when one is broken."""
    from kda_engram.validation import kda_batch as kda_rules

    launched = []
    real = kda_rules.kda_batch_rules
    monkeypatch.setattr(kda_rules, "kda_batch_rules", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(10 * B + N)
    errors = {}
    for name, batch, T, sizes in _batch_cases(B, N, gen):
        def queue(c, out):
            out.update(kda_rules.check_kda_batch(batch, T, None, c, guard=True, **sizes))

        one_launch, pytorch = {}, {}
        calls = len(launched)
        error = _first_error(lambda c: queue(c, one_launch))
        assert len(launched) == calls + 1, name
        with monkeypatch.context() as m:
            m.setattr(kda_rules, "fits_kda_batch_rules", lambda *a: False)
            assert _first_error(lambda c: queue(c, pytorch)) == error, name
        assert len(launched) == calls + 1, name  # the PyTorch rules launched no batch kernel
        expect = {"decode_state_indices", "decode_conv_indices"} if B else set()
        if N:
            expect |= {"prefill_cu_seqlens", "prefill_state_indices", "prefill_conv_indices"}
            if batch.checkpoint_offsets is not None:
                expect |= {"checkpoint_offsets", "checkpoint_indices"}
        assert set(one_launch) == set(pytorch) == expect, name
        for field, copy in one_launch.items():
            want = getattr(batch, field) if error is None else torch.full_like(getattr(batch, field), dict(
                kda_rules.KDA_BATCH_GUARDS)[field])
            assert copy.dtype == torch.int64 and torch.equal(copy, want.long()), (name, field)
            assert torch.equal(pytorch[field].long(), want.long()), (name, field)
        errors[name] = error
    for name in ("plain", "checkpoints into the caches", "separate checkpoint buffers", "no cache sizes", "strided"):
        assert errors[name] is None, (name, errors[name])
    if N:
        assert errors["token count"].startswith("batch.prefill_cu_seqlens: must end at T=")
    assert errors["cu_seqlens from 1"] == "batch.prefill_cu_seqlens: must start at 0, got 1"
    if B:
        assert errors["decode query length 3"] == (f"query_lens[{B - 1}]: the first num_decode={B} requests are "
                                                   "decode rows of one token, got 3")
        assert errors["query length and duplicate: the first rule"] == errors["decode query length 3"]
        assert errors["decode row out of range"].startswith(
            "batch.decode_state_indices/prefill_state_indices: entries must be <")
    if B + N > 1:
        assert "conv_indices: non-negative entries must be distinct" in errors["duplicate conv rows"]
    if N > 1:
        assert "must be non-decreasing, got a sequence of length -" in errors["cu_seqlens decreasing"]
        assert errors["unaligned offset"].startswith("batch.checkpoint_offsets[0]: expected 0 (none) or a multiple")
        assert errors["offset past its sequence"].startswith("batch.checkpoint_offsets[1]")
        assert "checkpoint_indices (state rows written this step): non-negative entries must be distinct" in \
            errors["checkpoint on a written row"]
        assert errors["checkpoint row past its buffer"] == (
            f"batch.checkpoint_indices: entries must be < {2 * (2 * (B + N) + 4)} (rows available), got max {10**12}")


def test_kda_batch_rules_fit_one_program():
    from kda_engram.validation.index_rules import MAX_ONE_PROGRAM_INDICES, fits_kda_batch_rules

    assert fits_kda_batch_rules(MAX_ONE_PROGRAM_INDICES, 0, False, 2)
    assert fits_kda_batch_rules(MAX_ONE_PROGRAM_INDICES // 2, MAX_ONE_PROGRAM_INDICES // 4, True, 4)
    assert not fits_kda_batch_rules(MAX_ONE_PROGRAM_INDICES // 2, MAX_ONE_PROGRAM_INDICES // 4 + 1, True, 4)
    assert not fits_kda_batch_rules(MAX_ONE_PROGRAM_INDICES + 1, 0, False, 2)
    assert not fits_kda_batch_rules(4, 4, True, 5)
