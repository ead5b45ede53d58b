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


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_engram_gate_ops(device):
    T, hc, dim = 5, 2, 32
    hidden = rnd(T, hc, dim, seed=1, device=device)
    kv = rnd(T, (hc + 1) * dim, seed=2, device=device)
    qw, kw = rnd(hc, dim, seed=3, device=device), rnd(hc, dim, seed=4, device=device)
    mask = torch.tensor([True, False, True, True, True], device=device)
    opcheck(ops.engram._engram_post_wkv_op, (hidden, kv, qw, kw, 1e-6, 1e-6, mask, 4))
    width = dim // 2
    sends = []
    for r in range(2):
        cols = torch.cat([torch.arange(j * dim + r * width, j * dim + (r + 1) * width) for j in range(hc + 1)])
        kv_r = kv[:, cols.to(device)]
        opcheck(ops.engram._engram_gate_partials_op, (hidden, kv_r, qw, kw, r, 2))
        sends.append(ops.engram_gate_partials(hidden, kv_r, qw, kw, rank=r, tp_size=2))
    gathered = torch.cat(sends)
    opcheck(ops.engram._engram_gate_finish_op, (hidden, gathered, 2, 1e-6, 1e-6, mask))
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
    opcheck(ops.engram._ngram_hash_op, (ids, cu, h, hist, dead, None, False))
    opcheck(ops.engram._ngram_hash_op, (ids, cu, h, None, None, None, True))
    opcheck(ops.engram._next_history_op, (ids, cu, h, hist, dead))
    rows = ops.ngram_hash(ids, cu, layout, history=hist)[:, 1]
    for rank in (0, 1):
        table = EngramTable.for_layer(layout, 3, storage="fp32", device=device, rank=rank, world_size=2)
        table.load_(rnd(table.num_rows, 16, seed=5))
        opcheck(ops.engram._engram_lookup_op, (rows, ops.handle(table), False))
        opcheck(ops.engram._engram_lookup_op, (rows, ops.handle(table), True))
        assert torch.equal(ops.engram_lookup(rows, table, local=True), table.lookup_local(rows))
    cache = torch.randint(-1, 25, (5, 2), generator=torch.Generator().manual_seed(1)).to(device)
    slots, has = idx([4, -1, 0], device), torch.tensor([True, True, False], device=device)
    opcheck(ops.engram._engram_history_gather_op, (cache, slots, has))
    opcheck(ops.engram._engram_history_scatter_op, (cache, slots, hist))
    opcheck(ops.engram._engram_history_checkpoint_op, (ids, cu, hist, dead, idx([2, 0, 5], device),
                                                       idx([1, 2, 3], device), cache))


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
