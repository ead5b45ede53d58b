"""The Gluon folded prologue (kda/hopper/prologue.py) and its torch model
(kda/hopper/prologue_model.py).

CPU: Gluon has no interpreter, so the kernel's order of operations is checked
through its model: with the kernel's bf16 roundings against the fp64 folded
contract (``naive_chunk_operands``), and without them against the Triton folded
prologue under the interpreter (fp32). Each check must catch a planted fault. The
sm_90a compile (registers, spills, shared memory) is ``tests/test_compile_sm90.py
-k gluon_prologue``.

GPU (sm_90): the kernel itself at 16x2k_H32 and on a ragged batch with an empty and
a 1-token sequence, chunk by chunk against the Triton folded prologue, fp64 and the
model; then the Gluon walk on its operands against the Hopper path's output and
final state. ``python3 -m kda_engram.tools.benchmarks.bench_gluon_prologue`` times it.
"""

import math

import pytest
import torch

from kda_engram.bundles import KDAInputs

from kda_engram.kda.hopper.folded_prologue import prepare_folded_prologue
from kda_engram.kda.hopper.prologue import gluon_folded_prologue, gluon_prologue_unsupported
from kda_engram.kda.hopper.prologue_model import model_folded_prologue
from kda_engram.kda.metadata import prepare_chunk_metadata
from kda_engram.kda.reference import naive_chunk_operands

from ..helpers import make_raw, rel_rmse, sm90_or_skip

KEYS = ("qg", "kd", "t_fold", "a_fold")
LENGTHS = [37, 64, 0, 130, 1, 200]


def _raw(lengths, H, seed, *, correlated=True, device="cpu"):
    """make_raw at K = V = 128, rounded to bf16 values (so that input rounding is no
    part of any error), keys sharing a common direction per head (A_kk entries near
    0.5 instead of ~0.1: the inverse and its composition matter)."""
    raw, cu = make_raw(lengths, H=H, K=128, V=128, seed=seed)
    if correlated:
        gen = torch.Generator().manual_seed(seed + 7)
        raw["k"] = raw["k"] + 2.5 * torch.randn(1, 1, H, 128, generator=gen)
    raw = {n: (t.to(torch.bfloat16).float() if n in ("q", "k", "v", "raw_g", "raw_beta") else t)
           for n, t in raw.items()}
    return {n: t.to(device) for n, t in raw.items()}, cu.to(device)


def _model(raw, cu, lower_bound, **kw):
    return model_folded_prologue(raw["q"], raw["k"], raw["raw_g"], raw["raw_beta"], raw["A_log"], raw["dt_bias"],
                                 lower_bound, cu, **kw)


def _chunk_errors(x, ref, cu, key):
    """rel_rmse per chunk (``a_fold``: the chunk's own columns only), over every chunk."""
    errs = []
    bounds = cu.tolist()
    for n in range(len(bounds) - 1):
        for s in range(bounds[n], bounds[n + 1], 64):
            e = min(s + 64, bounds[n + 1])
            a, b = x[0, s:e], ref[0, s:e]
            if key == "a_fold":
                a, b = a[..., : e - s], b[..., : e - s]
            errs.append(rel_rmse(a, b))
    return errs


