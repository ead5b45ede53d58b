"""The Engram custom ops (:mod:`kda_engram.ops.engram`) and the object handles
(:mod:`kda_engram.ops.common`): ``torch.library.opcheck`` on every op, the
wrappers against the entry points."""

import gc

import pytest
import torch

from kda_engram import ops
from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.table import EngramTable

from .support import DEVICES, idx, opcheck, rnd, small_layout


def op_args(entry, *args, **kwargs):
    """An :class:`~kda_engram.ops.common.EntryOp`'s positional arguments, bound by
    name (objects that cross as handles given as their handles)."""
    return tuple(entry.bind(args, kwargs).values())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_engram_gate_ops(device):
    T, hc, dim = 5, 2, 32
    hidden = rnd(T, hc, dim, seed=1, device=device)
    kv = rnd(T, (hc + 1) * dim, seed=2, device=device)
    qw, kw = rnd(hc, dim, seed=3, device=device), rnd(hc, dim, seed=4, device=device)
    mask = torch.tensor([True, False, True, True, True], device=device)
    post = ops.engram_post_wkv
    opcheck(post.op, op_args(post, hidden, kv, qw, kw, eps=1e-6, clamp_value=1e-6, token_mask=mask, num_kv_tokens=4))
    width = dim // 2
    sends = []
    for r in range(2):
        cols = torch.cat([torch.arange(j * dim + r * width, j * dim + (r + 1) * width) for j in range(hc + 1)])
        kv_r = kv[:, cols.to(device)]
        opcheck(ops.engram_gate_partials.op, op_args(ops.engram_gate_partials, hidden, kv_r, qw, kw, rank=r, tp_size=2))
        sends.append(ops.engram_gate_partials(hidden, kv_r, qw, kw, rank=r, tp_size=2))
    gathered = torch.cat(sends)
    opcheck(ops.engram_gate_finish.op, op_args(ops.engram_gate_finish, hidden, gathered, tp_size=2, eps=1e-6,
                                               token_mask=mask))
    torch.testing.assert_close(ops.engram_gate_finish(hidden, gathered, tp_size=2, eps=1e-6, token_mask=mask),
                               ops.engram_post_wkv(hidden, kv, qw, kw, eps=1e-6, token_mask=mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_engram_memory_ops(device):
    layout = small_layout()
    h = ops.handle(layout)
    ids = torch.randint(0, 25, (9,), generator=torch.Generator().manual_seed(0)).to(device)
    cu = idx([0, 4, 4, 9], device)
    hist = torch.tensor([[3, 4], [-1, -1], [7, -1]], device=device)
    dead = torch.zeros(9, dtype=torch.bool, device=device)
    dead[6] = True
    opcheck(ops.ngram_hash.op, op_args(ops.ngram_hash, ids, cu, h, history=hist, dead_mask=dead))
    opcheck(ops.ngram_hash.op, op_args(ops.ngram_hash, ids, cu, h, global_rows=True))
    opcheck(ops.next_history.op, op_args(ops.next_history, ids, cu, h, history=hist, dead_mask=dead))
    rows = ops.ngram_hash(ids, cu, layout, history=hist)[:, 1]
    for rank in (0, 1):
        table = EngramTable.for_layer(layout, 3, storage="fp32", device=device, rank=rank, world_size=2)
        table.load_(rnd(table.num_rows, 16, seed=5))
        lookup = ops.engram_lookup
        opcheck(lookup.op, op_args(lookup, rows, ops.handle(table)))
        opcheck(lookup.op, op_args(lookup, rows, ops.handle(table), local=True))
        assert torch.equal(ops.engram_lookup(rows, table, local=True), table.lookup_local(rows))
    cache = torch.randint(-1, 25, (5, 2), generator=torch.Generator().manual_seed(1)).to(device)
    slots, has = idx([4, -1, 0], device), torch.tensor([True, True, False], device=device)
    opcheck(ops.engram_history_gather.op, op_args(ops.engram_history_gather, cache, slots, has))
    opcheck(ops.engram_history_scatter.op, op_args(ops.engram_history_scatter, cache, slots, hist))
    opcheck(ops.engram_history_checkpoint.op, op_args(ops.engram_history_checkpoint, ids, cu, hist, dead,
                                                      idx([2, 0, 5], device), idx([1, 2, 3], device), cache))


def test_handles():
    layout = small_layout()
    h = ops.handle(layout)
    assert ops.handle(layout) == h and ops.handle(h) == h and ops.resolve(h, EngramLayout) is layout
    with pytest.raises(ValueError, match="no live EngramTable"):
        ops.resolve(h, EngramTable)
    with pytest.raises(TypeError, match="expected an EngramLayout or EngramTable"):
        ops.handle("layout")
    table = EngramTable.for_layer(layout, 0, storage="fp32", device="cpu")
    ht = ops.handle(table)
    del table
    gc.collect()
    with pytest.raises(ValueError, match="no live"):
        ops.resolve(ht, EngramTable)




def test_engram_ops_run_the_functions_device_rules_by_default():
    """Issue 46: the history ops wrote rows outside the cache that was passed. By
    default an op runs its function's rules (here: one sync read-back, as the
    history functions do); ``check_inputs=False`` runs the host rules only."""
    from ..helpers import refused

    base = torch.full((6, 2), 7, dtype=torch.int64)
    cache = base[:3]
    before = base.clone()
    with refused(ValueError, match="slot_indices") as info:
        ops.engram_history_scatter(cache, idx([0, 4], "cpu"), torch.zeros(2, 2, dtype=torch.int64))
    assert str(info.value).startswith("slot_indices")
    assert torch.equal(base, before)
    with refused(ValueError, match="slot_indices"):
        ops.engram_history_gather(cache, idx([5], "cpu"))
    lay = small_layout()
    ids = torch.tensor([1, 2, 3, 4])
    with refused(ValueError, match="cu_seqlens"):
        ops.ngram_hash(ids, idx([0, 3, 2], "cpu"), ops.handle(lay))
    with pytest.raises(TypeError, match="check_inputs"):
        ops.engram_history_gather(cache, idx([0], "cpu"), check_inputs=None)


def _host_rule_cases():
    """``(id, call(check_inputs), exception, message)``: a call that breaks a host rule
    of its entry point which the op wrappers once left out (they re-checked one or two
    tensors; a layout or table handle was not resolved)."""
    T, hc, dim = 4, 2, 32
    hidden = rnd(T, hc, dim, seed=1)
    kv = rnd(T, (hc + 1) * dim, seed=2)
    qw, kw = rnd(hc, dim, seed=3), rnd(hc, dim, seed=4)
    layout = small_layout()  # the lambdas hold it: a handle names only a live layout
    table = EngramTable.for_layer(layout, 3, storage="fp32", device="cpu")
    table.load_(rnd(table.num_rows, 16, seed=5))
    ids, cu = torch.arange(6) % 25, idx([0, 2, 2, 6], "cpu")
    cache = torch.full((5, 2), 7, dtype=torch.int64)
    slots = idx([4, -1, 0], "cpu")
    wide = torch.zeros(3, 3, dtype=torch.int64)  # max_ngram - 1 = 2 columns
    return [
        ("post_wkv_kv_dtype", lambda c: ops.engram_post_wkv(hidden, kv.half(), qw, kw, eps=1e-6, check_inputs=c),
         TypeError, "hidden_states, kv: expected one dtype"),
        ("post_wkv_num_kv_tokens", lambda c: ops.engram_post_wkv(hidden, kv, qw, kw, eps=1e-6, num_kv_tokens=9,
                                                                 check_inputs=c),
         ValueError, "num_kv_tokens: expected an int 0 <= num_kv_tokens <= 4, got 9"),
        ("partials_kv_local", lambda c: ops.engram_gate_partials(hidden, kv[:, :40], qw, kw, rank=0, tp_size=2,
                                                                 check_inputs=c),
         ValueError, r"kv_local: expected shape \[4, 48\]"),
        ("finish_gathered", lambda c: ops.engram_gate_finish(hidden, torch.zeros(5, 20), tp_size=2, eps=1e-6,
                                                             check_inputs=c),
         ValueError, r"gathered: expected shape \[tp_size\*T"),
        ("hash_history_width", lambda c: ops.ngram_hash(ids, cu, ops.handle(layout), history=wide, check_inputs=c),
         ValueError, r"history: expected shape \[3, 2\]"),
        ("next_history_width", lambda c: ops.next_history(ids, cu, ops.handle(layout), history=wide, check_inputs=c),
         ValueError, r"history: expected shape \[3, 2\]"),
        ("lookup_rows_width", lambda c: ops.engram_lookup(torch.zeros(6, 3, dtype=torch.int64), ops.handle(table),
                                                          check_inputs=c),
         ValueError, r"rows: expected shape \[T, 4\]"),
        ("gather_flags", lambda c: ops.engram_history_gather(cache, slots, torch.ones(2, dtype=torch.bool),
                                                             check_inputs=c),
         ValueError, r"has_initial_state: expected shape \[3\]"),
        ("scatter_slots", lambda c: ops.engram_history_scatter(cache, slots.float(), cache[:3].clone(),
                                                               check_inputs=c),
         TypeError, "slot_indices: expected dtype"),
        ("checkpoint_offsets", lambda c: ops.engram_history_checkpoint(ids, cu, None, None, idx([0, 0], "cpu"),
                                                                       idx([1, 2, 3], "cpu"), cache, check_inputs=c),
         ValueError, r"checkpoint_offsets: expected shape \[3\]"),
    ], cache


@pytest.mark.parametrize("case", range(10))
@pytest.mark.parametrize("check_inputs", [False, True])
def test_each_op_runs_its_entry_points_whole_host_rules(case, check_inputs):
    """Issue 45: one rule function per entry point, run by the entry point and by its
    op's wrapper with ``check_inputs=False``: the same one-line refusal either way,
    and the history cache written by no refused call."""
    from ..helpers import refused

    cases, cache = _host_rule_cases()
    name, call, exc, message = cases[case]
    before = cache.clone()
    with refused(exc, match=f"^{message}") as info:
        call(check_inputs)
    assert "\n" not in str(info.value), name
    assert torch.equal(cache, before), name


def test_the_ops_run_each_host_rule_once(monkeypatch):
    """The wrapper runs the rules, the op's eager body only launches (``check_inputs=False``);
    by default the entry point runs them, once, and the op is not crossed."""
    import kda_engram.engram.history as history
    import kda_engram.ops.engram as op_module

    calls = []
    rule = history.check_history_gather

    def counted(*args):
        calls.append(args)
        rule(*args)

    monkeypatch.setattr(history, "check_history_gather", counted)
    monkeypatch.setattr(op_module, "check_history_gather", counted)
    cache = torch.arange(10, dtype=torch.int64).view(5, 2)
    slots = idx([4, -1, 0], "cpu")
    for check_inputs in (False, True, "sync"):
        calls.clear()
        got = ops.engram_history_gather(cache, slots, check_inputs=check_inputs)
        assert len(calls) == 1, check_inputs
        assert got.tolist() == [[8, 9], [-1, -1], [0, 1]]
    calls.clear()
    ops.engram_history_gather.unchecked(cache, slots)
    assert calls == []
