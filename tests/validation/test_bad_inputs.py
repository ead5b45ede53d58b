"""Every bad input of issue 27 gets a one-line ValueError/TypeError naming the
argument, or a correct result (CPU: kernels under the Triton interpreter)."""

import math

import numpy as np
import pytest
import torch

from kda_engram import platform
from kda_engram.engram.gate import engram_post_wkv
from kda_engram.engram.table import EngramTable
from kda_engram.kda.chunk import kda_prefill_walk
from kda_engram.kda.conv import kda_conv_decode
from kda_engram.kda.decode import kda_decode, kda_decode_multi
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.kda.reference import naive_chunk_operands, naive_recurrent_kda

from ..helpers import raw_kda_inputs, refused

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

H, K, V = 1, 16, 16


def rnd(gen, *shape):
    return torch.randn(*shape, generator=gen)


def prefill_raw(T, seed=0):
    return raw_kda_inputs((1, T), H, K, V, seed)


def decode_raw(B, S=None, seed=0):
    return raw_kda_inputs((B,) if S is None else (B, S), H, K, V, seed)


def gate_inputs(T=4, hc=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=rnd(gen, T, hc, dim), kv=rnd(gen, T, (hc + 1) * dim), q_weight=rnd(gen, hc, dim),
                k_weight=rnd(gen, hc, dim))


def one_line(info, name):
    text = str(info.value)
    assert "\n" not in text and text.startswith(name), text


# ------------------------------------------------------------------------------ scalars


@pytest.mark.parametrize("kw, exc, name", [
    (dict(eps=math.nan), ValueError, "eps"),
    (dict(eps=math.inf), ValueError, "eps"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(eps=1e-6, clamp_value=math.nan), ValueError, "clamp_value"),
    (dict(eps="1e-6"), TypeError, "eps"),
])
def test_engram_post_wkv_scalars(kw, exc, name):
    with pytest.raises(exc) as info:
        engram_post_wkv(**gate_inputs(), **kw)
    one_line(info, name)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(scale=math.nan), ValueError, "scale"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(lower_bound=math.nan), ValueError, "lower_bound"),
    (dict(lower_bound=1.0), ValueError, "lower_bound"),
    (dict(lower_bound="x"), TypeError, "lower_bound"),
])
def test_kda_decode_scalars(kw, exc, name):
    cache = torch.zeros(2, H, V, K)
    with pytest.raises(exc) as info:
        kda_decode(**decode_raw(2), state_cache=cache, state_indices=torch.tensor([0, 1]), **kw)
    one_line(info, name)
    with pytest.raises(exc):
        kda_decode_multi(**decode_raw(2, 2), state_cache=torch.zeros(4, H, V, K),
                         state_indices=torch.tensor([[0, 1], [2, 3]]), **kw)


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0])
def test_kda_prefill_walk_scale(scale):
    raw = prefill_raw(8)
    cu = torch.tensor([0, 8])
    ops = naive_chunk_operands(**raw, cu_seqlens=cu)
    with pytest.raises(ValueError) as info:
        kda_prefill_walk(ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"], torch.zeros(1, 8, H, V),
                        scale, cu, None, False)
    one_line(info, "scale")


def test_prefill_scalars():
    raw = prefill_raw(8)
    for kw, name in ((dict(scale=math.nan), "scale"), (dict(lower_bound=math.inf), "lower_bound")):
        with pytest.raises(ValueError) as info:
            chunk_kda_prefill(**raw, cu_seqlens=torch.tensor([0, 8]), **kw)
        one_line(info, name)


# --------------------------------------------------------------------------- decode S = 0


def test_decode_multi_zero_steps_is_empty():
    """S = 0 is a valid, empty call: [B, 0, H, V] out, no state row touched."""
    cache = torch.randn(3, H, V, K)
    before = cache.clone()
    out = kda_decode_multi(**decode_raw(2, 0), state_cache=cache, state_indices=torch.zeros(2, 0, dtype=torch.int64))
    assert out.shape == (2, 0, H, V)
    assert torch.equal(cache, before)
    out = kda_decode_multi(**decode_raw(2, 0), state_cache=cache, state_indices=torch.zeros(2, 0, dtype=torch.int64),
                           initial_state_indices=torch.tensor([0, 1]))
    assert out.shape == (2, 0, H, V)
    assert torch.equal(cache, before)


# ------------------------------------------------------------------------------ table


def test_table_fp8_refuses_non_finite_weights():
    table = EngramTable([4, 4], 32, storage="fp8", device="cpu")
    good = torch.randn(8, 32)
    table.load_(good)
    w0, s0 = table.weight.clone(), table.scale.clone()
    for bad_value in (math.nan, math.inf):
        bad = good.clone()
        bad[5, 3] = bad_value
        with pytest.raises(ValueError) as info:
            table.load_(bad)
        one_line(info, "weight")
        assert torch.equal(table.weight, w0) and torch.equal(table.scale, s0)  # nothing written


