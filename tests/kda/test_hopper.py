"""The Hopper prefill path (kda/hopper/, kda/hopper/folded_prologue.py) and its dispatch.

CPU (interpreter): the folded prologue against ``reference.naive_chunk_operands`` (fp32),
and the path choice (``prefill_path``) with its refusals. GPU (sm_90): every
contract of ``chunk_kda_prefill`` on ``path="hopper"`` against the fp64 recurrence
and the portable path: ragged batches with empty and 1-token sequences, dense and
paged states (fp32, bf16), checkpoints, ``out=v``, the conv path with strided
bands, determinism (CUDA-graph replay: ``test_prefill.py``, on both paths),
and accuracy no worse than the portable path (and fla's, where importable) at
1 x 32768 tokens with the slow-channel and fast gates.
"""

import math
import re

import pytest
import torch

from kda_engram.bundles import KDAInputs

from kda_engram.kda.hopper.folded_prologue import prepare_folded_prologue
from kda_engram.kda.metadata import prepare_chunk_metadata
from kda_engram.kda.prefill import chunk_kda_prefill, prefill_path
from kda_engram.kda.reference import naive_chunk_operands, naive_recurrent_kda

from ..helpers import make_raw, rel_rmse, sm90_or_skip

# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_folded_prologue_matches_chunk_operands(lower_bound):
    lengths = [37, 64, 0, 130, 1]
    raw, cu = make_raw(lengths, H=2, K=16, V=16, seed=4)
    cu = cu.to(torch.int32)
    T = sum(lengths)
    _, indices = prepare_chunk_metadata(cu, T)
    ops = prepare_folded_prologue(KDAInputs.pick({**raw, "lower_bound": lower_bound}), cu, indices)()
    ref = naive_chunk_operands(**{n: t.double() for n, t in raw.items()}, cu_seqlens=cu, lower_bound=lower_bound)
    for key in ("qg", "kd", "t_fold"):
        err = (ops[key].double() - ref[key]).abs().max().item()
        assert err < 1e-5, (key, err)
    assert ops["v"] is raw["v"]
    bounds = cu.tolist()
    for n in range(len(lengths)):
        for s in range(bounds[n], bounds[n + 1], 64):
            e = min(s + 64, bounds[n + 1])
            # a_fold: the chunk's L columns (the pad columns are the walk's to mask).
            err = (ops["a_fold"][0, s:e, :, : e - s].double() - ref["a_fold"][0, s:e, :, : e - s]).abs().max()
            assert err.item() < 1e-5, (n, s, err.item())


def test_path_choice_on_the_cpu():
    raw, cu = make_raw([10], H=2, K=16, V=16)
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="portable") == "portable"
    with pytest.raises(ValueError, match=r"path: the Hopper path cannot serve this call: it needs a CUDA device"):
        prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="hopper")
    with pytest.raises(ValueError, match=r"path: expected one of \('auto', 'fused', 'hopper', 'portable'\), got 'fast'"):
        chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, path="fast")
    with pytest.raises(ValueError, match="Hopper path cannot serve"):
        chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, path="hopper")


def test_paths_are_registered_backends_that_answer_in_one_voice():
    """Issue 45: ``chunk_kda_prefill(path=...)``, ``prefill_path`` and ``prefill_verdict``
    (the fla integration's) ask one registry and refuse in its words."""
    from kda_engram.kda.prefill import prefill_verdict
    from kda_engram.kda.prefill_paths import BACKENDS, PrefillCall, refusal, verify

    assert {"portable", "grouped", "hopper", "fused"} <= BACKENDS.keys()
    assert {b.path for b in BACKENDS.values()} == {"portable", "hopper", "fused"}
    raw, cu = make_raw([10], H=2, K=16, V=16)
    call = PrefillCall(raw["q"], raw["v"], cu_seqlens=cu)
    assert verify("portable", call) == (True, None) and prefill_verdict(call) == (True, None)
    ok, reason = verify("hopper", call)
    assert not ok and reason.startswith("needs a CUDA device")
    for run in (lambda: prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="hopper"),
                lambda: chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, path="hopper")):
        with pytest.raises(ValueError) as info:
            run()
        assert str(info.value) == f"path: {refusal('hopper', reason)}"
    wide = torch.zeros(1, 4, 2, 48)
    ok, reason = verify("portable", PrefillCall(wide, wide, cu_seqlens=cu))
    assert not ok and "K=48" in reason
    assert prefill_verdict(PrefillCall(wide, wide, cu_seqlens=cu)) == (False, refusal("portable", reason))
    with pytest.raises(ValueError, match="^" + re.escape(f"path: {refusal('portable', reason)}") + "$"):
        prefill_path(wide, wide, None, cu_seqlens=cu, path="portable")


