"""The input forms of the KDA entry points, against the fp64 recurrence.

``gate="log_decay"`` (a precomputed per-channel log decay instead of the raw gate
with ``A_log``/``dt_bias``: what fla's ``chunk_kda`` and Hugging Face's Kimi-Linear
pass), ``qk_l2norm=False`` (q, k normalised by the caller) and
``beta_sigmoid=False`` (beta after its sigmoid), for ``chunk_kda_prefill``,
``kda_decode`` and ``kda_decode_multi``. CPU: fp32 under the interpreter; GPU: bf16.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kda_engram.kda.decode import kda_decode, kda_decode_multi
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.kda.reference import kda_gate, naive_recurrent_kda

H, K = 2, 32
LENGTHS = [1, 63, 70]
ATOL = 3e-4


def forms_inputs(lead, *, gate, qk_l2norm, beta_sigmoid, strong=False, seed=0, dtype=torch.float32,
                 device="cpu", K=K):
    """Inputs ``[*lead, H, K]`` in the requested forms, and the matching fp64 copies."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=rnd(*lead, H, K), k=rnd(*lead, H, K), v=rnd(*lead, H, K), raw_g=rnd(*lead, H, K) * 2.0,
             raw_beta=rnd(*lead, H))
    A_log, dt_bias = rnd(H) * 0.5, rnd(H * K)
    if gate == "log_decay":
        x["raw_g"] = kda_gate(x["raw_g"], A_log, dt_bias)  # what a separate gate kernel hands over
        if strong:  # decays far past fp32's exp range, and a full reset
            flat = x["raw_g"].view(-1)
            flat[::7] = -1e4
            flat[3::11] = -math.inf
        A_log = dt_bias = None
    if not qk_l2norm:
        x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    if not beta_sigmoid:
        x["raw_beta"] = torch.sigmoid(x["raw_beta"])
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    x["A_log"] = None if A_log is None else A_log.to(device)
    x["dt_bias"] = None if dt_bias is None else dt_bias.to(device)
    forms = dict(gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid)
    return x, forms


def as64(x):
    return {n: None if t is None else t.double().cpu() for n, t in x.items()}


def close(a, b, atol=ATOL):
    assert a.shape == b.shape
    assert torch.isfinite(a).all()
    err = (a.double().cpu() - b.double().cpu()).abs().max().item() if a.numel() else 0.0
    assert err < atol, err


FORMS = [
    ("log_decay", True, True, False),
    ("log_decay", True, True, True),
    ("log_decay", False, False, False),
    ("raw", False, True, False),
    ("raw", True, False, False),
]
FORM_IDS = ["log_decay", "log_decay_strong", "log_decay_prenormed_beta", "raw_prenormed", "raw_beta_sigmoid_given"]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_prefill_forms_match_fp64_recurrence(form):
    gate, l2, sig, strong = form
    T = sum(LENGTHS)
    x, forms = forms_inputs((1, T), gate=gate, qk_l2norm=l2, beta_sigmoid=sig, strong=strong, seed=1)
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    h0 = torch.randn(len(LENGTHS), H, K, K, generator=torch.Generator().manual_seed(2))
    o, final = chunk_kda_prefill(**x, cu_seqlens=cu, initial_state=h0, output_final_state=True, **forms)
    o_ref, f_ref, _ = naive_recurrent_kda(**as64(x), cu_seqlens=cu, initial_state=h0.double(),
                                          output_final_state=True, **forms)
    close(o, o_ref)
    close(final, f_ref)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_decode_forms_match_fp64_recurrence(form):
    gate, l2, sig, strong = form
    B, S, slots = 3, 4, 32
    x, forms = forms_inputs((B, S), gate=gate, qk_l2norm=l2, beta_sigmoid=sig, strong=strong, seed=3)
    h0 = torch.randn(B, H, K, K, generator=torch.Generator().manual_seed(4))
    o_ref, _, _ = naive_recurrent_kda(**as64(x), initial_state=h0.double(), **forms)
    # One token at a time through kda_decode, then all S through kda_decode_multi.
    cache = torch.zeros(slots, H, K, K)
    rows = torch.tensor([5, 0, 9])
    cache[rows] = h0
    for s in range(S):
        o = kda_decode(**{n: t[:, s] if t is not None and t.dim() > 1 else t for n, t in x.items()},
                       state_cache=cache, state_indices=rows, **forms)
        close(o, o_ref[:, s])
    multi = torch.zeros(slots, H, K, K)
    multi[rows] = h0
    idx = torch.stack([rows] + [torch.arange(3) + 10 + 3 * s for s in range(1, S)], 1)  # distinct rows
    o = kda_decode_multi(**x, state_cache=multi, state_indices=idx, **forms)
    close(o, o_ref)
    close(multi[idx[:, -1]], cache[rows], atol=1e-5)


