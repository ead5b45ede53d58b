"""The ``torch.ops.kda_engram`` custom ops: ``torch.library.opcheck`` on every op
(schema and ``mutates_args``, fake implementation, AOT dispatch with dynamic shapes),
the Python wrappers against the kernel entry points, the object-handle registry;
on the GPU, a mixed prefill + decode step of both serving layers captured in a
CUDA graph and replayed with new inputs, and the same step under
``torch.compile(fullgraph=True)``.

CPU shapes are tiny (the opcheck utilities run each op several times under the
Triton interpreter).
"""

import gc
import math

import pytest
import torch

from kda_engram import ops
from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.table import EngramTable
from kda_engram.kda.decode import kda_decode as kda_decode_direct
from kda_engram.kda.prefill import chunk_kda_prefill as prefill_direct
from kda_engram.layers.engram import EngramBatch, EngramLayer
from kda_engram.layers.kda import KDABatch, KimiDeltaAttention

H, K = 1, 16
OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=OPCHECK)


def rnd(*shape, seed=0, device="cpu", scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul_(scale).to(device)


def kda_raw(T, device, seed=0):
    """q, k, v, raw_g [1, T, H, K], raw_beta [1, T, H], A_log, dt_bias."""
    return (rnd(1, T, H, K, seed=seed, device=device), rnd(1, T, H, K, seed=seed + 1, device=device),
            rnd(1, T, H, K, seed=seed + 2, device=device), rnd(1, T, H, K, seed=seed + 3, device=device),
            rnd(1, T, H, seed=seed + 4, device=device), rnd(H, seed=seed + 5, device=device, scale=0.5),
            rnd(H * K, seed=seed + 6, device=device))


def idx(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ------------------------------------------------------------------------- KDA ops


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_decode_ops(device):
    q, k, v, g, b, A, dt = (x[0, :2] if x.dim() > 1 else x for x in kda_raw(2, device))
    cache = rnd(3, H, K, K, seed=9, device=device, scale=0.3)
    opcheck(ops._kda_decode_op, (q, k, v, g, b, A, dt, cache, idx([2, -1], device), None, -5.0))
    qm, km, vm, gm, bm = (x.reshape(1, 2, *x.shape[1:]) for x in (q, k, v, g, b))
    opcheck(ops._kda_decode_multi_op, (qm, km, vm, gm, bm, A, dt, cache, idx([[0, 1]], device), idx([2], device),
                                       0.2, None))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_prefill_ops(device):
    # Lengths 10 and 70: T // 64 + N = 3 chunk rows, all real (the prologue leaves
    # the rows of the static bound that no chunk uses undefined, which opcheck's
    # output comparison would trip over).
    T = 80
    q, k, v, g, b, A, dt = kda_raw(T, device)
    cu = idx([0, 10, 80], device)
    C = 3 * H * K
    cw = rnd(C, 4, seed=11, device=device, scale=0.5)
    conv = rnd(4, C, 3, seed=12, device=device)
    conv_idx, has = idx([0, 3], device), torch.tensor([True, False], device=device)
    opcheck(ops._fused_kda_prologue_op, (q, k, v, g, b, A, dt, K**-0.5, -5.0, cu, cw, conv, conv_idx, has, None))
    opr = ops.fused_kda_prologue(q, k, v, g, b, A, dt, K**-0.5, -5.0, cu)
    cache = rnd(4, H, K, K, seed=13, device=device, scale=0.3)
    state_idx, ck_off, ck_idx = idx([1, 2], device), idx([0, 64], device), idx([-1, 3], device)
    opcheck(ops._fused_kda_chunk_op, (opr["qg"], opr["w"], opr["u"], opr["kg_t"], opr["aqk"], opr["decay"], K**-0.5,
                                      cu, None, False, None, None, ck_off, ck_idx, True, cache, state_idx, has))
    opcheck(ops._fused_kda_chunk_op, (opr["qg"], opr["w"], opr["u"], opr["kg_t"], opr["aqk"], opr["decay"], K**-0.5,
                                      cu, None, True, None, None, None, None, False, None, None, None))
    ck = torch.zeros(2, H, K, K, device=device)
    opcheck(ops._chunk_kda_prefill_op, (q, k, v, g, b, A, dt, cu, None, -5.0, None, False, cache, state_idx, has, ck,
                                        ck_off, None, False, cw, conv, conv_idx, has))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_conv_ops(device):
    C = 40
    x = rnd(5, C + 8, seed=1, device=device)[:3, 4 : 4 + C]  # a strided column slice
    w = rnd(C, 4, seed=2, device=device)
    conv = rnd(4, C, 3, seed=3, device=device)
    opcheck(ops._kda_conv_decode_op, (x, w, conv, idx([3, -1, 0], device), torch.float32))
    opcheck(ops._kda_conv_decode_op, (x, w, conv, idx([3, -1, 0], device), None))
    xt = rnd(130, C, seed=4, device=device)
    opcheck(ops._kda_conv_checkpoint_op, (xt, idx([0, 64, 130], device), idx([64, 64], device), idx([1, -1], device),
                                          conv))


def test_wrappers_match_the_entry_points():
    T = 70
    q, k, v, g, b, A, dt = kda_raw(T, "cpu", seed=20)
    cu = idx([0, 64, 70], "cpu")
    cache0 = rnd(4, H, K, K, seed=21, scale=0.3)
    has = torch.tensor([True, False])
    kw = dict(lower_bound=-5.0, cu_seqlens=cu, state_indices=idx([1, 2], "cpu"), has_initial_state=has,
              checkpoint_offsets=idx([64, 0], "cpu"), checkpoint_state_indices=idx([3, -1], "cpu"))
    c1, c2 = cache0.clone(), cache0.clone()
    o1, f1 = prefill_direct(q, k, v, g, b, A, dt, state_cache=c1, checkpoint_state=c1, **kw)
    o2, f2 = ops.chunk_kda_prefill(q, k, v, g, b, A, dt, state_cache=c2, checkpoint_state=c2, **kw)  # into the cache
    assert f1 is None and f2 is None
    assert torch.equal(o1, o2) and torch.equal(c1, c2)
    o3, f3 = ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, lower_bound=-5.0, output_final_state=True)
    assert f3.shape == (2, H, K, K)
    qd, kd, vd, gd, bd = (x[0, :2] for x in (q, k, v, g, b))
    d1, d2 = cache0.clone(), cache0.clone()
    assert torch.equal(kda_decode_direct(qd, kd, vd, gd, bd, A, dt, d1, idx([0, 2], "cpu")),
                       ops.kda_decode(qd, kd, vd, gd, bd, A, dt, d2, idx([0, 2], "cpu")))
    assert torch.equal(d1, d2)
    assert hasattr(torch.ops.kda_engram, "chunk_kda_prefill") and hasattr(torch.ops.kda_engram, "engram_lookup")
    with pytest.raises(ValueError, match="state_cache needs"):
        ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, state_cache=c1)
    with pytest.raises(ValueError, match="conv_state_indices"):
        ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, conv_weight=torch.zeros(48, 4),
                              conv_state=torch.zeros(2, 48, 3))
    with pytest.raises(ValueError, match="q: expected shape"):
        ops.kda_decode(q, kd, vd, gd, bd, A, dt, d1, idx([0, 2], "cpu"))