def test_table_column_sizes_must_be_ints():
    with pytest.raises(TypeError) as info:
        EngramTable([5.5, 3], 32, device="cpu")
    one_line(info, "column_sizes")
    assert np.array_equal(EngramTable([np.int64(5), 3], 32, device="cpu").column_sizes, [5, 3])


# ----------------------------------------------------------------- CPU without interpreter


def test_cpu_tensors_without_interpreter(monkeypatch):
    """One line that says what to do, from the shared rule, before Triton is reached."""
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    calls = [
        lambda: kda_decode(**decode_raw(2), state_cache=torch.zeros(2, H, V, K), state_indices=torch.tensor([0, 1])),
        lambda: chunk_kda_prefill(**prefill_raw(8), cu_seqlens=torch.tensor([0, 8])),
        lambda: engram_post_wkv(**gate_inputs(), eps=1e-6),
        lambda: kda_conv_decode(torch.zeros(2, 8), torch.zeros(8, 4), torch.zeros(2, 8, 3), torch.tensor([0, 1])),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="CUDA/ROCm device.*TRITON_INTERPRET=1") as info:
            call()
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------- non-finite gate / inputs


def test_prefill_softplus_gate_plus_inf_stays_finite():
    """A +inf raw gate decays the state to exactly zero, as decode and the reference do."""
    T = 70
    raw = prefill_raw(T, seed=1)
    raw["raw_g"][0, 10, 0, 3] = math.inf
    raw["raw_g"][0, 66, 0, 5] = math.inf
    cu = torch.tensor([0, T])
    o, f = chunk_kda_prefill(**raw, cu_seqlens=cu, output_final_state=True)
    o_ref, f_ref, _ = naive_recurrent_kda(**raw, cu_seqlens=cu, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(f).all()
    assert (o.double() - o_ref.double()).abs().max() < 3e-4
    assert (f.double() - f_ref.double()).abs().max() < 3e-4


@pytest.mark.parametrize("name", ["k", "v"])
def test_prefill_nan_input_poisons_its_chunk_only_from_its_start(name):
    """Pinned, and documented in the prefill docstring: a NaN at token 80 reaches
    tokens 64..79 (its chunk is solved as one system); tokens < 64 stay clean."""
    T = 100
    raw = prefill_raw(T, seed=2)
    raw[name][0, 80] = math.nan
    o, _ = chunk_kda_prefill(**raw, cu_seqlens=torch.tensor([0, T]))
    finite = torch.isfinite(o[0]).all(-1).all(-1)
    assert finite[:64].all()
    assert not finite[64:].any()


def test_table_rows_outside_their_column():
    table = EngramTable([4, 4], 32, device="cpu").load_(torch.randn(8, 32))
    rows = torch.tensor([[0, 4], [5, 7], [-1, -1]])
    with refused(ValueError) as info:
        table.lookup(rows)
    one_line(info, "rows")
    assert "entry [1, 0] = 5 lies outside hash column 0's table [0, 4)" in str(info.value)
    assert table.lookup(torch.tensor([[3, 4], [-1, 7]])).shape[0] == 2


# ------------------------------------------------------------------------- issue 46


def test_an_input_that_requires_grad_is_refused_under_grad_mode():
    """kda-engram is forward-only: an input that asks for a gradient is refused in one
    line (it used to come back as an output with no grad_fn), under no_grad it runs."""
    x = prefill_raw(8)
    x["q"] = x["q"].clone().requires_grad_()
    cu = torch.tensor([0, 8])
    with pytest.raises(ValueError) as info:
        chunk_kda_prefill(**x, cu_seqlens=cu)
    one_line(info, "q")
    assert "forward-only" in str(info.value)
    with torch.no_grad():
        out, _ = chunk_kda_prefill(**x, cu_seqlens=cu)
    assert out.grad_fn is None
    d = decode_raw(2)
    d["raw_beta"] = d["raw_beta"].clone().requires_grad_()
    cache = torch.zeros(2, H, V, K)
    with pytest.raises(ValueError) as info:
        kda_decode(**d, state_cache=cache, state_indices=torch.tensor([0, 1]))
    one_line(info, "raw_beta")
    assert torch.equal(cache, torch.zeros_like(cache))


def test_a_tensor_on_meta_is_blamed_itself():
    x = prefill_raw(8)
    x["q"] = x["q"].to("meta")
    with pytest.raises(ValueError) as info:
        chunk_kda_prefill(**x, cu_seqlens=torch.tensor([0, 8]))
    one_line(info, "q")
    assert "meta" in str(info.value)


def test_allocate_cache_names_a_negative_slot_count():
    from kda_engram.layers.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(hidden_size=32, num_heads=1, head_dim=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError) as info:
        layer.allocate_cache(-1)
    one_line(info, "slots")
    with pytest.raises(TypeError) as info:
        layer.allocate_cache(2.5)
    one_line(info, "slots")
