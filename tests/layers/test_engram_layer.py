"""EngramLayer: token ids -> hash -> table rows -> wkv -> gate, with the hash history
carried across chunked prefill, decode and prefix-cache checkpoints; ``from_config``
and the DeepSeek-V4.1 weight names. (The history cache kernels: tests/engram/test_history.py.)

References: ``engram.reference`` (NumPy hash, gather, fp8 decode) and the gate
reference, composed by ``naive_engram_layer``.
"""

import numpy as np
import pytest
import torch

from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.reference import naive_next_history, naive_ngram_hash
from kda_engram.engram.table import quantize_fp8_ue8m0
from kda_engram.layers.engram import (
    EngramBatch,
    EngramLayer,
    engram_hash_step,
)
from kda_engram.layers.kda import KDABatch
from kda_engram.layers.reference import naive_engram_layer

from ..helpers import refused

DIM, HC, EPS = 32, 2, 1e-6
VOCAB = 30


def make_layout(head_dim=16):
    return EngramLayout.build(layer_ids=[2, 5], max_ngram=3, n_heads=2, head_dim=head_dim, vocab_size=[40, 50],
                              compressed_vocab_size=VOCAB, pad_id=1, seed=3)


def make_layer(layout=None, layer_id=5, seed=0, **kw):
    layout = layout or make_layout()
    kw.setdefault("storage", "fp32")
    layer = EngramLayer(layout, layer_id, DIM, HC, eps=EPS, dtype=torch.float32, device="cpu", **kw)
    w = layer.reset_parameters(torch.Generator().manual_seed(seed))
    return layer, w


def ids_for(T, seed):
    return torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(seed))


def hidden_for(T, seed):
    return torch.randn(T, HC, DIM, generator=torch.Generator().manual_seed(seed))


def ref_out(layer, w, hidden, ids, cu, **kw):
    return naive_engram_layer(layer.layout, layer.layer_id, w, hidden, ids, cu, eps=EPS, **kw)


def test_whole_layer_matches_reference_and_advances_history():
    layer, w = make_layer()
    lens = [6, 1, 9]
    T = sum(lens)
    ids, hidden = ids_for(T, 1), hidden_for(T, 2)
    gen = torch.Generator().manual_seed(3)
    dead = torch.rand(T, generator=gen) < 0.15
    mask = torch.rand(T, generator=gen) > 0.2
    cache = torch.full((5, 2), -7, dtype=torch.int64)  # -7: never read (fresh sequences)
    slots = torch.tensor([4, -1, 0])
    batch = EngramBatch.from_query_lens(torch.tensor(lens), slots, torch.tensor([False, False, False]),
                                        dead_mask=dead, token_mask=mask)
    batch.validate(T, 5)
    out = layer(hidden, batch, token_ids=ids, history_cache=cache)
    cu = [0, 6, 7, 16]
    want = ref_out(layer, w, hidden, ids, cu, dead_mask=dead, token_mask=mask)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    hist = naive_next_history(ids, cu, layer.layout, dead_mask=dead)
    assert cache[4].tolist() == hist[0].tolist() and cache[0].tolist() == hist[2].tolist()
    assert (cache[[1, 2, 3]] == -7).all()  # the padding sequence (-1) and unnamed rows untouched


@pytest.mark.parametrize("lens", [[], [0], [0, 0]], ids=["no sequence", "one of length 0", "two of length 0"])
def test_an_empty_batch_gives_an_empty_output_and_leaves_the_cache(lens):
    # Issue 54: torch's "cannot reshape tensor of 0 elements" from the embeddings.
    layer, _ = make_layer()
    N = len(lens)
    cache = torch.full((3, 2), 4, dtype=torch.int64)
    batch = EngramBatch(torch.zeros(N + 1, dtype=torch.long), torch.arange(N), torch.zeros(N, dtype=torch.bool))
    hidden = hidden_for(0, 2)
    out = layer(hidden, batch, token_ids=torch.zeros(0, dtype=torch.long), history_cache=cache)
    assert out.shape == (0, HC, DIM) and out.dtype == hidden.dtype
    rows = layer.hash_step(torch.zeros(0, dtype=torch.long), batch, cache.clone())
    assert layer(hidden, rows=rows).shape == (0, HC, DIM)
    # A fresh sequence of length 0 has no tokens: its history is the reference's ("none").
    hist = naive_next_history(torch.zeros(0, dtype=torch.long), [0] * (N + 1), layer.layout)
    assert cache[:N].tolist() == hist.tolist() and (cache[N:] == 4).all()


