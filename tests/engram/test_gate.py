"""engram_post_wkv (the single-rank fused gate) against naive_engram_post_wkv.

CPU: the Triton interpreter, fp32/fp16, small T (the kernel is one program per
(token, stream), so dims up to 5120 stay cheap). GPU: bf16 and fp32 at real shapes.
"""

import math

import pytest
import torch

from kda_engram.engram.gate import (
    LOOP_WARPS,
    MAX_TOKENS_PER_PROGRAM,
    PERSISTENT_MIN_ROWS_PER_CU,
    PROGRAMS_PER_CU,
    SINGLE_PASS_MAX_DIM,
    SMALL_GRID_ROWS_PER_CU,
    SMALL_GRID_WARPS,
    WIDE_ROW_HINTS_MAX_ROWS_PER_CU,
    engram_post_wkv,
    launch_geometry,
    post_wkv_launch,
    row_pieces,
    small_grid_chunk,
    tokens_per_program,
    warps_for,
    WIDE_ROW_MAX_DIM,
    wide_row_warps,
)
from kda_engram.engram.reference import naive_engram_post_wkv
from kda_engram.platform import num_compute_units

EPS = 1e-6


def make_inputs(T, hc, dim, *, dtype=torch.float32, device="cpu", seed=0, T_kv=None, scale=1.0, wdtype=None):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    T_kv = T if T_kv is None else T_kv
    hidden = (scale * rnd(T, hc, dim)).to(dtype).to(device)
    kv = (scale * rnd(T_kv, (hc + 1) * dim)).to(dtype).to(device)
    wdtype = dtype if wdtype is None else wdtype
    q = (1 + 0.5 * rnd(hc, dim)).to(wdtype).to(device)
    k = (1 + 0.5 * rnd(hc, dim)).to(wdtype).to(device)
    return hidden, kv, q, k


def ref64(hidden, kv, q, k, **kw):
    """The reference in fp64 on the exact (already rounded) inputs."""
    return naive_engram_post_wkv(hidden.double(), kv.double(), q.double(), k.double(), eps=kw.pop("eps", EPS), **kw)


def assert_matches(out, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    elif dtype == torch.float16:
        # The output is rounded to fp16 once (half an ulp <= 2^-11 relative).
        torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
    else:
        torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=1e-2)


# --------------------------------------------------------------------------------------
# Launch geometry
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dim, pieces", [(96, (64, 32)), (257, (256, 16)), (2560, (2048, 512)), (5120, (4096, 1024)), (4096, (4096, 0)), (1, (16, 0))]
)
def test_row_pieces_cover_the_row(dim, pieces):
    head, tail = row_pieces(dim)
    assert (head, tail) == pieces
    assert head + tail >= dim and (head <= dim or dim < 16)
    assert tail == 0 or tail == 16 or head + tail // 2 < dim  # the tail is no wider than needed


def test_launch_geometry_switches_to_two_passes_above_the_register_budget():
    assert not launch_geometry(SINGLE_PASS_MAX_DIM, None, None)["LOOP"]
    big = launch_geometry(SINGLE_PASS_MAX_DIM + 1, None, None)
    assert big["LOOP"] and big["CHUNK"] >= 16
    assert launch_geometry(96, 32, None)["LOOP"]
    with pytest.raises(ValueError, match="chunk"):
        launch_geometry(96, 48, None)
    with pytest.raises(ValueError, match="num_warps"):
        launch_geometry(96, None, 3)


HINTED, PLAIN = ("evict_last", "evict_first"), ("", "")


