"""The Engram hash-history cache kernels (engram/history.py) against plain Python:
gather (fresh sequences read -1), scatter (only the named rows change) and the
prefix-cache checkpoint (the history of the truncated sequence)."""

import pytest
import torch

from kda_engram.engram.history import checkpoint_history, gather_history, scatter_history
from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.reference import naive_next_history


def test_history_kernels_against_python():
    gen = torch.Generator().manual_seed(10)
    cache = torch.randint(-1, 50, (6, 3), generator=gen)
    idx = torch.tensor([5, -1, 0, 2])
    has = torch.tensor([True, True, False, True])
    got = gather_history(cache, idx, has)
    want = torch.stack([cache[5], torch.full((3,), -1), torch.full((3,), -1), cache[2]])
    assert torch.equal(got, want)
    assert torch.equal(gather_history(cache, idx)[2], cache[0])
    new = torch.randint(0, 50, (4, 3), generator=gen, dtype=torch.int32)
    before = cache.clone()
    scatter_history(cache, idx, new)
    assert torch.equal(cache[5], new[0].long()) and torch.equal(cache[0], new[2].long())
    assert torch.equal(cache[2], new[3].long())
    for r in (1, 3, 4):
        assert torch.equal(cache[r], before[r])
    # checkpoint: offsets 0 (none), 1 (reaches into the old history), 4; row -1 skipped.
    ids = torch.arange(100, 112)
    cu = torch.tensor([0, 4, 6, 12, 12])
    hist = torch.tensor([[7, 8, 9], [1, 2, 3], [4, 5, 6], [0, 0, 0]])
    offs = torch.tensor([0, 1, 4, 0])
    rows = torch.tensor([1, 3, -1, 4])
    before = cache.clone()
    checkpoint_history(ids, cu, hist, None, offs, rows, cache)
    assert cache[3].tolist() == [2, 3, 104]
    assert torch.equal(cache[[0, 1, 2, 4, 5]], before[[0, 1, 2, 4, 5]])
    offs = torch.tensor([4, 0, 6, 0])
    rows = torch.tensor([1, -1, 4, -1])
    checkpoint_history(ids, cu, hist, None, offs, rows, cache)
    assert cache[1].tolist() == [101, 102, 103] and cache[4].tolist() == [109, 110, 111]
    with pytest.raises(ValueError, match="checkpoint_offsets"):
        checkpoint_history(ids, cu, hist, None, torch.tensor([5, 0, 0, 0]), rows, cache)
    with pytest.raises(ValueError, match="distinct"):
        gather_history(cache, torch.tensor([1, 1]))


@pytest.mark.parametrize("with_history, with_dead", [(False, False), (True, False), (True, True)])
def test_checkpoint_is_the_history_of_the_truncated_sequence(with_history, with_dead):
    layout = EngramLayout.build(layer_ids=[0], max_ngram=4, n_heads=1, head_dim=8, vocab_size=[101, 103, 107],
                                compressed_vocab_size=40, pad_id=0, seed=1)
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 2, 7, 5]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ids = torch.randint(0, 40, (cu[-1],), generator=gen)
    hist = torch.randint(-1, 40, (4, 3), generator=gen) if with_history else None
    dead = torch.rand(cu[-1], generator=gen) < 0.3 if with_dead else None
    offs = torch.tensor([1, 2, 5, 3])
    rows = torch.tensor([6, 0, 3, 2])
    cache = torch.full((7, 3), -7)
    checkpoint_history(ids, torch.tensor(cu), hist, dead, offs, rows, cache)
    for n, (p, row) in enumerate(zip(offs.tolist(), rows.tolist())):
        part = ids[cu[n] : cu[n] + p]
        want = naive_next_history(part, [0, p], layout, history=None if hist is None else hist[n : n + 1],
                                dead_mask=None if dead is None else dead[cu[n] : cu[n] + p])
        assert cache[row].tolist() == torch.as_tensor(want)[0].tolist(), n
    untouched = [r for r in range(7) if r not in rows.tolist()]
    assert (cache[untouched] == -7).all()


def test_the_layer_module_re_exports_the_kernels():
    from kda_engram.layers import engram as layer

    assert layer.gather_history is gather_history
    assert layer.scatter_history is scatter_history
    assert layer.checkpoint_history is checkpoint_history


@pytest.mark.gpu
def test_gpu_history_kernels_match_python(gpu):
    """The three history kernels at a serving batch (64 sequences up to 2000 tokens,
    a dead-token mask, prefix-cache offsets anywhere in the sequence) on the GPU."""
    layout = EngramLayout.build(layer_ids=[0], max_ngram=4, n_heads=1, head_dim=8, vocab_size=[101, 103, 107],
                                compressed_vocab_size=40, pad_id=0, seed=1)
    gen = torch.Generator().manual_seed(4)
    N, slots = 64, 80
    lengths = torch.randint(1, 2000, (N,), generator=gen).tolist()
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ids = torch.randint(0, 40, (cu[-1],), generator=gen)
    hist = torch.randint(-1, 40, (N, 3), generator=gen)
    dead = torch.rand(cu[-1], generator=gen) < 0.05
    offs = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lengths])
    rows = torch.randperm(slots, generator=gen)[:N]
    rows[::9] = -1
    cache = torch.randint(-1, 40, (slots, 3), generator=gen)
    cache_g = cache.to(gpu)
    has = torch.rand(N, generator=gen) < 0.7
    got = gather_history(cache_g, rows.to(gpu), has.to(gpu))
    want = torch.where((has & (rows >= 0))[:, None], cache[rows.clamp(min=0)], torch.full((N, 3), -1))
    assert torch.equal(got.cpu(), want)
    new = torch.randint(0, 40, (N, 3), generator=gen, dtype=torch.int32)
    scatter_history(cache_g, rows.to(gpu), new.to(gpu))
    live = rows >= 0
    cache[rows[live]] = new[live].long()
    assert torch.equal(cache_g.cpu(), cache)
    checkpoint_history(ids.to(gpu), torch.tensor(cu, device=gpu), hist.to(gpu), dead.to(gpu), offs.to(gpu),
                       rows.to(gpu), cache_g)
    for n, (p, row) in enumerate(zip(offs.tolist(), rows.tolist())):
        if row < 0 or p == 0:
            continue
        cache[row] = torch.as_tensor(naive_next_history(ids[cu[n] : cu[n] + p], [0, p], layout,
                                                      history=hist[n : n + 1], dead_mask=dead[cu[n] : cu[n] + p]))[0]
    assert torch.equal(cache_g.cpu(), cache)
