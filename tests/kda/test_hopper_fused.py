"""The fused Hopper prefill (``kda/hopper/fused.py``): its host rules on the CPU, and on
an sm_90 GPU against the fp64 recurrence and the model of its order of operations.

GPU cases: a ragged batch with empty, 1-token and chunk-edge sequences (31, 32, 33, 63,
64, 65) from a random initial state, every ``o`` row written (``o`` is pre-filled with
NaN), the fp64 recurrence within ``TOL_REF`` overall and ``2 TOL_REF`` for the worst
sequence (a masking bug shows in one sequence), the model with the kernel's roundings at
chunk 32 within ``TOL_MODEL``, an empty sequence's state passed through bit for bit; the
state cache (negative rows, ``has_initial_state``) and checkpoints against the dense run;
NaN in the rows past the only sequence's end changing no bit. The ragged batch and the
NaN rows run with each producer width.
"""

import pytest
import torch

from kda_engram.kda.hopper.fused import (FUSED_CHUNK, fused_prefill, fused_prefill_launch, fused_unsupported,
                                        needs_exact_diagonal)
from kda_engram.kda.hopper.fused_model import model_fused_prefill
from kda_engram.kda.reference import naive_recurrent_kda

from ..helpers import sm90_or_skip

LENGTHS = [1000, 0, 1, 31, 32, 33, 63, 64, 65, 700, 0]
#: The producer's widths: one warpgroup, or two splitting each chunk's rows.
PRODUCER_WIDTHS = [4, 8]
TOL_REF = 5e-3
TOL_MODEL = 2e-3
#: name: (A_log, dt_bias samplers at H heads of K channels, lower_bound, gate). The
#: bounded gate within the anchored span (no exact blocks compiled in); a bounded gate
#: past it, the softplus gate with fast decays and a precomputed log decay: flagged
#: chunks (a sub-chunk spanning more than 126 in log2 units) take the exact diagonal
#: blocks, the others the anchored product.
GATES = {
    "bounded": (lambda g, H: torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64)),
                lambda g, H, K: torch.randn(H * K, generator=g, dtype=torch.float64), -5.0, "raw"),
    "bounded, wide": (lambda g, H: torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64)),
                      lambda g, H, K: torch.randn(H * K, generator=g, dtype=torch.float64), -12.0, "raw"),
    "softplus, fast": (lambda g, H: 1 + 2 * torch.rand(H, generator=g, dtype=torch.float64),
                       lambda g, H, K: 1 + torch.randn(H * K, generator=g, dtype=torch.float64), None, "raw"),
    "log decay": (None, None, None, "log_decay"),
}


def _bf16(x):
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def _rel(x, ref) -> float:
    x, ref = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


_CASES = {}


def _case(lengths, device, gate="bounded", H=4, K=128, seed=0):
    """bf16 inputs (held as float64 for the references), the fp64 recurrence and the
    model, built once per ``lengths`` and gate."""
    key = (tuple(lengths), str(device), gate)
    if key in _CASES:
        return _CASES[key]
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape):
        return _bf16(torch.randn(*shape, generator=g, dtype=torch.float64)).to(torch.float64)

    q, k, v, raw_g, raw_beta = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H)
    alog, dtb, lower_bound, form = GATES[gate]
    A_log, dt_bias = (alog(g, H), dtb(g, H, K)) if alog else (None, None)
    if form == "log_decay":  # a natural-log decay per token, some channels fast
        raw_g = _bf16(-torch.rand(1, T, H, K, generator=g, dtype=torch.float64) * 12).to(torch.float64)
    init = (0.3 * torch.randn(len(lengths), H, K, K, generator=g, dtype=torch.float64)).to(torch.float32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    scale = K ** -0.5
    forms = dict(lower_bound=lower_bound, gate=form)
    ref = naive_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale=scale, cu_seqlens=cu,
                              initial_state=init.double(), output_final_state=True, **forms)[:2]
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    model = model_fused_prefill(q.float(), k.float(), v.float(), raw_g.float(), raw_beta.float(), f32(A_log),
                                f32(dt_bias), scale=scale, cu_seqlens=cu, initial_state=init, chunk_size=FUSED_CHUNK,
                                **forms)
    dev = {n: t.to(device, torch.bfloat16).contiguous() for n, t in
           dict(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta).items()}
    on = lambda t: None if t is None else t.to(device, torch.float32)  # noqa: E731
    dev.update(A_log=on(A_log), dt_bias=on(dt_bias), cu=cu.to(device, torch.int32), init=init.to(device))
    case = dict(dev=dev, ref=ref, model=model[:2], flagged=model[2], forms=forms, scale=scale, cu=cu)
    _CASES[key] = case
    return case


