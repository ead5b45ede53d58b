"""KimiDeltaAttention: mixed decode + prefill steps, prefix caching, chunked prefill,
TP sharding and bad input, against the plain-PyTorch layer reference
(``naive_kda_layer``: separate projections, ``F.conv1d``, ``naive_recurrent_kda``).

CPU (interpreter): fp32, head dim 16, one or two heads, short prompts (the
prologue costs ~0.6 s per 64-token chunk and head under the interpreter). GPU:
bf16 at K = V = 128 with the low-rank gates, the same exactness properties, a
CUDA-graph capture and ``torch.compile(fullgraph=True)`` of a mixed step of both
serving layers.
"""

import dataclasses
import math

import pytest
import torch

from kda_engram.layers.kda import KDABatch, KimiDeltaAttention
from kda_engram.layers.reference import naive_kda_layer
from kda_engram.parallel import TensorParallelGroup

from ..helpers import refused, rel_rmse

HID, K = 32, 16


def make_layer(heads=2, *, low_rank=True, lower_bound=-5.0, tp=None, seed=1, dtype=torch.float32, device="cpu",
               hidden=HID, head_dim=K, rank=8):
    layer = KimiDeltaAttention(
        hidden, heads, head_dim, gate_low_rank_dim=rank if low_rank else None,
        output_gate_low_rank_dim=rank if low_rank else None, lower_bound=lower_bound, tp=tp, dtype=dtype, device=device,
    )
    weights = layer.random_weights(torch.Generator().manual_seed(seed))
    layer.load_weights(weights)
    return layer, weights


def reference(layer, weights, x, cu, init=None, init_conv=None):
    return naive_kda_layer(weights, x, cu, num_heads=layer.num_heads, head_dim=layer.head_dim,
                               lower_bound=layer.lower_bound, norm_eps=layer.norm_eps, initial_state=init,
                               initial_conv=init_conv)


def close(a, b, atol):
    err = (a.double().cpu() - b.double().cpu()).abs().max().item() if a.numel() else 0.0
    assert err < atol, err


def cu_of(lengths):
    return [0] + torch.tensor(lengths).cumsum(0).tolist()


# ------------------------------------------------------------------------ mixed step


@pytest.mark.parametrize("variant", ["lowrank_bounded", "full_softplus"])
def test_mixed_decode_prefill_step_matches_reference(variant):
    low_rank, lb = (True, -5.0) if variant == "lowrank_bounded" else (False, None)
    long = 66 if low_rank else 40  # two chunks in one variant, one in the other (interpreter time)
    layer, w = make_layer(2, low_rank=low_rank, lower_bound=lb)
    slots = 8
    sc, cs = layer.allocate_cache(slots)
    sc.normal_(0, 0.3)
    cs.normal_()
    sc0, cs0 = sc.clone(), cs.clone()
    # Three decode rows (one padding row, index -1), then prefill lengths 5 (continues
    # slot 0), 0 (fresh, slot 1) and `long` (fresh, slot 2).
    lens = [1, 1, 1, 5, 0, long]
    slot = torch.tensor([3, -1, 5, 0, 1, 2])
    has = torch.tensor([True, True, True, True, False, False])
    batch = KDABatch.from_query_lens(torch.tensor(lens), slot, has, num_decode=3)
    T = sum(lens)
    batch.validate(T, slots, slots)
    x = torch.randn(T, HID, generator=torch.Generator().manual_seed(2))
    y = layer(x, batch, sc, cs)

    N = len(lens)
    init = torch.zeros(N, layer.local_heads, K, K)
    init_c = torch.zeros(N, layer.conv_channels, 3)
    for n in range(N):
        if slot[n] >= 0 and has[n]:
            init[n], init_c[n] = sc0[slot[n]], cs0[slot[n]]
    y_ref, s_ref, c_ref = reference(layer, w, x, cu_of(lens), init, init_c)
    live = torch.ones(T, dtype=torch.bool)
    live[1] = False
    close(y[live], y_ref[live], 2e-5)
    assert torch.equal(y[1], torch.zeros(HID))  # padding decode row: zero output
    for n in range(N):
        s = int(slot[n])
        if s < 0:
            continue
        close(sc[s], s_ref[n], 1e-5)
        if lens[n] > 0:
            close(cs[s], c_ref[n], 1e-6)
        else:
            assert torch.equal(cs[s], cs0[s])  # a zero-length sequence leaves its conv row alone
    for s in (4, 6, 7):  # rows nobody names are untouched
        assert torch.equal(sc[s], sc0[s]) and torch.equal(cs[s], cs0[s])


