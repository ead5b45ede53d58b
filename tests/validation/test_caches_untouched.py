"""A call that raises on bad input leaves every cache bit-identical.

The caches hold NaN sentinels and real values; each call is refused by a rule on
device values. Every entry point launches before its verdict is read (guarded
indices: rows -1, sequences empty, offsets 0, token ids 0), so this pins that the
guarded launches write no cache; the error itself comes at the next call
(``refused`` ends its block with ``raise_pending_errors``).
"""

import pytest
import torch

from kda_engram.engram.hashing import next_history, ngram_hash
from kda_engram.engram.layout import EngramLayout
from kda_engram.kda.chunk import kda_prefill_walk
from kda_engram.kda.conv import kda_conv_checkpoint, kda_conv_decode
from kda_engram.kda.decode import kda_decode, kda_decode_multi
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.kda.prologue import kda_prefill_prologue
from kda_engram.kda.reference import naive_chunk_operands

from ..helpers import assert_same, bits, raw_kda_inputs, refused, with_sentinels

H, K, V = 1, 16, 16
CONV_C = 2 * H * K + H * V


def prefill_raw(T, seed=0):
    return raw_kda_inputs((1, T), H, K, V, seed)


def decode_raw(B, S=None, seed=0):
    return raw_kda_inputs((B,) if S is None else (B, S), H, K, V, seed)


@pytest.mark.parametrize("indices", [[1, 1], [0, 6]], ids=["duplicate", "out_of_range"])
def test_kda_decode(indices):
    cache = with_sentinels(6, H, V, K)
    before = cache.clone()
    with refused(ValueError, match="state_indices"):
        kda_decode(**decode_raw(2), state_cache=cache, state_indices=torch.tensor(indices))
    assert_same([cache], [before])


def test_kda_decode_multi():
    cache = with_sentinels(6, H, V, K)
    before = cache.clone()
    with refused(ValueError, match="initial_state_indices"):
        kda_decode_multi(**decode_raw(2, 2), state_cache=cache, state_indices=torch.tensor([[0, 1], [2, 3]]),
                         initial_state_indices=torch.tensor([2, 4]))
    assert_same([cache], [before])


PREFILL_BAD = [
    ("checkpoint_offsets", dict(checkpoint_offsets=torch.tensor([32, 0]))),
    ("checkpoint_state_indices", dict(checkpoint_offsets=torch.tensor([64, 0]),
                                      checkpoint_state_indices=torch.tensor([3, -1]))),  # sequence 1's row
    ("state_indices", dict(state_indices=torch.tensor([3, 3]))),
    ("state_indices", dict(state_indices=torch.tensor([0, 4]))),  # past the cache: the guard must hold the write
    ("conv_state_indices", dict(conv_state_indices=torch.tensor([0, 9]))),
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 80, 70]))),
]


@pytest.mark.parametrize("name, bad", [("", {})] + PREFILL_BAD, ids=["valid"] + [f"{b[0]}{i}" for i, b in enumerate(PREFILL_BAD)])
def test_chunk_kda_prefill(name, bad):
    """The base call is valid (and writes); each bad argument makes it write nothing."""
    T = 70
    cache = with_sentinels(4, H, V, K)
    conv = with_sentinels(3, CONV_C, 3, seed=4)
    kw = dict(cu_seqlens=torch.tensor([0, 66, T]), state_cache=cache, state_indices=torch.tensor([0, 3]),
              has_initial_state=torch.tensor([False, True]), checkpoint_state=cache,
              checkpoint_offsets=torch.tensor([64, 0]), checkpoint_state_indices=torch.tensor([2, -1]),
              conv_weight=torch.randn(CONV_C, 4), conv_state=conv, conv_state_indices=torch.tensor([1, 2]),
              conv_has_initial_state=torch.tensor([True, False]))
    kw.update(bad)
    before = [cache.clone(), conv.clone()]
    if not bad:
        chunk_kda_prefill(**prefill_raw(T), **kw)
        assert not torch.equal(bits(cache), bits(before[0])) and not torch.equal(bits(conv), bits(before[1]))
        return
    with refused(ValueError, match=name):
        chunk_kda_prefill(**prefill_raw(T), **kw)
    assert_same([cache, conv], before)


def test_kda_prefill_walk():
    T = 70
    raw = prefill_raw(T)
    cu = torch.tensor([0, 66, T])
    ops = naive_chunk_operands(**raw, cu_seqlens=cu)
    cache = with_sentinels(4, H, V, K)
    out = with_sentinels(1, T, H, V, seed=5)
    for bad, name in ((dict(checkpoint_offsets=torch.tensor([128, 0])), "checkpoint_offsets"),
                      (dict(checkpoint_offsets=torch.tensor([64, 0]), chunk_offsets=torch.tensor([0, 1, 3])),
                       "chunk_offsets")):
        before = [cache.clone(), out.clone()]
        with refused(ValueError, match=name):
            kda_prefill_walk(ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"], out, 0.25, cu,
                            None, False, state_cache=cache, state_indices=torch.tensor([0, 1]),
                            has_initial_state=torch.tensor([True, True]), checkpoint_state=cache,
                            checkpoint_state_indices=torch.tensor([2, 3]), **bad)
        assert_same([cache, out], before)


