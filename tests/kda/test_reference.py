"""The three KDA formulations agree in fp64: recurrent, chunked, group-composed."""

import math

import pytest
import torch

from kda_engram.constants import KDA_CHECKPOINT_ALIGNMENT
from kda_engram.kda.reference import (
    kda_gate,
    l2norm,
    naive_chunk_kda,
    naive_chunk_operands,
    naive_chunk_transfer,
    naive_group_chunk_kda,
    naive_recurrent_kda,
)

LENGTHS = [0, 1, 63, 64, 65, 200, 1000]
H, K, V = 2, 16, 8
TOL = 1e-10


def make_inputs(lengths, *, gate="random", seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    raw_g = rnd(1, T, H, K)
    if gate == "at_bound":
        raw_g = raw_g.abs() + 40.0  # sigmoid saturates: a == lower_bound
    elif gate == "strong":
        raw_g = raw_g * 4.0
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return dict(
        q=rnd(1, T, H, K),
        k=rnd(1, T, H, K),
        v=rnd(1, T, H, V),
        raw_g=raw_g,
        raw_beta=rnd(1, T, H),
        A_log=rnd(H) * 0.5,
        dt_bias=rnd(H * K),
    ), cu


def checkpoint_offsets(lengths):
    # The largest aligned offset of every sequence (0 where none fits).
    return torch.tensor([(n // KDA_CHECKPOINT_ALIGNMENT) * KDA_CHECKPOINT_ALIGNMENT for n in lengths])


# The softplus gate has no bound to sit at, so "at_bound" pairs with -5 only.
@pytest.mark.parametrize(
    "lower_bound, gate",
    [(None, "random"), (None, "strong"), (-5.0, "random"), (-5.0, "strong"), (-5.0, "at_bound")],
)
def test_recurrent_chunk_and_groups_agree(lower_bound, gate):
    inputs, cu = make_inputs(LENGTHS, gate=gate)
    h0 = torch.randn(len(LENGTHS), H, V, K, dtype=torch.float64)
    ck = checkpoint_offsets(LENGTHS)
    kw = dict(lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0, output_final_state=True, checkpoint_offsets=ck)
    o_r, f_r, c_r = naive_recurrent_kda(**inputs, **kw)
    assert torch.isfinite(o_r).all()
    for groups in (1, 2, 4, 8):
        o_c, f_c, c_c = naive_group_chunk_kda(**inputs, groups=groups, **kw)
        assert (o_c - o_r).abs().max() < TOL, groups
        assert (f_c - f_r).abs().max() < TOL, groups
        assert (c_c - c_r).abs().max() < TOL, groups


def test_gate_forms():
    raw = torch.randn(3, H, K, dtype=torch.float64)
    A_log = torch.randn(H, dtype=torch.float64)
    dt = torch.randn(H, K, dtype=torch.float64)
    x = raw + dt
    soft = -torch.exp(A_log)[:, None] * torch.log1p(torch.exp(x))
    assert torch.allclose(kda_gate(raw, A_log, dt), soft)
    bounded = -5.0 * torch.sigmoid(torch.exp(A_log)[:, None] * x)
    assert torch.allclose(kda_gate(raw, A_log, dt.reshape(-1), lower_bound=-5.0), bounded)
    sat = kda_gate(torch.full_like(raw, 1e4), A_log, dt, lower_bound=-5.0)
    assert torch.all(sat == -5.0)


def test_l2norm_eps_inside_sqrt():
    x = torch.zeros(4, K, dtype=torch.float64)
    x[0, 0] = 1e-4
    y = l2norm(x)
    assert torch.allclose(y[0, 0], torch.tensor(1e-4 / math.sqrt(1e-8 + 1e-6), dtype=torch.float64))
    assert torch.all(y[1:] == 0)


def test_recurrence_matches_definition_for_one_token():
    inputs, cu = make_inputs([1], seed=3)
    h0 = torch.randn(1, H, V, K, dtype=torch.float64)
    o, f, _ = naive_recurrent_kda(**inputs, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    q, k = l2norm(inputs["q"][0, 0]), l2norm(inputs["k"][0, 0])
    a = kda_gate(inputs["raw_g"][0, 0], inputs["A_log"], inputs["dt_bias"])
    beta = torch.sigmoid(inputs["raw_beta"][0, 0])
    S = h0[0] * torch.exp(a)[:, None, :]
    S = S + beta[:, None, None] * (inputs["v"][0, 0][:, :, None] - S @ k[:, :, None]) * k[:, None, :]
    assert torch.allclose(f[0], S)
    assert torch.allclose(o[0, 0], K**-0.5 * (S @ q[:, :, None])[..., 0])


def test_batched_layout_equals_varlen():
    inputs, cu = make_inputs([70, 70], seed=1)
    batched = {k: v.reshape(2, 70, *v.shape[2:]) if v.dim() >= 3 else v for k, v in inputs.items()}
    o_b, f_b, _ = naive_chunk_kda(**batched, output_final_state=True)
    o_v, f_v, _ = naive_recurrent_kda(**inputs, cu_seqlens=cu, output_final_state=True)
    assert (o_b.reshape(o_v.shape) - o_v).abs().max() < TOL
    assert (f_b - f_v).abs().max() < TOL


def test_operands_contract():
    """Spot-check the documented contents of the chunk operands."""
    inputs, cu = make_inputs([65], seed=2)
    ops = naive_chunk_operands(**inputs, cu_seqlens=cu, lower_bound=-5.0)
    assert ops["kg_t"].shape == (2, H, K, 64) and ops["decay"].shape == (2, H, K)
    # Second chunk has one token: kg = k̂ (g_last == g), decay = 2^g.
    kh = l2norm(inputs["k"][0, 64])
    assert torch.allclose(ops["kg_t"][1, :, :, 0], kh)
    assert torch.all(ops["kg_t"][1, :, :, 1:] == 0)
    assert torch.allclose(ops["decay"][1], torch.exp2(ops["g"][0, 64]))
    # aqk is lower triangular inclusive with 1 * |q̂·k̂| on the diagonal scale.
    a = ops["aqk"][0, :64].transpose(0, 1)  # [H, 64, 64]
    assert torch.all(a.triu(1) == 0)
    assert torch.all(ops["akk"][0, :64].transpose(0, 1).triu(0) == 0)
    # The transfer operator reproduces one chunk step from any start state.
    S = torch.randn(H, V, K, dtype=torch.float64)
    M, Hc = naive_chunk_transfer(S, ops, 0, 0, 64)
    from kda_engram.kda.reference import naive_chunk_step

    _, S_next = naive_chunk_step(S, ops, 0, 0, 64, 1.0)
    assert (S @ M + Hc - S_next).abs().max() < TOL


def test_fp32_close_to_fp64():
    inputs, cu = make_inputs([130], seed=4)
    o64, _, _ = naive_recurrent_kda(**inputs, cu_seqlens=cu, lower_bound=-5.0)
    o32, _, _ = naive_chunk_kda(**{k: v.float() for k, v in inputs.items()}, cu_seqlens=cu, lower_bound=-5.0)
    assert o32.dtype == torch.float32
    assert (o32.double() - o64).abs().max() < 1e-4


@pytest.mark.parametrize("gate", ["random", "strong"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_folded_contract_walk_equals_the_recurrence(gate, lower_bound):
    """The folded operands (kd, t_fold, a_fold: the inverse folded in, w and u
    gone, v read directly) walk to the recurrence's outputs and final state, over
    ragged sequences and a random initial state; and each folded operand is what
    the fold says (w = M kd, u = M v)."""
    from kda_engram.kda.reference import _chunk_rows, naive_folded_chunk_step

    lengths = [1, 63, 64, 65, 200]
    inputs, cu = make_inputs(lengths, gate=gate, seed=9)
    N = len(lengths)
    h0 = torch.randn(N, H, V, K, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    scale = K**-0.5
    ref_o, ref_final, _ = naive_recurrent_kda(**inputs, cu_seqlens=cu, lower_bound=lower_bound, scale=scale,
                                              initial_state=h0, output_final_state=True)
    ops = naive_chunk_operands(**inputs, cu_seqlens=cu, lower_bound=lower_bound)
    o = torch.zeros_like(ref_o)
    for n, chunks in enumerate(_chunk_rows(cu, 64)):
        S = h0[n].clone()
        for row, s, e in chunks:
            o[0, s:e], S = naive_folded_chunk_step(S, ops, inputs["v"], row, s, e, scale)
        assert (S - ref_final[n]).abs().max() < TOL
    assert (o - ref_o).abs().max() < TOL
    # w and u are the fold applied to kd and v (one chunk, one head).
    s, e = 1 + 63, 1 + 63 + 64  # the third sequence: one full chunk
    beta = torch.sigmoid(inputs["raw_beta"][0, s:e, 0])
    akk = ops["akk"][0, s:e, 0]
    fold = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + akk) * beta[None, :]
    assert (fold @ ops["kd"][0, s:e, 0] - ops["w"][0, s:e, 0]).abs().max() < TOL
    assert (fold @ inputs["v"][0, s:e, 0] - ops["u"][0, s:e, 0]).abs().max() < TOL