def _worst(x, ref, cu):
    # The real chunks' rows only: a launch sized by a static bound has padding rows
    # after them that no program writes (torch.empty: zeros in a fresh process, old
    # values in a busy one, which made this check flaky in the GPU tier).
    bounds = cu.tolist()
    rows = sum(-(-(b - a) // 64) for a, b in zip(bounds[:-1], bounds[1:]))
    return {key: max(_chunk_errors(x[key], ref[key], cu, key)) for key in KEYS} | {
        "decay": rel_rmse(x["decay"][:rows], ref["decay"][:rows])}


# ----------------------------------------------------------------------------- CPU

#: The bf16-rounded model against fp64, per chunk and key. Why 8e-3: the bf16 stores
#: alone give about 2^-9 / sqrt(3) = 1.1e-3 relative RMS, the bf16 operands of the
#: products (each a single rounding, fp32 sums) about as much again; measured
#: 1.7e-3 to 3.5e-3. A planted fault measures 1e-2 to 1 (see the fault test).
BF16_TOL = 8e-3
#: The unrounded model against the Triton folded prologue under the interpreter
#: (both fp32): fp32 rounding of 2^(+-span) factors and 64-term sums.
FP32_TOL = 5e-5


@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, -0.05])
def test_model_with_bf16_roundings_matches_fp64_contract(lower_bound):
    raw, cu = _raw(LENGTHS, 2, seed=4)
    ref = naive_chunk_operands(**{n: t.double() for n, t in raw.items()}, cu_seqlens=cu, lower_bound=lower_bound)
    worst = _worst(_model(raw, cu, lower_bound), ref, cu)
    assert all(v < BF16_TOL for v in worst.values()), worst


def test_model_without_roundings_matches_triton_interpreter():
    raw, cu = _raw(LENGTHS, 2, seed=5)
    cu32 = cu.to(torch.int32)
    _, indices = prepare_chunk_metadata(cu32, raw["q"].shape[1])
    tri = prepare_folded_prologue(KDAInputs.pick({**raw, "lower_bound": -5.0}), cu32, indices)()
    worst = _worst(_model(raw, cu, -5.0, round_bf16=False), tri, cu)
    assert all(v < FP32_TOL for v in worst.values()), worst


@pytest.mark.parametrize("fault", ["anchor", "inverse", "mask"])
def test_each_planted_fault_is_caught(fault):
    """Both checks above fail on a model with a known fault (so they can fail)."""
    raw, cu = _raw(LENGTHS, 2, seed=4)
    lb = -0.05  # a slow gate: N^3 (sub-chunks 3 and 0 coupled) matters
    ref = naive_chunk_operands(**{n: t.double() for n, t in raw.items()}, cu_seqlens=cu, lower_bound=lb)
    worst = _worst(_model(raw, cu, lb, fault=fault), ref, cu)
    assert max(worst.values()) > BF16_TOL, (fault, worst)
    worst32 = _worst(_model(raw, cu, lb, round_bf16=False, fault=fault), ref, cu)
    assert max(worst32.values()) > 100 * FP32_TOL, (fault, worst32)


def test_model_without_roundings_is_fp32_exact_against_fp64():
    """Without its bf16 roundings the model is the contract to fp32 accuracy, also at the
    steepest gate the anchoring accepts (|L| = 5.4: factors near 2^124)."""
    raw, cu = _raw(LENGTHS, 2, seed=6)
    for lb in (-5.4, -0.1):
        ref = naive_chunk_operands(**{n: t.double() for n, t in raw.items()}, cu_seqlens=cu, lower_bound=lb)
        worst = _worst(_model(raw, cu, lb, round_bf16=False), ref, cu)
        assert all(v < FP32_TOL for v in worst.values()), (lb, worst)


def test_launcher_refuses_what_it_cannot_serve():
    raw, cu = make_raw([10], H=2, K=128, V=128)
    q = raw["q"].to(torch.bfloat16)
    assert gluon_prologue_unsupported(q, -5.0) is None
    assert "bounded gate only" in gluon_prologue_unsupported(q, None)
    assert "exceeds" in gluon_prologue_unsupported(q, -6.0)
    assert "raw bounded gate" in gluon_prologue_unsupported(q, None, gate="log_decay")
    assert "bf16" in gluon_prologue_unsupported(raw["q"], -5.0)
    assert "K = 128" in gluon_prologue_unsupported(q[..., :64], -5.0)
    _, indices = prepare_chunk_metadata(cu.to(torch.int32), 10)
    bf16 = {n: (t.to(torch.bfloat16) if t.dim() > 1 else t) for n, t in raw.items()}
    with pytest.raises(ValueError, match="gluon_folded_prologue: serves the bounded gate only"):
        gluon_folded_prologue(KDAInputs.pick(bf16), cu, indices)


