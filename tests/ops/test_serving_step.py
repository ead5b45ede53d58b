"""Both serving layers through the ops: a mixed prefill + decode step traced by
Dynamo with ``fullgraph=True`` on the CPU; on the GPU, the same step captured in
a CUDA graph and replayed with new inputs, and under ``torch.compile(fullgraph=True)``."""

import math

import pytest
import torch

from kda_engram.engram.layout import EngramLayout
from kda_engram.layers.engram import EngramBatch, EngramLayer
from kda_engram.layers.kda import KDABatch, KimiDeltaAttention

from .support import K, rnd, small_layout


def test_both_layers_trace_fullgraph_on_the_cpu():
    """Dynamo traces a mixed step of both layers without a graph break (the ops are
    opaque; ``aot_eager`` runs them eagerly, so no C++ toolchain is needed), and the
    traced step writes the same outputs and caches as the eager one."""
    kda = KimiDeltaAttention(32, 1, K, gate_low_rank_dim=8, output_gate_low_rank_dim=8, lower_bound=-5.0,
                             dtype=torch.float32, device="cpu")
    kda.reset_parameters(torch.Generator().manual_seed(0))
    eng = EngramLayer(small_layout(), 3, 32, 2, storage="fp32", dtype=torch.float32, device="cpu")
    eng.reset_parameters(torch.Generator().manual_seed(1))
    sc, cs = kda.allocate_cache(4)
    sc.copy_(rnd(*sc.shape, seed=2, scale=0.3))
    cs.copy_(rnd(*cs.shape, seed=3))
    hist = torch.full((4, 2), -1, dtype=torch.int64)
    kb = KDABatch.from_query_lens(torch.tensor([1, 10]), torch.tensor([0, 2]), torch.tensor([True, False]),
                                  num_decode=1, checkpoint_offsets=torch.tensor([0, 0]),
                                  checkpoint_indices=torch.tensor([-1, 3]))
    eb = EngramBatch.from_kda_batch(kb)
    x, hh = rnd(11, 32, seed=4), rnd(11, 2, 32, seed=6)
    ids = torch.randint(0, 25, (11,), generator=torch.Generator().manual_seed(5))

    def step(kb, eb):
        y = kda(x, kb, sc, cs, check_inputs=False)
        return y, eng(hh, eb, rows=eng.hash_step(ids, eb, hist, check_inputs=False), check_inputs=False)

    start = [t.clone() for t in (sc, cs, hist)]
    want = list(step(kb, eb)) + [t.clone() for t in (sc, cs, hist)]
    for t, t0 in zip((sc, cs, hist), start):
        t.copy_(t0)
    got = list(torch.compile(step, backend="aot_eager", fullgraph=True)(kb, eb)) + [sc, cs, hist]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------- GPU: graphs, compile

KDA_HID, KDA_HEADS, ENG_DIM, ENG_HC = 1024, 8, 1024, 4


def serving_layers(gpu):
    kda = KimiDeltaAttention(KDA_HID, KDA_HEADS, 128, gate_low_rank_dim=128, output_gate_low_rank_dim=128,
                             lower_bound=-5.0, dtype=torch.bfloat16, device=gpu)
    kda.reset_parameters(torch.Generator().manual_seed(0))
    layout = EngramLayout.build(layer_ids=[1, 2], max_ngram=4, n_heads=4, head_dim=64, vocab_size=3000,
                                compressed_vocab_size=2000, pad_id=1, seed=0)
    eng = EngramLayer(layout, 2, ENG_DIM, ENG_HC, eps=1e-6, storage="bf16", dtype=torch.bfloat16, device=gpu)
    eng.reset_parameters(torch.Generator().manual_seed(1))
    return kda, eng