# ----------------------------------------------------------------------------- GPU


def _inputs(lengths, heads, device, seed=0, gate="random"):
    raw, cu = make_raw(lengths, H=heads, K=128, V=128, seed=seed, device=device)
    raw.update({n: raw[n].to(torch.bfloat16) for n in ("q", "k", "v", "raw_g", "raw_beta")})
    gen = torch.Generator(device="cpu").manual_seed(seed + 100)
    if gate == "slow":  # ANCHORS: A_log = log U[1, 16), dt_bias ~ N(0, 1): some channels barely decay
        raw["A_log"] = torch.log(1 + 15 * torch.rand(heads, generator=gen)).to(device)
        raw["dt_bias"] = torch.randn(heads * 128, generator=gen).to(device)
    elif gate == "fast":  # A_log, dt_bias ~ U[0, 1): every channel decays fast
        raw["A_log"] = torch.rand(heads, generator=gen).to(device)
        raw["dt_bias"] = torch.rand(heads * 128, generator=gen).to(device)
    return raw, cu


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_gpu_hopper_ragged_matches_fp64_and_portable(gpu, lower_bound):
    sm90_or_skip(gpu, "the Hopper path")
    lengths = [1, 63, 64, 65, 0, 300, 1000, 1]
    heads = 4
    raw, cu = _inputs(lengths, heads, gpu, seed=5)
    h0 = torch.randn(len(lengths), heads, 128, 128, device=gpu) * 0.1
    kw = dict(lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    out = torch.full_like(raw["v"], math.nan)
    o_h, f_h = chunk_kda_prefill(**raw, **kw, path="hopper", out=out)
    o_p, f_p = chunk_kda_prefill(**raw, **kw, path="portable")
    o_x, f_x, _ = naive_recurrent_kda(**{n: t.double() for n, t in raw.items()}, lower_bound=lower_bound,
                                      cu_seqlens=cu, initial_state=h0.double(), output_final_state=True)
    assert torch.isfinite(o_h.float()).all() and torch.isfinite(f_h).all()  # every row written, softplus finite
    assert torch.equal(f_h[4], h0[4])  # an empty sequence passes its state through
    e_h, e_p = rel_rmse(o_h, o_x), rel_rmse(o_p, o_x)
    s_h, s_p = rel_rmse(f_h, f_x), rel_rmse(f_p, f_x)
    assert e_h < 1e-2 and s_h < 1e-2, (e_h, s_h)
    assert e_h <= 1.25 * e_p + 1e-4, (e_h, e_p)
    assert s_h <= 1.25 * s_p + 1e-4, (s_h, s_p)
    bounds = cu.tolist()
    for n, length in enumerate(lengths):  # per sequence: a masking fault shows in one only
        if length:
            assert rel_rmse(o_h[:, bounds[n]:bounds[n + 1]], o_x[:, bounds[n]:bounds[n + 1]]) < 2e-2, n


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("indexed", [True, False], ids=["ckpt_rows", "ckpt_staging"])
def test_gpu_hopper_cache_checkpoints_out_is_v(gpu, state_dtype, indexed):
    """The serving call: paged cache (a -1 row, has_initial_state), 64-aligned
    checkpoints, out=v; rows not given stay untouched; equal to the portable path."""
    sm90_or_skip(gpu, "the Hopper path")
    lengths = [128, 1, 0, 65, 200]
    heads, N = 2, 5
    raw, cu = _inputs(lengths, heads, gpu, seed=6)
    h0 = (torch.randn(N, heads, 128, 128, device=gpu) * 0.1).to(state_dtype)
    idx = torch.tensor([3, -1, 5, 0, 7], device=gpu)
    has = torch.tensor([True, True, False, False, True], device=gpu)
    offs = torch.tensor([128, 0, 0, 64, 192], device=gpu, dtype=torch.int32)
    ck_rows = torch.tensor([9, -1, -1, 10, 11], device=gpu, dtype=torch.int32) if indexed else None
    results = {}
    for path in ("hopper", "portable"):
        cache = torch.full((12, heads, 128, 128), math.nan, device=gpu, dtype=state_dtype)
        cache[3], cache[7] = h0[0], h0[4]
        ck = cache if indexed else torch.full((N, heads, 128, 128), math.nan, device=gpu, dtype=state_dtype)
        v = raw["v"].clone()
        o, final = chunk_kda_prefill(**{**raw, "v": v}, lower_bound=-5.0, cu_seqlens=cu, state_cache=cache,
                                     state_indices=idx, has_initial_state=has, checkpoint_state=ck,
                                     checkpoint_offsets=offs, checkpoint_state_indices=ck_rows, out=v, path=path)
        assert final is None and o.data_ptr() == v.data_ptr()
        results[path] = (o, cache, ck)
    o, cache, ck = results["hopper"]
    o_p, cache_p, ck_p = results["portable"]
    start = torch.where((has & (idx >= 0))[:, None, None, None], h0.float(), torch.zeros_like(h0.float()))
    o_x, f_x, c_x = naive_recurrent_kda(**{n: t.double() for n, t in raw.items()}, lower_bound=-5.0,
                                        cu_seqlens=cu, initial_state=start.double(), output_final_state=True,
                                        checkpoint_offsets=offs)
    assert rel_rmse(o, o_x) < 1e-2
    for n, r in ((0, 3), (2, 5), (3, 0), (4, 7)):
        assert rel_rmse(cache[r], f_x[n]) < 1e-2, n
        assert rel_rmse(cache[r], cache_p[r]) < 1e-2, n
    rows = (9, 10, 11) if indexed else (0, 3, 4)
    for n, r in zip((0, 3, 4), rows):
        assert rel_rmse(ck[r], c_x[n]) < 1e-2, n
    untouched = [1, 2, 4, 6, 8] if indexed else [1, 2, 4, 6, 8, 9, 10, 11]
    assert torch.isnan(cache[untouched].float()).all()
    if not indexed:
        assert torch.isnan(ck[[1, 2]].float()).all()


@pytest.mark.gpu
def test_gpu_hopper_conv_strided_bands_and_determinism(gpu):
    """The conv path over strided bands of one projection, strided raw_g / raw_beta
    slices, a conv state: equal to the portable path; two runs bitwise equal."""
    sm90_or_skip(gpu, "the Hopper path")
    heads, D = 4, 128
    lengths = [300, 0, 64, 77]
    T, N = sum(lengths), len(lengths)
    gen = torch.Generator(device="cpu").manual_seed(7)
    C = 3 * heads * D
    proj = torch.randn(1, T, C + heads * D + heads + 8, generator=gen).to(gpu, torch.bfloat16)
    q, k, v = (proj[..., i * heads * D:(i + 1) * heads * D].view(1, T, heads, D) for i in range(3))
    raw_g = proj[..., C:C + heads * D].view(1, T, heads, D)
    raw_beta = proj[..., C + heads * D:C + heads * D + heads]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=gpu, dtype=torch.int32)
    weight = (torch.randn(C, 4, generator=gen) * 0.3).to(gpu, torch.bfloat16)
    conv0 = torch.randn(N, C, 3, generator=gen).to(gpu, torch.bfloat16)
    common = dict(A_log=torch.rand(heads, device=gpu), dt_bias=torch.randn(heads * D, device=gpu), lower_bound=-5.0,
                  cu_seqlens=cu, output_final_state=True, conv_weight=weight,
                  conv_state_indices=torch.arange(N, device=gpu), conv_has_initial_state=torch.ones(N, dtype=torch.bool, device=gpu))
    runs = {}
    for path in ("hopper", "hopper", "portable"):
        conv = conv0.clone()
        o, final = chunk_kda_prefill(q, k, v, raw_g, raw_beta, **common, conv_state=conv, path=path)
        runs.setdefault(path, []).append((o, final, conv))
    (o1, f1, c1), (o2, f2, c2) = runs["hopper"]
    assert torch.equal(o1, o2) and torch.equal(f1, f2) and torch.equal(c1, c2)
    o_p, f_p, c_p = runs["portable"][0]
    assert torch.equal(c1, c_p)
    assert rel_rmse(o1, o_p) < 1e-2 and rel_rmse(f1, f_p) < 1e-2


