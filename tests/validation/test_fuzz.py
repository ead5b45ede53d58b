"""Fuzz (hypothesis) of the layer forwards (``KimiDeltaAttention`` and, issue 46,
``EngramLayer`` with its hash history cache) and the decode entry point with mixed
valid and invalid batches (issue 36).

The only oracle: a call either raises one line (``ValueError``/``TypeError``) and
leaves every cache bit-identical, or returns what the plain-PyTorch reference
returns and updates exactly the rows it was given. An invalid batch that is
accepted fails the test (it has no reference). Derandomized, small shapes: the
whole file runs in well under a minute under the interpreter.
"""

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_engram import raise_pending_errors
from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.reference import naive_next_history
from kda_engram.kda.decode import kda_decode
from kda_engram.kda.reference import naive_recurrent_kda
from kda_engram.layers.engram import EngramBatch, EngramLayer
from kda_engram.layers.kda import KDABatch, KimiDeltaAttention
from kda_engram.layers.reference import naive_engram_layer, naive_kda_layer

HID, HEADS, K, SLOTS = 32, 1, 16, 6
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

LAYER_MUTATIONS = [None, None, None, "state_row_past_cache", "conv_row_past_cache", "duplicate_rows",
                   "float_cu_seqlens", "token_count", "decode_query_len", "hidden_dtype", "checkpoint_misaligned"]


def _bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def _refused(call, caches):
    """Run ``call``; on a refusal check the oracle and return True."""
    before = [c.clone() for c in caches]
    try:
        call()
        raise_pending_errors()  # a device rule's error comes at the next call by default
    except (ValueError, TypeError) as e:
        assert "\n" not in str(e), str(e)
        for c, b in zip(caches, before):
            assert torch.equal(_bits(c), _bits(b))
        return True
    return False


_LAYER = {}


def _layer():
    if not _LAYER:
        layer = KimiDeltaAttention(HID, HEADS, K, gate_low_rank_dim=8, output_gate_low_rank_dim=8, lower_bound=-5.0)
        _LAYER["layer"], _LAYER["weights"] = layer, layer.reset_parameters(torch.Generator().manual_seed(0))
    return _LAYER["layer"], _LAYER["weights"]


@SETTINGS
@given(data=st.data())
def test_layer_forward_refuses_in_one_line_or_matches_the_reference(data):
    layer, weights = _layer()
    B = data.draw(st.integers(0, 2), "num_decode")
    lens = data.draw(st.lists(st.integers(1, 8), min_size=0 if B else 1, max_size=2), "prefill lengths")
    N = len(lens)
    rows = data.draw(st.permutations(range(SLOTS)), "rows")[: B + N]
    has = data.draw(st.lists(st.booleans(), min_size=N, max_size=N), "has_initial_state")
    mutation = data.draw(st.sampled_from(LAYER_MUTATIONS), "mutation")
    seed = data.draw(st.integers(0, 2**16), "seed")
    gen = torch.Generator().manual_seed(seed)
    sc, cs = layer.allocate_cache(SLOTS)
    sc.copy_(0.5 * torch.randn(sc.shape, generator=gen))
    cs.copy_(torch.randn(cs.shape, generator=gen))
    T = B + sum(lens)
    x = torch.randn(T, HID, generator=gen)

    query = [1] * B + lens
    state_rows, conv_rows = list(rows), list(rows)
    if mutation == "state_row_past_cache":
        state_rows[data.draw(st.integers(0, B + N - 1))] = SLOTS + data.draw(st.integers(0, 1000))
    elif mutation == "conv_row_past_cache":
        conv_rows[data.draw(st.integers(0, B + N - 1))] = SLOTS + data.draw(st.integers(0, 1000))
    elif mutation == "duplicate_rows" and B + N > 1:
        state_rows[-1] = state_rows[0]
    elif mutation == "decode_query_len" and B:
        query[0] = 3
    else:
        mutation = mutation if mutation in ("float_cu_seqlens", "token_count", "hidden_dtype",
                                            "checkpoint_misaligned") else None
    ck = {}
    if mutation == "checkpoint_misaligned" and N:
        ck = dict(checkpoint_offsets=torch.tensor([0] * B + [32] + [0] * (N - 1)),
                  checkpoint_indices=torch.tensor([-1] * (B + N)))
    elif mutation == "checkpoint_misaligned":
        mutation = None
    batch = KDABatch.from_query_lens(torch.tensor(query), torch.tensor(state_rows),
                                     torch.tensor([True] * B + has), num_decode=B,
                                     conv_state_indices=torch.tensor(conv_rows), **ck)
    if mutation == "float_cu_seqlens":
        batch = dataclasses.replace(batch, prefill_cu_seqlens=batch.prefill_cu_seqlens.float())
    if mutation == "token_count":
        x = torch.randn(T + data.draw(st.integers(1, 3)), HID, generator=gen)
    if mutation == "hidden_dtype":
        x = x.double()

    sc0, cs0 = sc.clone(), cs.clone()
    out = []
    if _refused(lambda: out.append(layer(x, batch, sc, cs)), [sc, cs]):
        assert mutation is not None, "a valid batch was refused"
        return
    assert mutation is None, f"accepted an invalid batch ({mutation})"
    cu = [0]
    for n in query:
        cu.append(cu[-1] + n)
    live = [True] * B + has
    init = torch.stack([sc0[r] if h else torch.zeros_like(sc0[r]) for r, h in zip(rows, live)])
    init_conv = torch.stack([cs0[r] if h else torch.zeros_like(cs0[r]) for r, h in zip(rows, live)])
    y_ref, s_ref, c_ref = naive_kda_layer(weights, x, cu, num_heads=HEADS, head_dim=K, lower_bound=-5.0,
                                              norm_eps=layer.norm_eps, initial_state=init, initial_conv=init_conv)
    assert (out[0].double() - y_ref).abs().max().item() < 1e-4
    for i, r in enumerate(rows):
        assert (sc[r].double() - s_ref[i]).abs().max().item() < 1e-4
        assert (cs[r].double() - c_ref[i]).abs().max().item() < 1e-5
    for r in set(range(SLOTS)) - set(rows):  # rows nobody named: untouched
        assert torch.equal(sc[r], sc0[r]) and torch.equal(cs[r], cs0[r])


