"""The Hopper path's Gluon walk (``kda/hopper/walk.py``, ``folded_walk``) alone, on an sm_90 GPU.

The walk reads the folded operands of ``reference.naive_chunk_operands`` computed in
float64 and rounded to bf16 (fp32 -> bf16, RTNE) as the prologue stores them; ``decay``
stays fp32. It is checked against

* the fp64 recurrence (``naive_recurrent_kda``): relative RMS below ``TOL_REF``
  (the precision study, ``experiments/gluon_kda_walk/PRECISION.md``, predicts
  1.7-3.4e-3), and below ``2 * TOL_REF`` for the worst single sequence (a masking
  bug shows up in one sequence only);
* the fp32 emulation of the walk's precision recipe (:func:`_emulated_walk`: S and R
  rounded to bf16 as the operands of their products, fp32 accumulation; ``o`` rounded
  to bf16 as the kernel stores it): below ``TOL_EMU``, which leaves room for the
  accumulation order and bf16 rounding flips only.

Cases: a ragged batch with empty and 1-token sequences and two gates (every ``o`` row
written, an empty sequence's state passed through bit for bit); the variants (``vb=64``:
V-half CTAs of 4 warps, synchronous wgmma, no initial state, no final state); the masks
(NaN in every operand row past the only sequence's end, and in the pad columns of its
tail chunk's ``a_fold`` rows: ``o`` and the state equal the clean run's bit for bit and
the rows past the end stay untouched).
"""

import pytest
import torch

from kda_engram.kda.hopper.walk import folded_walk
from kda_engram.kda.metadata import prepare_chunk_offsets
from kda_engram.kda.reference import naive_chunk_operands, naive_recurrent_kda

from ..helpers import sm90_or_skip

C = 64  # tokens per chunk
LENGTHS = [1000, 0, 1, 63, 64, 65, 2048, 37, 0]
TOL_REF = 5e-3
TOL_EMU = 1.5e-3


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (via fp32, RTNE), held as float32."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


#: name: (A_log, dt_bias, lower_bound) samplers. "slow": some channels barely decay;
#: "long mem": per-token log decay about -2e-4 .. -0.05, so the state carries thousands
#: of tokens and S is re-rounded on every chunk it survives.
GATES = {
    "slow, L=-5": (lambda g, H: torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64)),
                   lambda g, H, K: torch.randn(H, K, generator=g, dtype=torch.float64), -5.0),
    "long mem, softplus": (lambda g, H: torch.rand(H, generator=g, dtype=torch.float64),
                           lambda g, H, K: -10 + 6 * torch.rand(H, K, generator=g, dtype=torch.float64), None),
}


def _rel(x, ref) -> float:
    x, ref = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _emulated_walk(st, cu_seqlens, scale, initial_state, C=C):
    """The walk's precision recipe in fp32 on the CPU, chunk by chunk: per head,
    ``S_op = bf16(S)``, ``R = bf16(v - kd S_op^T)``, ``o = scale (qg S_op^T + a_fold R)``,
    ``S = S * decay + R^T t_fold`` (bf16 x bf16 products are exact in fp32, so this is an
    fp32-accumulating tensor-core product up to accumulation order). Returns ``(o
    [1, T, H, V] bf16, final [N, H, V, K] fp32)``."""
    T, H, V = st["v"].shape[1:]
    bounds, offsets = cu_seqlens.tolist(), prepare_chunk_offsets(cu_seqlens, C).tolist()
    o = torch.zeros(1, T, H, V)
    final = torch.zeros(len(bounds) - 1, H, V, st["kd"].shape[3])
    for n in range(len(bounds) - 1):
        S = initial_state[n].float().clone()
        for c, s in enumerate(range(bounds[n], bounds[n + 1], C)):
            e = min(s + C, bounds[n + 1])
            kd, qg, tf, vv = (st[key][0, s:e].transpose(0, 1) for key in ("kd", "qg", "t_fold", "v"))
            af = st["a_fold"][0, s:e, :, : e - s].transpose(0, 1)
            S_op = _bf16(S).transpose(1, 2)
            R = _bf16(vv - kd @ S_op)
            o[0, s:e] = (scale * (qg @ S_op + af @ R)).transpose(0, 1)
            S = S * st["decay"][offsets[n] + c][:, None, :] + R.transpose(1, 2) @ tf
        final[n] = S
    return o.to(torch.bfloat16), final


_CASES = {}