@pytest.mark.parametrize("groups", [1, 2])
def test_prefill_walk_bad_cu_seqlens(groups):
    """A decreasing cu_seqlens (the chunk offsets then index garbage): the guarded
    launches, serial or grouped, write no cache row and no output row."""
    T = 140
    raw = prefill_raw(T)
    ops = naive_chunk_operands(**raw, cu_seqlens=torch.tensor([0, 130, T]))
    cache = with_sentinels(4, H, V, K)
    out = with_sentinels(1, T, H, V, seed=5)
    before = [cache.clone(), out.clone()]
    with refused(ValueError, match="cu_seqlens"):
        kda_prefill_walk(ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"], out, 0.25,
                        torch.tensor([0, 130, 100]), None, False, state_cache=cache,
                        state_indices=torch.tensor([0, 1]), has_initial_state=torch.tensor([True, True]),
                        groups=groups)
    assert_same([cache, out], before)


@pytest.mark.parametrize("name, bad", [
    ("conv_state_indices", dict(conv_state_indices=torch.tensor([0, 5]))),
    ("conv_state_indices", dict(conv_state_indices=torch.tensor([2, 2]))),
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 80, 70]))),
    ("chunk_indices", dict(chunk_indices=torch.tensor([[0, 0], [0, 1], [1, 3]]))),
])
def test_prefill_prologue(name, bad):
    T = 70
    raw = prefill_raw(T)
    conv = with_sentinels(3, CONV_C, 3, seed=4)
    kw = dict(cu_seqlens=torch.tensor([0, 66, T]), conv_weight=torch.randn(CONV_C, 4), conv_state=conv,
              conv_state_indices=torch.tensor([1, 2]), conv_has_initial_state=torch.tensor([True, False]))
    kw.update(bad)
    before = conv.clone()
    with refused(ValueError, match=name):
        kda_prefill_prologue(raw["q"], raw["k"], raw["v"], raw["raw_g"], raw["raw_beta"], raw["A_log"],
                           raw["dt_bias"], 0.25, None, **kw)
    assert_same([conv], [before])


def test_ngram_hash_ids_past_the_map():
    """A token id past ``token_map``: the guarded launch reads no id out of range,
    the error names it."""
    layout = EngramLayout.build(layer_ids=[1], max_ngram=3, n_heads=2, head_dim=8, vocab_size=[101, 203],
                                compressed_vocab_size=50, pad_id=2)
    token_map = torch.arange(60) % 50
    with refused(ValueError, match="token_ids"):
        ngram_hash(torch.tensor([1, 2, 10**6, 4]), torch.tensor([0, 4]), layout, token_map=token_map)


def test_kda_conv_decode():
    conv = with_sentinels(4, 8, 3)
    before = conv.clone()
    with refused(ValueError, match="conv_state_indices"):
        kda_conv_decode(torch.randn(2, 8), torch.randn(8, 4), conv, torch.tensor([2, 2]))
    assert_same([conv], [before])


def test_kda_conv_checkpoint():
    conv = with_sentinels(4, 8, 3)
    before = conv.clone()
    x = torch.randn(20, 8)
    for offs, idx, name in (([5, 30], [0, 1], "checkpoint_offsets"), ([5, 6], [1, 1], "checkpoint_indices")):
        with refused(ValueError, match=name):
            kda_conv_checkpoint(x, torch.tensor([0, 10, 20]), torch.tensor(offs), torch.tensor(idx), conv)
        assert_same([conv], [before])


def test_next_history_into_itself():
    layout = EngramLayout.build(layer_ids=[1], max_ngram=3, n_heads=2, head_dim=8, vocab_size=[101, 203],
                                compressed_vocab_size=50, pad_id=2)
    history = torch.tensor([[4, 5], [-1, 7]])
    before = history.clone()
    with refused(ValueError, match="cu_seqlens"):
        next_history(torch.arange(6), torch.tensor([0, 4, 3]), layout, history=history, out=history)
    assert_same([history], [before])


