"""chunk_kda_prefill (prologue + chunk) end to end against naive_recurrent_kda.

CPU (interpreter): fp32 with small head dims (both kernels compile for powers of
two 16..128) and one K = V = 128 case. GPU: bf16 at real shapes, fla-core's
``chunk_kda`` side by side at the anchor shapes (``ANCHOR_SHAPES``), a CUDA-graph
capture; ``-k small`` selects the short cases run under compute-sanitizer.
"""

import math

import pytest
import torch

from kda_engram.kda.chunk import KDA_CHECKPOINT_ALIGNMENT
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.kda.reference import naive_recurrent_kda

from ..helpers import first_fit_autotune, refused, rel_rmse

H, K, V = 2, 32, 32
LENGTHS = [0, 1, 63, 65, 0]  # the interpreter runs the prologue slowly: keep T small
ATOL = 3e-4
RAW = ("q", "k", "v", "raw_g", "raw_beta")


def make_raw(lengths, *, H=H, K=K, V=V, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    raw = dict(
        q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, V), raw_g=rnd(1, T, H, K) * 2.0,
        raw_beta=rnd(1, T, H),
    )
    raw = {n: t.to(device=device, dtype=dtype) for n, t in raw.items()}
    raw["A_log"] = (rnd(H) * 0.5).to(device)
    raw["dt_bias"] = rnd(H * K).to(device)
    cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(device)
    return raw, cu


def close(a, b, atol=ATOL):
    assert a.shape == b.shape
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err < atol, err


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("state", ["none", "initial", "cache"])
def test_matches_naive(lower_bound, state):
    raw, cu = make_raw(LENGTHS, seed=1)
    N = len(LENGTHS)
    h0 = torch.randn(N, H, V, K)
    kw = dict(lower_bound=lower_bound, cu_seqlens=cu)
    if state == "none":
        o, final = chunk_kda_prefill(**raw, **kw, output_final_state=True)
        start = torch.zeros_like(h0)
    elif state == "initial":
        o, final = chunk_kda_prefill(**raw, **kw, initial_state=h0, output_final_state=True)
        start = h0
    else:
        slots = N + 3
        cache = torch.full((slots, H, V, K), math.nan)
        idx = torch.tensor([4, 0, -1, 2, 6], dtype=torch.int32)
        has = torch.tensor([True, False, True, True, False])
        for n in range(N):
            if idx[n] >= 0 and has[n]:
                cache[int(idx[n])] = h0[n]
        o, final = chunk_kda_prefill(**raw, **kw, state_cache=cache, state_indices=idx, has_initial_state=has)
        assert final is None
        start = torch.where((has & (idx >= 0))[:, None, None, None], h0, torch.zeros_like(h0))
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, **kw, initial_state=start, output_final_state=True)
    close(o, o_nv)
    if state == "cache":
        for n in range(N):
            if idx[n] >= 0:
                close(cache[int(idx[n])], f_nv[n])
        assert torch.isnan(cache[[1, 3, 5, 7]]).all()  # rows no sequence owns
    else:
        close(final, f_nv)


def test_checkpoints_equal_truncated_prefill():
    lengths = [192, 65, 0]  # 192: 64, 128 and its end; 65: 64; 0: none
    N = len(lengths)
    raw, cu = make_raw(lengths, seed=2)
    h0 = torch.randn(N, H, V, K)
    aligned = [list(range(KDA_CHECKPOINT_ALIGNMENT, n + 1, KDA_CHECKPOINT_ALIGNMENT)) for n in lengths]
    for j in range(max(map(len, aligned))):
        offs = torch.tensor([(a + [0] * 4)[j] for a in aligned])
        # Snapshots go into the paged cache itself, next to the sequences' own rows.
        cache = torch.full((8, H, V, K), math.nan)
        cache[:N] = h0
        ck_rows = torch.tensor([5, 7, -1])
        o, _ = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, state_cache=cache,
                                 state_indices=torch.arange(N), has_initial_state=torch.ones(N, dtype=torch.bool),
                                 checkpoint_state=cache, checkpoint_offsets=offs, checkpoint_state_indices=ck_rows)
        o_nv, f_nv, c_nv = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                               output_final_state=True, checkpoint_offsets=offs)
        close(o, o_nv)
        # The same prefill stopped at each offset ends in the checkpoint.
        tl_ = [int(p) for p in offs]
        traw = {n: torch.cat([raw[n][:, int(cu[s]): int(cu[s]) + tl_[s]] for s in range(N)], dim=1) for n in RAW}
        tcu = torch.tensor([0] + tl_).cumsum(0)
        _, f_trunc = chunk_kda_prefill(**traw, A_log=raw["A_log"], dt_bias=raw["dt_bias"], lower_bound=-5.0,
                                       cu_seqlens=tcu, initial_state=h0, output_final_state=True)
        for n in range(N):
            close(cache[n], f_nv[n])
            r = int(ck_rows[n])
            if r < 0:
                continue
            if offs[n] > 0:
                close(cache[r], c_nv[n])
                close(cache[r], f_trunc[n])
            else:
                assert torch.isnan(cache[r]).all()
        assert torch.isnan(cache[[3, 4, 6]]).all()