def _case(lengths, gate, device, H=4, K=128, V=128, seed=0, C=C):
    """Inputs, the fp64 references (with and without the initial state), the emulation
    and the bf16 operands the kernel reads, in chunks of ``C`` tokens; built once per
    ``(lengths, gate, C)``."""
    key = (tuple(lengths), gate, str(device), C)
    if key in _CASES:
        return _CASES[key]
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape):  # bf16-representable inputs, held in float64
        return _bf16(torch.randn(*shape, generator=g, dtype=torch.float64)).to(torch.float64)

    q, k, v, raw_g, raw_beta = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), r(1, T, H, K), r(1, T, H)
    a_fn, dt_fn, lower_bound = GATES[gate]
    A_log, dt_bias = a_fn(g, H), dt_fn(g, H, K)
    init = (0.3 * torch.randn(len(lengths), H, V, K, generator=g, dtype=torch.float64)).to(torch.float32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    args = [x.to(device) for x in (q, k, v, raw_g, raw_beta, A_log, dt_bias)]
    scale = K ** -0.5
    ref = {}
    for name, h0 in (("init", init.to(device, torch.float64)), ("zero", None)):
        ref[name] = naive_recurrent_kda(*args, scale=scale, lower_bound=lower_bound, cu_seqlens=cu.to(device),
                                        initial_state=h0, output_final_state=True)[:2]
    ops = {key: t.cpu() for key, t in naive_chunk_operands(*args, cu_seqlens=cu.to(device), lower_bound=lower_bound,
                                                           chunk_size=C).items()}
    st = {key: _bf16(ops[key]) for key in ("qg", "kd", "t_fold", "a_fold")}
    st["v"], st["decay"] = _bf16(v), ops["decay"].to(torch.float32)
    kin = {key: st[key].to(device, torch.bfloat16).contiguous() for key in ("qg", "kd", "t_fold", "a_fold", "v")}
    kin["decay"] = st["decay"].to(device).contiguous()
    kin["cu_seqlens"] = cu.to(device, torch.int32)
    kin["chunk_offsets"] = prepare_chunk_offsets(kin["cu_seqlens"], C)
    case = dict(st=st, kin=kin, scale=scale, init=init.to(device), cu=cu, ref=ref,
                emu=_emulated_walk(st, cu, scale, init, C))
    _CASES[key] = case
    return case


def _walk(kin, scale, initial_state, final_state=True, **opts):
    """Run the package's walk over ``kin``; ``o`` is pre-filled with NaN, so a row it
    does not write stays NaN. Returns ``(o, final or None)``."""
    v = kin["v"]
    o = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)
    N, H = kin["cu_seqlens"].numel() - 1, v.shape[2]
    final = (torch.empty(N, H, v.shape[3], kin["kd"].shape[3], dtype=torch.float32, device=v.device)
             if final_state else None)
    folded_walk(kin["qg"], kin["kd"], kin["t_fold"], kin["a_fold"], v, kin["decay"], o, scale, kin["cu_seqlens"],
                kin["chunk_offsets"], initial_state=initial_state, final_state=final, **opts)
    torch.cuda.synchronize()
    return o, final


@pytest.mark.gpu
@pytest.mark.parametrize("gate", list(GATES))
def test_gpu_walk_ragged_matches_fp64_and_the_recipe(gpu, gate):
    sm90_or_skip(gpu, "the Gluon walk")
    d = _case(LENGTHS, gate, gpu)
    o, s = _walk(d["kin"], d["scale"], d["init"])
    assert bool(torch.isfinite(o.float()).all()), "an o row inside the batch was not written"
    o_ref, s_ref = d["ref"]["init"]
    o_emu, s_emu = d["emu"]
    errors = {"o vs fp64": (_rel(o, o_ref), TOL_REF), "state vs fp64": (_rel(s, s_ref), TOL_REF),
              "o vs recipe": (_rel(o, o_emu), TOL_EMU), "state vs recipe": (_rel(s, s_emu), TOL_EMU)}
    cu = d["cu"].tolist()
    errors["worst sequence o vs fp64"] = (max(_rel(o[0, cu[n]:cu[n + 1]], o_ref[0, cu[n]:cu[n + 1]])
                                              for n, length in enumerate(LENGTHS) if length > 0), 2 * TOL_REF)
    assert all(err < tol for err, tol in errors.values()), errors
    for n, length in enumerate(LENGTHS):
        if length == 0:
            assert torch.equal(s[n], d["init"][n]), f"empty sequence {n}: its state changed"