def test_post_wkv_launch_defaults():
    cpu = torch.device("cpu")  # the interpreter's 8 compute units
    cus = num_compute_units(cpu)
    small = SMALL_GRID_ROWS_PER_CU * cus // 4  # tokens at hc = 4
    for T, dim in ((1, 5120), (small, 5120), (small, 2560), (small, 2600)):  # small grid: hinted two passes
        geom, block = post_wkv_launch(T, 4, dim, cpu)
        assert geom["LOOP"] and geom["CHUNK"] == small_grid_chunk(dim) and block == 1
        assert geom["num_warps"] == SMALL_GRID_WARPS and (geom["KEEP"], geom["LAST_USE"]) == HINTED
    assert [small_grid_chunk(d) for d in (5120, 2600, 2560, 2049)] == [2048, 1024, 1024, 1024]
    hinted_up_to = WIDE_ROW_HINTS_MAX_ROWS_PER_CU * cus // 4
    for T, hints in ((small + 1, HINTED), (hinted_up_to, HINTED), (hinted_up_to + 1, PLAIN), (10**6, PLAIN)):
        geom, block = post_wkv_launch(T, 4, 5120, cpu)  # wide single pass: one token per program
        assert not geom["LOOP"] and (geom["HEAD"], geom["TAIL"]) == (4096, 1024)
        assert geom["num_warps"] == wide_row_warps(5120) == 4 and block == 1
        assert (geom["KEEP"], geom["LAST_USE"]) == hints
    # l2_hints overrides only the hints; any other override leaves both choices to the caller.
    assert (post_wkv_launch(1, 4, 5120, cpu, l2_hints=False)[0]["KEEP"], post_wkv_launch(1, 4, 5120, cpu)[0]["LOOP"]) == ("", True)
    assert post_wkv_launch(10**6, 4, 5120, cpu, l2_hints=True)[0]["LAST_USE"] == "evict_first"
    geom, _ = post_wkv_launch(1, 4, 5120, cpu, tokens=1)
    assert not geom["LOOP"] and geom["KEEP"] == ""
    for T in (1, 10**6):  # past the wide-row dims and at or below the single-pass ones: neither
        for dim in (WIDE_ROW_MAX_DIM + 1, SINGLE_PASS_MAX_DIM):
            geom, _ = post_wkv_launch(T, 4, dim, cpu)
            assert (geom["KEEP"], geom["LAST_USE"]) == PLAIN and geom["LOOP"] == (dim > WIDE_ROW_MAX_DIM)
    # The persistent grid is an NVIDIA choice: never the default on the CPU / interpreter.
    assert not any(post_wkv_launch(T, 4, 5120, cpu)[0]["PERSISTENT"] for T in (1, 64, 10**6))


def test_post_wkv_launch_persistent_override():
    cpu = torch.device("cpu")
    for dim in (96, 2560, 5120):
        geom, block = post_wkv_launch(10**6, 4, dim, cpu, programs=8)
        assert geom["PERSISTENT"] and not geom["LOOP"] and block == 1 and geom["KEEP"] == ""
    assert post_wkv_launch(10**6, 4, 5120, cpu, programs=8, l2_hints=True)[0]["KEEP"] == "evict_last"
    for bad in (0, 6, 4.0, -4):
        with pytest.raises(ValueError, match="programs: expected a positive multiple of hc = 4"):
            post_wkv_launch(64, 4, 5120, cpu, programs=bad)
    with pytest.raises(ValueError, match="single pass only"):
        post_wkv_launch(64, 4, WIDE_ROW_MAX_DIM + 1, cpu, programs=8)
    with pytest.raises(ValueError, match="single pass only"):
        post_wkv_launch(64, 4, 2560, cpu, chunk=1024, programs=8)
    with pytest.raises(ValueError, match="tokens: the persistent grid"):
        post_wkv_launch(64, 4, 2560, cpu, tokens=2, programs=8)
    assert post_wkv_launch(64, 4, 2560, cpu, tokens=1, programs=8)[0]["PERSISTENT"]
    geom, block = post_wkv_launch(10**6, 4, 2560, cpu)
    assert not geom["LOOP"] and (geom["HEAD"], geom["TAIL"]) == (2048, 512) and geom["num_warps"] == 2
    assert wide_row_warps(2048 + 1024) == 4  # dim 2600: 3 warps' worth, rounded up to a power of two
    for T, dim, chunk in ((10**6, WIDE_ROW_MAX_DIM + 1, None), (64, 7168, None), (10**6, 2560, 1024)):
        geom, block = post_wkv_launch(T, 4, dim, cpu, chunk=chunk)  # too wide, or forced: two passes
        assert geom["LOOP"] and geom["num_warps"] == LOOP_WARPS and block == 1
    geom, block = post_wkv_launch(10**6, 4, 2560, cpu, num_warps=8, tokens=4)
    assert not geom["LOOP"] and geom["num_warps"] == 8 and block == 4
    with pytest.raises(ValueError, match="num_warps"):
        post_wkv_launch(64, 4, 5120, cpu, num_warps=3)
    geom, block = post_wkv_launch(10**6, 4, 1024, cpu)  # single pass: token blocks as before
    assert not geom["LOOP"] and geom["num_warps"] == warps_for(1024) and block == MAX_TOKENS_PER_PROGRAM