def test_chunked_prefill_and_decode_equal_one_shot():
    """Sequence A (slot 1) arrives as prefill 7 + prefill 8 + two decode steps, sequence
    B (slot 3) as prefill 5 + decode; batches built from KDABatch (decode rows first)."""
    layer, w = make_layer(seed=4)
    ids_a, ids_b = ids_for(17, 5), ids_for(6, 6)
    h_a, h_b = hidden_for(17, 7), hidden_for(6, 8)
    cache = torch.full((4, 2), -9, dtype=torch.int32)
    steps = [
        # (decode (seq, pos) rows, prefill (seq, start, end, has_init) rows)
        ([], [("a", 0, 7, False), ("b", 0, 5, False)]),
        ([("b", 5)], [("a", 7, 15, True)]),
        ([("a", 15)], []),
        ([("a", 16)], []),
    ]
    seqs = {"a": (ids_a, h_a, 1), "b": (ids_b, h_b, 3)}
    got = {"a": [], "b": []}
    for dec, pre in steps:
        rows = [(s, p, p + 1, True) for s, p in dec] + list(pre)
        ids = torch.cat([seqs[s][0][a:e] for s, a, e, _ in rows])
        hid = torch.cat([seqs[s][1][a:e] for s, a, e, _ in rows])
        kb = KDABatch.from_query_lens(torch.tensor([e - a for _, a, e, _ in rows]),
                                      torch.tensor([seqs[s][2] for s, *_ in rows]),
                                      torch.tensor([h for *_, h in rows]), num_decode=len(dec))
        batch = EngramBatch.from_kda_batch(kb)
        out = layer(hid, batch, rows=layer.hash_step(ids, batch, cache))
        t = 0
        for s, a, e, _ in rows:
            got[s].append(out[t : t + e - a])
            t += e - a
    for s, (ids, hid, _) in seqs.items():
        want = ref_out(layer, w, hid, ids, [0, ids.numel()])
        torch.testing.assert_close(torch.cat(got[s]), want, rtol=1e-5, atol=1e-5)
    assert cache[1].tolist() == ids_a[-2:].tolist() and cache[3].tolist() == ids_b[-2:].tolist()
    assert (cache[[0, 2]] == -9).all()


def test_history_checkpoint_resume_equals_one_shot():
    layout = make_layout()
    L, p = 70, 64
    ids = ids_for(L, 9)
    dead = torch.zeros(L, dtype=torch.bool)
    dead[p - 2] = True  # a dead token inside the checkpointed window
    cache = torch.full((4, 2), -5, dtype=torch.int64)
    one = EngramBatch(torch.tensor([0, L]), torch.tensor([0]), torch.tensor([False]), dead_mask=dead,
                      checkpoint_offsets=torch.tensor([p]), checkpoint_indices=torch.tensor([2]))
    one.validate(L, 4)
    rows_one = engram_hash_step(ids, one, layout, cache)
    assert cache[2].tolist() == [-1, int(ids[p - 1])]  # the window at p, the dead token as -1
    res = EngramBatch(torch.tensor([0, L - p]), torch.tensor([2]), torch.tensor([True]), dead_mask=dead[p:])
    rows_res = engram_hash_step(ids[p:], res, layout, cache)
    assert torch.equal(rows_res, rows_one[p:])
    assert torch.equal(cache[2], cache[0])
    want = naive_ngram_hash(ids, [0, L], layout, dead_mask=dead)
    np.testing.assert_array_equal(rows_one.numpy(), want)