def test_decode_only_and_prefill_only_steps():
    layer, w = make_layer(1)
    sc, cs = layer.allocate_cache(4)
    # prefill only: one fresh prompt of 9 tokens into slot 2
    x = torch.randn(11, HID, generator=torch.Generator().manual_seed(3))
    b1 = KDABatch.from_query_lens(torch.tensor([9]), torch.tensor([2]), num_decode=0)
    y1 = layer(x[:9], b1, sc, cs)
    # decode only: two steps of that sequence
    dec = KDABatch.from_query_lens(torch.tensor([1]), torch.tensor([2]), num_decode=1)
    y2 = layer(x[9:10], dec, sc, cs)
    y3 = layer(x[10:11], dec, sc, cs)
    y_ref, s_ref, c_ref = reference(layer, w, x, [0, 11])
    close(torch.cat([y1, y2, y3]), y_ref, 2e-5)
    close(sc[2], s_ref[0], 1e-5)
    close(cs[2], c_ref[0], 1e-6)


# --------------------------------------------------------------------- prefix caching


def test_prefix_checkpoint_resume_and_chunked_prefill_equal_one_prefill_then_decode():
    layer, w = make_layer(1, seed=4)
    L, p = 100, 64
    x = torch.randn(L + 2, HID, generator=torch.Generator().manual_seed(5))
    slots = 6
    sc, cs = layer.allocate_cache(slots)
    sc.fill_(math.nan)  # never read where has_initial_state is false
    cs.fill_(math.nan)

    # 1. One prefill of the whole prompt into slot 0, checkpoint at p into slot 1.
    one = KDABatch.from_query_lens(torch.tensor([L]), torch.tensor([0]), num_decode=0,
                                   checkpoint_offsets=torch.tensor([p]), checkpoint_indices=torch.tensor([1]))
    one.validate(L, slots, slots)
    y_one = layer(x[:L], one, sc, cs)
    y_ref, s_ref, c_ref = reference(layer, w, x, [0, L + 2])
    close(y_one, y_ref[:L], 2e-5)
    _, s_p, c_p = reference(layer, w, x[:p], [0, p])
    close(sc[1], s_p[0], 1e-5)  # the recurrent state after p tokens
    # ... and the conv window at p: the raw q/k/v inputs of tokens p-3 .. p-1.
    proj = torch.nn.functional.linear(x[:L], layer.in_proj.weight)
    close(cs[1], proj[p - 3 : p, : layer.conv_channels].t(), 1e-6)

    # 2. Resume from the checkpoint row (state and conv window at p) for the rest.
    res = KDABatch.from_query_lens(torch.tensor([L - p]), torch.tensor([1]), torch.tensor([True]), num_decode=0)
    y_res = layer(x[p:L], res, sc, cs)
    close(y_res, y_one[p:], 1e-5)
    close(sc[1], sc[0], 1e-5)
    close(cs[1], cs[0], 1e-6)

    # 3. Chunked prefill into slot 2: 40 tokens, then 60 from the carried caches.
    first = KDABatch.from_query_lens(torch.tensor([40]), torch.tensor([2]), num_decode=0)
    rest = KDABatch.from_query_lens(torch.tensor([L - 40]), torch.tensor([2]), torch.tensor([True]), num_decode=0)
    y_c = torch.cat([layer(x[:40], first, sc, cs), layer(x[40:L], rest, sc, cs)])
    close(y_c, y_one, 2e-5)
    close(sc[2], sc[0], 1e-5)

    # 4. Two decode steps of the chunked sequence (slot 2) and of the resumed one
    #    (slot 1) in one batch equal the reference recurrence over L + 2 tokens.
    dec = KDABatch.from_query_lens(torch.tensor([1, 1]), torch.tensor([2, 1]), num_decode=2)
    for t in (L, L + 1):
        y_d = layer(x[t : t + 1].expand(2, HID), dec, sc, cs)
        close(y_d, y_ref[t : t + 1].expand(2, HID), 2e-5)
    close(sc[2], s_ref[0], 1e-5)
    close(cs[1], c_ref[0], 1e-6)
    assert torch.isnan(sc[3:]).all() and torch.isnan(cs[3:]).all()