DECODE_MUTATIONS = [None, None, "row_past_cache", "duplicate_rows", "float_rows", "rows_shape", "scale_nan"]


@SETTINGS
@given(data=st.data())
def test_kda_decode_refuses_in_one_line_or_matches_the_reference(data):
    B = data.draw(st.integers(1, 4), "batch")
    rows = data.draw(st.permutations(range(SLOTS)), "rows")[:B]
    rows = [r if data.draw(st.booleans()) or r % 3 else -1 for r in rows]  # some padding rows
    mutation = data.draw(st.sampled_from(DECODE_MUTATIONS), "mutation")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    inputs = dict(q=rnd(B, HEADS, K), k=rnd(B, HEADS, K), v=rnd(B, HEADS, K), raw_g=rnd(B, HEADS, K),
                  raw_beta=rnd(B, HEADS), A_log=rnd(HEADS) * 0.5, dt_bias=rnd(HEADS * K))
    cache = 0.5 * rnd(SLOTS, HEADS, K, K)
    idx = torch.tensor(rows)
    kw = {}
    if mutation == "row_past_cache":
        idx[data.draw(st.integers(0, B - 1))] = SLOTS + data.draw(st.integers(0, 100))
    elif mutation == "duplicate_rows" and B > 1:
        idx[-1] = idx[0] = SLOTS - 1
    elif mutation == "float_rows":
        idx = idx.float()
    elif mutation == "rows_shape":
        idx = idx[None]
    elif mutation == "scale_nan":
        kw["scale"] = float("nan")
    else:
        mutation = None
    before = cache.clone()
    out = []
    if _refused(lambda: out.append(kda_decode(**inputs, state_cache=cache, state_indices=idx, **kw)), [cache]):
        assert mutation is not None, "a valid call was refused"
        return
    assert mutation is None, f"accepted an invalid call ({mutation})"
    one = {n: (t[:, None] if n not in ("A_log", "dt_bias") else t) for n, t in inputs.items()}
    h0 = before[idx.clamp(min=0)].clone()
    o_ref, final, _ = naive_recurrent_kda(**one, initial_state=h0, output_final_state=True)
    live = idx >= 0
    assert torch.equal(out[0][~live], torch.zeros_like(out[0][~live]))  # padding rows: zeros
    assert (out[0][live] - o_ref[live, 0]).abs().max().item() < 1e-4 if live.any() else True
    for b in range(B):
        if idx[b] >= 0:
            assert (cache[idx[b]] - final[b]).abs().max().item() < 1e-4
    for r in set(range(SLOTS)) - {int(i) for i in idx}:
        assert torch.equal(cache[r], before[r])


# ------------------------------------------------------------------- Engram layer