def test_layer_runs_the_module_gate_branch_through_the_ops(monkeypatch):
    """One gate branch: the layer calls Engram.gate with the torch.ops entry points;
    a checked layer has run their host rules (issue 55: once a step), so it calls
    them unchecked; ``check_inputs=False`` leaves the host rules to the ops."""
    from kda_engram import ops
    from kda_engram.layers.engram_gate import Engram
    import kda_engram.ops.engram as op_module

    layer, w = make_layer()
    seen, calls = [], []
    gate = Engram.gate

    def recording_gate(self, *args, **kwargs):
        seen.append(kwargs.get("kernels"))
        return gate(self, *args, **kwargs)

    monkeypatch.setattr(Engram, "gate", recording_gate)
    for name in ("check_post_wkv_arguments", "check_table_lookup"):
        rule = getattr(op_module, name)
        monkeypatch.setattr(op_module, name, lambda *a, _rule=rule, _name=name: (calls.append(_name), _rule(*a)))
    ids, hidden = ids_for(9, 1), hidden_for(9, 2)
    batch = EngramBatch.from_query_lens(torch.tensor([9]), torch.tensor([0]))
    want = ref_out(layer, w, hidden, ids, [0, 9]).float()
    gate_ops = (ops.engram_post_wkv, ops.engram_gate_partials, ops.engram_gate_finish)
    for check_inputs in (True, False):
        seen.clear()
        calls.clear()
        cache = torch.full((1, 2), -1, dtype=torch.int64)
        out = layer(hidden, batch, token_ids=ids, history_cache=cache, check_inputs=check_inputs)
        assert len(seen) == 1
        kernels = (seen[0].post_wkv, seen[0].partials, seen[0].finish)
        for kernel, op in zip(kernels, gate_ops):
            if check_inputs:
                assert kernel is op.unchecked
            else:
                assert kernel.func is op and kernel.keywords == {"check_inputs": False}
        assert calls == ([] if check_inputs else ["check_table_lookup", "check_post_wkv_arguments"])
        torch.testing.assert_close(out, want, atol=5e-5, rtol=0)


@pytest.mark.parametrize("spoil, error, match", [
    (lambda e: setattr(e, "eps", -1.0), ValueError, "^eps: expected a finite number"),
    (lambda e: setattr(e, "clamp_value", float("inf")), ValueError, "^clamp_value: expected a finite number"),
    (lambda e: setattr(e, "q_weight", torch.nn.Parameter(torch.ones(HC, DIM + 1), requires_grad=False)), ValueError,
     r"^q_weight: expected shape \[2, 32\]"),
    (lambda e: setattr(e, "k_weight", torch.nn.Parameter(torch.ones(HC, DIM, dtype=torch.float16),
                                                         requires_grad=False)), TypeError,
     "^k_weight: expected dtype float32, got float16"),
])
def test_a_checked_layer_refuses_a_spoiled_gate_before_the_hash(spoil, error, match):
    """The gate's host rules the layer answers for its ops (they then run unchecked)
    raise as the ops' did, and before the hash writes the history."""
    layer, _ = make_layer()
    spoil(layer.engram)
    hist = torch.tensor([[1, 42]], dtype=torch.int64)
    batch = EngramBatch.from_query_lens(torch.tensor([5]), torch.tensor([0]))
    with pytest.raises(error, match=match):
        layer(hidden_for(5, 2), batch, token_ids=ids_for(5, 1), history_cache=hist)
    assert hist.tolist() == [[1, 42]]