def test_tokens_per_program_keeps_small_batches_parallel():
    cpu = torch.device("cpu")  # the interpreter pretends to have CPU_COMPUTE_UNITS
    assert tokens_per_program(16 * 8 * 2 - 1, cpu) == 1  # fewer than 2 programs' worth per CU
    assert tokens_per_program(10**7, cpu) == MAX_TOKENS_PER_PROGRAM
    block = tokens_per_program(16 * 8 * 4, cpu)  # 4 programs' worth of rows per CU
    assert block & (block - 1) == 0 and 1 <= block <= 4
    assert tokens_per_program(8, cpu, tokens=3) == 3
    with pytest.raises(ValueError, match="tokens"):
        tokens_per_program(8, cpu, tokens=0)


# --------------------------------------------------------------------------------------
# Against the reference (interpreter on the CPU)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [96, 257, 2560, 5120])
@pytest.mark.parametrize("hc", [1, 2, 4])
def test_matches_reference_fp32(dim, hc):
    T = 3 if dim >= 2560 else 5
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=dim + hc)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    assert_matches(out, ref64(hidden, kv, q, k), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim, tokens", [(2560, None), (2600, 3)])
def test_wide_row_path_matches_reference(dtype, dim, tokens):
    # The wide single pass (row pieces in registers on few warps); 2600 = 2048 + a
    # masked 1024-lane tail walked 3 tokens per program; a mask and short kv.
    hc, T = 4, 11
    assert not post_wkv_launch(T, hc, dim, torch.device("cpu"))[0]["LOOP"]
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=dtype, seed=dim)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(2)) > 0.3
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=T - 4, tokens=tokens)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=T - 4), dtype)
    assert torch.equal(out[T - 4 :], hidden[T - 4 :]) and torch.equal(out[~mask], hidden[~mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [2560, 2600])
def test_small_grid_path_matches_reference(dtype, dim):
    # The small-grid launch (hinted two passes of half-row blocks; 2600 = two full
    # 1024-wide blocks and a masked one), with a mask and short kv; the hints change
    # no arithmetic, so the unhinted launch of the same blocks is bit-identical.
    hc, T = 4, 5
    geom, _ = post_wkv_launch(T, hc, dim, torch.device("cpu"))
    assert geom["LOOP"] and geom["KEEP"] == "evict_last"
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=dtype, seed=dim + 1)
    mask = torch.tensor([True, False, True, True, True])
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=T - 1)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=T - 1), dtype)
    assert torch.equal(out[T - 1 :], hidden[T - 1 :]) and torch.equal(out[1], hidden[1])
    plain = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=T - 1,
                            chunk=geom["CHUNK"], num_warps=geom["num_warps"], l2_hints=False)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("dim, hc, programs", [(96, 4, 8), (2600, 4, 8), (2560, 2, 2), (257, 1, 3)])
def test_persistent_path_matches_reference(dim, hc, programs):
    # Programs walk tokens b, b + programs // hc, ...: 11 tokens over programs // hc
    # columns leave the last step partly masked; a mask and short kv on top. The
    # rows run the single pass's arithmetic, so the one-token-per-program launch of
    # the same pieces is bit-identical.
    T = 11
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=dim + hc)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(5)) > 0.3
    kw = dict(eps=EPS, token_mask=mask, num_kv_tokens=T - 3)
    out = engram_post_wkv(hidden, kv, q, k, programs=programs, **kw)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=T - 3), torch.float32)
    assert torch.equal(out, engram_post_wkv(hidden, kv, q, k, tokens=1, **kw))
    assert torch.equal(out[T - 3 :], hidden[T - 3 :]) and torch.equal(out[~mask], hidden[~mask])