def test_out_may_be_v():
    raw, cu = make_raw([70, 5], seed=3)
    ref, _ = chunk_kda_prefill(**raw, cu_seqlens=cu)
    v = raw["v"].clone()
    o, _ = chunk_kda_prefill(**{**raw, "v": v}, cu_seqlens=cu, out=v)
    assert o.data_ptr() == v.data_ptr()
    assert torch.equal(o, ref)


def test_fused_projection_slices_and_unchecked():
    lengths = [64, 1, 30]
    raw, cu = make_raw(lengths, seed=4)
    T = sum(lengths)
    # raw_g and raw_beta as column slices of one fused projection: read in place.
    proj = torch.randn(1, T, H * K + H + 5)
    proj[..., : H * K] = raw["raw_g"].reshape(1, T, H * K)
    proj[..., H * K : H * K + H] = raw["raw_beta"]
    g_view = proj[..., : H * K].view(1, T, H, K)
    b_view = proj[..., H * K : H * K + H]
    assert not g_view.is_contiguous() and not b_view.is_contiguous()
    h0 = torch.randn(len(lengths), H, V, K)
    ref, f_ref = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o, f = chunk_kda_prefill(**{**raw, "raw_g": g_view, "raw_beta": b_view}, lower_bound=-5.0, cu_seqlens=cu,
                             initial_state=h0, output_final_state=True, check_inputs=False)
    assert torch.equal(o, ref) and torch.equal(f, f_ref)


def test_fp16_inputs():
    raw, cu = make_raw([1, 100], seed=5, dtype=torch.float16)
    h0 = torch.randn(2, H, V, K)
    o, final = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float16
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                        output_final_state=True)
    close(o, o_nv, atol=3e-2)
    close(final, f_nv, atol=5e-2)


def test_bf16_inputs_on_every_path():
    """Issue 36: all-bf16 inputs (K = 16, two sequences) give the reference's result
    on the CPU too (the interpreter's tl.dot is wrong on bf16 operands: the
    interpreter path multiplies in fp32; before, max|o| was 6.8e9 against 0.23)."""
    raw, cu = make_raw([64, 16], H=1, K=16, V=16, seed=7, dtype=torch.bfloat16)
    o, final = chunk_kda_prefill(**raw, cu_seqlens=cu, output_final_state=True)
    assert o.dtype == torch.bfloat16
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, cu_seqlens=cu, output_final_state=True)
    close(o, o_nv, atol=3e-2)
    close(final, f_nv, atol=5e-2)


def test_head_dim_128():
    raw, cu = make_raw([65, 64], H=1, K=128, V=128, seed=6)
    h0 = torch.randn(2, 1, 128, 128)
    o, final = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                        output_final_state=True)
    close(o, o_nv)
    close(final, f_nv)