# ----------------------------------------------------------------------------- GPU


def _gpu_inputs(lengths, H, device, seed):
    raw, cu = _raw(lengths, H, seed, correlated=False)
    raw = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "raw_g", "raw_beta") else t).to(device)
           for n, t in raw.items()}
    cu = cu.to(torch.int32).to(device)
    offsets, indices = prepare_chunk_metadata(cu, raw["q"].shape[1])
    return raw, cu, offsets, indices


def _both(raw, cu, indices, lower_bound):
    x = KDAInputs.pick({**raw, "lower_bound": lower_bound})
    glu = gluon_folded_prologue(x, cu, indices)()
    tri = prepare_folded_prologue(x, cu, indices)()
    torch.cuda.synchronize()
    return glu, tri


def _full_chunk_errors(x, ref, key, T):
    """Per 64-row chunk rel RMS error of ``[1, T, H, D]`` tensors (T a multiple of 64), on the GPU."""
    a = x[0].double().reshape(T // 64, 64, *x.shape[2:])
    b = ref[0].double().reshape(T // 64, 64, *ref.shape[2:])
    d = (a - b).pow(2).flatten(1).mean(1).sqrt()
    return (d / b.pow(2).flatten(1).mean(1).sqrt().clamp_min(1e-30)).cpu()


@pytest.mark.gpu
@pytest.mark.gpu_mem(16)
def test_gpu_gluon_prologue_16x2k_h32_matches_triton_and_fp64(gpu):
    sm90_or_skip(gpu, "the Gluon prologue")
    lengths, H = [2048] * 16, 32
    raw, cu, offsets, indices = _gpu_inputs(lengths, H, gpu, seed=11)
    T = sum(lengths)
    glu, tri = _both(raw, cu, indices, -5.0)
    for key in KEYS:
        assert torch.isfinite(glu[key].float()).all(), key
        err = _full_chunk_errors(glu[key], tri[key], key, T)
        assert err.max() < 1e-2, (key, err.max().item(), int(err.argmax()))
    rows = int(offsets[-1])
    assert rel_rmse(glu["decay"][:rows], tri["decay"][:rows]) < 1e-5
    # fp64 on 4 of the 32 heads (the reference's memory): chunk by chunk.
    sub = {n: (t[:, :, :4] if t.dim() >= 3 else t) for n, t in raw.items()}
    sub["A_log"], sub["dt_bias"] = raw["A_log"][:4], raw["dt_bias"].view(H, 128)[:4].reshape(-1)
    ref = naive_chunk_operands(**{n: t.double() for n, t in sub.items()}, cu_seqlens=cu, lower_bound=-5.0)
    for key in KEYS:
        err = _full_chunk_errors(glu[key][:, :, :4], ref[key], key, T)
        assert err.max() < 1e-2, (key, err.max().item(), int(err.argmax()))


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0])
def test_gpu_gluon_prologue_ragged_matches_triton_fp64_and_model(gpu, lower_bound):
    sm90_or_skip(gpu, "the Gluon prologue")
    lengths, H = [1, 63, 64, 65, 0, 300, 1000, 1], 4
    raw, cu, offsets, indices = _gpu_inputs(lengths, H, gpu, seed=12)
    glu, tri = _both(raw, cu, indices, lower_bound)
    ref = naive_chunk_operands(**{n: t.double() for n, t in raw.items()}, cu_seqlens=cu, lower_bound=lower_bound)
    cpu = {n: t.float().cpu() for n, t in raw.items()}
    model = _model(cpu, cu.cpu(), lower_bound)
    g = {n: t.float().cpu() for n, t in glu.items() if n != "v"}
    for name, other, tol in (("triton", tri, 1e-2), ("fp64", ref, 1e-2), ("model", model, 5e-3)):
        other = {n: t.cpu() for n, t in other.items() if n in (*KEYS, "decay")}
        worst = _worst(g, other, cu.cpu())
        assert all(v < tol for v in worst.values()), (name, worst)
    rows = int(offsets[-1])  # the real chunk rows (the launch's padding rows are never written)
    assert rel_rmse(glu["decay"][:rows], tri["decay"][:rows]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [pytest.param(([1, 63, 64, 65, 0, 300, 1000, 1], 4), id="ragged"),
                                   pytest.param(([2048] * 16, 32), id="16x2k_H32",
                                                marks=pytest.mark.gpu_mem(12))])