@pytest.mark.parametrize("dim, hc", [(96, 4), (257, 2)])
def test_matches_reference_fp16_with_mask_and_short_kv(dim, hc):
    T = 6
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=torch.float16, seed=7, wdtype=torch.float32)
    mask = torch.tensor([True, False, True, True, False, True])
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=4)
    want = ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=4)
    assert_matches(out, want, torch.float16)
    # masked rows and rows past num_kv_tokens are hidden, bit for bit
    assert torch.equal(out[1], hidden[1]) and torch.equal(out[4:], hidden[4:])
    assert not torch.equal(out[0], hidden[0])


@pytest.mark.parametrize("dim, chunk, tokens", [(257, 64, 1), (96, 32, 3), (130, 128, 2)])
def test_two_pass_path_matches_reference(dim, chunk, tokens):
    T, hc = 5, 2
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=chunk)
    mask = torch.tensor([True, True, False, True, True])
    out = engram_post_wkv(
        hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=3, chunk=chunk, num_warps=2, tokens=tokens
    )
    want = ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=3)
    assert_matches(out, want, torch.float32)
    assert torch.equal(out[2:], hidden[2:])


@pytest.mark.parametrize("dim, tokens", [(96, 2), (257, 3), (64, 8)])
def test_token_blocks_match_reference(dim, tokens):
    # T = 7 is no multiple of the block: the last program's extra tokens must be
    # neither read nor written (out is a view into a NaN-filled buffer).
    T, hc = 7, 2
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=tokens)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(tokens)) > 0.3
    backing = torch.full((T + 2, hc, dim), float("nan"))
    out = backing[1 : T + 1]
    engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=6, tokens=tokens, out=out)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=6), torch.float32)
    assert torch.isnan(backing[0]).all() and torch.isnan(backing[-1]).all()


def test_fewer_kv_rows_than_tokens_reads_zero():
    hidden, kv, q, k = make_inputs(5, 2, 96, T_kv=2, seed=3)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS)  # num_kv_tokens defaults to kv.shape[0]
    assert_matches(out, ref64(hidden, kv, q, k), torch.float32)
    assert torch.equal(out[2:], hidden[2:])
    # num_kv_tokens = 0: nothing is read from kv at all
    out0 = engram_post_wkv(hidden, kv, q, k, eps=EPS, num_kv_tokens=0)
    assert torch.equal(out0, hidden)


def test_empty_batch():
    hidden, kv, q, k = make_inputs(0, 4, 96, seed=1)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS)
    assert out.shape == (0, 4, 96)
    hidden, _, q, k = make_inputs(0, 4, 96)
    assert engram_post_wkv(hidden, torch.empty(0, 5 * 96), q, k, eps=EPS).shape == (0, 4, 96)