def _run(d, **state):
    x = d["dev"]
    o = torch.full_like(x["v"], float("nan"))
    fused_prefill(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], o, d["scale"], x["cu"],
                  **d["forms"], **state)
    torch.cuda.synchronize()
    return o


@pytest.mark.gpu
@pytest.mark.parametrize("warps", PRODUCER_WIDTHS)
@pytest.mark.parametrize("gate", list(GATES))
def test_gpu_fused_ragged_matches_fp64_and_the_model(gpu, gate, warps):
    sm90_or_skip(gpu, "the fused Hopper prefill")
    d = _case(LENGTHS, gpu, gate)
    if gate != "bounded":
        assert d["flagged"] > 0, "no chunk of the case takes the exact diagonal blocks"
    x = d["dev"]
    N, H, K = len(LENGTHS), x["q"].shape[2], x["q"].shape[3]
    final = torch.full((N, H, K, K), float("nan"), device=gpu)
    o = _run(d, initial_state=x["init"], final_state=final, producer_warps=warps)
    assert bool(torch.isfinite(o.float()).all()), "an o row inside the batch was not written"
    (o_ref, s_ref), (o_mod, s_mod) = d["ref"], d["model"]
    cu = d["cu"].tolist()
    errors = {"o vs fp64": (_rel(o, o_ref), TOL_REF), "state vs fp64": (_rel(final, s_ref), TOL_REF),
              "o vs model": (_rel(o, o_mod), TOL_MODEL), "state vs model": (_rel(final, s_mod), TOL_MODEL),
              "worst sequence o vs fp64": (max(_rel(o[0, cu[n]:cu[n + 1]], o_ref[0, cu[n]:cu[n + 1]])
                                               for n, length in enumerate(LENGTHS) if length > 0), 2 * TOL_REF)}
    assert all(err < tol for err, tol in errors.values()), (gate, errors)
    for n, length in enumerate(LENGTHS):
        if length == 0:
            assert torch.equal(final[n], x["init"][n]), f"empty sequence {n}: its state changed"