# ---------------------------------------------------------------------- TP sharding


def fake_group(rank, world_size):
    group = TensorParallelGroup.single()
    group.rank, group.world_size = rank, world_size
    group.all_reduce = lambda y: y  # the test sums the rank partials itself
    return group


def test_tp_head_sharding_sums_to_the_full_layer():
    full, w = make_layer(2, seed=6)
    ranks = [KimiDeltaAttention(HID, 2, K, gate_low_rank_dim=8, output_gate_low_rank_dim=8, lower_bound=-5.0,
                                tp=fake_group(r, 2), dtype=torch.float32, device="cpu") for r in range(2)]
    for layer in ranks:
        layer.load_weights(w)
        assert layer.local_heads == 1 and layer.conv_channels == 3 * K
    lens = [1, 1, 20]
    batch = KDABatch.from_query_lens(torch.tensor(lens), torch.tensor([0, 1, 2]), torch.tensor([True, True, False]),
                                     num_decode=2)
    x = torch.randn(sum(lens), HID, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(8)
    sc_full = torch.randn(3, 2, K, K, generator=gen) * 0.3
    cs_full = torch.randn(3, full.conv_channels, 3, generator=gen)
    sc_f, cs_f = sc_full.clone(), cs_full.clone()
    y_full = full(x, batch, sc_f, cs_f)
    y_sum = 0
    for r, layer in enumerate(ranks):
        # Rank r's conv channels: its q, k and v head slices.
        ch = torch.cat([torch.arange(r * K, (r + 1) * K) + band * 2 * K for band in range(3)])
        sc_r, cs_r = sc_full[:, r : r + 1].clone(), cs_full[:, ch].clone()
        y_sum = y_sum + layer(x, batch, sc_r, cs_r)
        close(sc_r, sc_f[:, r : r + 1], 1e-6)
        close(cs_r, cs_f[:, ch], 1e-12)
    close(y_sum, y_full, 1e-5)


# ------------------------------------------------------------------------ bad input


def test_layer_construction_errors():
    with refused(ValueError, match="num_heads"):
        KimiDeltaAttention(HID, 3, K, tp=fake_group(0, 2), dtype=torch.float32, device="cpu")
    with refused(ValueError, match="head_dim"):
        KimiDeltaAttention(HID, 2, 24, dtype=torch.float32, device="cpu")
    with refused(ValueError, match="conv_size"):
        KimiDeltaAttention(HID, 2, K, conv_size=3, dtype=torch.float32, device="cpu")
    with refused(ValueError, match="lower_bound"):
        KimiDeltaAttention(HID, 2, K, lower_bound=1.0, dtype=torch.float32, device="cpu")
    layer, w = make_layer(2)
    with refused(ValueError, match="missing"):
        layer.load_weights({k: v for k, v in w.items() if k != "A_log"})
    with refused(ValueError, match="unknown"):
        layer.load_weights({**w, "q_proj.bias": torch.zeros(2 * K)})
    bad = dict(w, **{"q_proj.weight": torch.zeros(2 * K, HID + 1)})
    with refused(ValueError, match="q_proj.weight: expected shape"):
        layer.load_weights(bad)
    assert layer.load_weights({"blk.0." + k: v for k, v in w.items()}, prefix="blk.0.") == {
        "blk.0." + k for k in w}


def test_forward_and_batch_errors():
    layer, _ = make_layer(2)
    sc, cs = layer.allocate_cache(4)
    x = torch.randn(6, HID)
    ok = KDABatch.from_query_lens(torch.tensor([1, 5]), torch.tensor([0, 1]), num_decode=1)
    with refused(ValueError, match="hidden_states: expected shape"):
        layer(torch.randn(6, HID + 1), ok, sc, cs)
    with refused(TypeError, match="hidden_states: expected dtype"):
        layer(x.double(), ok, sc, cs)
    with refused(ValueError, match="state_cache: expected shape"):
        layer(x, ok, sc[:, :1], cs)
    with refused(ValueError, match="conv_state: expected shape"):
        layer(x, ok, sc, cs[:, :, :2])
    with refused(TypeError, match="batch: expected a KDABatch"):
        layer(x, {"num_decode": 1}, sc, cs)
    with refused(ValueError, match="do not match num_decode"):
        layer(x, KDABatch.from_query_lens(torch.tensor([1]), torch.tensor([0]), num_decode=1), sc, cs)
    with refused(ValueError, match="num_decode"):
        KDABatch.from_query_lens(torch.tensor([1]), torch.tensor([0]), num_decode=2)
    with refused(ValueError, match="give both or neither"):
        KDABatch.from_query_lens(torch.tensor([5]), torch.tensor([0]), num_decode=0, checkpoint_offsets=torch.tensor([0]))
    # validate(): the syncing checks
    with refused(ValueError, match="prefill_cu_seqlens"):
        ok.validate(7)
    ck = KDABatch.from_query_lens(torch.tensor([70]), torch.tensor([0]), num_decode=0,
                                  checkpoint_offsets=torch.tensor([32]), checkpoint_indices=torch.tensor([1]))
    with refused(ValueError, match="multiple of 64"):
        ck.validate(70)
    dup = KDABatch.from_query_lens(torch.tensor([1, 5]), torch.tensor([1, 1]), num_decode=1)
    with refused(ValueError, match="distinct"):
        dup.validate(6, 4, 4)
    clash = KDABatch.from_query_lens(torch.tensor([1, 70]), torch.tensor([1, 0]), num_decode=1,
                                     checkpoint_offsets=torch.tensor([0, 64]), checkpoint_indices=torch.tensor([0, 1]))
    with refused(ValueError, match="distinct"):
        clash.validate(71, 4, 4)
    with refused(ValueError, match="entries must be < 4"):
        KDABatch.from_query_lens(torch.tensor([1]), torch.tensor([4]), num_decode=1).validate(1, 4, 4)


# --------------------------------------------------- refusals leave every cache intact


def _replace(batch, **fields):
    return dataclasses.replace(batch, **fields)


def _mixed(state_rows=(0, 1), lens=(1, 10), **kw):
    return KDABatch.from_query_lens(torch.tensor(list(lens)), torch.tensor(list(state_rows)), num_decode=1, **kw)


# (name, expected error, message regex, batch, tokens): every batch has a valid decode
# row, so a check run after the decode launch would leave its write behind.
LAYER_BAD = [
    ("float_cu_seqlens", TypeError, "batch.prefill_cu_seqlens: expected dtype",
     lambda: _replace(_mixed(), prefill_cu_seqlens=_mixed().prefill_cu_seqlens.float()), 11),
    ("float_checkpoint_offsets", TypeError, "batch.checkpoint_offsets: expected dtype",
     lambda: _replace(_mixed(checkpoint_offsets=torch.tensor([0, 0]), checkpoint_indices=torch.tensor([-1, 2])),
                      checkpoint_offsets=torch.tensor([0.0])), 11),
    ("decode_row_past_the_cache", ValueError, "entries must be < 4 .* got max 1000", lambda: _mixed((1000, 1)), 11),
    ("prefill_row_past_the_cache", ValueError, "entries must be < 4 .* got max 1000", lambda: _mixed((0, 1000)), 11),
    ("conv_row_past_the_cache", ValueError, "conv_indices.* got max 9",
     lambda: _mixed(conv_state_indices=torch.tensor([0, 9])), 11),
    ("token_count_mismatch", ValueError, "prefill_cu_seqlens: must end at T=19", lambda: _mixed(), 20),
    ("duplicate_rows", ValueError, "distinct", lambda: _mixed((1, 1)), 11),
    ("checkpoint_offset_not_aligned", ValueError, "checkpoint_offsets\\[0\\]: expected 0 \\(none\\) or a multiple of 64",
     lambda: _mixed(checkpoint_offsets=torch.tensor([0, 32]), checkpoint_indices=torch.tensor([-1, 2])), 11),
    ("checkpoint_on_a_written_row", ValueError, "distinct",
     lambda: _mixed(lens=(1, 64), checkpoint_offsets=torch.tensor([0, 64]), checkpoint_indices=torch.tensor([-1, 0])),
     65),
    ("decode_query_len_3", ValueError, "query_lens\\[0\\]: the first num_decode=1 .* got 3", lambda: _mixed(lens=(3, 10)), 11),
]


@pytest.mark.parametrize("name, error, message, make_batch, tokens", LAYER_BAD, ids=[c[0] for c in LAYER_BAD])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_decode", "unfused_decode"])
def test_refused_mixed_step_leaves_every_cache_bit_identical(name, error, message, make_batch, tokens, fused):
    """Issue 36: a refused mixed step (no KDABatch.validate) raises one line naming
    the argument and writes neither cache, whatever the rule (host or device)."""
    _refused_step_leaves_every_cache_bit_identical(error, message, make_batch, tokens, fused)


@pytest.mark.parametrize("name, error, message, make_batch, tokens", LAYER_BAD, ids=[c[0] for c in LAYER_BAD])
def test_refused_step_through_the_pytorch_rules_leaves_every_cache_bit_identical(name, error, message, make_batch,
                                                                                 tokens, monkeypatch):
    """The same through the rules a batch too large for one rule program takes
    (PyTorch ops, then the guards): same messages, no cache written."""
    from kda_engram.validation import kda_batch

    monkeypatch.setattr(kda_batch, "fits_kda_batch_rules", lambda *a: False)
    _refused_step_leaves_every_cache_bit_identical(error, message, make_batch, tokens, True)


def _refused_step_leaves_every_cache_bit_identical(error, message, make_batch, tokens, fused):
    layer, _ = make_layer(2)
    layer.fused_decode = fused
    sc, cs = layer.allocate_cache(4)
    gen = torch.Generator().manual_seed(5)
    sc.copy_(torch.randn(sc.shape, generator=gen))
    cs.copy_(torch.randn(cs.shape, generator=gen))
    sc[::2] = math.nan  # NaN sentinels: compared bit for bit
    sc0, cs0 = sc.clone(), cs.clone()
    with refused(error, match=message) as info:
        layer(torch.randn(tokens, HID, generator=gen), make_batch(), sc, cs)
    assert "\n" not in str(info.value)
    assert torch.equal(sc.view(torch.int32), sc0.view(torch.int32))
    assert torch.equal(cs.view(torch.int32), cs0.view(torch.int32))


# ------------------------------------------------------------------------------ GPU

GPU_HID, GPU_HEADS, GPU_K = 1024, 8, 128


def gpu_layer(gpu, seed=11):
    # Kimi-Linear's shape per head: K = V = 128, both gates low-rank with r = 128.
    return make_layer(GPU_HEADS, seed=seed, dtype=torch.bfloat16, device=gpu, hidden=GPU_HID, head_dim=GPU_K,
                      rank=GPU_K)


@pytest.mark.gpu
def test_gpu_bf16_mixed_step_matches_reference(gpu):
    layer, w = gpu_layer(gpu)
    slots = 16
    sc, cs = layer.allocate_cache(slots)
    sc.normal_(0, 0.05)
    cs.normal_(0, 0.5)
    sc0, cs0 = sc.clone(), cs.clone()
    lens = [1, 1, 1, 1, 300, 64, 1000]
    slot = torch.tensor([3, 7, -1, 9, 0, 1, 2], device=gpu)
    has = torch.tensor([True, True, True, True, True, False, False], device=gpu)
    batch = KDABatch.from_query_lens(torch.tensor(lens, device=gpu), slot, has, num_decode=4)
    T = sum(lens)
    batch.validate(T, slots, slots)
    x = torch.randn(T, GPU_HID, device=gpu, generator=torch.Generator(gpu).manual_seed(3)).to(torch.bfloat16)
    y = layer(x, batch, sc, cs)
    N = len(lens)
    init = torch.zeros(N, GPU_HEADS, GPU_K, GPU_K)
    init_c = torch.zeros(N, layer.conv_channels, 3)
    for n in range(N):
        if slot[n] >= 0 and has[n]:
            init[n], init_c[n] = sc0[slot[n]].cpu(), cs0[slot[n]].float().cpu()
    y_ref, s_ref, c_ref = naive_kda_layer(w, x.float(), cu_of(lens), num_heads=GPU_HEADS, head_dim=GPU_K,
                                              lower_bound=-5.0, initial_state=init, initial_conv=init_c,
                                              dtype=torch.float32)
    live = torch.ones(T, dtype=torch.bool)
    live[2] = False
    assert rel_rmse(y[live], y_ref[live]) < 3e-2
    assert y[2].abs().max().item() == 0
    for n in range(N):
        if slot[n] >= 0:
            assert rel_rmse(sc[slot[n]], s_ref[n]) < 3e-2
            assert rel_rmse(cs[slot[n]], c_ref[n]) < 1e-2


@pytest.mark.gpu
def test_gpu_prefix_checkpoint_resume_and_chunked_prefill(gpu):
    layer, w = gpu_layer(gpu, seed=12)
    L, p = 1000, 512
    x = torch.randn(L + 3, GPU_HID, device=gpu, generator=torch.Generator(gpu).manual_seed(4)).to(torch.bfloat16)
    sc, cs = layer.allocate_cache(6)
    sc.fill_(math.nan)
    cs.fill_(math.nan)
    one = KDABatch.from_query_lens(torch.tensor([L], device=gpu), torch.tensor([0], device=gpu), num_decode=0,
                                   checkpoint_offsets=torch.tensor([p], device=gpu),
                                   checkpoint_indices=torch.tensor([1], device=gpu))
    y_one = layer(x[:L], one, sc, cs)
    res = KDABatch.from_query_lens(torch.tensor([L - p], device=gpu), torch.tensor([1], device=gpu),
                                   torch.tensor([True], device=gpu), num_decode=0)
    y_res = layer(x[p:L], res, sc, cs)
    # The resumed walk repeats the same 64-token chunks from the same fp32 state (up
    # to the rounding of a projection GEMM of another row count).
    assert rel_rmse(y_res, y_one[p:]) < 1e-2
    assert rel_rmse(sc[1], sc[0]) < 1e-2
    assert rel_rmse(cs[1], cs[0]) < 1e-2
    first = KDABatch.from_query_lens(torch.tensor([700], device=gpu), torch.tensor([2], device=gpu), num_decode=0)
    rest = KDABatch.from_query_lens(torch.tensor([L - 700], device=gpu), torch.tensor([2], device=gpu),
                                    torch.tensor([True], device=gpu), num_decode=0)
    y_c = torch.cat([layer(x[:700], first, sc, cs), layer(x[700:L], rest, sc, cs)])
    dec = KDABatch.from_query_lens(torch.tensor([1, 1], device=gpu), torch.tensor([2, 0], device=gpu), num_decode=2)
    y_d = [layer(x[t : t + 1].expand(2, GPU_HID), dec, sc, cs) for t in range(L, L + 3)]
    y_ref, s_ref, _ = naive_kda_layer(w, x.float(), [0, L + 3], num_heads=GPU_HEADS, head_dim=GPU_K,
                                          lower_bound=-5.0, dtype=torch.float32)
    assert rel_rmse(y_one, y_ref[:L]) < 3e-2
    assert rel_rmse(y_c, y_ref[:L]) < 3e-2
    for t, yd in enumerate(y_d):
        assert rel_rmse(yd[0], y_ref[L + t]) < 3e-2 and rel_rmse(yd[1], y_ref[L + t]) < 3e-2
    assert rel_rmse(sc[2], s_ref[0]) < 3e-2
    assert rel_rmse(sc[2], sc[0]) < 1e-2


# --------------------------------------------------------------- fused decode step, CPU


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("variant", ["lowrank_bounded", "full_softplus"])
def test_fused_decode_step_matches_unfused_layer_path(variant, state_dtype):
    """The one-launch decode (default) against the conv launch + kda_decode + PyTorch
    output gate, from the same caches: outputs, state rows, conv rows; padding row
    zero; rows no index names (NaN sentinels) untouched."""
    low_rank, lb = (True, -5.0) if variant == "lowrank_bounded" else (False, None)
    fused, w = make_layer(2, low_rank=low_rank, lower_bound=lb)
    plain = KimiDeltaAttention(HID, 2, K, gate_low_rank_dim=8 if low_rank else None,
                               output_gate_low_rank_dim=8 if low_rank else None, lower_bound=lb, fused_decode=False)
    plain.load_weights(w)
    assert fused.fused_decode and not plain.fused_decode
    slots = 8
    sc, cs = fused.allocate_cache(slots, state_dtype=state_dtype)
    assert sc.dtype == state_dtype
    sc.copy_((0.3 * torch.randn(sc.shape, generator=torch.Generator().manual_seed(5))).to(state_dtype))
    cs.normal_(generator=torch.Generator().manual_seed(6))
    sc[[1, 6]] = math.nan
    cs[[1, 6]] = math.nan
    sc2, cs2 = sc.clone(), cs.clone()
    slot = torch.tensor([3, -1, 5, 0])
    conv_slot = torch.tensor([2, 4, 7, 0])  # conv rows apart from the state rows; padding state row keeps a conv row
    batch = KDABatch.from_query_lens(torch.ones(4, dtype=torch.int64), slot, num_decode=4,
                                     conv_state_indices=conv_slot)
    for step in range(2):  # two consecutive steps: the second reads what the first wrote
        x = torch.randn(4, HID, generator=torch.Generator().manual_seed(10 + step))
        y = fused(x, batch, sc, cs)
        y2 = plain(x, batch, sc2, cs2)
        close(y, y2, 2e-5)
        assert torch.equal(y[1], torch.zeros(HID))
    for s in (3, 5, 0):
        if state_dtype == torch.bfloat16:
            err = (sc[s].float() - sc2[s].float()).abs()
            assert bool((err <= sc2[s].float().abs() * 2.0**-7 + 1e-6).all())  # one bf16 ulp at most
        else:
            close(sc[s], sc2[s], 1e-5)
    for s in (2, 4, 7, 0):
        close(cs[s], cs2[s], 1e-6)
    assert torch.isnan(sc[[1, 6]]).all() and torch.isnan(cs[[1, 6]]).all()
    assert torch.equal(sc[[2, 4, 7]].float(), sc2[[2, 4, 7]].float())  # no state index names them


def test_allocate_cache_state_dtype():
    layer, _ = make_layer(1)
    sc, _ = layer.allocate_cache(2)
    assert sc.dtype == torch.float32
    sc, _ = layer.allocate_cache(2, state_dtype=torch.bfloat16)
    assert sc.dtype == torch.bfloat16
    with refused(TypeError, match="state_dtype: expected float32 or bfloat16, got torch.float16"):
        layer.allocate_cache(2, state_dtype=torch.float16)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_decode", "unfused_decode"])
def test_a_parameter_that_requires_grad_is_refused_before_any_write(fused):
    """Issue 46: kda-engram is forward-only. A parameter that requires grad (under grad
    mode) is refused with the layer's host rules: the unfused decode path used to write
    the conv windows before ``kda_decode`` refused ``A_log``."""
    layer, _ = make_layer(2)
    layer.fused_decode = fused
    layer.A_log.requires_grad_(True)
    sc, cs = layer.allocate_cache(4)
    gen = torch.Generator().manual_seed(6)
    sc.copy_(torch.randn(sc.shape, generator=gen))
    cs.copy_(torch.randn(cs.shape, generator=gen))
    sc0, cs0 = sc.clone(), cs.clone()
    batch = KDABatch.from_query_lens(torch.tensor([1, 10]), torch.tensor([0, 1]), torch.tensor([True, False]),
                                     num_decode=1)
    x = torch.randn(11, HID, generator=gen)
    with pytest.raises(ValueError) as info:
        layer(x, batch, sc, cs)
    assert str(info.value).startswith("A_log: expected a parameter that does not require grad")
    assert "\n" not in str(info.value) and "forward-only" in str(info.value)
    assert torch.equal(sc, sc0) and torch.equal(cs, cs0)
    with torch.no_grad():
        assert layer(x, batch, sc, cs).grad_fn is None  # outside grad mode it runs


# ------------------------------------------------------- the default call's cost


def test_default_checks_add_no_more_than_kda_decodes():
    """Issue 45: the layer forward's default call of a decode batch adds at most the
    aten ops and kernel launches over its ``check_inputs=False`` call that the plain
    ``kda_decode`` default adds over its own (one rule launch, its verdict and
    guarded copies in one allocation); a mixed decode + prefill batch adds no more
    than the decode batch. Counted in the steady state (the previous call's verdict
    pending), on the CPU under the interpreter."""
    from kda_engram.tools.benchmarks.profile_default_checks import _calls, _layer_batches, count_ops_and_launches

    def extra(call):
        checked, plain = count_ops_and_launches(lambda: call(True)), count_ops_and_launches(lambda: call(False))
        return checked[0] - plain[0], checked[1] - plain[1]

    dev = torch.device("cpu")
    with torch.inference_mode():
        calls = {**_calls(dev, 4, 2, K), **_layer_batches(dev, 4, 2, K)}
        decode_ops, decode_launches = extra(calls["kda_decode"])
        assert decode_launches == 1  # its index rule launch (the counter sees launches at all)
        for name in ("layer_forward", "layer_forward_mixed"):
            ops, launches = extra(calls[name])
            assert ops <= decode_ops, (name, ops, decode_ops)
            assert launches <= decode_launches, (name, launches, decode_launches)


def test_the_layer_module_names_its_batch():
    """``KDABatch`` lives in layers/kda_batch.py, the checkpoint side in
    layers/kda_weights.py; the layer's module keeps both import paths."""
    from kda_engram import layers
    from kda_engram.layers import kda, kda_batch, kda_weights

    assert kda.KDABatch is kda_batch.KDABatch is layers.KDABatch
    assert issubclass(KimiDeltaAttention, kda_weights.KDAWeights)
    assert KimiDeltaAttention.load_weights is kda_weights.KDAWeights.load_weights
