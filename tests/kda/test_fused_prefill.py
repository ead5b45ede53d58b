"""fused_kda_prefill_c16 (one launch, 16-token chunks, bounded gate) against the
recurrence and against the two-stage chunk_kda_prefill.

CPU (interpreter): fp32 (and fp16) with K = V = 32 (two V-tiles at BV = 16) and
one K = V = 128 case. GPU: bf16 at real shapes against the portable path and an
fp64 recurrence (relative RMS), the state cache with checkpoints, and a CUDA-graph
capture replayed with new cu_seqlens contents.
"""

import math

import pytest
import torch

from kda_engram.kda.fused_prefill import fused_kda_prefill_c16
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.kda.reference import naive_recurrent_kda

H, K, V = 2, 32, 32
LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 130]
ATOL = 3e-4
RAW = ("q", "k", "v", "raw_g", "raw_beta")
SMALL = {"BV": 16, "num_warps": 4, "num_stages": 1}  # two V-tiles per head at V = 32
PIPE = {**SMALL, "pipeline": True}  # chunk c + 1 prepared beside chunk c's state step


def make_raw(lengths, *, H=H, K=K, V=V, seed=0, device="cpu", dtype=torch.float32, gate_scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    raw = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, V), raw_g=rnd(1, T, H, K) * gate_scale,
               raw_beta=rnd(1, T, H))
    raw = {n: t.to(device=device, dtype=dtype) for n, t in raw.items()}
    raw["A_log"] = (rnd(H) * 0.5).to(device)
    raw["dt_bias"] = rnd(H * K).to(device)
    cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(device)
    return raw, cu


def close(a, b, atol=ATOL):
    assert a.shape == b.shape
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err < atol, err


@pytest.mark.parametrize("config", [SMALL, PIPE], ids=["serial", "pipeline"])
@pytest.mark.parametrize("state", ["none", "initial", "cache"])
def test_matches_naive_and_two_stage(state, config):
    raw, cu = make_raw(LENGTHS, seed=1)
    N = len(LENGTHS)
    h0 = torch.randn(N, H, V, K)
    kw = dict(lower_bound=-5.0, cu_seqlens=cu)
    if state == "cache":
        slots = N + 4
        cache = torch.full((slots, H, V, K), math.nan)
        idx = torch.tensor([4, 0, -1, 2, 6, 9, 11, 12, 8], dtype=torch.int32)
        has = torch.tensor([True, False, True, True, False, True, True, False, True])
        for n in range(N):
            if idx[n] >= 0 and has[n]:
                cache[int(idx[n])] = h0[n]
        cache2 = cache.clone()
        o, final = fused_kda_prefill_c16(**raw, **kw, state_cache=cache, state_indices=idx, has_initial_state=has,
                                         config=config)
        o2, _ = chunk_kda_prefill(**raw, **kw, state_cache=cache2, state_indices=idx, has_initial_state=has)
        assert final is None
        start = torch.where((has & (idx >= 0))[:, None, None, None], h0, torch.zeros_like(h0))
    else:
        start = h0 if state == "initial" else torch.zeros_like(h0)
        init = h0 if state == "initial" else None
        o, final = fused_kda_prefill_c16(**raw, **kw, initial_state=init, output_final_state=True, config=config)
        o2, final2 = chunk_kda_prefill(**raw, **kw, initial_state=init, output_final_state=True)
        close(final, final2)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, **kw, initial_state=start, output_final_state=True)
    close(o, o_nv)
    close(o, o2)
    if state == "cache":
        for n in range(N):
            if idx[n] >= 0:
                close(cache[int(idx[n])], f_nv[n])
                close(cache[int(idx[n])], cache2[int(idx[n])])
        untouched = [r for r in range(slots) if r not in idx.tolist()]
        assert untouched and torch.isnan(cache[untouched]).all()  # rows no sequence owns: never written
    else:
        close(final, f_nv)


def test_default_scale_and_explicit_scale():
    raw, cu = make_raw([40, 17], seed=2)
    o, _ = fused_kda_prefill_c16(**raw, lower_bound=-2.0, cu_seqlens=cu)
    o_s, _ = fused_kda_prefill_c16(**raw, lower_bound=-2.0, cu_seqlens=cu, scale=0.3)
    o_nv, _, _ = naive_recurrent_kda(**raw, lower_bound=-2.0, cu_seqlens=cu)
    o_nvs, _, _ = naive_recurrent_kda(**raw, lower_bound=-2.0, cu_seqlens=cu, scale=0.3)
    close(o, o_nv)
    close(o_s, o_nvs)