@pytest.mark.gpu
def test_gpu_fused_state_cache_and_checkpoints(gpu):
    """The cache form of the dense run: rows scattered, one sequence with no initial
    state, one with row -1 (nothing read or written); a checkpoint at token 64 of the
    1000-token sequence equals the dense run's state after a 64-token prefix."""
    sm90_or_skip(gpu, "the fused Hopper prefill")
    lengths = [1000, 65, 0, 300]
    d = _case(lengths, gpu)
    x = d["dev"]
    N, H, K = len(lengths), x["q"].shape[2], x["q"].shape[3]
    final = torch.empty(N, H, K, K, device=gpu)
    o_dense = _run(d, initial_state=x["init"], final_state=final)
    rows = torch.tensor([5, 2, 7, -1], dtype=torch.int32, device=gpu)
    has = torch.tensor([1, 0, 1, 1], dtype=torch.uint8, device=gpu)
    cache = torch.randn(9, H, K, K, device=gpu)
    cache[5], cache[7] = x["init"][0], x["init"][2]
    before = cache.clone()
    snaps = torch.full((3, H, K, K), float("nan"), device=gpu)
    o = _run(d, state_cache=cache, state_indices=rows, has_initial_state=has, checkpoint_state=snaps,
             checkpoint_offsets=torch.tensor([64, 0, 0, 0], dtype=torch.int32, device=gpu),
             checkpoint_state_indices=torch.tensor([1, -1, -1, -1], dtype=torch.int32, device=gpu))
    cu = d["cu"].tolist()
    # Sequences 0 and 2 start from the dense run's states (sequence 2 is empty);
    # sequence 1 starts from zeros (has = 0), checked against a zero-start run below.
    assert torch.equal(o[0, : cu[1]], o_dense[0, : cu[1]]), "sequence 0 differs from the dense run"
    assert torch.equal(cache[5], final[0]) and torch.equal(cache[7], final[2])
    untouched = [i for i in range(9) if i not in (2, 5, 7)]
    assert torch.equal(cache[untouched], before[untouched]), "a row the call was not given changed"
    # Sequence 1 started from zeros (has = 0): the cache row holds its final state from zeros.
    zero_start = torch.empty(1, H, K, K, device=gpu)
    sub = dict(d, dev=dict(x, cu=x["cu"][1:3].contiguous()))
    o_zero = _run(sub, final_state=zero_start)
    assert torch.equal(cache[2], zero_start[0])
    assert torch.equal(o[0, cu[1]:cu[2]], o_zero[0, cu[1]:cu[2]]), "sequence 1 differs from its zero-start run"
    prefix = torch.empty(1, H, K, K, device=gpu)
    _run(dict(d, dev=dict(x, cu=torch.tensor([0, 64], dtype=torch.int32, device=gpu))),
         initial_state=x["init"][:1].contiguous(), final_state=prefix)
    assert torch.equal(snaps[1], prefix[0]), "the checkpoint is not the state after 64 tokens"
    assert bool(torch.isnan(snaps[0]).all()) and bool(torch.isnan(snaps[2]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("warps", PRODUCER_WIDTHS)
@pytest.mark.parametrize("gate", ["bounded", "softplus, fast"])
def test_gpu_fused_masks_rows_past_the_sequence_end(gpu, gate, warps):
    """NaN in q, k, v, raw_g and raw_beta past the only sequence's end (65 of 192 rows)
    change no bit of ``o`` or the state, and no ``o`` row past the end is written (with
    the exact diagonal blocks too: their raw rows past the end are the next sequence's)."""
    sm90_or_skip(gpu, "the fused Hopper prefill")
    d = _case([65, 127], gpu, gate)
    x = dict(d["dev"], cu=d["dev"]["cu"][:2].contiguous())
    H, K = x["q"].shape[2], x["q"].shape[3]
    s_clean = torch.empty(1, H, K, K, device=gpu)
    o_clean = _run(dict(d, dev=x), final_state=s_clean, producer_warps=warps)
    assert bool(torch.isnan(o_clean[0, 65:].float()).all()), "a row past the only sequence was written"
    poisoned = {n: (t.clone() if n in ("q", "k", "v", "raw_g", "raw_beta") else t) for n, t in x.items()}
    for n in ("q", "k", "v", "raw_g", "raw_beta"):
        poisoned[n][0, 65:] = float("nan")
    s_p = torch.empty_like(s_clean)
    o_p = _run(dict(d, dev=poisoned), final_state=s_p, producer_warps=warps)
    assert torch.equal(o_p[0, :65], o_clean[0, :65]) and torch.equal(s_p, s_clean)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["bounded", "log decay"])
def test_gpu_fused_through_the_entry_point(gpu, gate):
    """``chunk_kda_prefill(path="fused")`` (the registered backend, the default checks on)
    gives the direct launch's ``o`` and final state bit for bit."""
    sm90_or_skip(gpu, "the fused Hopper prefill")
    from kda_engram.kda.prefill import chunk_kda_prefill

    d = _case(LENGTHS, gpu, gate)
    x = d["dev"]
    N, H, K = len(LENGTHS), x["q"].shape[2], x["q"].shape[3]
    final = torch.empty(N, H, K, K, device=gpu)
    o = _run(d, initial_state=x["init"], final_state=final)
    o_e, s_e = chunk_kda_prefill(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
                                 **d["forms"], cu_seqlens=x["cu"], initial_state=x["init"],
                                 output_final_state=True, path="fused")
    assert torch.equal(o_e, o) and torch.equal(s_e, final)


def test_fused_backend_is_asked_only_by_name_on_a_cpu():
    """CPU: ``path="fused"`` is a registered path that refuses a CPU call in one line, and
    ``path="auto"`` does not take it before its GPU checks and benchmark."""
    from kda_engram.kda.prefill import prefill_path
    from kda_engram.kda.prefill_paths import auto_order, path_names

    assert "fused" in path_names() and "fused" not in auto_order()
    q, k, v, g, b = _cpu_inputs()
    with pytest.raises(ValueError, match="CUDA"):
        prefill_path(q, v, None, cu_seqlens=None, path="fused")


def _cpu_inputs(T=64, H=2, K=128, dtype=torch.bfloat16, g_dtype=torch.bfloat16):
    q = torch.zeros(1, T, H, K, dtype=dtype)
    return q, q.clone(), q.clone(), torch.zeros(1, T, H, K, dtype=g_dtype), torch.zeros(1, T, H, dtype=dtype)


@pytest.mark.parametrize("gate, lower_bound, exact", [("raw", -5.0, False), ("raw", -5.45, False),
                                                      ("raw", -5.5, True), ("raw", None, True),
                                                      ("log_decay", None, True)])
def test_fused_serves_every_gate_form_in_bf16(gate, lower_bound, exact):
    """Every gate form, raw gate bf16 or fp32; the exact diagonal blocks are compiled in
    where a sub-chunk may span past the anchored range (16 |lower_bound| log2 e > 126, or
    an unbounded gate), and only there."""
    q, k, v, g, b = _cpu_inputs()
    for raw_g in (g, _cpu_inputs(g_dtype=torch.float32)[3]):
        assert fused_unsupported(q, k, v, raw_g, b, None, gate=gate, lower_bound=lower_bound) is None
    assert needs_exact_diagonal(gate, lower_bound) is exact


@pytest.mark.parametrize("case, words", [
    (dict(gate="softplus"), "gate="),
    (dict(dtype=torch.float16), "bf16"),
    (dict(K=64), "K = V = 128"),
    (dict(strided_v=True), "v must"),
    (dict(g_dtype=torch.float16), "raw_g"),
])
def test_fused_says_why_it_does_not_serve_a_call(case, words):
    """CPU: each unserved form is named in one line (the backend keeps another path for it)."""
    case = dict(case)
    q, k, v, g, b = _cpu_inputs(K=case.pop("K", 128), dtype=case.pop("dtype", torch.bfloat16),
                                g_dtype=case.pop("g_dtype", torch.bfloat16))
    if case.pop("strided_v", False):
        v = torch.zeros(1, 64, 2, 256, dtype=torch.bfloat16)[..., :128]
    reason = fused_unsupported(q, k, v, g, b, None, **{"lower_bound": -5.0, **case})
    assert reason is not None and words in reason, reason


@pytest.mark.parametrize("warps", PRODUCER_WIDTHS)
def test_fused_launch_takes_each_producer_width(warps):
    """CPU: each producer width gets the register split that leaves the consumers 168
    (the compile test checks it on sm_90a); any other width is a ValueError naming it."""
    q, k, v, g, b = _cpu_inputs()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    args = (q, k, v, g, b, torch.zeros(2), torch.zeros(256), torch.empty_like(v), 1.0, cu)
    kwargs = fused_prefill_launch(*args, lower_bound=-5.0, producer_warps=warps)[3]
    assert kwargs["PW"] == warps and 32 * warps * kwargs["PRODUCER_REGS"] + 256 * 168 <= 65536
    with pytest.raises(ValueError, match="producer_warps.*got 6"):
        fused_prefill_launch(*args, lower_bound=-5.0, producer_warps=6)
