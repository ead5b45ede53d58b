"""The fused layer decode step (conv + KDA step + gated RMSNorm, one launch)
against its plain-PyTorch reference, one token and S tokens per sequence.

CPU: the interpreter, fp32 inputs, small heads; fp32 and bf16 state caches.
GPU (``-m gpu``): bf16 at the Kimi-Linear shapes, against the reference and
under CUDA-graph capture.
"""

import math

import pytest
import torch

from kda_engram.kda.fused_decode import kda_layer_decode_step
from kda_engram.kda.reference import naive_fused_kda_decode

from ..helpers import refused

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

BF16 = torch.bfloat16


def make_case(B, H, D, *, S=None, slots=8, state_dtype=torch.float32, dtype=torch.float32, device="cpu", seed=0):
    """Inputs as strided bands of one projection row (the layer's layout)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    C = 3 * H * D
    lead = (B,) if S is None else (B, S)
    width = C + H * D + H + H * D + 3  # q|k|v|gate|beta|g_out + slack: every band strided
    proj = rnd(*lead, width).to(dtype).to(device)
    bands = dict(
        x=proj[..., :C], raw_g=proj[..., C: C + H * D], raw_beta=proj[..., C + H * D: C + H * D + H],
        g_out=proj[..., C + H * D + H: C + 2 * H * D + H],
    )
    params = dict(
        conv_weight=(0.5 * rnd(C, 4)).to(dtype).to(device),
        A_log=(0.5 * rnd(H)).to(device),
        dt_bias=rnd(H * D).to(device),
        o_norm_weight=(1 + 0.1 * rnd(D)).to(dtype).to(device),
    )
    state = (0.5 * rnd(slots, H, D, D)).to(state_dtype).to(device)
    conv = rnd(slots, C, 3).to(dtype).to(device)
    return bands, params, state, conv


def run_both(bands, params, state, conv, idx, cidx, **kw):
    s2, c2 = state.clone(), conv.clone()
    o = kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=cidx, state_cache=state,
                              state_indices=idx, **kw)
    r = naive_fused_kda_decode(**bands, **params, conv_state=c2, conv_state_indices=cidx, state_cache=s2,
                                   state_indices=idx, **kw)
    return o, r, s2, c2


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_one_token_matches_reference(lower_bound, state_dtype):
    bands, params, state, conv = make_case(4, 2, 32, state_dtype=state_dtype, seed=1)
    state[[2, 6]] = math.nan
    conv[[1, 6]] = math.nan
    before_s, before_c = state.clone(), conv.clone()
    idx = torch.tensor([5, -1, 0, 3])
    cidx = torch.tensor([0, 2, -1, 3])
    o, r, s_ref, c_ref = run_both(bands, params, state, conv, idx, cidx, lower_bound=lower_bound)
    torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    assert torch.equal(o[1], torch.zeros_like(o[1]))  # padding sequence
    for row in (5, 0, 3):
        err = (state[row].float() - s_ref[row].float()).abs()
        tol = s_ref[row].float().abs() * (2.0**-7 if state_dtype == BF16 else 1e-5) + 1e-6
        assert bool((err <= tol).all())
    torch.testing.assert_close(conv[[0, 2, 3]], c_ref[[0, 2, 3]], rtol=0, atol=0)
    for row in (1, 2, 4, 6, 7):  # no state index names them
        assert torch.equal(state[row].float().nan_to_num(7.0), before_s[row].float().nan_to_num(7.0))
    for row in (1, 4, 5, 6, 7):  # no conv index names them
        assert torch.equal(conv[row].nan_to_num(7.0), before_c[row].nan_to_num(7.0))


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_speculative_tokens_match_reference_and_sequential_steps(state_dtype):
    """S = 3 tokens per sequence, a state and a conv row per token, starting from
    rows that are also written (read first): equal to the reference and, bit for
    bit, to three one-token launches."""
    B, S, H, D = 3, 3, 2, 32
    bands, params, state, conv = make_case(B, H, D, S=S, slots=12, state_dtype=state_dtype, seed=2)
    idx = torch.tensor([[0, 4, 7], [-1, -1, -1], [3, -1, 8]])
    cidx = torch.tensor([[1, 5, 9], [2, 6, -1], [3, 10, 11]])
    init, cinit = torch.tensor([0, -1, 3]), torch.tensor([1, 2, 3])
    kw = dict(initial_state_indices=init, initial_conv_indices=cinit, lower_bound=-5.0)
    s_seq, c_seq = state.clone(), conv.clone()
    o, r, s_ref, c_ref = run_both(bands, params, state, conv, idx, cidx, **kw)
    torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    torch.testing.assert_close(conv, c_ref, rtol=0, atol=0)
    # Sequential: scratch rows 0..B-1 of copies carry each sequence's running state/window.
    run_s, run_c = s_seq[init.clamp(min=0)].clone(), c_seq[cinit].clone()
    for s in range(S):
        one = {n: t[:, s] for n, t in bands.items()}
        rows = torch.where(init >= 0, torch.arange(B), -1)
        o_s = kda_layer_decode_step(**one, **params, conv_state=run_c, conv_state_indices=torch.arange(B),
                                    state_cache=run_s, state_indices=rows, lower_bound=-5.0)
        assert torch.equal(o_s, o[:, s])
        for b in range(B):
            if idx[b, s] >= 0:
                assert torch.equal(state[idx[b, s]].float(), run_s[b].float())
            if cidx[b, s] >= 0:
                assert torch.equal(conv[cidx[b, s]], run_c[b])


def test_output_dtype_and_bad_input():
    bands, params, state, conv = make_case(2, 2, 16, seed=3)
    state0, conv0 = state.clone(), conv.clone()
    out = torch.empty(2, 2 * 16, dtype=torch.float16)
    o = kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=torch.tensor([0, 1]),
                              state_cache=state, state_indices=torch.tensor([0, 1]), out=out)
    assert o is out
    # out_dtype: the dtype of a new out, the same values as that buffer's
    o16 = kda_layer_decode_step(**bands, **params, conv_state=conv0, conv_state_indices=torch.tensor([0, 1]),
                                state_cache=state0, state_indices=torch.tensor([0, 1]), out_dtype=torch.float16)
    assert o16.dtype == torch.float16 and torch.equal(o16, out)
    with refused(TypeError, match="out_dtype: expected None or one of"):
        kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=torch.tensor([0, 1]),
                              state_cache=state, state_indices=torch.tensor([0, 1]), out_dtype=torch.int32)
    with refused(TypeError, match="state_cache: expected dtype float32 or bfloat16"):
        kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=torch.tensor([0, 1]),
                              state_cache=state.half(), state_indices=torch.tensor([0, 1]))
    with refused(ValueError, match="state_indices: non-negative entries must be distinct"):
        kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=torch.tensor([0, 1]),
                              state_cache=state, state_indices=torch.tensor([1, 1]))
    with refused(ValueError, match=r"g_out: expected shape \[2, 32\]"):
        bad = dict(bands, g_out=bands["g_out"][:, :8])
        kda_layer_decode_step(**bad, **params, conv_state=conv, conv_state_indices=torch.tensor([0, 1]),
                              state_cache=state, state_indices=torch.tensor([0, 1]))


@pytest.mark.parametrize("fault", ["conv row duplicated", "initial conv row out of range",
                                   "initial conv rows duplicated"])
def test_multi_step_conv_rows_refused_with_caches_untouched(fault):
    """S tokens per sequence: the conv rows' rules (one launch with the state rows'
    rules) refuse in one line naming the argument, and neither cache changes."""
    B, S, slots = 3, 2, 12
    bands, params, state, conv = make_case(B, 2, 16, S=S, slots=slots, seed=5)
    idx = torch.arange(B * S).view(B, S)
    cidx = torch.arange(B * S).view(B, S) + 2
    cinit = torch.tensor([9, 10, 11])
    if fault == "conv row duplicated":
        cidx[2, 1] = cidx[0, 0]
        match = "conv_state_indices: non-negative entries must be distinct"
    elif fault == "initial conv row out of range":
        cinit[1] = slots
        match = f"initial_conv_indices: entries must be < {slots} \\(rows available\\), got max {slots}"
    else:
        cinit[2] = cinit[0]
        match = "initial_conv_indices: non-negative entries must be distinct"
    s0, c0 = state.clone(), conv.clone()
    with refused(ValueError, match=match):
        kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=cidx, state_cache=state,
                              state_indices=idx, initial_state_indices=idx[:, 0].clone(), initial_conv_indices=cinit,
                              lower_bound=-5.0)
    assert torch.equal(state, s0) and torch.equal(conv, c0)


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S", [None, 4], ids=["one", "spec4"])
def test_gpu_kimi_linear_shapes_and_cuda_graph(gpu, state_dtype, S):
    B, H, D = 64, 32, 128
    bands, params, state, conv = make_case(B, H, D, S=S, slots=B + 4 if S is None else B * 4 + 4,
                                           state_dtype=state_dtype, dtype=BF16, device=gpu, seed=4)
    if S is None:
        idx = torch.randperm(B + 4, device=gpu)[:B]
        idx[3] = -1
        cidx = idx.clone()
        cidx[3] = sorted(set(range(B + 4)) - set(idx.tolist()))[0]  # the padding row still has a conv row
        kw = {}
    else:
        idx = torch.randperm(B * 4 + 4, device=gpu)[: B * S].view(B, S)
        cidx = idx.clone()
        kw = dict(initial_state_indices=idx[:, 0].clone(), initial_conv_indices=cidx[:, 0].clone())
    s0, c0 = state.clone(), conv.clone()
    o, r, s_ref, c_ref = run_both(bands, params, state, conv, idx, cidx, lower_bound=-5.0, **kw)
    err = ((o.float() - r.float()).norm() / r.float().norm()).item()
    assert err < 1e-2, err
    # Captured and replayed from the same start: the same bits.
    state.copy_(s0)
    conv.copy_(c0)
    out = torch.empty_like(o)
    g = torch.cuda.CUDAGraph()
    kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=cidx, state_cache=state,
                          state_indices=idx, lower_bound=-5.0, out=out, check_inputs=False, **kw)  # warm-up
    state.copy_(s0)
    conv.copy_(c0)
    with torch.cuda.graph(g):
        kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=cidx, state_cache=state,
                              state_indices=idx, lower_bound=-5.0, out=out, check_inputs=False, **kw)
    state.copy_(s0)
    conv.copy_(c0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o)


TILE_CASES = [("block_v", bv) for bv in (1, 2, 4, 8, 16)] + [("num_warps", w) for w in (1, 2, 4, 8, 16, 32)]


@pytest.mark.parametrize("name, value", TILE_CASES, ids=[f"{n}={v}" for n, v in TILE_CASES])
def test_every_accepted_tuning_value_matches_the_reference(name, value):
    # Issue 54: block_v wider than V returned wrong outputs and wrote no state row.
    bands, params, state, conv = make_case(2, 1, 16, seed=7)
    idx, cidx = torch.tensor([3, 1]), torch.tensor([0, 2])
    s_ref, c_ref = state.clone(), conv.clone()
    r = naive_fused_kda_decode(**bands, **params, conv_state=c_ref, conv_state_indices=cidx, state_cache=s_ref,
                               state_indices=idx, lower_bound=-5.0)
    o = kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=cidx, state_cache=state,
                              state_indices=idx, lower_bound=-5.0, **{name: value})
    torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[idx], s_ref[idx], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[cidx], c_ref[cidx], rtol=0, atol=0)


@pytest.mark.parametrize("name, value", [("block_v", 32), ("block_v", 256), ("block_v", 3), ("block_v", 0),
                                         ("block_v", True), ("block_v", 8.0), ("num_warps", 0), ("num_warps", 3),
                                         ("num_warps", 64), ("num_warps", -4)])
def test_a_tuning_value_it_cannot_honour_is_refused_in_one_line(name, value):
    bands, params, state, conv = make_case(2, 1, 16, seed=7)
    state0, conv0 = state.clone(), conv.clone()
    with refused(ValueError, match=rf"^{name}: expected a power of two .* or None, got {value!r}$"):
        kda_layer_decode_step(**bands, **params, conv_state=conv, conv_state_indices=torch.tensor([0, 2]),
                              state_cache=state, state_indices=torch.tensor([3, 1]), **{name: value})
    assert torch.equal(state, state0) and torch.equal(conv, conv0)
    empty, *_ = make_case(0, 1, 16, seed=7)  # refused on an empty batch too, not only where it launches
    with refused(ValueError, match=rf"^{name}: expected a power of two .* or None, got {value!r}$"):
        kda_layer_decode_step(**empty, **params, conv_state=conv, conv_state_indices=torch.zeros(0, dtype=torch.long),
                              state_cache=state, state_indices=torch.zeros(0, dtype=torch.long), **{name: value})
