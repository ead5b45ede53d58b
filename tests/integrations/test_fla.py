"""kda_engram.integrations.fla: registration in fla-core's registry, the verifier,
and calls through fla's own ``chunk_kda`` / ``fused_recurrent_kda`` that must reach
our kernels (counted, so a silent fallback fails) and match the fp64 recurrence.

Needs the ``fla`` extra (fla-core 0.6.0); CPU: fp32 under the interpreter.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

fla_kda = pytest.importorskip("fla.ops.kda", reason="needs the fla extra: pip install 'kda-engram[fla]'")

from fla.backends import _function_registries, _operation_registries  # noqa: E402
from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402

import kda_engram.integrations.fla as kf  # noqa: E402

from ..helpers import first_fit_autotune  # noqa: E402
from kda_engram.kda.prefill import prefill_verdict  # noqa: E402
from kda_engram.kda.prefill_paths import PrefillCall  # noqa: E402
from kda_engram.kda.reference import kda_gate, naive_recurrent_kda  # noqa: E402

H, K = 2, 32


def backend_of(registry):
    return registry._backends.get("kda_engram")


def inputs(B, T, *, H=H, K=K, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, K), g=rnd(B, T, H, K), beta=rnd(B, T, H))
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}, rnd(H).to(device) * 0.5, rnd(H * K).to(device)


def reference(x, *, cu_seqlens=None, h0_v_first=None, **forms):
    """fp64 recurrence, sequence by sequence for a batch (``[B, T]`` without cu_seqlens)."""
    d = {n: t.double().cpu() for n, t in x.items()}
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    h0 = None if h0_v_first is None else h0_v_first.double().cpu()
    o, f, _ = naive_recurrent_kda(*args, forms.pop("A_log", None), forms.pop("dt_bias", None), cu_seqlens=cu_seqlens,
                                  initial_state=h0, output_final_state=True, **forms)
    return o, f


def close(a, b, atol=3e-4):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double().cpu() - b.double().cpu()).abs().max().item()
    assert err < atol, err


def test_registered_for_chunk_kda_and_the_kda_operations():
    from inspect import unwrap

    assert backend_of(_function_registries[unwrap(chunk_kda)]).priority == kf.PRIORITY
    assert backend_of(_operation_registries["kda"]).priority == kf.PRIORITY


def test_fla_is_not_imported_by_the_package():
    code = "import sys, kda_engram, kda_engram.integrations, kda_engram.integrations.vllm; print('fla' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_chunk_kda_hf_form_is_routed_and_exact():
    """What Hugging Face's Kimi-Linear passes: a log-decay g from the gate, beta
    after its sigmoid, the L2 norm in the kernel, a K-first fp32 state."""
    x, A_log, dt_bias = inputs(2, 70, seed=1)
    x["g"] = kda_gate(x["g"], A_log, dt_bias)
    x["beta"] = x["beta"].sigmoid()
    h0 = torch.randn(2, H, K, K)  # [N, H, K, V]
    before = kf.ROUTED["chunk_kda"]
    with torch.inference_mode():
        o, ht = chunk_kda(**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert kf.ROUTED["chunk_kda"] == before + 1  # served by us, not fla's fallback
    for b in range(2):
        o_ref, f_ref = reference({n: t[b:b + 1] for n, t in x.items()}, h0_v_first=h0[b:b + 1].transpose(-1, -2),
                                 gate="log_decay", beta_sigmoid=False)
        close(o[b:b + 1], o_ref)
        close(ht[b:b + 1], f_ref.transpose(-1, -2))
    assert ht.is_contiguous() and ht.dtype == torch.float32


@pytest.mark.parametrize("a_log", ["given", "none"])
def test_chunk_kda_gate_in_kernel_varlen_v_first_is_routed_and_exact(a_log):
    lengths = [5, 64, 30]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    x, A_log, dt_bias = inputs(1, sum(lengths), seed=2)
    h0 = torch.randn(3, H, K, K)  # V-first
    A = A_log if a_log == "given" else None
    before = kf.ROUTED["chunk_kda"]
    with torch.inference_mode():
        o, ht = chunk_kda(**x, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                          state_v_first=True, cu_seqlens=cu, A_log=A, dt_bias=dt_bias)
    assert kf.ROUTED["chunk_kda"] == before + 1
    o_ref, f_ref = reference(x, cu_seqlens=cu, h0_v_first=h0, A_log=A_log if A is not None else torch.zeros(H),
                             dt_bias=dt_bias, lower_bound=-5.0, qk_l2norm=False)
    close(o, o_ref)
    close(ht, f_ref)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_fused_recurrent_kda_is_routed_and_exact(varlen):
    x, _, _ = inputs(1 if varlen else 3, 12 if varlen else 4, seed=3)
    x["k"] = F.normalize(x["k"], dim=-1)
    x["g"] = F.logsigmoid(x["g"])
    x["beta"] = x["beta"].sigmoid()
    cu = torch.tensor([0, 5, 5, 12]) if varlen else None
    h0 = torch.randn(3, H, K, K)  # [N, H, K, V]
    before = kf.ROUTED["fused_recurrent_kda_fwd"]
    with torch.inference_mode():
        o, ht = fused_recurrent_kda(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert kf.ROUTED["fused_recurrent_kda_fwd"] == before + 1
    if varlen:
        o_ref, f_ref = reference(x, cu_seqlens=cu, h0_v_first=h0.transpose(-1, -2), gate="log_decay",
                                 qk_l2norm=False, beta_sigmoid=False)
        close(o, o_ref)
        close(ht, f_ref.transpose(-1, -2))
    else:
        for b in range(3):
            o_ref, f_ref = reference({n: t[b:b + 1] for n, t in x.items()}, h0_v_first=h0[b:b + 1].transpose(-1, -2),
                                     gate="log_decay", qk_l2norm=False, beta_sigmoid=False)
            close(o[b:b + 1], o_ref)
            close(ht[b:b + 1], f_ref.transpose(-1, -2))


def refusal(function, *args, **kwargs):
    backend = backend_of(_operation_registries["kda"])
    ok, reason = backend.verify(function, *args, **kwargs)
    assert not ok and reason and "\n" not in reason
    return reason


@pytest.mark.filterwarnings("ignore:kda-engram. fla's:RuntimeWarning")  # each refusal's first warning
def test_verifier_refuses_what_we_do_not_serve():
    x, A_log, dt_bias = inputs(1, 8)
    with torch.inference_mode():
        assert backend_of(_operation_registries["kda"]).verify("chunk_kda", **x) == (True, None)
        gva = dict(x, v=torch.randn(1, 8, 2 * H, K), g=torch.randn(1, 8, 2 * H, K), beta=torch.randn(1, 8, 2 * H))
        assert "GVA" in refusal("chunk_kda", **gva)
        wide = inputs(1, 8, K=48)[0]
        assert "K=48" in refusal("chunk_kda", **wide)
        # The prefill registry's answer, in its words (issue 45): what chunk_kda_prefill raises.
        assert refusal("chunk_kda", **wide) == prefill_verdict(PrefillCall(wide["q"], wide["v"]))[1]
        assert "allow_neg_eigval" in refusal("chunk_kda", **x, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
        assert "return_intermediate_states" in refusal("chunk_kda", **x, return_intermediate_states=True)
        assert "context parallelism" in refusal("chunk_kda", **x, cp_context=object())
        assert "per-channel beta" in refusal("chunk_kda", **dict(x, beta=torch.randn(1, 8, H, K)))
        assert "A_log=None needs lower_bound" in refusal("chunk_kda", **x, use_gate_in_kernel=True, dt_bias=dt_bias)
        assert "argument foo" in refusal("chunk_kda", **x, foo=1)
        assert "state-pool form" in refusal("fused_recurrent_kda_fwd", **x, initial_state=torch.zeros(4, H, K, K),
                                            ssm_state_indices=torch.zeros(1, dtype=torch.long))
        assert "K-first" in refusal("fused_recurrent_kda_fwd", **x, initial_state=torch.zeros(1, H, K, K))
    assert "autograd" in refusal("chunk_kda", **x)
    assert kf.REFUSED[("chunk_kda", "kda-engram serves inference only (autograd is on)")] >= 1


def test_env_switch_disables(monkeypatch):
    backend = backend_of(_operation_registries["kda"])
    assert backend.is_enabled()
    monkeypatch.setenv("FLA_KDA_ENGRAM", "0")
    assert not backend.is_enabled()
    x, _, _ = inputs(1, 4)
    before = kf.ROUTED["fused_recurrent_kda_fwd"]
    registry = _operation_registries["kda"]
    assert registry.get_active() is not backend  # fla skips a disabled backend
    assert kf.ROUTED["fused_recurrent_kda_fwd"] == before


# --------------------------------------------------------------------------- GPU

# Our own forward cases with the shapes of fla's tests/ops/test_kda.py
# (test_fused_recurrent, test_chunk, test_chunk_varlen): (B, T, H, D).
FLA_SHAPES = [(1, 63, 1, 64), (2, 500, 3, 60), (2, 1000, 3, 64), (3, 1024, 4, 100), (4, 1024, 4, 128),
              (4, 2048, 8, 64)]
FLA_VARLEN = [[0, 15], [0, 256, 500, 1000], [0, 15, 100, 300, 1200, 2000], [0, 100, 300, 1200, 3000, 4096]]


def _gpu_case(gpu, B, T, Hh, D, seed, cu=None):
    """bf16 inputs of one case. q and k are L2-normalised, as fla's own tests feed
    them: the delta rule with raw ``randn`` keys (|k|^2 ~ D, beta ~ 0.5) grows the
    state by about |1 - beta |k|^2| per step, so fused_recurrent (no in-kernel norm)
    reached inf / NaN in fla and in ours alike at T = 1000 (the tier's failure)."""
    gen = torch.Generator(device=gpu).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=gpu)  # noqa: E731
    x = dict(q=F.normalize(rnd(B, T, Hh, D), dim=-1), k=F.normalize(rnd(B, T, Hh, D), dim=-1), v=rnd(B, T, Hh, D),
             g=F.logsigmoid(rnd(B, T, Hh, D)), beta=rnd(B, T, Hh).sigmoid())
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    N = B if cu is None else len(cu) - 1
    return x, rnd(N, Hh, D, D)


