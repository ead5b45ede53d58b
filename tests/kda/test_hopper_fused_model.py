"""The torch model of the fused Hopper prefill's order of operations
(kda/hopper/fused_model.py): the CPU proof of the one-launch kernel (issue 52).

* Without roundings, in fp64, the model is the KDA recurrence to fp64 rounding for the
  three gate forms: the bounded gate, the softplus gate with decays fast enough that
  every chunk takes the exact diagonal path (spans past 126 inside a sub-chunk, where
  anchored factors leave the fp32 range), and a precomputed log decay.
* With the kernel's bf16 roundings, on bf16-valued inputs at K = V = 128, it stays within
  the Gluon walk's precision budget of the fp64 recurrence, for every gate.
* Each planted fault fails the exact check on at least one gate.

Both chunk sizes: 64 (the design's, four sub-chunks, strips anchored at their ends) and
32 (the kernel's, ``kda/hopper/fused.py``: two sub-chunks, one product anchored at their
boundary). At 32 the block substitution has no ``L > J`` term to drop, so the
``"substitution"`` fault is the 64-token model's only.
"""

import math

import pytest
import torch

from kda_engram.constants import MAX_ANCHOR_SPAN
from kda_engram.kda.hopper.fused_model import FAULTS, _prepare_chunk, log2_gate, model_fused_prefill
from kda_engram.kda.reference import kda_gate, naive_recurrent_kda

from ..helpers import rel_rmse

LENGTHS = [1, 63, 64, 0, 130, 200]
#: fp64 without roundings: the algebra is exact.
TOL_EXACT = 1e-12
#: With the kernel's roundings: the Gluon walk's recipe measured 1.7-3.4e-3 on the walk
#: alone (experiments/gluon_kda_walk/PRECISION.md); the prepared operands add their bf16
#: rounding (measured 3.9-4.3e-3 here at K = 128).
TOL_BF16 = 6e-3

#: name: (A_log, dt_bias, lower_bound, gate) samplers at H heads of K channels.
GATES = {
    "bounded L=-5": (lambda g, H: torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64)),
                     lambda g, H, K: torch.randn(H * K, generator=g, dtype=torch.float64), -5.0, "raw"),
    "softplus, fast": (lambda g, H: 1 + 2 * torch.rand(H, generator=g, dtype=torch.float64),
                       lambda g, H, K: 3 + torch.randn(H * K, generator=g, dtype=torch.float64), None, "raw"),
    "log decay": (None, None, None, "log_decay"),
}


def _case(gate, lengths=LENGTHS, H=2, K=32, seed=0, bf16_values=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, K), raw_g=rnd(1, T, H, K),
             raw_beta=rnd(1, T, H))
    x["k"] = x["k"] + 1.5 * rnd(1, 1, H, K)  # keys sharing a direction: A_kk far from 0
    alog, dtb, lb, form = GATES[gate]
    x["A_log"], x["dt_bias"] = (alog(g, H), dtb(g, H, K)) if alog else (None, None)
    if form == "log_decay":  # a precomputed natural-log decay, some channels fast
        x["raw_g"] = -torch.rand(1, T, H, K, generator=g, dtype=torch.float64) * 12
    if bf16_values:
        x = {n: (t.to(torch.bfloat16).to(torch.float64) if t is not None else t) for n, t in x.items()}
    kw = dict(scale=K ** -0.5, cu_seqlens=cu, lower_bound=lb, gate=form)
    x0 = 0.1 * rnd(len(lengths), H, K, K)
    return x, kw, x0


def _reference(x, kw, h0):
    o, s, _ = naive_recurrent_kda(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
                                  initial_state=h0, output_final_state=True, **kw)
    return o, s


def _model(x, kw, h0, dtype=torch.float64, **opts):
    cast = {n: (t.to(dtype) if t is not None and n not in ("A_log", "dt_bias") else t) for n, t in x.items()}
    return model_fused_prefill(cast["q"], cast["k"], cast["v"], cast["raw_g"], cast["raw_beta"], cast["A_log"],
                               cast["dt_bias"], initial_state=h0, **kw, **opts)


def _errors(x, kw, h0, **opts):
    o_ref, s_ref = _reference(x, kw, h0)
    o, s, flagged = _model(x, kw, h0, **opts)
    return rel_rmse(o, o_ref), rel_rmse(s, s_ref), flagged