@pytest.mark.gpu
def test_gpu_walk_variants(gpu):
    """Same inputs (the first gate): V-half CTAs, synchronous wgmma, the warp-specialised
    loader (the same arithmetic: bit for bit the default walk's ``o`` and state), no
    initial state, no final state."""
    sm90_or_skip(gpu, "the Gluon walk")
    d = _case(LENGTHS, next(iter(GATES)), gpu)
    o_emu, s_emu = d["emu"]
    o_plain, s_plain = _walk(d["kin"], d["scale"], d["init"])
    o_ws, s_ws = _walk(d["kin"], d["scale"], d["init"], warp_specialized=True)
    assert torch.equal(o_ws, o_plain) and torch.equal(s_ws, s_plain), "the warp-specialised walk differs"
    for name, opts in (("vb=64 (V-half CTAs, 4 warps)", dict(vb=64)), ("synchronous wgmma", dict(use_async=False))):
        o, s = _walk(d["kin"], d["scale"], d["init"], **opts)
        e_o, e_s = _rel(o, o_emu), _rel(s, s_emu)
        assert e_o < TOL_EMU and e_s < TOL_EMU, (name, e_o, e_s)
    o, s = _walk(d["kin"], d["scale"], None)
    o_ref, s_ref = d["ref"]["zero"]
    r_o, r_s = _rel(o, o_ref), _rel(s, s_ref)
    assert r_o < TOL_REF and r_s < TOL_REF, ("initial_state=None vs the fp64 recurrence from zero", r_o, r_s)
    o, s = _walk(d["kin"], d["scale"], d["init"], final_state=False)
    assert s is None
    e_o = _rel(o, o_emu)
    assert e_o < TOL_EMU, ("no final state", e_o)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [32, 16])
def test_gpu_walk_smaller_chunks(gpu, chunk):
    """The walk compiled for 32- and 16-token chunks (the fused prefill's candidate
    granularities: a chunk-64 producer does not fit its registers) on operands of that
    chunk size, plain and warp-specialised: within the recipe of the emulation and of
    the fp64 recurrence, bit for bit between the two."""
    sm90_or_skip(gpu, "the Gluon walk")
    d = _case(LENGTHS, next(iter(GATES)), gpu, C=chunk)
    o, s = _walk(d["kin"], d["scale"], d["init"], chunk_size=chunk)
    o_ws, s_ws = _walk(d["kin"], d["scale"], d["init"], chunk_size=chunk, warp_specialized=True)
    assert torch.equal(o_ws, o) and torch.equal(s_ws, s)
    o_emu, s_emu = d["emu"]
    e_o, e_s = _rel(o, o_emu), _rel(s, s_emu)
    assert e_o < TOL_EMU and e_s < TOL_EMU, (chunk, e_o, e_s)
    o_ref, s_ref = d["ref"]["init"]
    r_o, r_s = _rel(o, o_ref), _rel(s, s_ref)
    assert r_o < TOL_REF and r_s < TOL_REF, (chunk, r_o, r_s)


@pytest.mark.gpu
def test_gpu_walk_masks_rows_past_the_sequence_end(gpu):
    """One 65-token sequence in a 192-row batch (a second sequence only pads it): NaN in
    every operand row past its end and in the pad columns of its tail row's ``a_fold``
    (the contract says zeros) change no bit of ``o`` or the state, and the walk writes
    no ``o`` row past the end."""
    sm90_or_skip(gpu, "the Gluon walk")
    d = _case([65, 127], next(iter(GATES)), gpu)
    kin = dict(d["kin"], cu_seqlens=d["kin"]["cu_seqlens"][:2].clone(),
               chunk_offsets=d["kin"]["chunk_offsets"][:2].clone())
    init = d["init"][:1].contiguous()
    o_clean, s_clean = _walk(kin, d["scale"], init)
    assert bool(torch.isnan(o_clean[0, 65:].float()).all()), "the walk wrote rows past the only sequence"
    poisoned = {key: (t.clone() if torch.is_tensor(t) else t) for key, t in kin.items()}
    for key in ("qg", "kd", "t_fold", "v", "a_fold"):
        poisoned[key][0, 65:] = float("nan")
    poisoned["a_fold"][0, 64, :, 1:] = float("nan")
    o_p, s_p = _walk(poisoned, d["scale"], init)
    assert torch.equal(o_p[0, :65], o_clean[0, :65])
    assert torch.equal(s_p, s_clean)


@pytest.mark.parametrize("chunk_size", [48, 8, 128, True])
def test_walk_refuses_a_chunk_size_it_has_no_products_for(chunk_size):
    """CPU: ``chunk_size`` other than 16, 32 or 64 is refused in one line, before any launch."""
    from kda_engram.kda.hopper.walk import folded_walk_launch

    z = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^chunk_size: expected 16, 32 or 64"):
        folded_walk_launch(z, z, z, torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16), z, torch.zeros(1, 1, 128), z,
                           0.1, cu, torch.tensor([0, 1], dtype=torch.int32), chunk_size=chunk_size)