class StepInputs:
    """Static buffers of one mixed step: 3 decode rows, then 2 prefill sequences of
    ``TP`` tokens in all; every field is refilled in place for a replay."""

    B, TP = 3, 320

    def __init__(self, gpu, kda, eng, slots=12):
        T = self.B + self.TP
        self.x = torch.empty(T, KDA_HID, dtype=torch.bfloat16, device=gpu)
        self.hc_hidden = torch.empty(T, ENG_HC, ENG_DIM, dtype=torch.bfloat16, device=gpu)
        self.ids = torch.empty(T, dtype=torch.int64, device=gpu)
        self.query_lens = torch.empty(self.B + 2, dtype=torch.int64, device=gpu)
        self.slots = torch.empty(self.B + 2, dtype=torch.int64, device=gpu)
        self.has = torch.empty(self.B + 2, dtype=torch.bool, device=gpu)
        self.ck_off = torch.empty(self.B + 2, dtype=torch.int64, device=gpu)
        self.ck_idx = torch.empty(self.B + 2, dtype=torch.int64, device=gpu)
        self.sc, self.cs = kda.allocate_cache(slots)
        self.hist = torch.empty(slots, 3, dtype=torch.int64, device=gpu)

    def fill(self, seed, split):
        gen = torch.Generator().manual_seed(seed)
        self.x.copy_(torch.randn(self.x.shape, generator=gen))
        self.hc_hidden.copy_(torch.randn(self.hc_hidden.shape, generator=gen))
        self.ids.copy_(torch.randint(0, 2000, self.ids.shape, generator=gen))
        self.query_lens.copy_(torch.tensor([1, 1, 1, split, self.TP - split]))
        perm = torch.randperm(10, generator=gen)[: self.B + 2]
        self.slots.copy_(perm)
        self.has.copy_(torch.tensor([True, True, True, bool(seed % 2), False]))
        self.ck_off.copy_(torch.tensor([0, 0, 0, 0, (self.TP - split) // 64 * 64]))
        self.ck_idx.copy_(torch.tensor([-1, -1, -1, -1, 11]))
        self.sc.copy_(torch.randn(self.sc.shape, generator=gen) * 0.05)
        self.cs.copy_(torch.randn(self.cs.shape, generator=gen))
        self.hist.copy_(torch.randint(0, 2000, self.hist.shape, generator=gen))

    def caches(self):
        return [self.sc, self.cs, self.hist]


def batches(s):
    """The step's batch metadata, built on the device from the static buffers."""
    kb = KDABatch.from_query_lens(s.query_lens, s.slots, s.has, num_decode=s.B, checkpoint_offsets=s.ck_off,
                                  checkpoint_indices=s.ck_idx)
    return kb, EngramBatch.from_kda_batch(kb)


def mixed_step(kda, eng, s, kb=None, eb=None):
    """One engine step of both layers from the static buffers; without ``kb``/``eb``
    the batch metadata is built inside the step (on the device, as an engine would)."""
    if kb is None:
        kb, eb = batches(s)
    y = kda(s.x, kb, s.sc, s.cs, check_inputs=False)
    rows = eng.hash_step(s.ids, eb, s.hist, check_inputs=False)
    z = eng(s.hc_hidden, eb, rows=rows, check_inputs=False)
    return y, z


def assert_same(a, b, what):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= 1e-2 * max(b.float().abs().max().item(), 1e-6), (what, err)


@pytest.mark.gpu
def test_gpu_cuda_graph_mixed_step_of_both_layers(gpu):
    kda, eng = serving_layers(gpu)
    s = StepInputs(gpu, kda, eng)
    s.fill(1, 100)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mixed_step(kda, eng, s)  # compile the kernels, cache the layout's device arrays
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, z_g = mixed_step(kda, eng, s)

    for seed, split in ((2, 250), (3, 64)):  # new inputs and a new prefill split, same shapes
        s.fill(seed, split)
        before = [c.clone() for c in s.caches()]
        graph.replay()
        torch.cuda.synchronize()
        got = [y_g.clone(), z_g.clone()] + [c.clone() for c in s.caches()]
        for c, b in zip(s.caches(), before):
            c.copy_(b)
        want = list(mixed_step(kda, eng, s)) + s.caches()
        for what, a, b in zip(["kda", "engram", "state", "conv", "history"], got, want):
            assert_same(a, b, what)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_mixed_step_of_both_layers(gpu):
    kda, eng = serving_layers(gpu)
    s = StepInputs(gpu, kda, eng)
    # The batch metadata is built eagerly and passed in (a frozen dataclass built
    # inside the compiled region is not something every torch version traces).
    compiled = torch.compile(lambda kb, eb: mixed_step(kda, eng, s, kb, eb), fullgraph=True)
    for seed, split in ((4, 100), (5, 200)):
        s.fill(seed, split)
        before = [c.clone() for c in s.caches()]
        y_c, z_c = compiled(*batches(s))
        got = [y_c.clone(), z_c.clone()] + [c.clone() for c in s.caches()]
        for c, b in zip(s.caches(), before):
            c.copy_(b)
        want = list(mixed_step(kda, eng, s)) + s.caches()
        for what, a, b in zip(["kda", "engram", "state", "conv", "history"], got, want):
            assert_same(a, b, what)
        assert not math.isnan(y_c.float().sum().item())