def _fla_error(raw, cu, h0, lower_bound, o_x, f_x):
    """fla's relative RMS errors (o, state) on the same inputs, or None without fla."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # ImportError, or fla failing at import
        return None
    with torch.inference_mode():
        o, f = chunk_kda(raw["q"], raw["k"], raw["v"], raw["raw_g"], raw["raw_beta"],
                         initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=lower_bound is not None, lower_bound=lower_bound, A_log=raw["A_log"],
                         dt_bias=raw["dt_bias"], cu_seqlens=cu)
    return rel_rmse(o, o_x), rel_rmse(f.transpose(-1, -2), f_x)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["slow", "fast", "random-softplus"])
def test_gpu_hopper_accuracy_32k_no_worse_than_fla(gpu, gate):
    """1 x 32768 tokens, 2 heads, random initial state, against the fp64 recurrence
    (run on the GPU): the Hopper path within 1.25x of the portable path's error and
    no worse than fla's (where fla imports) plus 10%."""
    sm90_or_skip(gpu, "the Hopper path")
    lower_bound = None if gate.endswith("softplus") else -5.0
    raw, cu = _inputs([32768], 2, gpu, seed=9, gate=gate.split("-")[0])
    h0 = torch.randn(1, 2, 128, 128, device=gpu) * 0.1
    kw = dict(lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o_h, f_h = chunk_kda_prefill(**raw, **kw, path="hopper")
    o_p, f_p = chunk_kda_prefill(**raw, **kw, path="portable")
    o_x, f_x, _ = naive_recurrent_kda(**{n: t.double() for n, t in raw.items()}, lower_bound=lower_bound,
                                      cu_seqlens=cu, initial_state=h0.double(), output_final_state=True)
    e = (rel_rmse(o_h, o_x), rel_rmse(f_h, f_x))
    p = (rel_rmse(o_p, o_x), rel_rmse(f_p, f_x))
    print(f"\n{gate}: hopper o {e[0]:.3e} state {e[1]:.3e}; portable o {p[0]:.3e} state {p[1]:.3e}", end="")
    assert e[0] <= 1.25 * p[0] + 1e-4 and e[1] <= 1.25 * p[1] + 1e-4, (e, p)
    fla = _fla_error(raw, cu, h0, lower_bound, o_x, f_x)
    if fla is not None:
        print(f"; fla o {fla[0]:.3e} state {fla[1]:.3e}", end="")
        assert e[0] <= 1.1 * fla[0] + 1e-4 and e[1] <= 1.1 * fla[1] + 1e-4, (e, fla)


def test_auto_picks_hopper_only_where_the_portable_walk_takes_one_group(monkeypatch):
    import dataclasses

    import kda_engram.kda.portable_prefill as prefill  # the "grouped" verifier's resolve_groups
    from kda_engram.kda.prefill_paths import BACKENDS

    raw, cu = make_raw([10], H=2, K=16, V=16)
    hopper = dataclasses.replace(BACKENDS["hopper"], verify=lambda call: (True, None))
    monkeypatch.setitem(BACKENDS, "hopper", hopper)
    monkeypatch.setattr(prefill, "resolve_groups", lambda *a: (1, 1))
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "hopper"
    monkeypatch.setattr(prefill, "resolve_groups", lambda *a: (4, 8))
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="hopper") == "hopper"
    monkeypatch.setitem(BACKENDS, "hopper", dataclasses.replace(hopper, priority=None))  # path= only
    monkeypatch.setattr(prefill, "resolve_groups", lambda *a: (1, 1))
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"