def test_gpu_walk_on_gluon_prologue_matches_hopper_path(gpu, shape):
    """The Gluon walk on the Gluon prologue's operands gives the Hopper path's ``o`` and
    final state (Triton prologue + the same walk), and is as close to fp64 (ragged)."""
    from kda_engram.bundles import ConvArgs, KDAInputs, StateArgs
    from kda_engram.kda.hopper.prefill import hopper_kda_prefill
    from kda_engram.kda.hopper.walk import folded_walk
    from kda_engram.kda.reference import naive_recurrent_kda

    sm90_or_skip(gpu, "the Gluon prologue")
    lengths, H = shape
    raw, cu, offsets, indices = _gpu_inputs(lengths, H, gpu, seed=13)
    N = len(lengths)
    h0 = torch.randn(N, H, 128, 128, device=gpu) * 0.1
    scale = 128 ** -0.5
    ops = gluon_folded_prologue(KDAInputs.pick({**raw, "lower_bound": -5.0}), cu, indices)()
    o_g = torch.full_like(raw["v"], math.nan)
    f_g = torch.empty(N, H, 128, 128, device=gpu)
    folded_walk(ops["qg"], ops["kd"], ops["t_fold"], ops["a_fold"], ops["v"], ops["decay"], o_g, scale, cu, offsets,
                initial_state=h0, final_state=f_g)
    inputs = KDAInputs.pick({**raw, "scale": scale, "lower_bound": -5.0})
    o_h, f_h = hopper_kda_prefill(inputs, cu_seqlens=cu, chunk_offsets=offsets, chunk_indices=indices,
                                  out=torch.empty_like(raw["v"]), state=StateArgs(initial_state=h0,
                                                                                  output_final_state=True),
                                  conv=ConvArgs())
    torch.cuda.synchronize()
    bounds = cu.tolist()
    for n, length in enumerate(lengths):
        if length:
            sl = slice(bounds[n], bounds[n + 1])
            assert rel_rmse(o_g[:, sl], o_h[:, sl]) < 1e-2, n
        assert rel_rmse(f_g[n], f_h[n]) < 1e-2, n
    if len(lengths) < 16:
        o_x, f_x, _ = naive_recurrent_kda(**{n: t.double() for n, t in raw.items()}, lower_bound=-5.0,
                                          cu_seqlens=cu, initial_state=h0.double(), output_final_state=True)
        e_g, e_h = rel_rmse(o_g, o_x), rel_rmse(o_h, o_x)
        s_g, s_h = rel_rmse(f_g, f_x), rel_rmse(f_h, f_x)
        assert e_g <= 1.25 * e_h + 1e-4 and s_g <= 1.25 * s_h + 1e-4, (e_g, e_h, s_g, s_h)


@pytest.mark.gpu
@pytest.mark.gpu_mem(8)
def test_gpu_gluon_prologue_bench(gpu, capsys):
    """Prints the Gluon vs the Triton folded prologue at 16x2k_H32 (run with ``-s``)."""
    from kda_engram.tools.benchmarks.bench_gluon_prologue import run

    sm90_or_skip(gpu, "the Gluon prologue")
    with capsys.disabled():
        run()
