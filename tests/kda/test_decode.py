"""KDA decode (one token and multi-token) against ``naive_recurrent_kda``.

CPU: the Triton interpreter on small heads (fp32, fp16). GPU (``-m gpu``): bf16 at
serving shapes; the ``small`` cases are the ones to run under compute-sanitizer
(``pytest -m gpu -k small``).
"""

import math

import pytest
import torch

from kda_engram.kda.decode import decode_tiling, kda_decode, kda_decode_multi, launch_decode
from kda_engram.kda.reference import naive_recurrent_kda

from ..helpers import assert_untouched, make_step, refused

# The interpreter evaluates tl.sigmoid(z) as 1 / (1 + exp(-z)) in numpy: at the
# extreme gates exp overflows to inf and the sigmoid correctly becomes 0, with a
# RuntimeWarning that is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# ---------------------------------------------------------------------------- helpers


def make_cache(slots, H, V, K, named, *, device="cpu", seed=1):
    """fp32 cache: random rows where ``named``, NaN sentinels everywhere else."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.full((slots, H, V, K), math.nan, device=device)
    rows = sorted({int(r) for r in named if int(r) >= 0})
    cache[rows] = 0.5 * torch.randn(len(rows), H, V, K, generator=gen, device=device)
    return cache


def reference_step(inputs, cache, rows, lower_bound, scale=None):
    """``naive_recurrent_kda`` on one token per sequence from cache rows ``rows``."""
    one = {n: (t[:, None] if n not in ("A_log", "dt_bias") else t) for n, t in inputs.items()}
    h0 = cache[rows.clamp(min=0).long()].clone()
    o, final, _ = naive_recurrent_kda(
        **one, scale=scale, lower_bound=lower_bound, initial_state=h0, output_final_state=True
    )
    return o[:, 0], final


# ------------------------------------------------------------------ one token, CPU

# Out-of-order, sparse rows with padding entries next to NaN sentinel rows.
INDICES = [7, -1, 2, 11, -3, 0]
SLOTS = 13


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("gate", ["random", "extreme"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_decode_matches_reference(lower_bound, gate, index_dtype):
    B, H, K, V = len(INDICES), 2, 32, 32
    inputs = make_step(B, H, K, V, gate=gate)
    idx = torch.tensor(INDICES, dtype=index_dtype)
    pad = idx < 0
    inputs["q"][pad] = math.nan  # garbage in padding rows must not leak into out
    cache = make_cache(SLOTS, H, V, K, INDICES)
    before = cache.clone()
    ref_o, ref_state = reference_step(inputs, before, idx, lower_bound)

    out = torch.full((B, H, V), math.nan)
    got = kda_decode(**inputs, state_cache=cache, state_indices=idx, lower_bound=lower_bound, out=out)

    assert got is out
    live = ~pad
    torch.testing.assert_close(out[live], ref_o[live], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    torch.testing.assert_close(cache[idx[live].long()], ref_state[live], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(cache[idx[live].long()]).all()
    assert_untouched(cache, before, INDICES)


def test_decode_head_dim_128_fp16():
    B, H, K, V = 3, 2, 128, 128
    inputs = make_step(B, H, K, V, dtype=torch.float16, seed=3)
    idx = torch.tensor([4, 0, -1])
    cache = make_cache(6, H, V, K, idx.tolist())
    before = cache.clone()
    ref_o, ref_state = reference_step(inputs, before, idx, -5.0)
    out = kda_decode(**inputs, state_cache=cache, state_indices=idx, lower_bound=-5.0)
    assert out.dtype == torch.float16 and out.shape == (B, H, V)
    torch.testing.assert_close(out[:2].float(), ref_o[:2], atol=2e-3, rtol=2e-3)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(cache[[4, 0]], ref_state[:2], atol=1e-5, rtol=1e-5)
    assert_untouched(cache, before, [4, 0])


@pytest.mark.parametrize("block_v, num_warps", [(16, 1), (32, 4), (64, 4)])
def test_every_tile_size(block_v, num_warps):
    B, H, K, V = 2, 2, 64, 64
    inputs = make_step(B, H, K, V, seed=4)
    idx = torch.tensor([1, 3])
    cache = make_cache(4, H, V, K, idx.tolist())
    before = cache.clone()
    ref_o, ref_state = reference_step(inputs, before, idx, None, scale=0.3)
    out = torch.empty(B, H, V)
    launch_decode(
        *inputs.values(), cache, idx, idx, out, 0.3, None, steps=1, init_stride=1, idx_strides=(1, 0),
        block_v=block_v, num_warps=num_warps,
    )
    torch.testing.assert_close(out, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[idx], ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, bad", [("block_v", 128), ("block_v", 3), ("block_v", True), ("num_warps", 0),
                                       ("num_warps", 3), ("num_warps", 64)])
def test_a_tile_it_cannot_honour_is_refused_in_one_line(name, bad):
    # Issue 54: num_warps was never checked; block_v=True passed as 1.
    inputs = make_step(2, 2, 64, 64, seed=4)
    idx = torch.tensor([1, 3])
    cache = make_cache(4, 2, 64, 64, idx.tolist())
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"^{name}: expected a power of two .* or None, got {bad!r}$"):
        launch_decode(*inputs.values(), cache, idx, idx, torch.empty(2, 2, 64), 0.3, None, steps=1, init_stride=1,
                      idx_strides=(1, 0), **{name: bad})
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0))


def test_strided_inputs_state_and_out():
    """Inputs as column slices of one fused projection, a transposed head axis, a
    non-unit last stride, a cache that is one layer of a larger buffer, strided
    indices and a strided output."""
    B, H, K, V = 3, 2, 32, 32
    dense = make_step(B, H, K, V, seed=5)
    gen = torch.Generator().manual_seed(6)
    # [q | k | v | g | beta] side by side in one projection row, with a gap.
    widths = [H * K, H * K, H * V, H * K, H]
    proj = torch.randn(B, sum(widths) + 7, generator=gen)
    cols = torch.tensor([0] + widths).cumsum(0).tolist()
    for i, name in enumerate(["q", "k", "v", "raw_g", "raw_beta"]):
        proj[:, cols[i] : cols[i + 1]] = dense[name].reshape(B, -1)
    q = proj[:, cols[0] : cols[1]].view(B, H, K)
    v = proj[:, cols[2] : cols[3]].view(B, H, V)
    raw_beta = proj[:, cols[4] : cols[5]]
    # k transposed in memory ([H, B, K] storage), raw_g with last-dim stride 2.
    k = dense["k"].transpose(0, 1).contiguous().transpose(0, 1)
    g_wide = torch.zeros(B, H, 2 * K)
    g_wide[..., ::2] = dense["raw_g"]
    raw_g = g_wide[..., ::2]
    dt_wide = torch.zeros(2 * H * K)
    dt_wide[::2] = dense["dt_bias"]
    dt_bias = dt_wide[::2]  # flat [H*K] with stride 2
    assert q.stride() == (proj.stride(0), K, 1) and raw_g.stride(-1) == 2
    strided = dict(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, A_log=dense["A_log"], dt_bias=dt_bias)

    layers = torch.full((5, 2, H, V, K), math.nan)  # [slots, layer, H, V, K]
    idx_wide = torch.tensor([[3, 99], [-1, 99], [0, 99]])
    idx = idx_wide[:, 0]  # stride 2
    layers[[3, 0], 1] = 0.5 * torch.randn(2, H, V, K, generator=gen)
    cache = layers[:, 1]
    before = layers.clone()
    ref_o, ref_state = reference_step(dense, cache.clone(), idx, -5.0)

    out_wide = torch.full((B, 2 * H, V), 7.0)
    out = out_wide[:, ::2]
    kda_decode(**strided, state_cache=cache, state_indices=idx, lower_bound=-5.0, out=out)
    torch.testing.assert_close(out[[0, 2]], ref_o[[0, 2]], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out_wide[:, 1::2], torch.full_like(out_wide[:, 1::2], 7.0))
    torch.testing.assert_close(cache[[3, 0]], ref_state[[0, 2]], atol=1e-5, rtol=1e-5)
    # The other layer and the unnamed rows of this layer are untouched.
    torch.testing.assert_close(layers[:, 0], before[:, 0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(layers[[1, 2, 4], 1], before[[1, 2, 4], 1], equal_nan=True, rtol=0, atol=0)


def test_check_inputs_off_and_empty_batch():
    B, H, K, V = 2, 2, 32, 32
    inputs = make_step(B, H, K, V, seed=7)
    idx = torch.tensor([1, 0], dtype=torch.int32)
    c1 = make_cache(2, H, V, K, [0, 1])
    c2 = c1.clone()
    o1 = kda_decode(**inputs, state_cache=c1, state_indices=idx)
    o2 = kda_decode(**inputs, state_cache=c2, state_indices=idx, check_inputs=False)
    assert torch.equal(o1, o2) and torch.equal(c1, c2)
    empty = make_step(0, H, K, V)
    out = kda_decode(**empty, state_cache=c1, state_indices=torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, H, V)
    assert torch.equal(c1, c2)


def test_decode_tiling_fits():
    for B, H in [(1, 1), (4, 2), (64, 32), (1024, 8)]:
        bv, nw = decode_tiling(B, H, 128, "cpu")
        assert 128 % bv == 0 and bv & (bv - 1) == 0 and nw in (1, 2, 4, 8)
    assert decode_tiling(1, 1, 16, "cpu")[0] == 16


# ------------------------------------------------------------------ bad input, CPU


def _valid_call(B=2, H=2, K=32, V=32, slots=4):
    args = make_step(B, H, K, V, seed=8)
    args["state_cache"] = torch.zeros(slots, H, V, K)
    args["state_indices"] = torch.tensor([0, 2])
    return args


BAD = [
    ("q", lambda a: a.update(q=a["q"].numpy()), TypeError, "q: expected a torch.Tensor"),
    ("q", lambda a: a.update(q=a["q"][:, :1]), ValueError, "q: expected shape"),
    ("q", lambda a: a.update(q=a["q"][None]), ValueError, "q: expected shape [B, H, K]"),
    ("q", lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q: expected dtype"),
    ("q", lambda a: a.update(q=a["q"].to("meta")), ValueError, "q: expected a tensor on cpu"),
    ("k", lambda a: a.update(k=a["k"][..., :16]), ValueError, "k: expected shape [2, 2, 32]"),
    ("v", lambda a: a.update(v=a["v"][:, :, :16]), ValueError, "v: expected shape"),
    ("v", lambda a: a.update(v=a["v"].double()), TypeError, "v: expected dtype"),
    ("dtype mix", lambda a: a.update(k=a["k"].half()), TypeError, "q, k, v: expected one dtype"),
    ("raw_g", lambda a: a.update(raw_g=a["raw_g"][1:]), ValueError, "raw_g: expected shape"),
    ("raw_beta", lambda a: a.update(raw_beta=a["raw_beta"][..., None]), ValueError, "raw_beta: expected shape"),
    ("A_log", lambda a: a.update(A_log=a["A_log"][:1]), ValueError, "A_log: expected shape [2]"),
    ("dt_bias", lambda a: a.update(dt_bias=a["dt_bias"][:5]), ValueError, "dt_bias: expected shape"),
    ("state dtype", lambda a: a.update(state_cache=a["state_cache"].half()), TypeError, "state_cache: expected dtype float32"),
    ("state dims", lambda a: a.update(state_cache=a["state_cache"][0]), ValueError, "state_cache: expected shape"),
    ("head dim", lambda a: a.update(
        state_cache=torch.zeros(4, 2, 24, 32), v=a["v"][..., :24]), ValueError, "powers of two"),
    ("index dtype", lambda a: a.update(state_indices=a["state_indices"].float()), TypeError, "state_indices: expected dtype"),
    ("index shape", lambda a: a.update(state_indices=a["state_indices"][:1]), ValueError, "state_indices: expected shape"),
    ("index range", lambda a: a.update(state_indices=torch.tensor([0, 4])), ValueError, "state_indices: entries must be < 4"),
    ("duplicates", lambda a: a.update(state_indices=torch.tensor([3, 3])), ValueError, "distinct"),
    ("out shape", lambda a: a.update(out=torch.empty(2, 2, 16)), ValueError, "out: expected shape"),
    ("out dtype", lambda a: a.update(out=torch.empty(2, 2, 32, dtype=torch.int64)), TypeError, "out: expected dtype"),
    ("lower_bound", lambda a: a.update(lower_bound=2.0), ValueError, "lower_bound"),
    ("lower_bound type", lambda a: a.update(lower_bound="x"), TypeError, "lower_bound"),
    ("scale type", lambda a: a.update(scale=torch.tensor(1.0)), TypeError, "scale"),
]


@pytest.mark.parametrize("what, mutate, exc, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected(what, mutate, exc, message):
    args = _valid_call()
    mutate(args)
    before = args["state_cache"].clone()
    with refused(exc) as info:
        kda_decode(**args)
    assert message in str(info.value)
    assert torch.equal(args["state_cache"], before)


BAD_ROWS = [b for b in BAD if b[0].startswith("index") or b[0] == "duplicates"]


@pytest.mark.parametrize("what, mutate, exc, message", [(None, None, None, None), *BAD_ROWS],
                         ids=["valid", *(b[0] for b in BAD_ROWS)])
def test_null_row_rows_pass_the_host_rule_once(what, mutate, exc, message, monkeypatch):
    """``null_row=0``: the caller's rows pass :func:`check_decode_indices` once (before
    the null rows become -1 for the value rules), and every refusal of the rows stays."""
    import kda_engram.validation.kda_decode as rules

    seen = []
    real = rules.check_decode_indices
    monkeypatch.setattr(rules, "check_decode_indices", lambda rows, *rest: seen.append(rows) or real(rows, *rest))
    args = _valid_call()
    if mutate is None:
        kda_decode(**args, null_row=0)
    else:
        mutate(args)
        before = args["state_cache"].clone()
        with refused(exc) as info:
            kda_decode(**args, null_row=0)
        assert message in str(info.value)
        assert torch.equal(args["state_cache"], before)
    assert len(seen) == 1 and seen[0] is args["state_indices"]


# ------------------------------------------------------------- multi-token, CPU


def reference_multi(inputs, cache, init_rows, lower_bound):
    """Outputs of one S-token reference call, and the state after every token
    (chained one-token calls), all from cache rows ``init_rows``."""
    h0 = cache[init_rows.clamp(min=0).long()].clone()
    o, final, _ = naive_recurrent_kda(**inputs, lower_bound=lower_bound, initial_state=h0, output_final_state=True)
    S = inputs["q"].shape[1]
    states, state = [], h0
    for s in range(S):
        tok = {n: (t[:, s : s + 1] if n not in ("A_log", "dt_bias") else t) for n, t in inputs.items()}
        _, state, _ = naive_recurrent_kda(**tok, lower_bound=lower_bound, initial_state=state, output_final_state=True)
        states.append(state)
    tol = 1e-10 if final.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(states[-1], final, atol=tol, rtol=tol)  # chaining = one call
    return o, torch.stack(states, 1)  # [B, S, H, V, K]


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("explicit_initial", [False, True])
def test_multi_matches_reference(lower_bound, explicit_initial):
    B, S, H, K, V = 3, 3, 2, 32, 32
    inputs = make_step(B, S=S, H=H, K=K, V=V, seed=9, gate="random" if lower_bound is None else "extreme")
    inputs = {n: (t.double() if t.dim() > 1 else t) for n, t in inputs.items()}
    # seq 0 writes every token; seq 1 skips token 1; seq 2 is padding (default
    # initial) or starts from its own last row (explicit initial).
    state_indices = torch.tensor([[5, 1, 8], [2, -1, 10], [-1, 4, 0]])
    initial = torch.tensor([5, 12, 0]) if explicit_initial else None
    init_rows = state_indices[:, 0] if initial is None else initial
    named = state_indices.flatten().tolist() + init_rows.tolist()
    cache = make_cache(14, H, V, K, named)
    before = cache.clone()
    inputs32 = {n: t.float() for n, t in inputs.items()}
    ref_o, ref_states = reference_multi(inputs, before.double(), init_rows, lower_bound)

    out = kda_decode_multi(
        **inputs32, state_cache=cache, state_indices=state_indices, initial_state_indices=initial,
        lower_bound=lower_bound,
    )
    assert out.shape == (B, S, H, V)
    live = init_rows >= 0
    torch.testing.assert_close(out[live].double(), ref_o[live], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    written = []
    for b in range(B):
        for s in range(S):
            r = int(state_indices[b, s])
            if live[b] and r >= 0:
                torch.testing.assert_close(cache[r].double(), ref_states[b, s], atol=1e-5, rtol=1e-5)
                written.append(r)
    assert_untouched(cache, before, written)


def test_multi_one_token_equals_decode():
    B, H, K, V = 3, 2, 32, 32
    inputs = make_step(B, H, K, V, seed=10)
    idx = torch.tensor([2, -1, 0])
    c1 = make_cache(3, H, V, K, idx.tolist())
    c2 = c1.clone()
    o1 = kda_decode(**inputs, state_cache=c1, state_indices=idx)
    multi = {n: (t[:, None] if n not in ("A_log", "dt_bias") else t) for n, t in inputs.items()}
    o2 = kda_decode_multi(**multi, state_cache=c2, state_indices=idx[:, None])
    assert torch.equal(o1, o2[:, 0])
    assert torch.equal(c1.nan_to_num(), c2.nan_to_num()) and torch.equal(c1.isnan(), c2.isnan())


def _valid_multi(B=2, S=2, H=2, K=32, V=32, slots=6):
    args = make_step(B, S=S, H=H, K=K, V=V, seed=11)
    args["state_cache"] = torch.zeros(slots, H, V, K)
    args["state_indices"] = torch.tensor([[0, 1], [2, 3]])
    return args


BAD_MULTI = [
    ("q rank", lambda a: a.update(q=a["q"][:, 0]), ValueError, "q: expected shape [B, S, H, K]"),
    ("v tokens", lambda a: a.update(v=a["v"][:, :1]), ValueError, "v: expected shape [2, 2, 2, 32]"),
    ("beta", lambda a: a.update(raw_beta=a["raw_beta"][:, 0]), ValueError, "raw_beta: expected shape"),
    ("indices shape", lambda a: a.update(state_indices=a["state_indices"][:, 0]), ValueError, "state_indices: expected shape [2, 2]"),
    ("indices dup", lambda a: a.update(state_indices=torch.tensor([[0, 1], [1, 3]])), ValueError, "distinct"),
    ("indices range", lambda a: a.update(state_indices=torch.tensor([[0, 1], [2, 6]])), ValueError, "entries must be < 6"),
    ("initial dtype", lambda a: a.update(initial_state_indices=torch.tensor([0.0, 2.0])), TypeError, "initial_state_indices: expected dtype"),
    ("initial shape", lambda a: a.update(initial_state_indices=torch.tensor([0])), ValueError, "initial_state_indices: expected shape"),
    ("initial dup", lambda a: a.update(initial_state_indices=torch.tensor([4, 4])), ValueError, "initial_state_indices: non-negative entries must be distinct"),
    ("initial clash", lambda a: a.update(initial_state_indices=torch.tensor([3, 2])), ValueError, "another sequence"),
]


@pytest.mark.parametrize("what, mutate, exc, message", BAD_MULTI, ids=[b[0] for b in BAD_MULTI])
def test_multi_bad_input_is_rejected(what, mutate, exc, message):
    args = _valid_multi()
    mutate(args)
    before = args["state_cache"].clone()
    with refused(exc) as info:
        kda_decode_multi(**args)
    assert message in str(info.value)
    assert torch.equal(args["state_cache"], before)


# ------------------------------------------------- packed tokens of uneven counts (varlen)

# Four sequences of 3, 0, 1 and 2 tokens, then two tokens no sequence owns (CUDA-graph
# padding); W = 3 columns of rows a sequence, vLLM's null row 0.
VARLEN_COUNTS, VARLEN_T, VARLEN_W = [3, 0, 1, 2], 8, 3
VARLEN_ROWS = [[5, 1, 8], [0, 0, 0], [2, 0, 0], [6, 4, 9]]


def _varlen_case(lower_bound, seed=21, device="cpu", dtype=torch.float32, K=32):
    H, V = 2, K
    packed = make_step(1, S=VARLEN_T, H=H, K=K, V=V, seed=seed, gate="random" if lower_bound is None else "extreme",
                       device=device, dtype=dtype)
    cu = torch.tensor([0, *VARLEN_COUNTS], device=device).cumsum(0)
    rows = torch.tensor(VARLEN_ROWS, device=device)
    cache = make_cache(12, H, V, K, range(1, 12), seed=seed, device=device)
    return packed, cu, rows, cache


def _per_sequence(packed, cu, rows, start_cols, cache, lower_bound, null_row):
    """The same walk one sequence at a time (each its own [1, L] launch), rows <= null_row mapped to -1."""
    out = torch.zeros_like(packed["v"])
    for n in range(cu.numel() - 1):
        a, b = int(cu[n]), int(cu[n + 1])
        start = int(rows[n, start_cols[n]])
        if b == a or start <= null_row:
            continue
        one = {name: (t[:, a:b] if t.dim() > 1 else t) for name, t in packed.items()}
        written = torch.where(rows[n:n + 1, :b - a] > null_row, rows[n:n + 1, :b - a], -1)
        out[:, a:b] = kda_decode_multi(**one, state_cache=cache, state_indices=written,
                                       initial_state_indices=torch.tensor([start], device=cache.device),
                                       lower_bound=lower_bound)
    return out


def check_varlen_equals_one_launch_per_sequence(lower_bound, accepted, **case):
    packed, cu, rows, cache = _varlen_case(lower_bound, **case)
    expected_cache = cache.clone()
    cols = [0] * len(VARLEN_COUNTS) if accepted is None else [a - 1 for a in accepted]
    expected = _per_sequence(packed, cu, rows, cols, expected_cache, lower_bound, null_row=0)
    out = torch.full_like(packed["v"], 7.0)
    got = kda_decode_multi(**packed, state_cache=cache, state_indices=rows, cu_seqlens=cu, null_row=0,
                           num_accepted_tokens=None if accepted is None else torch.tensor(accepted, device=cu.device),
                           lower_bound=lower_bound, out=out)
    assert got is out
    owned = int(cu[-1])
    assert torch.equal(out[:, :owned], expected[:, :owned])
    assert torch.equal(out[:, owned:], torch.full_like(out[:, owned:], 7.0))
    assert torch.equal(cache.nan_to_num(3.0), expected_cache.nan_to_num(3.0))
    fresh = _varlen_case(lower_bound, **case)[3]
    assert not torch.equal(cache.nan_to_num(3.0), fresh.nan_to_num(3.0))  # rows were written


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("accepted", [None, [2, 1, 1, 1]])
def test_varlen_equals_one_launch_per_sequence(lower_bound, accepted):
    """Uneven counts, a zero-length sequence, padding tokens past cu_seqlens[-1], vLLM's
    null row and the start from the last accepted token, in one launch: equal to one
    launch per sequence; tokens no sequence owns keep what ``out`` held, rows no
    sequence writes are untouched."""
    check_varlen_equals_one_launch_per_sequence(lower_bound, accepted)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("accepted", [None, [2, 1, 1, 1]])
def test_varlen_equals_one_launch_per_sequence_gpu_bf16(lower_bound, accepted):
    """The same on the GPU, bf16 inputs at the serving head size (K = V = 128)."""
    check_varlen_equals_one_launch_per_sequence(lower_bound, accepted, device="cuda", dtype=torch.bfloat16, K=128)


def test_varlen_without_null_row_or_tokens():
    """The default null row (-1): row 0 is a row; no token at all (T = 0) and no
    column (W = 0) launch nothing."""
    packed, cu, rows, cache = _varlen_case(None, seed=22)
    rows = rows - 1  # row 0 of the case becomes -1 (none), its row 1 becomes a real row 0
    expected_cache = cache.clone()
    expected = _per_sequence(packed, cu, rows, [0] * 4, expected_cache, None, null_row=-1)
    got = kda_decode_multi(**packed, state_cache=cache, state_indices=rows, cu_seqlens=cu)
    assert torch.equal(got[:, :int(cu[-1])], expected[:, :int(cu[-1])])
    assert torch.equal(got[:, int(cu[-1]):], torch.zeros_like(got[:, int(cu[-1]):]))  # allocated here: zeros
    assert torch.equal(cache.nan_to_num(3.0), expected_cache.nan_to_num(3.0))
    before = cache.clone()
    empty = {n: (t[:, :0] if t.dim() > 1 else t) for n, t in packed.items()}
    none = torch.zeros(5, dtype=torch.int64)
    assert kda_decode_multi(**empty, state_cache=cache, state_indices=rows, cu_seqlens=none).shape[1] == 0
    kda_decode_multi(**packed, state_cache=cache, state_indices=rows[:, :0], cu_seqlens=none)
    assert torch.equal(cache.nan_to_num(3.0), before.nan_to_num(3.0))


BAD_VARLEN = [
    ("longer than W", dict(cu_seqlens=torch.tensor([0, 4, 4, 5, 6])), ValueError,
     "cu_seqlens: a sequence has more tokens than state_indices' width W=3"),
    ("past T", dict(cu_seqlens=torch.tensor([0, 3, 3, 4, 9])), ValueError, "at most T=8 last"),
    ("decreasing", dict(cu_seqlens=torch.tensor([0, 3, 2, 4, 6])), ValueError, "non-decreasing"),
    ("accepted", dict(num_accepted_tokens=torch.tensor([1, 1, 4, 1])), ValueError,
     "num_accepted_tokens: expected entries in [1, 3]"),
    ("accepted with initial", dict(num_accepted_tokens=torch.tensor([1, 1, 1, 1]),
                                   initial_state_indices=torch.tensor([5, -1, 2, 6])), ValueError, "not both"),
    ("null row", dict(null_row=-2), ValueError, "null_row: expected an int -1 <= null_row"),
    ("rows shape", dict(state_indices=torch.tensor([[5, 1, 8]])), ValueError, "state_indices: expected [4, W]"),
    ("batch", dict(q=torch.zeros(2, 4, 2, 32)), ValueError, "q: with cu_seqlens the batch dim must be 1"),
    ("written twice", dict(state_indices=torch.tensor([[5, 1, 8], [0, 0, 0], [2, 0, 0], [6, 8, 9]])), ValueError,
     "distinct"),
]


@pytest.mark.parametrize("what, change, exc, message", BAD_VARLEN, ids=[b[0] for b in BAD_VARLEN])
def test_varlen_bad_input_is_rejected(what, change, exc, message):
    """A rule on the packed layout broken: one clear error, no row written. Rows past a
    sequence's length and null rows are none (row 0 stands four times above, legally)."""
    packed, cu, rows, cache = _varlen_case(None, seed=23)
    args = dict(packed, state_cache=cache, state_indices=rows, cu_seqlens=cu, null_row=0)
    if "q" in change:
        args.update(k=change["q"], v=change["q"], raw_g=change["q"], raw_beta=change["q"][..., 0])
    args.update(change)
    before = cache.clone()
    with refused(exc) as info:
        kda_decode_multi(**args)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert torch.equal(cache.nan_to_num(3.0), before.nan_to_num(3.0))