def _bad_cases():
    N = 3
    st = lambda rows=N: torch.zeros(rows, H, V, K)  # noqa: E731
    idx = torch.arange(N)
    has = torch.ones(N, dtype=torch.bool)
    return [
        ("cache_and_initial", dict(state_cache=st(4), state_indices=idx, has_initial_state=has, initial_state=st()),
         ValueError, "replaces"),
        ("cache_and_final", dict(state_cache=st(4), state_indices=idx, has_initial_state=has,
                                 output_final_state=True), ValueError, "replaces"),
        ("cache_without_has", dict(state_cache=st(4), state_indices=idx), ValueError, "has_initial_state"),
        ("cache_index_too_big", dict(state_cache=st(4), state_indices=torch.tensor([0, 9, 1]),
                                     has_initial_state=has), ValueError, "state_indices"),
        ("ckpt_misaligned", dict(checkpoint_state=st(), checkpoint_offsets=torch.tensor([0, 0, 65])),
         ValueError, "checkpoint_offsets"),
        ("ckpt_past_end", dict(checkpoint_state=st(), checkpoint_offsets=torch.tensor([128, 0, 0])),
         ValueError, "checkpoint_offsets"),
        ("ckpt_without_state", dict(checkpoint_offsets=torch.tensor([64, 0, 0])), ValueError, "checkpoint_state"),
        ("initial_wrong_layout", dict(initial_state=torch.zeros(N, H, K, V + 1)), ValueError, "initial_state"),
        ("out_wrong_shape", dict(out=torch.zeros(1, 10, H, V)), ValueError, "out"),
        ("scale_nan", dict(scale=math.nan), ValueError, "scale"),
        ("q_not_tensor", dict(q=[1.0]), TypeError, "q"),
        ("raw_beta_wrong_shape", dict(raw_beta=torch.zeros(1, 200, H, 1)), ValueError, "raw_beta"),
        ("cu_float", dict(cu_seqlens=torch.tensor([0.0, 64.0, 160.0, 200.0])), TypeError, "cu_seqlens"),
        ("cu_short_of_T", dict(cu_seqlens=torch.tensor([0, 64, 160, 190])), ValueError, "cu_seqlens"),
        ("final_state_flag_a_string", dict(output_final_state="yes"), TypeError,
         "output_final_state: expected a bool, got str"),  # issue 36: was read as true
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case):
    _, change, exc, msg = case
    raw, cu = make_raw([64, 96, 40], seed=7)
    args = dict(raw, cu_seqlens=cu)
    args.update(change)
    with refused(exc, match=msg):
        chunk_kda_prefill(**args)


def test_state_cache_rule_holds_without_checks():
    # Wrong argument combinations are caught even with check_inputs=False.
    raw, cu = make_raw([64], seed=8)
    with refused(ValueError, match="replaces"):
        chunk_kda_prefill(**raw, cu_seqlens=cu, state_cache=torch.zeros(2, H, V, K), state_indices=torch.zeros(1),
                          has_initial_state=torch.ones(1, dtype=torch.bool), output_final_state=True,
                          check_inputs=False)


# ----------------------------------------------------------------------------- GPU


def gpu_inputs(lengths, heads, device, seed=0):
    raw, cu = make_raw(lengths, H=heads, K=128, V=128, seed=seed, device=device, dtype=torch.bfloat16)
    return raw, cu


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_gpu_bf16_matches_naive(gpu, lower_bound):
    lengths = [1, 63, 64, 65, 300, 1000, 0]
    heads = 4
    raw, cu = gpu_inputs(lengths, heads, gpu)
    h0 = torch.randn(len(lengths), heads, 128, 128, device=gpu) * 0.1
    o, final = chunk_kda_prefill(**raw, lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0,
                                 output_final_state=True)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0,
                                        output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert torch.isfinite(o.float()).all() and torch.isfinite(final).all()
    assert rel_rmse(o, o_nv) < 1e-2
    assert rel_rmse(final, f_nv) < 1e-2


