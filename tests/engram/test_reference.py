import pytest
import torch

from kda_engram.engram.reference import naive_engram_gate_sharded, naive_engram_post_wkv, shard_kv_by_dim


def inputs(T=7, hc=4, dim=64, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return rnd(T, hc, dim), rnd(T, (hc + 1) * dim), rnd(hc, dim), rnd(hc, dim)


def test_gate_matches_formula():
    hidden, kv, qw, kw = inputs(T=3, hc=2, dim=8)
    out = naive_engram_post_wkv(hidden, kv, qw, kw, eps=1e-5, clamp_value=1e-6)
    t, h, dim = 1, 1, 8
    key, value = kv[t, h * dim : (h + 1) * dim], kv[t, 2 * dim :]
    x = hidden[t, h]
    dot = (x * qw[h] * kw[h] * key).sum() / torch.sqrt((x * x).mean() + 1e-5) / torch.sqrt((key * key).mean() + 1e-5) / dim**0.5
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6)))
    assert torch.allclose(out[t, h], x + gate * value)


def test_mask_and_missing_kv_rows():
    hidden, kv, qw, kw = inputs(T=6)
    mask = torch.tensor([True, False, True, True, False, True])
    out = naive_engram_post_wkv(hidden, kv, qw, kw, eps=1e-6, token_mask=mask, num_kv_tokens=4)
    assert torch.equal(out[1], hidden[1]) and torch.equal(out[4:], hidden[4:])
    assert not torch.equal(out[0], hidden[0])
    short = naive_engram_post_wkv(hidden, kv[:4], qw, kw, eps=1e-6, token_mask=mask)
    assert torch.equal(short, out)


def test_zero_dot_takes_positive_sign():
    hidden, kv, qw, kw = inputs(T=2, hc=1, dim=16)
    out = naive_engram_post_wkv(hidden, kv, torch.zeros_like(qw), kw, eps=1e-6, clamp_value=0.25)
    gate = torch.sigmoid(torch.tensor(0.5, dtype=torch.float64))
    assert torch.allclose(out, hidden + gate * kv[:, None, 16:])


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_sharded_equals_unsharded(tp_size):
    hidden, kv, qw, kw = inputs(T=9, hc=4, dim=64, seed=tp_size)
    mask = torch.rand(9) > 0.3
    full = naive_engram_post_wkv(hidden, kv, qw, kw, eps=1e-6, token_mask=mask)
    sharded = naive_engram_gate_sharded(hidden, kv, qw, kw, tp_size=tp_size, eps=1e-6, token_mask=mask)
    assert (full - sharded).abs().max() < 1e-12


def test_shard_layout():
    kv = torch.arange(2 * 3 * 8).reshape(2, 24)  # hc = 2, dim = 8
    r0, r1 = shard_kv_by_dim(kv, hc=2, tp_size=2)
    assert r0[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert r1[0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_sharded_rejects_indivisible_dim():
    hidden, kv, qw, kw = inputs(dim=12)
    with pytest.raises(ValueError, match="divisible"):
        naive_engram_gate_sharded(hidden, kv, qw, kw, tp_size=8, eps=1e-6)