def test_bad_forms():
    x, _ = forms_inputs((1, 4), gate="raw", qk_l2norm=True, beta_sigmoid=True)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="gate: expected one of"):
        chunk_kda_prefill(**x, cu_seqlens=cu, gate="softplus")
    with pytest.raises(ValueError, match="A_log: expected None with gate='log_decay'"):
        chunk_kda_prefill(**x, cu_seqlens=cu, gate="log_decay")
    with pytest.raises(ValueError, match="lower_bound: expected None with gate='log_decay'"):
        chunk_kda_prefill(**{**x, "A_log": None, "dt_bias": None}, cu_seqlens=cu, gate="log_decay",
                          lower_bound=-5.0)
    with pytest.raises(ValueError, match="dt_bias: required with gate='raw'"):
        chunk_kda_prefill(**{**x, "dt_bias": None}, cu_seqlens=cu)
    with pytest.raises(TypeError, match="qk_l2norm: expected a bool"):
        chunk_kda_prefill(**x, cu_seqlens=cu, qk_l2norm=1)
    d = {n: t[0] if t is not None and t.dim() > 1 else t for n, t in x.items()}
    cache = torch.zeros(4, H, K, K)
    with pytest.raises(ValueError, match="A_log: expected None with gate='log_decay'"):
        kda_decode(**d, state_cache=cache, state_indices=torch.tensor([0, 1, 2, 3])[:4], gate="log_decay")
    with pytest.raises(TypeError, match="beta_sigmoid: expected a bool"):
        kda_decode_multi(**{n: t[None] if t is not None and t.dim() > 1 else t for n, t in d.items()},
                         state_cache=cache, state_indices=torch.zeros(1, 4, dtype=torch.long),
                         beta_sigmoid="no", check_inputs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gpu_bf16_forms_match_fp64_recurrence(gpu, form):
    gate, l2, sig, strong = form
    lengths = [1, 300, 1000]
    x, forms = forms_inputs((1, sum(lengths)), gate=gate, qk_l2norm=l2, beta_sigmoid=sig, strong=strong, seed=5,
                            dtype=torch.bfloat16, device=gpu, K=128)
    cu = torch.tensor([0] + lengths, device=gpu).cumsum(0)
    o, final = chunk_kda_prefill(**x, cu_seqlens=cu, output_final_state=True, **forms)
    o_ref, f_ref, _ = naive_recurrent_kda(**as64(x), cu_seqlens=cu.cpu(), output_final_state=True, **forms)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    scale = o_ref.abs().max().item()
    assert (o.double().cpu() - o_ref).abs().max().item() < 2e-2 * scale
    assert (final.double().cpu() - f_ref).abs().max().item() < 2e-2 * f_ref.abs().max().item()
    B, S = 8, 3
    x, forms = forms_inputs((B, S), gate=gate, qk_l2norm=l2, beta_sigmoid=sig, strong=strong, seed=6,
                            dtype=torch.bfloat16, device=gpu, K=128)
    cache = torch.zeros(B * S, H, 128, 128, device=gpu)
    idx = torch.arange(B * S, device=gpu).view(B, S)
    o = kda_decode_multi(**x, state_cache=cache, state_indices=idx, **forms)
    o_ref, f_ref, _ = naive_recurrent_kda(**as64(x), output_final_state=True, **forms)
    assert (o.double().cpu() - o_ref).abs().max().item() < 2e-2 * o_ref.abs().max().item()
    assert (cache[idx[:, -1]].double().cpu() - f_ref).abs().max().item() < 2e-2 * f_ref.abs().max().item()
