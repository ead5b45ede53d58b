"""kda_prefill_prologue against the reference's chunk operands and, through the
reference chunk walk, against the token-by-token recurrence.

CPU: the Triton interpreter, fp32/fp16 inputs, small head dims (the kernel takes
K, V in {16, 32, 64, 128}). GPU (``@pytest.mark.gpu``): bf16 at K = V = 128.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kda_engram import raise_pending_errors
from kda_engram.constants import LOG2E, MAX_ANCHOR_SPAN, SUB_CHUNK
from kda_engram.kda.metadata import prepare_chunk_indices, prepare_chunk_offsets
from kda_engram.kda.prologue import kda_prefill_prologue
from kda_engram.kda.reference import kda_gate, naive_chunk_operands, naive_chunk_walk, naive_recurrent_kda

from ..helpers import refused

RAGGED = [1, 15, 16, 17, 63, 64, 65, 1000]
KEYS_T = ("qg", "w", "u", "aqk")  # token-major outputs
KEYS_C = ("kg_t", "decay")  # chunk-major outputs


def make_inputs(lengths, H, K, V=None, *, dtype=torch.float32, gate="random", seed=0, device="cpu"):
    V = K if V is None else V
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    raw_g = rnd(1, T, H, K)
    if gate == "at_bound":
        raw_g = raw_g.abs() + 40.0  # sigmoid saturates at 1: a == lower_bound exactly
    elif gate == "no_decay":
        raw_g = -raw_g.abs() - 40.0  # a -> 0 in both forms
    elif gate == "strong":
        raw_g = raw_g * 4.0 + 6.0  # softplus form: large decays, |g| in the hundreds
    elif gate == "mixed":
        # softplus form: the first half of the tokens strong (sub-chunks past the
        # factored span), the rest moderate (spans of 60-126, factored and centred).
        raw_g = torch.where(torch.arange(T)[None, :, None, None] < T // 2, raw_g * 4.0 + 6.0, raw_g * 0.3 - 1.0)
    x = dict(
        q=rnd(1, T, H, K),
        k=rnd(1, T, H, K),
        v=rnd(1, T, H, V),
        raw_g=raw_g,
        raw_beta=rnd(1, T, H),
        A_log=rnd(H) * 0.5,
        dt_bias=rnd(H * K),
    )
    x = {n: t.to(device=device, dtype=dtype if n in ("q", "k", "v", "raw_g", "raw_beta") else torch.float32)
         for n, t in x.items()}
    cu = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return x, cu


def run_prologue(x, cu, lower_bound, **kw):
    K = x["q"].shape[-1]
    return kda_prefill_prologue(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
                              K ** -0.5, lower_bound, cu, **kw)


def reference(x, cu, lower_bound, dtype=torch.float64):
    return naive_chunk_operands(*(x[n].to(dtype) for n in ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias")),
                          cu_seqlens=cu, lower_bound=lower_bound)


def rel_err(got, want):
    scale = want.abs().max().clamp_min(1e-30)
    return ((got.to(want.dtype) - want).abs().max() / scale).item()


def token_mask(cu, T):
    """True on token rows that belong to a sequence (all of them when cu[-1] == T)."""
    m = torch.zeros(T, dtype=torch.bool)
    b = cu.tolist()
    for s, e in zip(b, b[1:]):
        m[s:e] = True
    return m


def assert_operands_close(out, ref, cu, tol, keys=KEYS_T + KEYS_C):
    n_chunks = int(prepare_chunk_offsets(cu.cpu())[-1])
    for key in keys:
        got = out[key]
        if key in KEYS_C:
            got = got[:n_chunks]
        assert torch.isfinite(got).all(), key
        err = rel_err(got, ref[key])
        assert err < tol, f"{key}: relative error {err:.2e} >= {tol:.0e}"


def assert_walk_matches_recurrence(out, x, cu, lower_bound, tol, seed=1):
    N, H = cu.numel() - 1, x["q"].shape[2]
    K, V = x["q"].shape[3], x["v"].shape[3]
    h0 = torch.randn(N, H, V, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    h0 = h0.to(x["q"].device)
    scale = K ** -0.5
    ops = {n: (t.double() if t.is_floating_point() else t) for n, t in out.items()}
    o_c, f_c, _ = naive_chunk_walk(ops, cu_seqlens=cu, scale=scale, initial_state=h0)
    args = [x[n].double() for n in ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias")]
    o_r, f_r, _ = naive_recurrent_kda(*args, scale=scale, lower_bound=lower_bound, cu_seqlens=cu,
                                      initial_state=h0, output_final_state=True)
    assert rel_err(o_c, o_r) < tol
    assert rel_err(f_c, f_r) < tol


# ------------------------------------------------------------------ CPU (interpreter)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_ragged_fp32_matches_reference_and_recurrence(lower_bound):
    x, cu = make_inputs(RAGGED, H=1, K=32)
    out = run_prologue(x, cu, lower_bound)
    T = x["q"].shape[1]
    rows = prepare_chunk_indices(cu, total_tokens=T).shape[0]
    assert out["qg"].shape == (1, T, 1, 32) and out["qg"].dtype == torch.float32
    assert out["kg_t"].shape == (rows, 1, 32, 64) and out["decay"].dtype == torch.float32
    assert out["aqk"].shape == (1, T, 1, 64)
    ref = reference(x, cu, lower_bound)
    assert_operands_close(out, ref, cu, tol=2e-5)
    assert_walk_matches_recurrence(out, x, cu, lower_bound, tol=1e-4)


PROLOGUE_WARPS = [1, 2, 4, 8, 16, (16, 1), (1, 16)]


@pytest.mark.parametrize("num_warps", PROLOGUE_WARPS, ids=str)
def test_every_accepted_num_warps_matches_the_reference(num_warps):
    # Issue 54: every accepted value (a power of two in [1, 16], or an (intra, solve)
    # pair of them) against the reference.
    x, cu = make_inputs([70, 5], H=1, K=16, seed=54)
    out = run_prologue(x, cu, -5.0, num_warps=num_warps)
    assert_operands_close(out, reference(x, cu, -5.0), cu, tol=2e-5)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_head_dim_128_two_heads(lower_bound):
    x, cu = make_inputs([40, 64], H=2, K=128)
    out = run_prologue(x, cu, lower_bound)
    assert_operands_close(out, reference(x, cu, lower_bound), cu, tol=2e-5)


@pytest.mark.parametrize(
    "lower_bound, gate",
    [(-5.0, "at_bound"), (-5.0, "no_decay"), (None, "no_decay"), (None, "strong"), (-20.0, "at_bound"),
     (-5.4, "at_bound"), (-7.0, "at_bound")],
)
def test_gate_extremes(lower_bound, gate):
    # at_bound: every step decays by exp(-5) (g reaches -462 over a chunk: the
    # factored products must never form 2^(+-g)); strong softplus: unbounded
    # decays on the exact diagonal path; -5.4 is the steepest bound on the
    # factored diagonal (its unshifted factors reach 2^-125); -7 and -20 exceed
    # it (factored, -7 lost the diagonal blocks to underflow: error 0.84).
    x, cu = make_inputs([64, 33], H=1, K=32, gate=gate)
    out = run_prologue(x, cu, lower_bound)
    ref = reference(x, cu, lower_bound)
    if gate == "at_bound" or gate == "strong":
        assert ref["decay"].min() == 0.0 or ref["decay"].min() < 1e-30  # decays do leave fp32 range
    assert_operands_close(out, ref, cu, tol=2e-5)
    assert_walk_matches_recurrence(out, x, cu, lower_bound, tol=1e-4)


def subchunk_spans(x, cu):
    """Each 16-token sub-chunk's decay span (log2 units, max over channels) of the
    softplus gate, per sequence."""
    a = kda_gate(x["raw_g"].double(), x["A_log"].double(), x["dt_bias"].double(), None)[0] * LOG2E  # [T, H, K]
    spans = []
    b = cu.tolist()
    for s, e in zip(b, b[1:]):
        for t in range(s, e, SUB_CHUNK):
            spans.append(-a[t:min(t + SUB_CHUNK, e)].sum(0).min().item())
    return spans


def test_unbounded_gate_picks_each_subchunks_diagonal_form():
    # One launch with sub-chunks on both sides of the factored span: the strong ones
    # take the exact sums, the moderate ones the factored product centred on their
    # own span (uncentred, their row factors would reach 2^-126).
    x, cu = make_inputs([64, 48, 64], H=1, K=32, gate="mixed")
    spans = subchunk_spans(x, cu)
    assert max(spans) > MAX_ANCHOR_SPAN and any(60 < s <= MAX_ANCHOR_SPAN for s in spans), spans
    out = run_prologue(x, cu, None)
    assert_operands_close(out, reference(x, cu, None), cu, tol=2e-5)
    assert_walk_matches_recurrence(out, x, cu, None, tol=1e-4)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fp16_inputs(lower_bound):
    x, cu = make_inputs([17, 64, 65], H=2, K=32, dtype=torch.float16)
    out = run_prologue(x, cu, lower_bound)
    for key in KEYS_T + ("kg_t",):
        assert out[key].dtype == torch.float16, key
    assert out["decay"].dtype == torch.float32
    # The reference sees the same fp16 values; the error is the output rounding.
    assert_operands_close(out, reference(x, cu, lower_bound), cu, tol=4e-3)


def test_strided_inputs_read_in_place():
    lengths, H, K, V = [20, 70], 2, 32, 16
    x, cu = make_inputs(lengths, H, K, V)
    T = sum(lengths)
    # One fused projection [T, q | k | v | g | beta | pad]: every operand is a view
    # with the projection's row stride; k additionally has a non-unit channel stride.
    widths = [H * K, H * K, H * V, H * K, H]
    fused = torch.randn(1, T, sum(widths) + 7)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    views = {}
    for name, (a, b) in zip(("q", "k", "v", "raw_g", "raw_beta"), zip(offs, offs[1:])):
        band = fused[..., a:b]
        views[name] = band if name == "raw_beta" else band.unflatten(-1, (H, -1))
    k_t = torch.randn(1, T, K, H).transpose(2, 3)  # [1, T, H, K], channel stride H
    for name in ("q", "v", "raw_g", "raw_beta"):
        views[name].copy_(x[name])
    k_t.copy_(x["k"])
    views["k"] = k_t
    dt2 = torch.randn(K, H).t()  # [H, K] non-contiguous
    dt2.copy_(x["dt_bias"].view(H, K))
    strided = dict(views, A_log=x["A_log"], dt_bias=dt2)
    assert not strided["q"].is_contiguous() and not strided["raw_beta"].is_contiguous()
    before = fused.clone()
    got = run_prologue(strided, cu, -5.0)
    want = run_prologue(x, cu, -5.0)
    assert torch.equal(fused, before)  # inputs untouched
    for key in KEYS_T + KEYS_C:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)


def test_padding_rows_untouched_and_empty_sequences():
    # Zero-length sequences, padding chunk rows (T // 64 + N rows): every real
    # token and chunk row is written, padding rows never are.
    lengths = [0, 5, 0, 64, 3]
    x, cu = make_inputs(lengths, H=2, K=16)
    cu = cu.to(torch.int64)  # both index dtypes are read in place
    T = sum(lengths)
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with mock.patch.object(torch, "empty", nan_empty):
        out = run_prologue(x, cu, -5.0)
    ci = prepare_chunk_indices(cu, total_tokens=T)
    live = ci[:, 0] >= 0
    assert int(live.sum()) == 3 and ci.shape[0] == T // 64 + len(lengths)
    for key in KEYS_C:
        assert not torch.isnan(out[key][live]).any(), key
        assert torch.isnan(out[key][~live]).all(), key
    for key in KEYS_T:
        assert not torch.isnan(out[key]).any(), key
    assert_operands_close(out, reference(x, cu, -5.0), cu, tol=2e-5)
    # An explicit chunk_indices (int64 here) gives the same result.
    again = run_prologue(x, cu, -5.0, chunk_indices=ci.to(torch.int64))
    for key in KEYS_T:
        torch.testing.assert_close(again[key], out[key], rtol=0, atol=0)
    for key in KEYS_C:
        torch.testing.assert_close(again[key][live], out[key][live], rtol=0, atol=0)


# ---------------------------------------------------------------------------- conv


def conv_reference(x, cu, weight, conv_state, indices, has_init):
    """Depthwise causal conv (width 4) + SiLU over the three bands with
    ``F.conv1d``; returns the convolved inputs and the expected new conv state."""
    q, k, v = x["q"], x["k"], x["v"]
    _, T, H, K = q.shape
    V = v.shape[3]
    raw = torch.cat([q.reshape(T, H * K), k.reshape(T, H * K), v.reshape(T, H * V)], dim=1).double()
    C = raw.shape[1]
    out = torch.zeros_like(raw)
    new_state = None if conv_state is None else conv_state.clone()
    b = cu.tolist()
    for n, (s, e) in enumerate(zip(b, b[1:])):
        if e == s:
            continue  # no chunk: no output, the state row is left alone
        window = torch.zeros(C, 3, dtype=torch.float64)
        row = -1 if indices is None else int(indices[n])
        if row >= 0 and has_init is not None and bool(has_init[n]):
            window = conv_state[row].double()
        xs = torch.cat([window, raw[s:e].t()], dim=1)  # [C, 3 + len]
        y = F.conv1d(xs[None], weight.double()[:, None, :], groups=C)[0]  # [C, len]
        out[s:e] = F.silu(y).t()
        if new_state is not None and row >= 0:
            new_state[row] = xs[:, -3:].to(new_state.dtype)
    conv = dict(x)
    conv["q"] = out[:, : H * K].reshape(1, T, H, K)
    conv["k"] = out[:, H * K : 2 * H * K].reshape(1, T, H, K)
    conv["v"] = out[:, 2 * H * K :].reshape(1, T, H, V)
    return conv, new_state


@pytest.mark.parametrize("mode", ["no_state", "state_mixed", "state_no_flags"])
def test_conv_path(mode):
    # lengths 1 and 2 are shorter than the conv window (the state shifts), 70 has
    # two chunks (the second reads the first's raw inputs), 0 has no chunk.
    lengths, H, K, V = [1, 2, 0, 5, 70], 2, 16, 32
    x, cu = make_inputs(lengths, H, K, V, seed=3)
    C = 2 * H * K + H * V
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(C, 4, generator=gen) * 0.5
    conv_state = indices = has_init = None
    kw = {}
    if mode != "no_state":
        conv_state = torch.randn(6, C, 3, generator=gen)
        indices = torch.tensor([4, 0, 2, -1, 1], dtype=torch.int32)  # sequence 3: no row
        if mode == "state_mixed":
            has_init = torch.tensor([True, False, True, True, True])
        kw = dict(conv_state=conv_state, conv_state_indices=indices, conv_has_initial_state=has_init)
    conv_x, want_state = conv_reference(x, cu, weight, None if conv_state is None else conv_state.clone(),
                                        indices, has_init)
    state_before = None if conv_state is None else conv_state.clone()
    out = run_prologue(x, cu, -5.0, conv_weight=weight, **kw)
    assert_operands_close(out, reference(conv_x, cu, -5.0), cu, tol=2e-5)
    if conv_state is not None:
        torch.testing.assert_close(conv_state, want_state, rtol=0, atol=0)
        # Rows 3 and 5 belong to no sequence, row 2 to the empty one: untouched.
        for row in (2, 3, 5):
            assert torch.equal(conv_state[row], state_before[row])
        assert not torch.equal(conv_state[0], state_before[0])


def test_conv_end_to_end_against_recurrence():
    lengths, H, K = [3, 66], 1, 16
    x, cu = make_inputs(lengths, H, K, seed=7)
    C = 3 * H * K
    weight = torch.randn(C, 4) * 0.5
    conv_state = torch.randn(2, C, 3)
    indices = torch.tensor([1, 0])
    has_init = torch.tensor([True, True])
    conv_x, _ = conv_reference(x, cu, weight, conv_state.clone(), indices, has_init)
    out = run_prologue(x, cu, None, conv_weight=weight, conv_state=conv_state, conv_state_indices=indices,
                       conv_has_initial_state=has_init)
    assert_walk_matches_recurrence(out, conv_x, cu, None, tol=1e-4)


# ----------------------------------------------------------------------- bad input


def _bad(x, cu, **over):
    args = dict(x, scale=x["q"].shape[-1] ** -0.5, lower_bound=-5.0, cu_seqlens=cu)
    args.update(over)
    return kda_prefill_prologue(**args)


@pytest.fixture
def small():
    return make_inputs([5, 9], H=2, K=16)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(q=torch.randn(2, 14, 2, 16)), ValueError, "q: expected shape"),
        (dict(k=torch.randn(1, 14, 2, 32)), ValueError, "k: expected shape"),
        (dict(v=torch.randn(1, 14, 2, 16, dtype=torch.float64)), TypeError, "v: expected dtype"),
        (dict(q=torch.randn(1, 14, 2, 16).half()), TypeError, "q, k, v: expected one dtype"),
        (dict(raw_g=torch.randn(1, 14, 2, 8)), ValueError, "raw_g: expected shape"),
        (dict(raw_beta=torch.randn(1, 14, 2, 1)), ValueError, "raw_beta: expected shape"),
        (dict(A_log=torch.randn(3)), ValueError, "A_log: expected shape"),
        (dict(dt_bias=torch.randn(2, 8)), ValueError, "dt_bias: expected shape"),
        (dict(scale="x"), TypeError, "scale"),
        (dict(lower_bound=2.0), ValueError, "lower_bound"),
        (dict(lower_bound=float("nan")), ValueError, "lower_bound"),
        (dict(cu_seqlens=torch.tensor([0, 5, 13], dtype=torch.int32)), ValueError, "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 9, 5, 14], dtype=torch.int32)), ValueError, "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0.0, 14.0])), TypeError, "cu_seqlens"),
        (dict(chunk_indices=torch.tensor([[0, 0], [2, 0]], dtype=torch.int32)), ValueError, "chunk_indices"),
        (dict(chunk_indices=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, "chunk_indices"),
        # Issue 54: rows in range one by one but not the batch's gave NaN operands.
        (dict(chunk_indices=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
         r"^chunk_indices: row 1 differs from prepare_chunk_indices\(cu_seqlens\)'s"),
        (dict(chunk_indices=torch.tensor([[1, 0], [0, 0]], dtype=torch.int32)), ValueError,
         r"^chunk_indices: row 0 differs"),
        (dict(chunk_indices=torch.tensor([[0, 0], [1, 0], [1, 0]], dtype=torch.int32)), ValueError,
         r"^chunk_indices: row 2 differs"),
        (dict(chunk_indices=torch.tensor([[0, 0]], dtype=torch.int32)), ValueError,
         r"^chunk_indices: the batch has 2 chunks, got 1 rows"),
        (dict(conv_state=torch.zeros(2, 96, 3)), ValueError, "conv_state: given without conv_weight"),
        (dict(conv_weight=torch.randn(96, 3)), ValueError, "conv_weight: expected shape"),
        (dict(conv_weight=torch.randn(96, 4), conv_state=torch.zeros(2, 96, 3)), ValueError, "conv_state_indices"),
        (dict(conv_weight=torch.randn(96, 4), conv_state=torch.zeros(2, 96, 3),
              conv_state_indices=torch.tensor([1, 1])), ValueError, "distinct"),
        (dict(conv_weight=torch.randn(96, 4), conv_state=torch.zeros(2, 96, 3),
              conv_state_indices=torch.tensor([0, 2])), ValueError, "conv_state_indices: entries must be < 2"),
        (dict(conv_weight=torch.randn(96, 4), conv_state=torch.zeros(2, 96, 3),
              conv_state_indices=torch.tensor([0, 1]), conv_has_initial_state=torch.tensor([1, 0])),
         TypeError, "conv_has_initial_state"),
        (dict(num_warps=3), ValueError, "num_warps"),
        (dict(num_warps=(4,)), TypeError, "num_warps"),
        (dict(num_warps=True), TypeError, "num_warps"),
        (dict(num_warps=(8, 4.0)), TypeError, "num_warps"),
    ],
)
def test_bad_input(small, over, exc, match):
    x, cu = small
    with refused(exc, match=match):
        _bad(x, cu, **over)


def test_chunk_indices_with_padding_rows_past_the_chunks_are_accepted(small):
    x, cu = small
    want = run_prologue(x, cu, -5.0)
    ci = torch.tensor([[0, 0], [1, 0], [-1, -1], [-1, -1]], dtype=torch.int32)
    got = _bad(x, cu, chunk_indices=ci)
    raise_pending_errors()
    for name in ("qg", "w", "u", "aqk"):
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("lengths", [[], [0, 0]])
def test_no_tokens(lengths):
    x, cu = make_inputs(lengths, H=2, K=16)
    out = run_prologue(x, cu, -5.0)
    assert out["qg"].shape == (1, 0, 2, 16) and out["kg_t"].shape == (len(lengths), 2, 16, 64)


def test_unsupported_head_dim():
    x, cu = make_inputs([5], H=1, K=16)
    x = dict(x, q=torch.randn(1, 5, 1, 24), k=torch.randn(1, 5, 1, 24), raw_g=torch.randn(1, 5, 1, 24),
             dt_bias=torch.randn(24))
    with refused(ValueError, match="K"):
        _bad(x, cu)


# ----------------------------------------------------------------------------- GPU


def _gpu_inputs(lengths, H, dtype=torch.bfloat16, gate="random", seed=0):
    return make_inputs(lengths, H, 128, dtype=dtype, gate=gate, seed=seed, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound, gate", [(-5.0, "random"), (-5.0, "at_bound"), (None, "random"),
                                               (None, "strong"), (None, "mixed")])
def test_gpu_small_bf16_matches_reference(gpu, lower_bound, gate):
    x, cu = _gpu_inputs(RAGGED, H=4, gate=gate)
    out = run_prologue(x, cu, lower_bound)
    torch.cuda.synchronize()
    assert out["qg"].dtype == torch.bfloat16 and out["decay"].dtype == torch.float32
    ref = reference(x, cu, lower_bound, dtype=torch.float32)
    assert_operands_close(out, ref, cu, tol=2e-2)
    assert_walk_matches_recurrence(out, x, cu, lower_bound, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 4e-3)])
def test_gpu_small_fp32_fp16_paths(gpu, dtype, tol):
    x, cu = _gpu_inputs([1, 63, 64, 65, 300], H=2, dtype=dtype)
    for lower_bound in (-5.0, None):
        out = run_prologue(x, cu, lower_bound)
        assert_operands_close(out, reference(x, cu, lower_bound), cu, tol=tol)


# Strided views and the conv prologue: two tests, so the tier compiles their kernels
# side by side (together they took 22 s of a cold smoke run).
@pytest.mark.gpu
def test_gpu_small_bf16_strided(gpu):
    lengths, H, K = [1, 2, 70, 200], 4, 128
    x, cu = _gpu_inputs(lengths, H)
    T = sum(lengths)
    fused = torch.randn(1, T, 4 * H * K + H + 8, device="cuda", dtype=torch.bfloat16)
    views = dict(q=fused[..., :H * K], k=fused[..., H * K:2 * H * K], v=fused[..., 2 * H * K:3 * H * K],
                 raw_g=fused[..., 3 * H * K:4 * H * K])
    views = {n: t.unflatten(-1, (H, K)) for n, t in views.items()}
    views["raw_beta"] = fused[..., 4 * H * K:4 * H * K + H]
    for n, t in views.items():
        t.copy_(x[n])
    strided = dict(views, A_log=x["A_log"], dt_bias=x["dt_bias"])
    got, want = run_prologue(strided, cu, -5.0), run_prologue(x, cu, -5.0)
    for key in KEYS_T:
        torch.testing.assert_close(got[key], want[key], rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
def test_gpu_small_bf16_conv(gpu):
    lengths, H, K = [1, 2, 70, 200], 4, 128
    x, cu = _gpu_inputs(lengths, H)
    C = 3 * H * K
    weight = (torch.randn(C, 4, device="cuda") * 0.5).to(torch.bfloat16)
    conv_state = torch.randn(5, C, 3, device="cuda").to(torch.bfloat16)
    indices = torch.tensor([3, 0, -1, 1], device="cuda", dtype=torch.int32)
    has_init = torch.tensor([True, False, True, True], device="cuda")
    cpu = lambda t: t.cpu()  # noqa: E731
    conv_x, want_state = conv_reference({n: cpu(t).float() for n, t in x.items()}, cpu(cu), cpu(weight).float(),
                                        cpu(conv_state).float(), cpu(indices), cpu(has_init))
    out = run_prologue(x, cu, -5.0, conv_weight=weight, conv_state=conv_state, conv_state_indices=indices,
                       conv_has_initial_state=has_init)
    ref = reference({n: t.cuda() for n, t in conv_x.items()}, cu, -5.0, dtype=torch.float32)
    assert_operands_close(out, ref, cu, tol=2e-2)
    torch.testing.assert_close(conv_state.float().cpu(), want_state, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.gpu_mem(4)
def test_gpu_bf16_real_shape(gpu):
    # 8192 tokens in four ragged sequences, H = 32: the benchmark's regime.
    lengths = [1, 3000, 4127, 1064]
    x, cu = _gpu_inputs(lengths, H=32, seed=11)
    out = run_prologue(x, cu, -5.0, check_inputs=False)
    ref = reference(x, cu, -5.0, dtype=torch.float32)
    assert_operands_close(out, ref, cu, tol=2e-2)


def test_reference_helpers_are_consistent():
    # Sanity check of the test's own conv reference: no state and a zero weight
    # except tap 3 is SiLU of the input itself.
    x, cu = make_inputs([3, 4], H=1, K=16)
    weight = torch.zeros(48, 4)
    weight[:, 3] = 1.0
    conv_x, _ = conv_reference(x, cu, weight, None, None, None)
    torch.testing.assert_close(conv_x["q"].float(), F.silu(x["q"]), rtol=1e-6, atol=1e-6)
    assert math.isclose(rel_err(torch.ones(2), torch.ones(2)), 0.0)