def test_strided_inputs_and_out_buffer_are_respected():
    T, hc, dim = 4, 2, 96
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(hc, T, dim, generator=gen).transpose(0, 1)  # [T, hc, dim], not contiguous
    wide = torch.randn(T, 7 + (hc + 1) * dim + 5, generator=gen)
    kv = wide[:, 7 : 7 + (hc + 1) * dim]  # a column slice of a fused projection
    q = torch.randn(hc, 2 * dim, generator=gen)[:, ::2]  # stride 2 along dim
    k = torch.randn(dim, hc, generator=gen).t()  # [hc, dim] transposed
    backing = torch.full((T, hc + 1, dim + 3), float("nan"))
    out = backing[:, 1:, 2 : 2 + dim]
    got = engram_post_wkv(hidden, kv, q, k, eps=EPS, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(out, ref64(hidden, kv, q, k), torch.float32)
    # nothing outside the view was written
    assert torch.isnan(backing[:, 0]).all() and torch.isnan(backing[:, :, :2]).all() and torch.isnan(backing[:, :, -1]).all()


# --------------------------------------------------------------------------------------
# Edge values
# --------------------------------------------------------------------------------------


def test_zero_inputs_give_zero_and_no_nan():
    hidden, kv, q, k = make_inputs(3, 4, 96)
    zero_out = engram_post_wkv(torch.zeros_like(hidden), torch.zeros_like(kv), q, k, eps=EPS)
    assert torch.equal(zero_out, torch.zeros_like(hidden))
    # zero keys: key_rms = rsqrt(eps) but dot = 0, so the gate is sigmoid(sqrt(clamp))
    kv0 = kv.clone()
    kv0[:, : 4 * 96] = 0
    out = engram_post_wkv(hidden, kv0, q, k, eps=EPS, clamp_value=0.04)
    gate = torch.sigmoid(torch.tensor(0.2))
    torch.testing.assert_close(out, hidden + gate * kv0[:, None, 4 * 96 :], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_zero_dot_takes_the_positive_sign(zero):
    hidden, kv, q, k = make_inputs(3, 2, 257, seed=5)
    q = torch.full_like(q, zero)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, clamp_value=0.25)
    gate = torch.sigmoid(torch.tensor(0.5))
    torch.testing.assert_close(out, hidden + gate * kv[:, None, 2 * 257 :], rtol=1e-6, atol=1e-6)
    assert_matches(out, ref64(hidden, kv, q, k, clamp_value=0.25), torch.float32)


def test_negating_k_weight_flips_the_gate():
    # sigmoid(-x) = 1 - sigmoid(x): with |dot| above the clamp, gate(-k) = 1 - gate(k).
    hidden, kv, q, k = make_inputs(4, 2, 96, seed=9)
    value = kv[:, None, 2 * 96 :]
    gate_pos = (engram_post_wkv(hidden, kv, q, k, eps=EPS, clamp_value=1e-12) - hidden) / value
    gate_neg = (engram_post_wkv(hidden, kv, q, -k, eps=EPS, clamp_value=1e-12) - hidden) / value
    torch.testing.assert_close(gate_pos + gate_neg, torch.ones_like(gate_pos), rtol=1e-4, atol=1e-4)
    assert (gate_pos < 0.5).any() and (gate_pos > 0.5).any()  # both signs of dot occur


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e15), (torch.float16, 4e3), (torch.float32, 1e-15)])
def test_huge_and_tiny_magnitudes(dtype, scale):
    hidden, kv, q, k = make_inputs(3, 4, 257, dtype=dtype, seed=13, scale=scale, wdtype=torch.float32)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS if scale > 1 else 0.0)
    assert torch.isfinite(out).all()
    want = ref64(hidden, kv, q, k, eps=EPS if scale > 1 else 0.0)
    tol = 2e-3 if dtype == torch.float16 else 2e-5
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * scale)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    hidden, kv, q, k = make_inputs(4, 2, 96)
    with pytest.raises(ValueError, match=r"kv: expected shape \[\*, 288\]"):
        engram_post_wkv(hidden, kv[:, :-1], q, k, eps=EPS)
    with pytest.raises(ValueError, match=r"q_weight: expected shape \[2, 96\]"):
        engram_post_wkv(hidden, kv, q[:1], k, eps=EPS)
    with pytest.raises(ValueError, match=r"k_weight: expected shape \[2, 96\]"):
        engram_post_wkv(hidden, kv, q, torch.ones(3, 96), eps=EPS)
    with pytest.raises(TypeError, match="hidden_states, kv: expected one dtype"):
        engram_post_wkv(hidden, kv.half(), q, k, eps=EPS)
    with pytest.raises(TypeError, match="hidden_states: expected dtype"):
        engram_post_wkv(hidden.double(), kv.double(), q, k, eps=EPS)
    with pytest.raises(ValueError, match=r"token_mask: expected shape \[4\]"):
        engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="token_mask: expected dtype bool"):
        engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=torch.ones(4))
    with pytest.raises(ValueError, match="num_kv_tokens"):
        engram_post_wkv(hidden, kv, q, k, eps=EPS, num_kv_tokens=5)
    with pytest.raises(ValueError, match="kv: expected a tensor on cpu"):
        engram_post_wkv(hidden, kv.to("meta"), q, k, eps=EPS)
    with pytest.raises(ValueError, match=r"out: expected shape \[4, 2, 96\]"):
        engram_post_wkv(hidden, kv, q, k, eps=EPS, out=torch.empty(4, 2, 95))
    with pytest.raises(ValueError, match="hidden_states: expected shape"):
        engram_post_wkv(hidden[0], kv, q, k, eps=EPS)