@pytest.mark.parametrize("layout", ["plain", "null row", "varlen", "varlen accepted"])
def test_multi_row_arguments_pass_their_host_rule_once(layout, monkeypatch):
    """Each row argument the caller gives is checked once; the rows the layout rules
    derive from them (the rows really walked) are not checked again."""
    import kda_engram.validation.kda_decode as rules

    names = []
    real = rules.check_tensor
    monkeypatch.setattr(rules, "check_tensor", lambda name, *rest, **kw: names.append(name) or real(name, *rest, **kw))
    if layout in ("plain", "null row"):
        args = dict(_valid_multi(), initial_state_indices=torch.tensor([4, 5]),
                    null_row=0 if layout == "null row" else -1)
        given = ["state_indices", "initial_state_indices"]
    else:
        packed, cu, rows, cache = _varlen_case(None, seed=23)
        args = dict(packed, state_cache=cache, state_indices=rows, cu_seqlens=cu, null_row=0)
        if layout == "varlen accepted":
            args["num_accepted_tokens"] = torch.tensor([2, 1, 1, 1])
            given = ["state_indices", "cu_seqlens", "num_accepted_tokens"]
        else:
            args["initial_state_indices"] = torch.tensor([5, -1, 2, 6])
            given = ["state_indices", "cu_seqlens", "initial_state_indices"]
    kda_decode_multi(**args)
    assert {n: names.count(n) for n in given} == dict.fromkeys(given, 1), names