def test_the_hash_step_runs_each_ops_host_rules_once(monkeypatch):
    """Issue 45: a checked step has run every host rule of its history and hash ops
    (one rule function each, :mod:`kda_engram.validation.engram`), so it calls them
    unchecked; an unchecked step (``check_inputs=False``) leaves the host rules to
    the ops."""
    import kda_engram.ops.engram as op_module

    calls = []
    for name in ("check_history_gather", "check_ngram_hash_arguments", "check_next_history_arguments",
                 "check_history_checkpoint", "check_history_scatter"):
        rule = getattr(op_module, name)
        monkeypatch.setattr(op_module, name, lambda *a, _rule=rule, _name=name: (calls.append(_name), _rule(*a)))
    layout = make_layout()
    ids = ids_for(9, 1)
    batch = EngramBatch.from_query_lens(torch.tensor([4, 5]), torch.tensor([0, 1]),
                                        checkpoint_offsets=torch.tensor([0, 2]), checkpoint_indices=torch.tensor([-1, 2]))
    runs = []
    for check_inputs in (True, False):
        calls.clear()
        cache = torch.full((3, 2), -1, dtype=torch.int64)
        runs.append((engram_hash_step(ids, batch, layout, cache, check_inputs=check_inputs), cache))
        assert calls == ([] if check_inputs else ["check_history_gather", "check_ngram_hash_arguments",
                                                  "check_next_history_arguments", "check_history_checkpoint",
                                                  "check_history_scatter"])
    (rows_a, cache_a), (rows_b, cache_b) = runs
    assert torch.equal(rows_a, rows_b) and torch.equal(cache_a, cache_b)
    assert cache_a[2].tolist() == ids[4:6].tolist()  # the checkpoint at offset 2 of the second sequence


def test_a_compiled_hash_step_refuses_a_cache_of_another_width():
    """While ``torch.compile`` traces, the step knows the layout only by its handle: the
    cache's width is checked against next_history's output (the scatter's rule), so
    a cache the hash cannot read is refused before the compiled step runs."""
    layer, _ = make_layer()
    batch = EngramBatch.from_query_lens(torch.tensor([5]), torch.tensor([0]))
    cache = torch.full((1, 3), -1, dtype=torch.int64)  # max_ngram - 1 = 2 columns
    before = cache.clone()
    step = torch.compile(lambda ids: layer.hash_step(ids, batch, cache), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"history: expected shape \[1, 3\], got \[1, 2\]"):
        step(ids_for(5, 1))
    assert torch.equal(cache, before)
    with refused(ValueError, match=r"^history_cache: expected shape \[\*, 2\]"):
        layer.hash_step(ids_for(5, 1), batch, cache)  # eagerly: the layout's own rule