def test_unchecked_call_never_reads_past_kv():
    # check_inputs=False with num_kv_tokens beyond kv's rows: the host clamps it.
    hidden, kv, q, k = make_inputs(5, 2, 96, T_kv=3, seed=2)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, num_kv_tokens=10, check_inputs=False)
    assert_matches(out, ref64(hidden, kv, q, k), torch.float32)
    assert torch.equal(out[3:], hidden[3:])


# --------------------------------------------------------------------------------------
# GPU: bf16 at real shapes
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [96, 257, 2560, 5120])
@pytest.mark.parametrize("hc", [1, 2, 4])
def test_gpu_bf16_matches_reference(gpu, dim, hc):
    T = 777
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=torch.bfloat16, device=gpu, seed=dim * hc)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(1)).to(gpu) > 0.2
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=T - 37)
    want = ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=T - 37)
    assert_matches(out, want, torch.bfloat16)
    assert torch.equal(out[T - 37 :], hidden[T - 37 :])
    assert torch.equal(out[~mask], hidden[~mask])


@pytest.mark.gpu
@pytest.mark.gpu_mem(4)  # fp32 inputs of 3001 tokens and their fp64 reference
@pytest.mark.parametrize(
    "dim, chunk, tokens", [(5120, None, None), (5120, 1024, 3), pytest.param(12288, None, None, marks=pytest.mark.gpu_mem(8)),
                           (2560, None, 8), (5120, None, 1)]
)
def test_gpu_fp32_tight(gpu, dim, chunk, tokens):
    T, hc = 3001, 4
    hidden, kv, q, k = make_inputs(T, hc, dim, device=gpu, seed=dim)
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, chunk=chunk, tokens=tokens)
    assert_matches(out, ref64(hidden, kv, q, k), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [2560, 2600, 5120])
@pytest.mark.parametrize("T", [1, 64, 128, 300])
def test_gpu_small_grid_and_hinted_rows(gpu, dim, T):
    # T <= 128 at hc 4: the small-grid launch; 300: the hinted wide row. Hints on or
    # off, the same blocks give the same bits.
    hc = 4
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=torch.bfloat16, device=gpu, seed=dim + T)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(T)).to(gpu) > 0.2
    n_kv = max(T - 7, 0)
    geom, _ = post_wkv_launch(T, hc, dim, gpu)
    assert geom["KEEP"] == "evict_last" and geom["LOOP"] == (T * hc <= SMALL_GRID_ROWS_PER_CU * num_compute_units(gpu))
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=n_kv)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=n_kv), torch.bfloat16)
    assert torch.equal(out[n_kv:], hidden[n_kv:]) and torch.equal(out[~mask], hidden[~mask])
    launch = dict(chunk=geom["CHUNK"], num_warps=geom["num_warps"]) if geom["LOOP"] else dict(tokens=1)
    assert torch.equal(out, engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=n_kv,
                                            l2_hints=False, **launch))