def _run(fn, monkeypatch, enabled, **kw):
    monkeypatch.setenv("FLA_KDA_ENGRAM", "1" if enabled else "0")
    with torch.inference_mode():
        return fn(**kw)


# One test per (op, case), so the tier spreads fla's and our compiles over its workers
# (the cases of one op in one test took up to 404 s on one worker).
_FLA_GPU_CASES = ([("fused_recurrent", B, T, Hh, D, None) for B, T, Hh, D in FLA_SHAPES]
                  + [("chunk", B, T, Hh, D, None) for B, T, Hh, D in FLA_SHAPES]
                  + [("chunk_varlen", 1, cu[-1], 4, 128, cu) for cu in FLA_VARLEN])


@pytest.mark.gpu
@pytest.mark.parametrize("op, B, T, Hh, D, cu", _FLA_GPU_CASES,
                         ids=[f"{c[0]}-B{c[1]}-T{c[2]}-H{c[3]}-D{c[4]}" + (f"-N{len(c[5]) - 1}" if c[5] else "")
                              for c in _FLA_GPU_CASES])
def test_gpu_fla_forward_case_routed(gpu, monkeypatch, op, B, T, Hh, D, cu):
    """One of fla's forward cases under inference mode with our backend active:
    routed to us (counted) and as close to fla's own kernels as the bf16 outputs
    allow, or refused with a reason (head dims 60 / 100); a K = V = 128 case is
    always routed. fla's autotuners take their first config (speed is not checked
    here)."""
    seed = FLA_SHAPES.index((B, T, Hh, D)) if cu is None else FLA_VARLEN.index(cu)
    x, h0 = _gpu_case(gpu, B, T, Hh, D, seed, cu)
    kw = dict(x, initial_state=h0, output_final_state=True)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.long, device=gpu)
    name, fn = (("fused_recurrent_kda_fwd", fused_recurrent_kda) if op == "fused_recurrent"
                else ("chunk_kda", chunk_kda))
    if op != "fused_recurrent":
        kw["use_qk_l2norm_in_kernel"] = True
    with first_fit_autotune():
        before = kf.ROUTED[name]
        o, ht = _run(fn, monkeypatch, True, **kw)
        took = kf.ROUTED[name] - before
        o_fla, ht_fla = _run(fn, monkeypatch, False, **kw)
    assert kf.ROUTED[name] == before + took
    if not took:
        reasons = [r for (f, r) in kf.REFUSED if f == name]
        assert D != 128 and reasons, (D, reasons)
        print(f"\nfell back {op} B={B} T={T} H={Hh} D={D}: {reasons[-1]}")
        return
    for who, out, state in (("fla", o_fla, ht_fla), ("kda-engram", o, ht)):
        assert torch.isfinite(out).all() and torch.isfinite(state).all(), f"{who}: non-finite output or state"
    err = (o.float() - o_fla.float()).abs().max().item() / max(o_fla.float().abs().max().item(), 1e-6)
    err_h = (ht.float() - ht_fla.float()).abs().max().item() / max(ht_fla.float().abs().max().item(), 1e-6)
    print(f"\nrouted {op} B={B} T={T} H={Hh} D={D}: rel err o {err:.2e}, state {err_h:.2e}")
    assert err < 2e-2 and err_h < 2e-2, (B, T, Hh, D, err, err_h)