# ---------------------------------------------------------------------- Engram ops


def small_layout(head_dim=16):
    return EngramLayout.build(layer_ids=[0, 3], max_ngram=3, n_heads=2, head_dim=head_dim, vocab_size=[20, 30],
                              compressed_vocab_size=25, pad_id=0, seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_engram_gate_ops(device):
    T, hc, dim = 5, 2, 32
    hidden = rnd(T, hc, dim, seed=1, device=device)
    kv = rnd(T, (hc + 1) * dim, seed=2, device=device)
    qw, kw = rnd(hc, dim, seed=3, device=device), rnd(hc, dim, seed=4, device=device)
    mask = torch.tensor([True, False, True, True, True], device=device)
    opcheck(ops._engram_post_wkv_op, (hidden, kv, qw, kw, 1e-6, 1e-6, mask, 4))
    width = dim // 2
    sends = []
    for r in range(2):
        cols = torch.cat([torch.arange(j * dim + r * width, j * dim + (r + 1) * width) for j in range(hc + 1)])
        kv_r = kv[:, cols.to(device)]
        opcheck(ops._engram_gate_partials_op, (hidden, kv_r, qw, kw, r, 2))
        sends.append(ops.engram_gate_partials(hidden, kv_r, qw, kw, rank=r, tp_size=2))
    gathered = torch.cat(sends)
    opcheck(ops._engram_gate_finish_op, (hidden, gathered, 2, 1e-6, 1e-6, mask))
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
    opcheck(ops._ngram_hash_op, (ids, cu, h, hist, dead, None, False))
    opcheck(ops._ngram_hash_op, (ids, cu, h, None, None, None, True))
    opcheck(ops._next_history_op, (ids, cu, h, hist, dead))
    rows = ops.ngram_hash(ids, cu, layout, history=hist)[:, 1]
    for rank in (0, 1):
        table = EngramTable.for_layer(layout, 3, storage="fp32", device=device, rank=rank, world_size=2)
        table.load_(rnd(table.num_rows, 16, seed=5))
        opcheck(ops._engram_lookup_op, (rows, ops.handle(table), False))
        opcheck(ops._engram_lookup_op, (rows, ops.handle(table), True))
        assert torch.equal(ops.engram_lookup(rows, table, local=True), table.lookup_local(rows))
    cache = torch.randint(-1, 25, (5, 2), generator=torch.Generator().manual_seed(1)).to(device)
    slots, has = idx([4, -1, 0], device), torch.tensor([True, True, False], device=device)
    opcheck(ops._engram_history_gather_op, (cache, slots, has))
    opcheck(ops._engram_history_scatter_op, (cache, slots, hist))
    opcheck(ops._engram_history_checkpoint_op, (ids, cu, hist, dead, idx([2, 0, 5], device), idx([1, 2, 3], device),
                                                cache))


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