def test_from_config_and_v41_fp8_weights():
    cfg = {"text_config": {
        "hidden_size": DIM, "hc_mult": HC, "rms_norm_eps": EPS, "engram_layer_ids": [2, 5],
        "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32, "engram_vocab_size": [40, 50],
        "engram_compressed_vocab_size": VOCAB, "engram_pad_id": 1, "engram_seed": 3,
    }}
    layer = EngramLayer.from_config(cfg, 5, storage="fp8", dtype=torch.float32, device="cpu")
    assert layer.engram.eps == EPS and layer.layout.head_dim == 32 and layer.table.storage == "fp8"
    prefix = EngramLayer.checkpoint_prefix(5)
    full = layer.random_weights(torch.Generator().manual_seed(11))
    q, s = quantize_fp8_ue8m0(full["embed.weight"])
    ckpt = {prefix + "embed.weight": q.view(torch.float8_e4m3fn), prefix + "embed.scale": s,
            prefix + "wkv.weight": full["wkv.weight"].bfloat16(), prefix + "q_weight": full["q_weight"],
            prefix + "k_weight": full["k_weight"], "layers.2.engram.wkv.weight": torch.zeros(1)}
    assert layer.load_weights(ckpt, prefix) == {n for n in ckpt if n.startswith(prefix)}
    T = 12
    ids, hidden = ids_for(T, 12), hidden_for(T, 13)
    batch = EngramBatch.from_query_lens(torch.tensor([T]), torch.tensor([0]))
    cache = torch.full((1, 2), -1, dtype=torch.int64)
    out = layer(hidden, batch, token_ids=ids, history_cache=cache)
    ref_w = {"embed.weight": q, "embed.scale": s, "wkv.weight": full["wkv.weight"].bfloat16(),
             "q_weight": full["q_weight"], "k_weight": full["k_weight"]}
    want = ref_out(layer, ref_w, hidden, ids, [0, T])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_bad_input():
    layer, w = make_layer()
    with refused(ValueError, match="missing"):
        layer.load_weights({k: v for k, v in w.items() if k != "q_weight"})
    with refused(ValueError, match="unknown"):
        layer.load_weights({**w, "wkv.bias": torch.zeros(3)})
    with refused(ValueError, match="embed.weight: expected shape"):
        layer.load_weights({**w, "embed.weight": torch.zeros(3, 16)})
    with refused(ValueError, match="layer_id"):
        EngramLayer(make_layout(), 4, DIM, HC, dtype=torch.float32, device="cpu")
    with refused(TypeError, match="layout"):
        EngramLayer({"engram_layer_ids": [5]}, 5, DIM, HC, dtype=torch.float32, device="cpu")
    hidden = hidden_for(4, 0)
    batch = EngramBatch.from_query_lens(torch.tensor([4]), torch.tensor([0]))
    with refused(ValueError, match="rows: pass rows"):
        layer(hidden, batch)
    with refused(ValueError, match="rows: expected shape"):
        layer(hidden, batch, rows=torch.zeros(4, 2, 3, dtype=torch.int32))
    with refused(ValueError, match="hidden_states: expected shape"):
        layer(hidden_for(4, 0)[:, :1], batch, rows=torch.zeros(4, 2, 4, dtype=torch.int32))
    with refused(ValueError, match="history_cache: expected shape"):
        engram_hash_step(ids_for(4, 0), batch, layer.layout, torch.zeros(2, 3, dtype=torch.int64))
    with refused(ValueError, match="cu_seqlens"):
        batch.validate(5)
    with refused(ValueError, match="entries must be < 1"):
        EngramBatch.from_query_lens(torch.tensor([4]), torch.tensor([1])).validate(4, 1)
    with refused(ValueError, match="give both or neither"):
        EngramBatch(torch.tensor([0, 4]), torch.tensor([0]), torch.tensor([True]),
                    checkpoint_offsets=torch.tensor([2])).validate(4)
    # The value rules, read back together: the first broken one is named with its values.
    two = dict(cu_seqlens=torch.tensor([0, 4, 7]), slot_indices=torch.tensor([0, 1]),
               has_initial_state=torch.tensor([True, False]))
    EngramBatch(**two, checkpoint_offsets=torch.tensor([4, 0]), checkpoint_indices=torch.tensor([2, 0])).validate(7, 3)
    with refused(ValueError, match=r"checkpoint_offsets\[1\]: expected 0 <= p <= the sequence length 3, got 5"):
        EngramBatch(**two, checkpoint_offsets=torch.tensor([0, 5]), checkpoint_indices=torch.tensor([2, 2])).validate(7)
    with refused(ValueError, match="checkpoint_indices \\(history rows written this step\\): non-negative entries must be distinct"):
        EngramBatch(**two, checkpoint_offsets=torch.tensor([4, 0]), checkpoint_indices=torch.tensor([1, 2])).validate(7, 3)
    with refused(ValueError, match="slot_indices/checkpoint_indices .*: non-negative entries must be distinct"):
        EngramBatch(torch.tensor([0, 4, 7]), torch.tensor([1, 1]), torch.tensor([True, True])).validate(7, 3)
    with refused(ValueError, match="batch.cu_seqlens: expected offsets from 0 to T=7, got first 0 last 6"):
        EngramBatch(torch.tensor([0, 4, 6]), torch.tensor([0, 1]), torch.tensor([True, True])).validate(7)