@pytest.mark.gpu
@pytest.mark.gpu_mem(4)  # the fp64 reference of up to 3001 x 4 x 5120
@pytest.mark.parametrize("dim", [2560, 2600, 5120])
@pytest.mark.parametrize("T", [2048, 3001])
def test_gpu_persistent_rows(gpu, dim, T):
    # Large T on an NVIDIA GPU: the persistent single pass, its grid what the GPU
    # holds at once; against the reference and bit for bit against one token per
    # program (the same arithmetic); then a grid of one token's programs (T steps).
    hc = 4
    geom, _ = post_wkv_launch(T, hc, dim, gpu)
    nvidia = torch.version.hip is None
    assert geom["PERSISTENT"] == (nvidia and T * hc >= PERSISTENT_MIN_ROWS_PER_CU * num_compute_units(gpu))
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=torch.bfloat16, device=gpu, seed=dim + T)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(T)).to(gpu) > 0.2
    kw = dict(eps=EPS, token_mask=mask, num_kv_tokens=T - 5)
    out = engram_post_wkv(hidden, kv, q, k, **kw)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=T - 5), torch.bfloat16)
    assert torch.equal(out, engram_post_wkv(hidden, kv, q, k, tokens=1, **kw))
    assert torch.equal(out, engram_post_wkv(hidden, kv, q, k, programs=hc, **kw))


@pytest.mark.gpu
def test_gpu_edge_values(gpu):
    hidden, kv, q, k = make_inputs(64, 4, 5120, dtype=torch.bfloat16, device=gpu, seed=3)
    assert torch.equal(engram_post_wkv(torch.zeros_like(hidden), torch.zeros_like(kv), q, k, eps=EPS), torch.zeros_like(hidden))
    out = engram_post_wkv(hidden, kv, torch.zeros_like(q), k, eps=EPS, clamp_value=0.25)
    gate = 1 / (1 + math.exp(-0.5))
    want = (hidden.float() + gate * kv[:, None, 4 * 5120 :].float()).bfloat16()
    torch.testing.assert_close(out.float(), want.float(), rtol=8e-3, atol=1e-2)
    big_h, big_kv = hidden * 1e15, kv * 1e15
    big = engram_post_wkv(big_h, big_kv, q, k, eps=EPS)
    assert torch.isfinite(big.float()).all()
    # atol: where hidden + gate*value cancels, a 1e-7 gate error times |value| ~ 1e15
    torch.testing.assert_close(big.double(), ref64(big_h, big_kv, q, k), rtol=8e-3, atol=1e11)
    empty = engram_post_wkv(hidden[:0], kv[:0], q, k, eps=EPS)
    assert empty.shape == (0, 4, 5120)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(gpu):
    hidden, kv, q, k = make_inputs(128, 4, 2560, dtype=torch.bfloat16, device=gpu, seed=4)
    mask = torch.ones(128, dtype=torch.bool, device=gpu)
    out = torch.empty_like(hidden)
    engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, out=out, check_inputs=False)
    hidden.copy_(torch.randn_like(hidden))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask), torch.bfloat16)


GATE_TUNING = ([dict(chunk=c) for c in (16, 32, 64, 128)] + [dict(num_warps=w) for w in (1, 2, 4, 8, 16, 32)]
               + [dict(tokens=t) for t in (1, 2, 3, 5, 8)])


@pytest.mark.parametrize("launch", GATE_TUNING, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_every_accepted_tuning_value_matches_the_reference(launch):
    # Issue 54: each accepted chunk (a power of two >= 16, wider than the row too),
    # num_warps (a power of two in [1, 32]) and tokens (a positive int) is honoured.
    T, hc, dim = 5, 2, 40
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=54)
    mask = torch.tensor([True, False, True, True, True])
    out = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask, num_kv_tokens=4, **launch)
    assert_matches(out, ref64(hidden, kv, q, k, token_mask=mask, num_kv_tokens=4), torch.float32)


@pytest.mark.parametrize("name, bad", [("chunk", 32.0), ("chunk", True), ("num_warps", 4.0), ("num_warps", True),
                                       ("num_warps", 0), ("num_warps", 64)])
def test_a_tuning_value_it_cannot_honour_is_refused_in_one_line(name, bad):
    # Issue 54: a float chunk failed inside `&`; True passed as num_warps=1.
    hidden, kv, q, k = make_inputs(5, 2, 40, seed=54)
    with pytest.raises(ValueError, match=rf"^{name}: expected a power of two .*got {bad!r}$"):
        engram_post_wkv(hidden, kv, q, k, eps=EPS, **{name: bad})