@pytest.mark.parametrize(("indexed", "config"), [(True, SMALL), (False, SMALL), (True, PIPE)],
                         ids=["rows", "staging", "rows_pipeline"])
def test_checkpoints_at_64_and_128(indexed, config):
    lengths = [130, 64, 65, 0, 128, 17]
    N = len(lengths)
    raw, cu = make_raw(lengths, seed=3)
    h0 = torch.randn(N, H, V, K)
    offs = torch.tensor([128, 64, 64, 0, 128, 0])
    if indexed:
        # Snapshots go into the paged cache itself, beside the sequences' own rows.
        cache = torch.full((14, H, V, K), math.nan)
        cache[:N] = h0
        ck_rows = torch.tensor([8, 9, -1, 10, 11, 12], dtype=torch.int32)
        o, _ = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, state_cache=cache,
                                     state_indices=torch.arange(N), has_initial_state=torch.ones(N, dtype=torch.bool),
                                     checkpoint_state=cache, checkpoint_offsets=offs, checkpoint_state_indices=ck_rows,
                                     config=config)
        ck = {n: cache[int(r)] for n, r in enumerate(ck_rows) if r >= 0 and offs[n] > 0}
        untouched = [6, 7, 10, 12, 13]  # offset 0 (rows 10, 12), or no sequence's row
        finals = cache[:N]
    else:
        staging = torch.full((N, H, V, K), math.nan)
        o, finals = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                          output_final_state=True, checkpoint_state=staging, checkpoint_offsets=offs,
                                          config=config)
        ck = {n: staging[n] for n in range(N) if offs[n] > 0}
        untouched = None
        assert torch.isnan(staging[[3, 5]]).all()
    o_nv, f_nv, c_nv = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                           output_final_state=True, checkpoint_offsets=offs)
    close(o, o_nv)
    close(finals, f_nv)
    assert set(ck) == ({0, 1, 4} if indexed else {0, 1, 2, 4})
    for n, row in ck.items():
        close(row, c_nv[n])
    if untouched is not None:
        assert torch.isnan(cache[untouched]).all()


def test_strided_gate_and_beta_read_in_place():
    lengths = [64, 1, 30]
    raw, cu = make_raw(lengths, seed=4)
    T = sum(lengths)
    proj = torch.randn(1, T, H * K + H + 5)
    proj[..., : H * K] = raw["raw_g"].reshape(1, T, H * K)
    proj[..., H * K: H * K + H] = raw["raw_beta"]
    g_view = proj[..., : H * K].view(1, T, H, K)
    b_view = proj[..., H * K: H * K + H]
    assert not g_view.is_contiguous() and not b_view.is_contiguous()
    h0 = torch.randn(len(lengths), H, V, K)
    ref, f_ref = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                       output_final_state=True)
    o, f = fused_kda_prefill_c16(**{**raw, "raw_g": g_view, "raw_beta": b_view}, lower_bound=-5.0, cu_seqlens=cu,
                                 initial_state=h0, output_final_state=True)
    assert torch.equal(o, ref) and torch.equal(f, f_ref)
    # dt_bias as [H, K] reads the same numbers as [H * K].
    o2, _ = fused_kda_prefill_c16(**{**raw, "dt_bias": raw["dt_bias"].view(H, K)}, lower_bound=-5.0, cu_seqlens=cu,
                                  initial_state=h0, output_final_state=True)
    assert torch.equal(o2, ref)


def test_out_may_be_v_and_is_written_only_where_covered():
    raw, cu = make_raw([70, 5], seed=5)
    T = raw["v"].shape[1]
    ref, _ = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, config=SMALL)
    v = raw["v"].clone()
    o, _ = fused_kda_prefill_c16(**{**raw, "v": v}, lower_bound=-5.0, cu_seqlens=cu, out=v, config=SMALL)
    assert o.data_ptr() == v.data_ptr() and torch.equal(o, ref)
    # cu_seqlens covering only the first 40 tokens: the rest of out stays as it was.
    out = torch.full((1, T, H, V), math.nan)
    fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=torch.tensor([0, 30, 40]), out=out)
    assert torch.isfinite(out[:, :40]).all() and torch.isnan(out[:, 40:]).all()


def test_saturated_gates_at_the_bound():
    # a = L on every channel: the chunk-local cumulative gate reaches 16 L log2(e),
    # the edge of the range the unanchored factors 2^G, 2^-G are built for.
    lengths = [16, 33, 70]
    raw, cu = make_raw(lengths, seed=6, gate_scale=0.0)
    raw["raw_g"] = raw["raw_g"] + 30.0
    raw["A_log"] = torch.full((H,), 1.0)
    raw["dt_bias"] = torch.zeros(H * K)
    h0 = torch.randn(len(lengths), H, V, K)
    o, f = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                        output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(f).all()
    close(o, o_nv)
    close(f, f_nv)