HASH_BAD = [
    # (name, message, token ids, batch): no EngramBatch.validate before the step.
    ("token_id_past_the_vocabulary", r"token_ids: expected ids in \[0, 30\).* got \[0, 1000000\]",
     lambda: torch.tensor([0, 1, 10**6, 3, 4]), lambda: EngramBatch.from_query_lens(torch.tensor([1, 4]), torch.tensor([0, 1]))),
    ("slot_past_the_cache", "entries must be < 4 .* got max 9",
     lambda: torch.tensor([0, 1, 2, 3, 4]), lambda: EngramBatch.from_query_lens(torch.tensor([1, 4]), torch.tensor([0, 9]))),
    ("token_count_mismatch", "batch.cu_seqlens: expected offsets from 0 to T=5, got first 0 last 3",
     lambda: torch.tensor([0, 1, 2, 3, 4]), lambda: EngramBatch.from_query_lens(torch.tensor([1, 2]), torch.tensor([0, 1]))),
    ("decreasing_cu_seqlens", r"batch.cu_seqlens: expected non-decreasing offsets, got batch.cu_seqlens\[2\] = 1 after 4",
     lambda: torch.tensor([0, 1, 2, 3, 4]),
     lambda: EngramBatch(torch.tensor([0, 4, 1, 5]), torch.tensor([0, 1, 2]), torch.tensor([True, True, True]))),
    ("checkpoint_on_a_slot", "distinct", lambda: torch.tensor([0, 1, 2, 3, 4]),
     lambda: EngramBatch.from_query_lens(torch.tensor([1, 4]), torch.tensor([0, 1]), checkpoint_offsets=torch.tensor([0, 2]),
                                         checkpoint_indices=torch.tensor([-1, 0]))),
]


@pytest.mark.parametrize("name, message, make_ids, make_batch", HASH_BAD, ids=[c[0] for c in HASH_BAD])
def test_refused_hash_step_leaves_the_history_cache_bit_identical(name, message, make_ids, make_batch):
    """Issue 36: engram_hash_step checks the token ids (as ngram_hash does) and the
    batch before writing the history cache; a refusal is one line, the cache intact."""
    layout = make_layout()
    cache = torch.randint(0, VOCAB, (4, 2), generator=torch.Generator().manual_seed(2))
    before = cache.clone()
    with refused(ValueError, match=message) as info:
        engram_hash_step(make_ids(), make_batch(), layout, cache)
    assert "\n" not in str(info.value)
    assert torch.equal(cache, before)