@pytest.mark.gpu
def test_gpu_small_cache_checkpoints_out_is_v(gpu):
    lengths = [128, 1, 0, 65, 200]
    heads = 2
    N = len(lengths)
    raw, cu = gpu_inputs(lengths, heads, gpu, seed=1)
    h0 = torch.randn(N, heads, 128, 128, device=gpu) * 0.1
    cache = torch.full((12, heads, 128, 128), math.nan, device=gpu)
    idx = torch.tensor([3, -1, 5, 0, 7], device=gpu)
    has = torch.tensor([True, True, False, False, True], device=gpu)
    cache[3], cache[7] = h0[0], h0[4]
    offs = torch.tensor([128, 0, 0, 64, 192], device=gpu, dtype=torch.int32)
    ck_rows = torch.tensor([9, -1, -1, 10, 11], device=gpu, dtype=torch.int32)
    v_ref = raw["v"].clone()
    o, final = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, state_cache=cache, state_indices=idx,
                                 has_initial_state=has, checkpoint_state=cache, checkpoint_offsets=offs,
                                 checkpoint_state_indices=ck_rows, out=raw["v"], path="portable")
    assert final is None and o.data_ptr() == raw["v"].data_ptr()
    start = torch.where((has & (idx >= 0))[:, None, None, None], h0, torch.zeros_like(h0))
    o_nv, f_nv, c_nv = naive_recurrent_kda(**{**raw, "v": v_ref}, lower_bound=-5.0, cu_seqlens=cu,
                                           initial_state=start, output_final_state=True, checkpoint_offsets=offs)
    assert rel_rmse(o, o_nv) < 1e-2
    for n, r in ((0, 3), (2, 5), (3, 0), (4, 7)):
        assert rel_rmse(cache[r], f_nv[n]) < 1e-2, n
    for n, r in ((0, 9), (3, 10), (4, 11)):
        assert rel_rmse(cache[r], c_nv[n]) < 1e-2, n
    assert torch.isnan(cache[[1, 2, 4, 6, 8]]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["portable", "hopper"])
def test_gpu_small_cuda_graph_replay_new_cu_seqlens(gpu, path):
    """A whole prefill (metadata, prologue, chunk; state cache and checkpoints) in
    one CUDA graph, replayed with new cu_seqlens contents of the same N and T, on
    each path (a host sync inside the capture would fail it)."""
    if path == "hopper" and torch.cuda.get_device_capability(gpu)[0] != 9:
        pytest.skip("the Hopper path needs an sm_90 GPU")
    heads, T = 2, 384
    raw, cu = gpu_inputs([100, 64, 220], heads, gpu, seed=2)
    N = cu.numel() - 1
    cache0 = torch.randn(8, heads, 128, 128, device=gpu) * 0.1
    cache = cache0.clone()
    idx = torch.tensor([1, 4, 6], device=gpu)
    has = torch.tensor([True, False, True], device=gpu)
    offs = torch.zeros(N, dtype=torch.int32, device=gpu)
    ck = torch.full((N, heads, 128, 128), math.nan, device=gpu)
    static_cu = cu.clone()
    out = torch.empty(1, T, heads, 128, dtype=torch.bfloat16, device=gpu)

    def prefill():
        return chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=static_cu, state_cache=cache,
                                 state_indices=idx, has_initial_state=has, checkpoint_state=ck,
                                 checkpoint_offsets=offs, out=out, check_inputs=False, path=path)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefill()  # compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill()

    new_cu = torch.tensor([0, 192, 192, T], device=gpu, dtype=cu.dtype)  # a zero-length sequence
    new_offs = torch.tensor([128, 0, 192], device=gpu, dtype=torch.int32)
    static_cu.copy_(new_cu)
    offs.copy_(new_offs)
    cache.copy_(cache0)
    graph.replay()
    torch.cuda.synchronize()
    o_graph, cache_graph, ck_graph = out.clone(), cache.clone(), ck.clone()

    cache_e = cache0.clone()
    ck_e = torch.full_like(ck, math.nan)
    o_e, _ = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=new_cu, state_cache=cache_e, state_indices=idx,
                               has_initial_state=has, checkpoint_state=ck_e, checkpoint_offsets=new_offs, path=path)
    assert torch.equal(o_graph, o_e)
    assert torch.equal(cache_graph, cache_e)
    assert torch.equal(ck_graph[[0, 2]], ck_e[[0, 2]])
    # And the replay is right, not just repeatable.
    start = torch.stack([cache0[1], torch.zeros_like(cache0[0]), cache0[6]])
    o_nv, f_nv, c_nv = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=new_cu, initial_state=start,
                                           output_final_state=True, checkpoint_offsets=new_offs)
    assert rel_rmse(o_graph, o_nv) < 1e-2
    assert rel_rmse(cache_graph[[1, 4, 6]], f_nv) < 1e-2
    assert rel_rmse(ck_graph[[0, 2]], c_nv[[0, 2]]) < 1e-2