CHUNKS = [64, 32]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("gate", list(GATES))
def test_model_without_roundings_is_the_recurrence(gate, chunk):
    """fp64, no roundings: the order of operations is the recurrence, for every gate
    (and the fast softplus gate takes the exact diagonal path in some chunks)."""
    x, kw, h0 = _case(gate)
    e_o, e_s, flagged = _errors(x, kw, h0, round_bf16=False, chunk_size=chunk)
    assert e_o < TOL_EXACT and e_s < TOL_EXACT, (gate, chunk, e_o, e_s)
    if gate == "softplus, fast":
        assert flagged > 0, "the fast softplus case must exercise the exact diagonal path"
    if gate == "bounded L=-5":
        assert flagged == 0, "a bounded gate (L >= -5.45) never needs the exact diagonal path"


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("gate", list(GATES))
def test_model_with_the_kernels_roundings_within_budget(gate, chunk):
    """fp32 arithmetic with the kernel's bf16 roundings, bf16-valued inputs at K = V = 128:
    within the walk's precision budget of the fp64 recurrence; the plain bf16 fold
    (``fold_split=False``, two wgmmas fewer) too, a little worse."""
    x, kw, h0 = _case(gate, lengths=[256, 130], K=128, bf16_values=True)
    e_o, e_s, _ = _errors(x, kw, h0, dtype=torch.float32, chunk_size=chunk)
    assert e_o < TOL_BF16 and e_s < TOL_BF16, (gate, chunk, e_o, e_s)
    p_o, p_s, _ = _errors(x, kw, h0, dtype=torch.float32, fold_split=False, chunk_size=chunk)
    assert p_o < 1.5 * TOL_BF16 and p_s < 1.5 * TOL_BF16, (gate, chunk, p_o, p_s)


@pytest.mark.parametrize("fault, chunk", [(f, c) for c in CHUNKS for f in FAULTS
                                          if f is not None and not (c == 32 and f == "substitution")])
def test_each_planted_fault_is_caught(fault, chunk):
    """Every planted fault breaks the model in fp32 without roundings (the kernel's
    arithmetic range, no bf16 noise to hide in) on at least one gate: NaN (an anchor or
    a flag that lets a factor leave the fp32 range) or an error 100x the clean model's
    (the substitution, the decay)."""
    caught = []
    for gate in GATES:
        x, kw, h0 = _case(gate)
        clean = max(_errors(x, kw, h0, dtype=torch.float32, round_bf16=False, chunk_size=chunk)[:2])
        e_o, e_s, _ = _errors(x, kw, h0, dtype=torch.float32, round_bf16=False, fault=fault, chunk_size=chunk)
        if not (math.isfinite(e_o) and math.isfinite(e_s)) or max(e_o, e_s) > 100 * clean:
            caught.append(gate)
    assert caught, f"fault {fault!r} at chunk {chunk} was caught by no gate"


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("nvalid", [1, 17, 31])
def test_ring_tiles_are_zero_past_the_sequence_end(nvalid, chunk):
    """A chunk's rows past the sequence end belong to the next sequence and may hold NaN
    or inf: the prepared tiles are finite, t_fold's rows and a_fold's columns there
    exactly zero, so the fused walk (``PRODUCER_RING``) needs no tail masking of its ring."""
    g = torch.Generator().manual_seed(nvalid)
    H, K = 2, 32
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    qf, kf, a, beta = rnd(H, chunk, K), rnd(H, chunk, K), -torch.rand(H, chunk, K, generator=g), torch.rand(H, chunk)
    for t, bad in ((qf, float("nan")), (kf, float("inf")), (a, float("nan")), (beta, float("nan"))):
        t[:, nvalid:] = bad
    tiles, decay, _ = _prepare_chunk(qf, kf, a, beta, nvalid, True, True, True, None)
    assert all(torch.isfinite(t).all() for t in tiles.values()) and torch.isfinite(decay).all()
    assert (tiles["t_fold"][:, nvalid:] == 0).all() and (tiles["a_fold"][:, :, nvalid:] == 0).all()
    assert (tiles["t_fold"][:, :nvalid] != 0).any()


def test_gate_forms_match_the_reference():
    """The model's log2 gate is the reference's natural-log gate times log2(e), for the
    bounded and softplus forms; the anchored span limit is the bf16/fp32 normal range."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    A_log, dtb = torch.randn(2, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    for lb in (None, -5.0):
        ref = kda_gate(raw, A_log, dtb, lb) / math.log(2.0)
        assert torch.allclose(log2_gate(raw, A_log, dtb, lb), ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(log2_gate(raw, None, None, None, "log_decay"), raw / math.log(2.0), rtol=1e-12)
    assert MAX_ANCHOR_SPAN <= 126.0


def test_unknown_fault_is_refused():
    x, kw, h0 = _case("bounded L=-5", lengths=[3])
    with pytest.raises(ValueError, match="fault"):
        _model(x, kw, h0, fault="typo")