# ------------------------------------------------------------------------ GPU, bf16


def _gpu_case(B, H, gate, lower_bound, seed, S=None):
    K = V = 128
    inputs = make_step(B, H, K, V, S=S, dtype=torch.bfloat16, gate=gate, device="cuda", seed=seed)
    # Sparse, shuffled rows with every 7th sequence padding; slots leave NaN gaps.
    slots = B * ((S or 1) + 1) + 3
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots, generator=gen)
    return inputs, perm, slots


# large: a 4 GiB cache, its copy and the reference's rows (peak about 20 GiB).
GPU_SHAPES = [pytest.param(8, 4, id="small"), pytest.param(1024, 32, id="large", marks=pytest.mark.gpu_mem(28)),
              pytest.param(256, 8, id="mid")]


@pytest.mark.gpu
@pytest.mark.parametrize("B, H", GPU_SHAPES)
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("gate", ["random", "extreme"])
def test_gpu_decode_bf16(B, H, lower_bound, gate):
    inputs, perm, slots = _gpu_case(B, H, gate, lower_bound, seed=B + H)
    idx = perm[:B].clone()
    idx[::7] = -1
    idx = idx.cuda()
    cache = make_cache(slots, H, 128, 128, idx.tolist(), device="cuda")
    before = cache.clone()
    ref_o, ref_state = reference_step({n: t.float() for n, t in inputs.items()}, before, idx, lower_bound)
    out = kda_decode(**inputs, state_cache=cache, state_indices=idx, lower_bound=lower_bound)
    torch.cuda.synchronize()
    live = idx >= 0
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[live].float(), ref_o[live], atol=2e-3, rtol=1.6e-2)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    torch.testing.assert_close(cache[idx[live]], ref_state[live], atol=1e-4, rtol=1e-4)
    assert_untouched(cache, before, idx.tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("B, S, H", [pytest.param(4, 3, 4, id="small"),
                                     pytest.param(256, 4, 32, id="large", marks=pytest.mark.gpu_mem(18))])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_gpu_multi_bf16(B, S, H, lower_bound):
    inputs, perm, slots = _gpu_case(B, H, "random", lower_bound, seed=S + H, S=S)
    state_indices = perm[: B * S].view(B, S).clone()
    state_indices[1::5, 1] = -1  # some tokens not written
    initial = perm[B * S : B * S + B].clone()
    initial[::6] = -1  # padding sequences
    state_indices, initial = state_indices.cuda(), initial.cuda()
    named = state_indices.flatten().tolist() + initial.tolist()
    cache = make_cache(slots, H, 128, 128, named, device="cuda")
    before = cache.clone()
    ref_o, ref_states = reference_multi({n: t.float() for n, t in inputs.items()}, before, initial, lower_bound)
    out = kda_decode_multi(
        **inputs, state_cache=cache, state_indices=state_indices, initial_state_indices=initial, lower_bound=lower_bound
    )
    torch.cuda.synchronize()
    live = initial >= 0
    torch.testing.assert_close(out[live].float(), ref_o[live], atol=2e-3, rtol=1.6e-2)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    write = live[:, None] & (state_indices >= 0)
    torch.testing.assert_close(cache[state_indices[write]], ref_states[write], atol=1e-4, rtol=1e-4)
    written = state_indices[write].tolist()
    assert_untouched(cache, before, written)


@pytest.mark.gpu
@pytest.mark.parametrize("B, H", [pytest.param(8, 4, id="small"), pytest.param(256, 32, id="large", marks=pytest.mark.gpu_mem(8))])
def test_gpu_strided_projection_and_cuda_graph(B, H):
    """Inputs sliced from one bf16 projection; the unchecked call captured in a CUDA
    graph and replayed gives the same result as two eager steps."""
    K = V = 128
    gen = torch.Generator().manual_seed(12)
    widths = [H * K, H * K, H * V, H * K, H]
    proj = torch.randn(B, sum(widths), generator=gen).to(torch.bfloat16).cuda()
    cols = torch.tensor([0] + widths).cumsum(0).tolist()
    q, k, v, raw_g = (proj[:, cols[i] : cols[i + 1]].view(B, H, -1) for i in range(4))
    raw_beta = proj[:, cols[4] : cols[5]]
    A_log = (0.5 * torch.randn(H, generator=gen)).cuda()
    dt_bias = torch.randn(H, K, generator=gen).cuda()
    idx = torch.randperm(2 * B, generator=gen)[:B].cuda()
    cache = make_cache(2 * B, H, V, K, idx.tolist(), device="cuda")
    start = cache.clone()
    args = (q, k, v, raw_g, raw_beta, A_log, dt_bias)
    dense = dict(zip(["q", "k", "v", "raw_g", "raw_beta"], (t.float() for t in args[:5])), A_log=A_log, dt_bias=dt_bias)

    eager = cache.clone()
    for _ in range(2):
        o_eager = kda_decode(*args, eager, idx, lower_bound=-5.0)
    out = torch.empty(B, H, V, dtype=torch.bfloat16, device="cuda")
    kda_decode(*args, cache, idx, lower_bound=-5.0, out=out, check_inputs=False)  # warm-up / compile
    cache.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_decode(*args, cache, idx, lower_bound=-5.0, out=out, check_inputs=False)
    cache.copy_(start)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, o_eager, atol=0, rtol=0)
    torch.testing.assert_close(cache, eager, atol=0, rtol=0, equal_nan=True)
    # And the first step against the reference.
    cache.copy_(start)
    o1 = kda_decode(*args, cache, idx, lower_bound=-5.0)
    ref_o, ref_state = reference_step(dense, start, idx, -5.0)
    torch.testing.assert_close(o1.float(), ref_o, atol=2e-3, rtol=1.6e-2)
    torch.testing.assert_close(cache[idx], ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("check_inputs", [True, False])
def test_decode_null_row_zero_is_padding(check_inputs):
    """``null_row=0`` (vLLM's convention): index 0 is padding, read and written by
    nobody, its output zero; equal to the same call with those rows as -1."""
    B, H, K, V = 4, 2, 32, 32
    inputs = make_step(B, H, K, V, seed=31)
    idx = torch.tensor([3, 0, 1, 0])
    cache = make_cache(5, H, V, K, range(5))
    expected_cache = cache.clone()
    want = kda_decode(**inputs, state_cache=expected_cache, state_indices=torch.tensor([3, -1, 1, -1]))
    got = kda_decode(**inputs, state_cache=cache, state_indices=idx, null_row=0, check_inputs=check_inputs)
    assert torch.equal(got, want) and torch.equal(got[idx == 0], torch.zeros_like(got[idx == 0]))
    assert torch.equal(cache, expected_cache)  # row 0 untouched, rows 3 and 1 stepped alike
    with refused(ValueError, match="null_row"):
        kda_decode(**inputs, state_cache=cache, state_indices=idx, null_row=-2)