def test_a_refusal_is_counted_with_its_reason_and_warned_once():
    """Issue 46: a refusal was only visible with fla's logging at INFO."""
    import warnings

    x, _, _ = inputs(1, 8)
    key = ("chunk_kda", "argument issue46_probe not served")
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="chunk_kda runs on fla's own kernels: argument issue46_probe"):
            refusal("chunk_kda", **x, issue46_probe=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same reason again: counted, not warned
            refusal("chunk_kda", **x, issue46_probe=1)
    assert kf.REFUSED[key] == 2


def test_a_positive_log_decay_through_fla_is_an_error_naming_the_gate():
    """Issue 46: fla's chunk_kda with g = randn (not a log decay) was served and
    returned all-NaN with no error."""
    from kda_engram import raise_pending_errors

    x, _, _ = inputs(1, 70, seed=5)
    h0 = torch.randn(1, H, K, K)
    with torch.inference_mode(), pytest.raises(ValueError, match="raw_g: with gate='log_decay'") as info:
        chunk_kda(**x, initial_state=h0, output_final_state=True)
        raise_pending_errors()
    assert "\n" not in str(info.value)


def test_a_missing_dependency_of_fla_is_named():
    """Issue 46: fla-core installed but ``packaging`` missing said "needs fla-core"."""
    code = ("import sys\nsys.modules['packaging'] = None\n"
            "try:\n    import kda_engram.integrations.fla\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "fla-core is installed but importing it failed" in out and "pip install packaging" in out, out