def test_fp16_inputs():
    raw, cu = make_raw([1, 100, 17], seed=7, dtype=torch.float16)
    h0 = torch.randn(3, H, V, K)
    o, final = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                     output_final_state=True)
    assert o.dtype == torch.float16
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                        output_final_state=True)
    close(o, o_nv, atol=3e-2)
    close(final, f_nv, atol=5e-2)


def test_head_dim_128():
    raw, cu = make_raw([65, 16], H=1, K=128, V=128, seed=8)
    h0 = torch.randn(2, 1, 128, 128)
    o, final = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                     output_final_state=True, config={"BV": 64})
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                        output_final_state=True)
    close(o, o_nv)
    close(final, f_nv)


def test_empty_batch_and_zero_lengths():
    raw, cu = make_raw([0, 0], seed=9)
    h0 = torch.randn(2, H, V, K)
    o, f = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, H, V) and torch.equal(f, h0)
    o, f = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=torch.zeros(1, dtype=torch.int64),
                                 output_final_state=True)
    assert f.shape == (0, H, V, K)


@pytest.mark.parametrize("bound", [None, -6.0, 0.0, 0.5, True])
def test_lower_bound_outside_the_served_range(bound):
    raw, cu = make_raw([20], seed=10)
    with pytest.raises(ValueError, match="lower_bound"):
        fused_kda_prefill_c16(**raw, lower_bound=bound, cu_seqlens=cu)


@pytest.mark.parametrize("config", [{"BV": 48}, {"BV": 16, "inv_precision": "fp8"}], ids=["bv48", "inv_fp8"])
def test_bad_config(config):
    raw, cu = make_raw([20], seed=12)
    with pytest.raises(ValueError, match="config"):
        fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, config=config)


def test_state_arguments_combinations_are_checked():
    raw, cu = make_raw([20], seed=11)
    with pytest.raises(ValueError, match="replaces"):
        fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, state_cache=torch.zeros(2, H, V, K),
                              state_indices=torch.zeros(1, dtype=torch.int64),
                              has_initial_state=torch.ones(1, dtype=torch.bool), output_final_state=True)


# ----------------------------------------------------------------------------- GPU