# The GPU's guarded launches, one test per call so that the tier's workers compile
# their kernels side by side (the three in one test took 55 s of a cold smoke run).
@pytest.mark.gpu
def test_guarded_decode_on_the_gpu(gpu):
    """On the GPU the read-back runs on a side stream after the launches: the
    guarded decode launch still leaves the cache bit-identical."""
    cache = with_sentinels(8, 4, 128, 128).to(gpu)
    before = cache.clone()
    x = {n: t.to(gpu) for n, t in raw_kda_inputs((4,), 4, 128, 128, 0).items()}
    with refused(ValueError, match="state_indices"):
        kda_decode(**x, state_cache=cache, state_indices=torch.tensor([0, 2, 9, 3], device=gpu))
    torch.cuda.synchronize()
    assert_same([cache], [before])


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["cu_seqlens", "state_indices"])
def test_guarded_prefill_on_the_gpu(gpu, bad):
    """The guarded prefill launches leave the cache bit-identical on a refused call."""
    cache = with_sentinels(8, 4, 128, 128).to(gpu)
    before = cache.clone()
    T = 300
    x = {n: t.to(gpu) for n, t in raw_kda_inputs((1, T), 4, 128, 128, 1).items()}
    kw = dict(cu_seqlens=torch.tensor([0, 100, 200, T], device=gpu), state_cache=cache,
              state_indices=torch.tensor([1, 3, 5], device=gpu),
              has_initial_state=torch.tensor([True, True, False], device=gpu))
    kw[bad] = dict(cu_seqlens=torch.tensor([0, 200, 100, T], device=gpu),
                   state_indices=torch.tensor([0, 8, 1], device=gpu))[bad]
    with refused(ValueError, match=bad):
        chunk_kda_prefill(**x, **kw)
    torch.cuda.synchronize()
    assert_same([cache], [before])


@pytest.mark.gpu
@pytest.mark.parametrize("rows, message", [([0, 1, 2, 99], "got max 99"), ([0, 1, 2, 0], "distinct")],
                         ids=["out_of_range", "duplicate"])
def test_guarded_layer_step_on_the_gpu(gpu, rows, message):
    """The layer's mixed step (its index sets in one launch, its guards in one
    launch) refused with both caches bit-identical."""
    from kda_engram.layers.kda import KDABatch, KimiDeltaAttention

    layer = KimiDeltaAttention(512, 4, 128, lower_bound=-5.0, dtype=torch.bfloat16, device=gpu)
    layer.reset_parameters(torch.Generator().manual_seed(0))
    sc, cs = layer.allocate_cache(16)
    sc.copy_(with_sentinels(16, 4, 128, 128))
    cs.normal_()
    sc0, cs0 = sc.clone(), cs.clone()
    lens = torch.tensor([1, 1, 100, 60], device=gpu)
    hs = torch.randn(162, 512, device=gpu).bfloat16()
    batch = KDABatch.from_query_lens(lens, torch.tensor(rows, device=gpu), num_decode=2)
    with refused(ValueError, match=f"batch.decode_state_indices/prefill_state_indices: .*{message}"):
        layer(hs, batch, sc, cs)
    torch.cuda.synchronize()
    assert_same([sc, cs], [sc0, cs0])


@pytest.mark.parametrize("indices", [[1, 1, 2], [0, 6, 2]], ids=["duplicate", "out_of_range"])
def test_kda_decode_past_the_one_program_rules(indices, monkeypatch):
    """Past MAX_ONE_PROGRAM_INDICES rows the decode's rules run as PyTorch ops:
    the same refusal, the cache untouched."""
    import kda_engram.validation.kda_decode as rules

    monkeypatch.setattr(rules, "MAX_ONE_PROGRAM_INDICES", 2)
    cache = with_sentinels(6, H, V, K)
    before = cache.clone()
    with refused(ValueError, match="state_indices"):
        kda_decode(**decode_raw(3), state_cache=cache, state_indices=torch.tensor(indices))
    assert_same([cache], [before])


def test_a_positive_log_decay_is_refused_and_writes_no_state():
    """Issue 46: a precomputed log-decay gate with a positive entry was served and
    returned an all-NaN output with no error (through fla's ``chunk_kda`` too)."""
    x = prefill_raw(70)
    g = -torch.rand(1, 70, H, K)
    g[0, 40, 0, 3] = 0.5
    cache = with_sentinels(4, H, V, K)
    before = cache.clone()
    kw = dict(cu_seqlens=torch.tensor([0, 64, 70]), gate="log_decay", state_cache=cache,
              state_indices=torch.tensor([1, 2]), has_initial_state=torch.tensor([True, False]))
    with refused(ValueError, match="raw_g: with gate='log_decay'") as info:
        chunk_kda_prefill(x["q"], x["k"], x["v"], g, x["raw_beta"], None, None, **kw)
    assert "\n" not in str(info.value)
    assert_same([cache], [before])
    d = decode_raw(2)
    with refused(ValueError, match="raw_g: with gate='log_decay'"):
        kda_decode(d["q"], d["k"], d["v"], d["raw_g"].abs(), d["raw_beta"], None, None, cache, torch.tensor([1, 2]),
                   gate="log_decay")
    assert_same([cache], [before])
    dm = decode_raw(2, 2)
    with refused(ValueError, match="raw_g: with gate='log_decay'"):
        kda_decode_multi(dm["q"], dm["k"], dm["v"], dm["raw_g"].abs(), dm["raw_beta"], None, None, cache,
                         torch.tensor([[0, 1], [2, 3]]), gate="log_decay")
    assert_same([cache], [before])
    # A log decay <= 0 is served (the same call with the entry fixed).
    g[0, 40, 0, 3] = -0.5
    chunk_kda_prefill(x["q"], x["k"], x["v"], g, x["raw_beta"], None, None, **kw)