ANCHOR_SHAPES = [("16x2k_H32", 16, 2048, 32), ("64x512_H32", 64, 512, 32), ("1x8k_H32", 1, 8192, 32)]


@pytest.mark.gpu
@pytest.mark.gpu_mem(6)  # 32768 tokens x 32 heads through two implementations
@pytest.mark.parametrize("case", ANCHOR_SHAPES, ids=lambda c: c[0])
def test_gpu_matches_fla_chunk_kda(gpu, case):
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or fla failing at import
        pytest.skip(f"fla-core is not importable ({type(exc).__name__}: {exc}); the side-by-side check needs it")
    _, n_seqs, length, heads = case
    raw, cu = gpu_inputs([length] * n_seqs, heads, gpu, seed=3)
    h0 = torch.randn(n_seqs, heads, 128, 128, device=gpu) * 0.1
    # fla's kernels take their first working config: timing dozens of configs per
    # kernel (each compiled) is not what this comparison is about.
    with torch.inference_mode(), first_fit_autotune():
        o_fla, f_fla = chunk_kda(
            raw["q"], raw["k"], raw["v"], raw["raw_g"], raw["raw_beta"],
            initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=-5.0, A_log=raw["A_log"], dt_bias=raw["dt_bias"], cu_seqlens=cu,
        )
        o, final = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0,
                                     output_final_state=True)
    # Two bf16 implementations, each about 0.5% (rms) from the exact result.
    assert rel_rmse(o, o_fla) < 2e-2
    assert rel_rmse(final, f_fla.transpose(-1, -2)) < 2e-2


def test_prefill_with_fused_conv_matches_conv_then_reference():
    """conv_* pass through to the prologue: raw bands in, conv + SiLU applied, conv state written."""
    import torch.nn.functional as F

    from kda_engram.kda.reference import naive_recurrent_kda as naive

    gen = torch.Generator().manual_seed(11)
    lengths, H, K = [5, 70], 2, 16
    T, N, C = sum(lengths), len(lengths), 3 * H * K
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, g = (rnd(1, T, H, K) for _ in range(4))
    beta, A_log, dt_bias = rnd(1, T, H), rnd(H) * 0.5, rnd(H * K)
    weight = rnd(C, 4) * 0.5
    conv_state = rnd(3, C, 3)
    rows = torch.tensor([2, 0])
    has = torch.tensor([True, False])
    cu = torch.tensor([0] + lengths).cumsum(0)
    initial_windows = conv_state.clone()
    out, final = chunk_kda_prefill(q, k, v, g, beta, A_log, dt_bias, lower_bound=-5.0, cu_seqlens=cu,
                                   output_final_state=True, conv_weight=weight, conv_state=conv_state,
                                   conv_state_indices=rows, conv_has_initial_state=has)
    x = torch.cat([q.reshape(T, H * K), k.reshape(T, H * K), v.reshape(T, H * K)], dim=1)
    conv = []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        head = initial_windows[rows[n]].T if has[n] else torch.zeros(3, C)
        seq = torch.cat([head, x[s:e]], dim=0).T[None]  # [1, C, 3 + L]
        conv.append(F.silu(F.conv1d(seq, weight[:, None, :], groups=C))[0].T)
        assert torch.allclose(conv_state[rows[n]], torch.cat([head, x[s:e]], 0)[-3:].T)
    y = torch.cat(conv, 0)
    qc, kc, vc = (y[:, i * H * K:(i + 1) * H * K].reshape(1, T, H, K) for i in range(3))
    o_ref, f_ref, _ = naive(qc, kc, vc, g, beta, A_log, dt_bias, lower_bound=-5.0, cu_seqlens=cu,
                            output_final_state=True)
    assert (out - o_ref).abs().max() < 2e-3
    assert (final - f_ref).abs().max() < 2e-3