def rel_rmse(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


RAGGED = [37, 4000, 1, 900, 2048, 129, 6000, 63, 64, 65]
GPU_SHAPES = [("16x2k_H32", [2048] * 16, 32), ("ragged_H32", RAGGED, 32), ("1x8k_H4", [8192], 4)]


def anchor_inputs(lengths, heads, device, seed=0):
    """bf16 inputs with the anchor run's slow-channel gates (A_log = log U[1, 16),
    dt_bias ~ N(0, 1)) and a random initial state."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    raw = {n: rnd(1, T, heads, 128).bfloat16() for n in ("q", "k", "v", "raw_g")}
    raw["raw_beta"] = rnd(1, T, heads).bfloat16()
    raw["A_log"] = torch.log(1 + 15 * torch.rand(heads, device=device, generator=gen))
    raw["dt_bias"] = rnd(heads * 128)
    cu = torch.tensor([0] + list(lengths), dtype=torch.int64, device=device).cumsum(0)
    h0 = rnd(len(lengths), heads, 128, 128) * 0.1
    return raw, cu, h0


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: c[0])
def test_gpu_bf16_vs_portable_and_fp64(gpu, case):
    _, lengths, heads = case
    raw, cu, h0 = anchor_inputs(lengths, heads, gpu)
    kw = dict(lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o, f = fused_kda_prefill_c16(**raw, **kw)
    o_p, f_p = chunk_kda_prefill(**raw, **kw)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all() and torch.isfinite(f).all()
    raw64 = {n: (t.double() if t.is_floating_point() else t) for n, t in raw.items()}
    o_64, f_64, _ = naive_recurrent_kda(**raw64, **{**kw, "initial_state": h0.double()})
    err = dict(o=rel_rmse(o, o_64), f=rel_rmse(f, f_64), o_p=rel_rmse(o_p, o_64), f_p=rel_rmse(f_p, f_64))
    print(case[0], err)
    # fla's own output error on such inputs is about 4.5e-3: ours must stay within
    # 5e-3 or within a quarter of the portable path's own error, and below 1e-2.
    assert err["o"] < 1e-2 and err["f"] < 1e-2, err
    assert err["o"] <= max(1.25 * err["o_p"], 5e-3) and err["f"] <= max(1.25 * err["f_p"], 5e-3), err
    assert rel_rmse(o, o_p) < 1e-2 and rel_rmse(f, f_p) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, {"BV": 32, "num_warps": 4, "num_stages": 2},
                                    {"BV": 128, "num_warps": 8, "num_stages": 2, "inv_precision": "tf32x3"},
                                    {"BV": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128},
                                    {"BV": 64, "num_warps": 4, "num_stages": 2, "inv_precision": "tf32"},
                                    {"BV": 64, "num_warps": 8, "num_stages": 2, "pipeline": True},
                                    {"BV": 128, "num_warps": 8, "num_stages": 2, "pipeline": True}],
                         ids=["default", "bv32", "bv128_tf32x3", "maxnreg128", "inv_tf32", "pipe64", "pipe128"])
def test_gpu_small_cache_checkpoints_out_is_v(gpu, config):
    lengths = [128, 1, 0, 65, 200, 15]
    heads = 2
    N = len(lengths)
    raw, cu, h0 = anchor_inputs(lengths, heads, gpu, seed=1)
    cache = torch.full((14, heads, 128, 128), math.nan, device=gpu)
    idx = torch.tensor([3, -1, 5, 0, 7, 12], device=gpu)
    has = torch.tensor([True, True, False, False, True, True], device=gpu)
    cache[3], cache[7], cache[12] = h0[0], h0[4], h0[5]
    offs = torch.tensor([128, 0, 0, 64, 192, 0], device=gpu, dtype=torch.int32)
    ck_rows = torch.tensor([9, -1, -1, 10, 11, 13], device=gpu, dtype=torch.int32)
    v_ref = raw["v"].clone()
    o, final = fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=cu, state_cache=cache, state_indices=idx,
                                     has_initial_state=has, checkpoint_state=cache, checkpoint_offsets=offs,
                                     checkpoint_state_indices=ck_rows, out=raw["v"], config=config)
    assert final is None and o.data_ptr() == raw["v"].data_ptr()
    start = torch.where((has & (idx >= 0))[:, None, None, None], h0, torch.zeros_like(h0))
    o_nv, f_nv, c_nv = naive_recurrent_kda(**{**raw, "v": v_ref}, lower_bound=-5.0, cu_seqlens=cu,
                                           initial_state=start, output_final_state=True, checkpoint_offsets=offs)
    assert rel_rmse(o, o_nv) < 1e-2
    for n, r in ((0, 3), (2, 5), (3, 0), (4, 7), (5, 12)):
        assert rel_rmse(cache[r], f_nv[n]) < 1e-2, n
    for n, r in ((0, 9), (3, 10), (4, 11)):
        assert rel_rmse(cache[r], c_nv[n]) < 1e-2, n
    assert torch.isnan(cache[[1, 2, 4, 6, 8, 13]]).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_new_cu_seqlens(gpu):
    heads, T = 2, 384
    raw, cu, h0 = anchor_inputs([100, 64, 220], heads, gpu, seed=2)
    cache0 = torch.randn(8, heads, 128, 128, device=gpu) * 0.1
    cache = cache0.clone()
    idx = torch.tensor([1, 4, 6], device=gpu)
    has = torch.tensor([True, False, True], device=gpu)
    offs = torch.zeros(3, dtype=torch.int32, device=gpu)
    ck = torch.full((3, heads, 128, 128), math.nan, device=gpu)
    static_cu = cu.clone()
    out = torch.empty(1, T, heads, 128, dtype=torch.bfloat16, device=gpu)

    def prefill():
        return fused_kda_prefill_c16(**raw, lower_bound=-5.0, cu_seqlens=static_cu, state_cache=cache,
                                     state_indices=idx, has_initial_state=has, checkpoint_state=ck,
                                     checkpoint_offsets=offs, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefill()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill()
    new_cu = torch.tensor([0, 192, 192, T], device=gpu, dtype=cu.dtype)
    new_offs = torch.tensor([128, 0, 192], device=gpu, dtype=torch.int32)
    static_cu.copy_(new_cu)
    offs.copy_(new_offs)
    cache.copy_(cache0)
    graph.replay()
    torch.cuda.synchronize()
    start = torch.stack([cache0[1], torch.zeros_like(cache0[0]), cache0[6]])
    o_nv, f_nv, c_nv = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=new_cu, initial_state=start,
                                           output_final_state=True, checkpoint_offsets=new_offs)
    assert rel_rmse(out, o_nv) < 1e-2
    assert rel_rmse(cache[[1, 4, 6]], f_nv) < 1e-2
    assert rel_rmse(ck[[0, 2]], c_nv[[0, 2]]) < 1e-2
    assert torch.isnan(ck[1]).all()