DIM, HC, VOCAB, EPS = 32, 2, 30, 1e-6
ENGRAM_MUTATIONS = [None, None, None, "slot_past_cache", "duplicate_slots", "checkpoint_row_past_cache",
                    "token_id_past_vocab", "float_token_ids", "token_count", "hidden_shape", "hidden_dtype",
                    "history_width", "history_dtype", "token_mask_shape", "hidden_requires_grad"]
_ENGRAM = {}


def _engram_layer():
    if not _ENGRAM:
        layout = EngramLayout.build(layer_ids=[2, 5], max_ngram=3, n_heads=2, head_dim=16, vocab_size=[40, 50],
                                    compressed_vocab_size=VOCAB, pad_id=1, seed=3)
        layer = EngramLayer(layout, 5, DIM, HC, eps=EPS, storage="fp32", dtype=torch.float32, device="cpu")
        _ENGRAM["layer"], _ENGRAM["weights"] = layer, layer.reset_parameters(torch.Generator().manual_seed(0))
    return _ENGRAM["layer"], _ENGRAM["weights"]


@SETTINGS
@given(data=st.data())
def test_engram_layer_refuses_in_one_line_or_matches_the_reference(data):
    """The Engram layer hashing here (``token_ids`` with ``history_cache``): a refused
    call leaves the history cache bit-identical (every host rule of the layer runs
    before the hash writes it), an accepted one matches the reference and writes
    exactly the named rows."""
    layer, weights = _engram_layer()
    lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3), "lengths")
    N, T = len(lens), sum(lens)
    rows = data.draw(st.permutations(range(SLOTS)), "rows")[:N]
    has = data.draw(st.lists(st.booleans(), min_size=N, max_size=N), "has_initial_state")
    mutation = data.draw(st.sampled_from(ENGRAM_MUTATIONS), "mutation")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    cache = torch.randint(-1, VOCAB, (SLOTS, 2), generator=gen)
    ids = torch.randint(0, VOCAB, (T,), generator=gen)
    hidden = torch.randn(T, HC, DIM, generator=gen)
    slots = list(rows)
    ck, mask = {}, None
    if mutation == "slot_past_cache":
        slots[data.draw(st.integers(0, N - 1))] = SLOTS + data.draw(st.integers(0, 1000))
    elif mutation == "duplicate_slots" and N > 1:
        slots[-1] = slots[0]
    elif mutation == "checkpoint_row_past_cache":
        ck = dict(checkpoint_offsets=torch.tensor([1] + [0] * (N - 1)),
                  checkpoint_indices=torch.tensor([SLOTS + 3] + [-1] * (N - 1)))
    elif mutation == "token_id_past_vocab":
        ids[data.draw(st.integers(0, T - 1))] = VOCAB + data.draw(st.integers(0, 100))
    elif mutation == "float_token_ids":
        ids = ids.float()
    elif mutation == "token_count":
        hidden = torch.randn(T + data.draw(st.integers(1, 3)), HC, DIM, generator=gen)
    elif mutation == "hidden_shape":
        hidden = hidden.reshape(T, HC * DIM)
    elif mutation == "hidden_dtype":
        hidden = hidden.double()
    elif mutation == "history_width":
        cache = torch.randint(-1, VOCAB, (SLOTS, 3), generator=gen)
    elif mutation == "history_dtype":
        cache = cache.float()
    elif mutation == "token_mask_shape":
        mask = torch.ones(T + 1, dtype=torch.bool)
    elif mutation == "hidden_requires_grad":
        hidden.requires_grad_()
    else:
        mutation = None
    batch = EngramBatch.from_query_lens(torch.tensor(lens), torch.tensor(slots), torch.tensor(has), token_mask=mask,
                                        **ck)
    cache0 = cache.clone()
    out = []
    if _refused(lambda: out.append(layer(hidden, batch, token_ids=ids, history_cache=cache)), [cache]):
        assert mutation is not None, "a valid batch was refused"
        return
    assert mutation is None, f"accepted an invalid batch ({mutation})"
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    hist = torch.stack([cache0[r] if h else torch.full_like(cache0[r], -1) for r, h in zip(rows, has)])
    want = naive_engram_layer(layer.layout, layer.layer_id, weights, hidden, ids, cu, eps=EPS, history=hist)
    assert (out[0].double() - want.double()).abs().max().item() < 1e-4
    new = naive_next_history(ids, cu, layer.layout, history=hist)
    for i, r in enumerate(rows):
        assert cache[r].tolist() == new[i].tolist()
    for r in set(range(SLOTS)) - set(rows):  # rows nobody named: untouched
        assert torch.equal(cache[r], cache0[r])