@pytest.mark.gpu
def test_gpu_bf16_layer_matches_reference(gpu):
    layout = EngramLayout.build(layer_ids=[1, 3], max_ngram=4, n_heads=4, head_dim=64, vocab_size=5000,
                                compressed_vocab_size=4000, pad_id=2, seed=0)
    dim, hc = 1024, 4
    layer = EngramLayer(layout, 3, dim, hc, eps=EPS, storage="bf16", dtype=torch.bfloat16, device=gpu)
    w = layer.reset_parameters(torch.Generator().manual_seed(0))
    lens = [1, 1, 300, 77]
    T = sum(lens)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4000, (T,), generator=gen)
    hidden = torch.randn(T, hc, dim, generator=gen)
    cache = torch.randint(0, 4000, (8, 3), generator=gen)
    kb = KDABatch.from_query_lens(torch.tensor(lens, device=gpu), torch.tensor([6, 2, 0, 1], device=gpu),
                                  torch.tensor([True, True, False, True], device=gpu), num_decode=2)
    batch = EngramBatch.from_kda_batch(kb)
    batch.validate(T, 8)
    cache_g = cache.to(gpu)
    out = layer(hidden.to(gpu, torch.bfloat16), batch, token_ids=ids.to(gpu), history_cache=cache_g)
    hist = torch.stack([cache[6], cache[2], torch.full((3,), -1), cache[1]])
    want = naive_engram_layer(layout, 3, w, hidden.bfloat16(), ids, [0, 1, 2, 302, T], eps=EPS, history=hist)
    err = (out.float().cpu() - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err
    new = naive_next_history(ids, [0, 1, 2, 302, T], layout, history=hist)
    assert cache_g[[6, 2, 0, 1]].cpu().tolist() == new.tolist()


@pytest.mark.parametrize("bad, name", [
    (dict(hidden=torch.randn(5, 32)), "hidden_states"),  # wrong shape (issue 46: hist[0] was rewritten first)
    (dict(hidden=torch.randn(5, HC, DIM, dtype=torch.float64)), "hidden_states"),  # wrong dtype
    (dict(hidden=torch.randn(6, HC, DIM)), "token_ids"),  # 6 streams for 5 token ids
    (dict(token_mask=torch.ones(4, dtype=torch.bool)), "batch.token_mask"),
])
def test_a_refused_forward_leaves_the_history_cache_as_it_was(bad, name):
    """Every host rule of the layer runs before the hash writes the history (issue 46)."""
    layer, _ = make_layer()
    ids = ids_for(5, 1)
    hidden = bad.get("hidden", hidden_for(5, 2))
    batch = EngramBatch.from_query_lens(torch.tensor([5]), torch.tensor([0]), token_mask=bad.get("token_mask"))
    hist = torch.tensor([[1, 42]], dtype=torch.int64)
    before = hist.clone()
    with pytest.raises((ValueError, TypeError)) as info:
        layer(hidden, batch, token_ids=ids, history_cache=hist)
    text = str(info.value)
    assert "\n" not in text and text.startswith(name), text
    assert torch.equal(hist, before)


def test_a_parameter_that_requires_grad_is_refused_before_the_hash():
    layer, _ = make_layer()
    layer.engram.wkv.weight.requires_grad_(True)
    hist = torch.tensor([[1, 42]], dtype=torch.int64)
    batch = EngramBatch.from_query_lens(torch.tensor([5]), torch.tensor([0]))
    with pytest.raises(ValueError) as info:
        layer(hidden_for(5, 2), batch, token_ids=ids_for(5, 1), history_cache=hist)
    assert str(info.value).startswith("engram.wkv.weight: expected a parameter that does not require grad")
    assert hist.tolist() == [[1, 42]]


def test_a_layer_step_runs_its_verdict_after_its_gate():
    """The hash's device rules are the layer step's verdict, run after the gate: no
    op of the step settles it mid-step (on a GPU that was a wait for the hash's
    read-back between the hash and the lookup). A broken step returns, writes no
    history, and its error is raised by the next call into the library."""
    from kda_engram import raise_pending_errors

    layer, _ = make_layer()
    cache = torch.full((3, 2), 5, dtype=torch.int64)
    cache[1, 1] = 99  # outside the vocabulary, in a row the step reads
    before = cache.clone()
    batch = EngramBatch.from_query_lens(torch.tensor([2, 3]), torch.tensor([0, 1]), torch.tensor([True, True]))
    out = layer(hidden_for(5, 1), batch, token_ids=ids_for(5, 2), history_cache=cache)
    assert out.shape == (5, HC, DIM) and torch.equal(cache, before)
    with pytest.raises(ValueError, match=r"^history_cache: expected ids in .*\(from an earlier .* call"):
        raise_pending_errors()


@pytest.mark.parametrize("bad", [99, -3])
def test_a_history_row_read_with_an_id_outside_the_vocabulary_is_refused(bad):
    # Issue 54: ngram_hash refused such a history, the layer hashed it (id 99 with a
    # vocabulary of 30) without a word.
    layer, _ = make_layer()
    cache = torch.full((3, 2), 5, dtype=torch.int64)
    cache[1, 1] = bad
    before = cache.clone()
    batch = EngramBatch.from_query_lens(torch.tensor([2, 3]), torch.tensor([0, 1]), torch.tensor([True, True]))
    with refused(ValueError, match=rf"^history_cache: expected ids in \[0, {VOCAB}\) \(layout.compressed_vocab_size; "
                                   r"the rows this step reads\) or -1 \(none\), got "):
        layer(hidden_for(5, 1), batch, token_ids=ids_for(5, 2), history_cache=cache)
    assert torch.equal(cache, before)
    # A row the step does not read (a fresh sequence) is not its business.
    fresh = EngramBatch.from_query_lens(torch.tensor([2, 3]), torch.tensor([0, 1]), torch.tensor([True, False]))
    layer(hidden_for(5, 1), fresh, token_ids=ids_for(5, 2), history_cache=cache)
