import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kda_engram.engram.layout import EngramLayout, is_prime, next_unused_prime

V41_FLASH = {
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16_000_000,
    "engram_compressed_vocab_size": 99_092,
    "engram_pad_token_id": 2,
}
V41_FLASH_NUM_EMBEDDINGS = [384006168, 384016682]


def sieve(n):
    flags = np.ones(n + 1, dtype=bool)
    flags[:2] = False
    for p in range(2, int(n**0.5) + 1):
        if flags[p]:
            flags[p * p :: p] = False
    return flags


def test_v41_flash_table_sizes_match_published():
    start = time.perf_counter()
    layout = EngramLayout.from_config(V41_FLASH)
    elapsed = time.perf_counter() - start
    assert list(layout.num_embeddings) == V41_FLASH_NUM_EMBEDDINGS
    assert elapsed < 1.0, f"building V4.1's layout took {elapsed:.2f}s"
    assert layout.n_hash_cols == 24 and layout.embedding_dim == 24 * 256
    # The published list is checked when present, and a wrong one is refused.
    EngramLayout.from_config({**V41_FLASH, "engram_num_embeddings": V41_FLASH_NUM_EMBEDDINGS})
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramLayout.from_config({**V41_FLASH, "engram_num_embeddings": [384006168, 384016683]})


def test_v41_flash_primes_follow_the_rule():
    layout = EngramLayout.from_config(V41_FLASH)
    p = layout.primes
    assert p.shape == (2, 3, 8)
    flat = p.reshape(-1)
    assert len(set(flat.tolist())) == flat.size
    assert all(is_prime(int(x)) for x in flat)
    # One set of used primes shared by all layers: layer 1's primes are the first
    # 24 at or above 16M, layer 14's the next 24, all consecutive primes.
    consecutive = []
    c = 16_000_000
    while len(consecutive) < 48:
        if is_prime(c):
            consecutive.append(c)
        c += 1
    assert sorted(flat.tolist()) == consecutive
    assert p[0, 0, 0] == consecutive[0]


def brute_layout_primes(layer_ids, max_ngram, n_heads, vocab_sizes):
    flags = sieve(max(vocab_sizes) * 4 + 1000)
    used = set()
    out = np.zeros((len(layer_ids), max_ngram - 1, n_heads), dtype=np.int64)
    for li in range(len(layer_ids)):
        for o in range(max_ngram - 1):
            c = vocab_sizes[o]
            for j in range(n_heads):
                while not flags[c] or c in used:
                    c += 1
                used.add(c)
                out[li, o, j] = c
                c += 1
    return out


def test_primes_per_order_vocab_sizes_against_sieve():
    layout = EngramLayout.build(
        layer_ids=[3, 0, 7], max_ngram=4, n_heads=5, head_dim=16,
        vocab_size=[1000, 1010, 990], compressed_vocab_size=300, pad_id=0,
    )
    expect = brute_layout_primes([3, 0, 7], 4, 5, [1000, 1010, 990])
    np.testing.assert_array_equal(layout.primes, expect)
    # Orders restart at their own floor and skip primes taken before.
    assert layout.primes[0, 0, 0] == 1009 and layout.primes[0, 2, 0] >= 991


def test_is_prime_exact():
    flags = sieve(20000)
    assert [n for n in range(20001) if is_prime(n)] == list(np.nonzero(flags)[0])
    # Carmichael numbers and strong pseudoprimes to several bases are composite.
    for n in (561, 1105, 1729, 2047, 3215031751, 3825123056546413051, 318665857834031151167461):
        assert not is_prime(n)
    for n in (2**31 - 1, 2**61 - 1, 16000057, 1_000_000_007):
        assert is_prime(n)
    assert next_unused_prime(16000000, set()) == 16000057
    assert next_unused_prime(16000000, {16000057}) == 16000079


def test_multipliers_reproduce_the_seeded_rng():
    layout = EngramLayout.from_config({**V41_FLASH, "engram_seed": 5})
    half = (np.iinfo(np.int64).max // 99_092) // 2
    for li, layer_id in enumerate([1, 14]):
        rng = np.random.default_rng(5 + 10007 * layer_id)
        expect = rng.integers(0, half, size=4, dtype=np.int64) * 2 + 1
        np.testing.assert_array_equal(layout.multipliers[li], expect)
    m = layout.multipliers
    assert (m % 2 == 1).all() and (m > 0).all()
    # A compressed id times a multiplier never overflows int64.
    assert int(m.max()) * (99_092 - 1) < 2**63
    assert not np.array_equal(layout.multipliers, EngramLayout.from_config(V41_FLASH).multipliers)


def test_offsets_and_columns():
    layout = EngramLayout.build(layer_ids=[1, 2], max_ngram=3, n_heads=2, head_dim=8, vocab_size=50, compressed_vocab_size=20, pad_id=1)
    sizes = layout.column_sizes(2)
    np.testing.assert_array_equal(sizes, layout.primes[1].reshape(-1))
    np.testing.assert_array_equal(layout.column_offsets(2), np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    local = layout.row_offsets()
    glob = layout.row_offsets(global_rows=True)
    np.testing.assert_array_equal(local[1], layout.column_offsets(2))
    np.testing.assert_array_equal(glob[1], local[1] + layout.num_embeddings[0])
    assert layout.total_rows(global_rows=True) == sum(layout.num_embeddings)
    assert layout.layer_index(2) == 1
    with pytest.raises(ValueError, match="layer_id"):
        layout.layer_index(3)
    primes, offsets, mults = layout.device_arrays("cpu")
    assert primes.dtype == offsets.dtype == mults.dtype == torch.int64
    assert layout.device_arrays("cpu")[0] is primes  # cached


def test_config_object_and_token_map_pad():
    cfg = SimpleNamespace(**{**V41_FLASH, "engram_compressed_vocab_size": 4, "engram_vocab_size": [100, 200, 300]})
    token_map = torch.tensor([0, 1, 3, 2, 3])
    layout = EngramLayout.from_config(cfg, token_map=token_map)
    assert layout.pad_id == 2 and layout.hash_pad_id == 3
    assert layout.vocab_sizes == (100, 200, 300)
    assert EngramLayout.from_config(cfg).hash_pad_id == 2
    with pytest.raises(ValueError, match="compressed"):
        EngramLayout.from_config(cfg, token_map=torch.tensor([0, 1, 2, 0, 1]))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"engram_max_ngram_size": 1}, "max_ngram"),
        ({"engram_vocab_size": [100, 200]}, "vocab_size"),
        ({"engram_layer_ids": [1, 1]}, "layer_ids"),
        ({"engram_pad_token_id": 99_092}, "pad_id"),
        ({"engram_layer_ids": []}, "layer_ids"),
    ],
)
def test_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        EngramLayout.from_config({**V41_FLASH, **change})


def test_missing_key():
    cfg = dict(V41_FLASH)
    del cfg["engram_n_heads"]
    with pytest.raises(ValueError, match="engram_n_heads"):
        EngramLayout.from_config(cfg)
