"""The vLLM plugin against vLLM 0.33.0's own kernel-call code (CPU, fp32, interpreter).

vLLM's files come from its wheel (``tests/integrations/vllm_wheel.py``: fetched with
``pip download --no-deps``, extracted to a temporary folder, a few modules outside
the kernel-call code stubbed; skipped with the reason when the wheel cannot be
had). Each test calls the name vLLM's layer calls, once as vLLM ships it and once
after the plugin replaced it, with the same arguments, and compares within 1e-5.
"""

import inspect
import logging
import math
import os
import sys

import pytest
import torch

from kda_engram.integrations import vllm_plugin

from ..helpers import free_port
from .vllm_wheel import vllm_kernels_on_cpu, vllm_root  # noqa: F401 (vllm_root: a fixture)

H, K = 2, 32
ATOL = 1e-5
AMD_PREFILL = "vllm.models.kimi_k3.amd.ops.kda_prefill"
VENDOR_KDA = {v: f"vllm.models.kimi_k3.{v}.ops.third_party.kda" for v in ("amd", "nvidia")}


def rnd(*s, seed=0):
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item()
    assert err < atol, f"max abs error {err:.3g} >= {atol}"


def _targets():
    import importlib

    for module_name, name, _, importers in vllm_plugin.REPLACEMENTS:
        for m in (module_name, *importers):
            try:
                module = importlib.import_module(m)
            except ImportError:
                continue
            try:
                owner, attribute = vllm_plugin.resolve(module, name)
            except AttributeError:
                continue
            if hasattr(owner, attribute):
                yield module, name


@pytest.fixture
def vllm_own(vllm_root):  # noqa: F811
    """vLLM's own functions (before any replacement), by ``(module, name)``; every
    target restored and the plugin's per-process state reset afterwards."""
    saved = {(m.__name__, n): getattr(*vllm_plugin.resolve(m, n)) for m, n in _targets()}
    vllm_plugin._reset()
    yield saved
    vllm_plugin._reset()
    for (m, n), f in saved.items():
        if m in sys.modules:
            setattr(*vllm_plugin.resolve(sys.modules[m], n), f)


@pytest.fixture
def plugin_on(vllm_own, monkeypatch):
    monkeypatch.setenv(vllm_plugin.SWITCH, "all")
    vllm_plugin.register()
    return vllm_own


def current(module_name, name):
    return getattr(*vllm_plugin.resolve(sys.modules[module_name], name))


# ------------------------------------------------------------------- the switch


def test_the_entry_point_is_declared_and_resolves():
    """vLLM finds the plugin through this entry point group (``vllm.plugins.
    load_general_plugins``); it must name ``register``."""
    import importlib
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["kda_engram"]
    module, attribute = target.split(":")
    assert getattr(importlib.import_module(module), attribute) is vllm_plugin.register



def test_the_switch_off_changes_nothing(vllm_own, monkeypatch, caplog):
    monkeypatch.delenv(vllm_plugin.SWITCH, raising=False)
    with caplog.at_level(logging.INFO, logger="vllm"):
        vllm_plugin.register()
    assert vllm_plugin.replaced() == [] and caplog.records == []
    assert all(current(m, n) is f for (m, n), f in vllm_own.items())


def test_another_vllm_version_is_refused_with_one_warning(vllm_own, monkeypatch, caplog):
    import vllm

    monkeypatch.setenv(vllm_plugin.SWITCH, "1")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.INFO, logger="vllm"):
        vllm_plugin.register()
        vllm_plugin.register()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "serves vLLM 0.33.x, found 0.34.0: nothing replaced" in caplog.records[0].getMessage()
    assert all(current(m, n) is f for (m, n), f in vllm_own.items())


def test_the_switch_on_replaces_and_logs_once(vllm_own, monkeypatch, caplog):
    from kda_engram.integrations import vllm_kimi_k3

    monkeypatch.setenv(vllm_plugin.SWITCH, "all")
    with caplog.at_level(logging.INFO, logger="vllm"):
        vllm_plugin.register()
        vllm_plugin.register()
    assert len(caplog.records) == 1 and caplog.records[0].levelname == "INFO"
    assert current(AMD_PREFILL, "chunk_kda_prefill") is vllm_kimi_k3.chunk_kda_prefill
    for module_name, name, our_name, importers in vllm_plugin.REPLACEMENTS:
        ours = vllm_plugin._ours(our_name)
        assert current(module_name, name) is ours, (module_name, name)
        # The package attributes are what the layers (Kimi-Linear at each forward) import.
        for importer in importers:
            if importer in sys.modules:
                assert current(importer, name) is ours, (importer, name)
    assert current(VENDOR_KDA["nvidia"], "fused_recurrent_kda") is vllm_kimi_k3.fused_recurrent_kda_nvidia
    assert current("vllm.models.kimi_k3.amd.ops.kda_chunk", "is_fused_kda_chunk_supported")() is True
    assert set(vllm_plugin.replaced()) == {f"{m}.{n}" for m, n, _, _ in vllm_plugin.REPLACEMENTS}
    assert all(t in caplog.records[0].getMessage() for t in vllm_plugin.replaced())


def test_the_default_switch_keeps_vllms_kernels_where_ours_is_slower(vllm_own, monkeypatch, caplog):
    """``KDA_ENGRAM_VLLM=1``: the calls of ``KEPT_BY_DEFAULT`` (measured slower) stay
    vLLM's and the log line names them; every other target is replaced."""
    monkeypatch.setenv(vllm_plugin.SWITCH, "1")
    with caplog.at_level(logging.INFO, logger="vllm"):
        vllm_plugin.register()
    every = {f"{m}.{n}" for m, n, _, _ in vllm_plugin.REPLACEMENTS}
    assert set(vllm_plugin.KEPT_BY_DEFAULT) < every
    assert set(vllm_plugin.replaced()) == every - set(vllm_plugin.KEPT_BY_DEFAULT)
    for module_name, name, our_name, importers in vllm_plugin.REPLACEMENTS:
        kept = f"{module_name}.{name}" in vllm_plugin.KEPT_BY_DEFAULT
        assert (current(module_name, name) is vllm_own[(module_name, name)]) is kept, (module_name, name)
        for importer in importers:
            if importer in sys.modules and (importer, name) in vllm_own:
                assert (current(importer, name) is vllm_own[(importer, name)]) is kept, (importer, name)
    message = caplog.records[0].getMessage()
    assert "kept vLLM's, where ours measured slower" in message
    assert all(t in message for t in vllm_plugin.KEPT_BY_DEFAULT)


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
@pytest.mark.parametrize("value", ["1", "all"])
def test_the_default_switch_hands_softplus_prefills_to_vllm(vllm_own, monkeypatch, vendor, value):
    """``KEPT_CALLS``: with ``1`` a ``chunk_kda_with_fused_gate`` call with the softplus
    gate (``lower_bound`` None, by keyword or in its positional place) reaches vLLM's
    own function and a bounded one ours; with ``all`` both reach ours."""
    from kda_engram.integrations import vllm_kimi_k3

    module = f"{VENDOR_KDA[vendor]}.chunk"
    seen = []
    theirs = lambda *a, **kw: seen.append("vllm") or "vllm"  # noqa: E731
    monkeypatch.setattr(sys.modules[module], "chunk_kda_with_fused_gate", theirs)
    monkeypatch.setattr(vllm_kimi_k3, "chunk_kda_prefill", lambda *a, **kw: seen.append("ours") or ("ours", None))
    monkeypatch.setenv(vllm_plugin.SWITCH, value)
    vllm_plugin.register()
    fn = current(module, "chunk_kda_with_fused_gate")
    args = [None] * 7
    fn(*args, lower_bound=None)
    fn(*args, None, None, False, None)  # lower_bound positional
    fn(*args)  # lower_bound left out: the softplus gate
    fn(*args, lower_bound=-5.0)
    fn(*args, None, None, False, -5.0)
    softplus = "vllm" if value == "1" else "ours"
    assert seen == [softplus] * 3 + ["ours"] * 2


@pytest.mark.parametrize("value", ["yes", "2", "fast"])
def test_an_unknown_switch_value_changes_nothing_with_one_warning(vllm_own, monkeypatch, caplog, value):
    monkeypatch.setenv(vllm_plugin.SWITCH, value)
    with caplog.at_level(logging.INFO, logger="vllm"):
        vllm_plugin.register()
    assert vllm_plugin.replaced() == []
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "none of 1, all or 0" in caplog.records[0].getMessage()
    assert all(current(m, n) is f for (m, n), f in vllm_own.items())


def test_a_module_vllm_imports_later_is_replaced_as_it_is_imported(vllm_own, monkeypatch):
    """The plugin imports none of vLLM's model modules: a target imported after it
    registered is patched as it loads, before the modules that import its names read
    them (the package ``ops/third_party/kda`` binds the replaced names)."""
    from kda_engram.integrations import vllm_kimi_k3

    later = [m for m in sys.modules if m.startswith(VENDOR_KDA["nvidia"])]
    for m in later:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setenv(vllm_plugin.SWITCH, "all")
    vllm_plugin.register()
    assert not any(r.startswith(VENDOR_KDA["nvidia"]) for r in vllm_plugin.replaced())
    import importlib

    package = importlib.import_module(VENDOR_KDA["nvidia"])
    assert package.fused_recurrent_kda is vllm_kimi_k3.fused_recurrent_kda_nvidia
    assert package.chunk_kda_with_fused_gate is vllm_kimi_k3.chunk_kda_with_fused_gate_nvidia
    assert package.fused_recurrent_kda_packed_decode is vllm_kimi_k3.fused_recurrent_kda_packed_decode
    assert any(r.startswith(VENDOR_KDA["nvidia"]) for r in vllm_plugin.replaced())


def test_the_signatures_are_vllms(vllm_own):
    from kda_engram.integrations import vllm_kimi_k3

    def params(f):
        return [(p.name, p.default, p.kind) for p in inspect.signature(f).parameters.values()]

    assert params(vllm_kimi_k3.chunk_kda_prefill) == params(vllm_own[(AMD_PREFILL, "chunk_kda_prefill")])
    ours = params(vllm_kimi_k3.fused_recurrent_kda_packed_decode)
    amd = params(vllm_own[(VENDOR_KDA["amd"], "fused_recurrent_kda_packed_decode")])
    nvidia = params(vllm_own[(VENDOR_KDA["nvidia"], "fused_recurrent_kda_packed_decode")])
    assert ours == nvidia and ours[:len(amd)] == amd  # NVIDIA's copy adds `out` at the end
    assert params(vllm_kimi_k3.fused_recurrent_kda) == params(vllm_own[(VENDOR_KDA["amd"], "fused_recurrent_kda")])
    assert params(vllm_kimi_k3.chunk_kda_with_fused_gate) == params(
        vllm_own[(VENDOR_KDA["amd"], "chunk_kda_with_fused_gate")])
    assert params(vllm_kimi_k3.chunk_kda_with_fused_gate_nvidia) == params(
        vllm_own[(VENDOR_KDA["nvidia"], "chunk_kda_with_fused_gate")])
    # The Engram launch: the kernel's own arguments, after the grid, plus num_warps.
    from kda_engram.integrations import vllm_deepseek_v41

    names = [n for n, _, _ in params(vllm_deepseek_v41.fused_engram_post_wkv)]
    assert names == ["grid", *vllm_own[(ENGRAM, "_fused_engram_post_wkv_kernel")].arg_names, "num_warps"]
    assert params(vllm_kimi_k3.fused_recurrent_kda_nvidia) == params(
        vllm_own[(VENDOR_KDA["nvidia"], "fused_recurrent_kda")])


# ------------------------------------------------------------------- prefill


def prefill_inputs(lengths, seed=0):
    T = sum(lengths)
    q, k, v, raw_g = (rnd(1, T, H, K, seed=seed + i) for i in range(4))
    raw_beta, A_log, g_bias = rnd(1, T, H, seed=seed + 4), rnd(H, seed=seed + 5) * 0.5, rnd(H * K, seed=seed + 6)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return q, k, v, raw_g, raw_beta, A_log, g_bias, cu


@pytest.mark.parametrize("lower_bound, l2norm", [(-5.0, True), (None, True), (-5.0, False)])
def test_prefill_matches_vllms_triton_path(plugin_on, lower_bound, l2norm):
    q, k, v, raw_g, raw_beta, A_log, g_bias, cu = prefill_inputs([3, 70, 20])
    if not l2norm:  # the caller normalised them
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    h0 = rnd(3, H, K, K, seed=9)
    kw = dict(initial_state=h0, output_final_state=True, lower_bound=lower_bound, use_qk_l2norm_in_kernel=l2norm,
              cu_seqlens=cu)
    with vllm_kernels_on_cpu():
        # vLLM's Triton path writes its output over v: it gets a copy.
        o_vllm, f_vllm = plugin_on[(AMD_PREFILL, "chunk_kda_prefill")](q, k, v.clone(), raw_g, raw_beta, A_log,
                                                                        g_bias, **kw)
    v_before = v.clone()
    o, f = current(AMD_PREFILL, "chunk_kda_prefill")(q, k, v, raw_g, raw_beta, A_log, g_bias, **kw)
    close(o, o_vllm)
    close(f, f_vllm)
    assert f.dtype == f_vllm.dtype == torch.float32
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("vendor", ["amd", "nvidia"])
def test_chunk_kda_with_fused_gate_matches_vllms(plugin_on, vendor):
    """The NVIDIA Kimi-K3 layer's and Kimi-Linear's prefill call (``out`` is the
    NVIDIA copy's argument)."""
    q, k, v, raw_g, raw_beta, A_log, g_bias, cu = prefill_inputs([3, 70, 20], seed=50)
    h0 = rnd(3, H, K, K, seed=59)
    T = q.shape[1]
    results = []
    for fn in (plugin_on[(VENDOR_KDA[vendor], "chunk_kda_with_fused_gate")],
               current(VENDOR_KDA[vendor], "chunk_kda_with_fused_gate")):
        out = torch.full((1, T, H, K), math.nan) if vendor == "nvidia" else None
        kw = {} if out is None else dict(out=out)
        with vllm_kernels_on_cpu():
            o, f = fn(q=q, k=k, v=v.clone(), raw_g=raw_g, raw_beta=raw_beta, A_log=A_log, g_bias=g_bias,
                      lower_bound=-5.0, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=cu, **kw)
        if out is not None:
            assert o.data_ptr() == out.data_ptr()
        results.append((o, f))
    (o_vllm, f_vllm), (o, f) = results
    close(o, o_vllm)
    close(f, f_vllm)
    assert f.dtype == f_vllm.dtype


def test_chunk_kda_with_fused_gate_refuses_keywords_it_does_not_serve(plugin_on):
    q, k, v, raw_g, raw_beta, A_log, g_bias, cu = prefill_inputs([3])
    with pytest.raises(TypeError) as info:
        current(VENDOR_KDA["nvidia"], "chunk_kda_with_fused_gate")(q, k, v, raw_g, raw_beta, A_log, g_bias,
                                                                   cu_seqlens=cu, state_cache=torch.zeros(1))
    assert str(info.value).startswith("state_cache: not an argument kda-engram serves"), str(info.value)


def test_prefill_state_cache_checkpoints_and_null_rows(plugin_on):
    """The ROCm layer's call: the paged cache, checkpoints into the cache itself,
    ``out``, ``backend="fused"``; vLLM's conventions: index 0 is no row, an offset
    that is not a multiple of 64 is skipped. vLLM's own Triton path serves neither
    the cache on a CPU (its gather asserts CUDA) nor checkpoints (only its HIP
    kernel does), so its references are its own call on the gathered rows, and on
    the prompts cut at the checkpoint offsets."""
    vllm_prefill = plugin_on[(AMD_PREFILL, "chunk_kda_prefill")]
    lengths = [70, 130, 5]
    q, k, v, raw_g, raw_beta, A_log, g_bias, cu = prefill_inputs(lengths, seed=20)
    T = sum(lengths)
    pool = rnd(8, H, K, K, seed=30)
    pool[0] = math.nan  # the null block: never read nor written
    before = pool.clone()
    rows = torch.tensor([3, 5, 0], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    ckpt_offsets = torch.tensor([64, 128, 20], dtype=torch.int32)  # 20: not a multiple of 64, skipped
    ckpt_rows = torch.tensor([6, 7, 2], dtype=torch.int32)
    out = torch.full((1, T + 4, H, K), math.nan)
    o, final = current(AMD_PREFILL, "chunk_kda_prefill")(
        q, k, v, raw_g, raw_beta, A_log, g_bias, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        backend="fused", out=out[:, 2:T + 2], checkpoint_state=pool, checkpoint_offsets=ckpt_offsets,
        checkpoint_state_indices=ckpt_rows, state_cache=pool, state_indices=rows, has_initial_state=has_init)
    assert final is None and o.data_ptr() == out[:, 2:].data_ptr()
    # vLLM's own call on the rows the cache holds (zeros: no initial state / null row).
    h0 = torch.stack([before[r] if h and r > 0 else torch.zeros(H, K, K) for r, h in zip(rows.tolist(),
                                                                                        has_init.tolist())])
    with vllm_kernels_on_cpu():
        o_vllm, f_vllm = vllm_prefill(q, k, v.clone(), raw_g, raw_beta, A_log, g_bias, initial_state=h0,
                                      output_final_state=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu)
    close(o, o_vllm)
    close(pool[3], f_vllm[0])
    close(pool[5], f_vllm[1])
    # The checkpoints: vLLM's own call on the prompts cut at their offsets.
    starts = cu[:-1].long()
    cut = [(0, 64), (1, 128)]
    for (n, off), row in zip(cut, (6, 7)):
        s = int(starts[n])
        part = [x[:, s:s + off] for x in (q, k, v, raw_g, raw_beta)]
        with vllm_kernels_on_cpu():
            _, f_cut = vllm_prefill(*part[:2], part[2].clone(), *part[3:], A_log, g_bias, initial_state=h0[n:n + 1],
                                    output_final_state=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=torch.tensor([0, off], dtype=torch.int32))
        close(pool[row], f_cut[0])
    # Row 0 (null) and row 2 (the skipped checkpoint) untouched, bit for bit; and
    # the rows no index names.
    for r in (0, 1, 2, 4):
        assert torch.equal(pool[r].view(torch.int32), before[r].view(torch.int32)), r
    assert out[:, :2].isnan().all() and out[:, T + 2:].isnan().all()


# ------------------------------------------------------------------- packed decode


@pytest.mark.parametrize("vendor", ["amd", "nvidia"])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_packed_decode_matches_vllms_kernel(plugin_on, vendor, lower_bound):
    B, V = 4, K
    width = 2 * H * K + H * V
    proj = rnd(B, width + 16, seed=40)  # the token stride is wider (the output gate follows)
    mixed_qkv = proj[:, :width]
    raw_g, raw_beta = rnd(1, B, H, K, seed=41), rnd(1, B, H, seed=42)
    A_log, dt_bias = rnd(H, seed=43) * 0.5, rnd(H * K, seed=44)
    pool = rnd(8, H, V, K, seed=45)
    rows = torch.tensor([3, 0, 5, -1])  # 0 (NULL_BLOCK_ID) and -1: padding
    args = (mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound)
    theirs_pool, ours_pool = pool.clone(), pool.clone()
    with vllm_kernels_on_cpu():
        o_vllm, ret_vllm = plugin_on[(VENDOR_KDA[vendor], "fused_recurrent_kda_packed_decode")](
            *args, initial_state=theirs_pool, state_indices=rows)
    o, ret = current(VENDOR_KDA[vendor], "fused_recurrent_kda_packed_decode")(*args, initial_state=ours_pool,
                                                                              state_indices=rows)
    assert ret is ours_pool and ret_vllm is theirs_pool
    close(o, o_vllm)
    assert (o[0, 1] == 0).all() and (o[0, 3] == 0).all()
    close(ours_pool, theirs_pool)
    for r in (0, 1, 2, 4, 6, 7):
        assert torch.equal(ours_pool[r], pool[r]), r


# ------------------------------------------------------------------- decode peel and speculative verify

#: (tokens per sequence, ssm_state_indices, num_accepted_tokens): uneven counts,
#: CUDA-graph padding (zero-length sequences and tokens past the last sequence),
#: a start row 0 (NULL_BLOCK_ID: a padding sequence), a write column 0 (not written).
VERIFY = dict(
    spec=([3, 1, 2, 0, 1, 0], [[1, 2, 3], [4, 5, 6], [7, 0, 9], [12, 13, 14], [0, 10, 11], [0, 0, 0]],
          [1, 3, 2, 1, 1, 1]),
    peel=([1, 1, 1, 1], [3, 0, 5, 6], None),
    uniform=([2, 2], [[1, 2], [3, 4]], [2, 1]),
)


@pytest.mark.parametrize("vendor", ["amd", "nvidia"])
@pytest.mark.parametrize("case", list(VERIFY))
def test_recurrent_matches_vllms_kernel(plugin_on, vendor, case):
    counts, ssm, accepted = VERIFY[case]
    pad = 2 if case == "spec" else 0  # tokens no sequence owns
    T = sum(counts) + pad
    q, k, v, raw_g = (rnd(1, T, H, K, seed=60 + i) for i in range(4))
    raw_beta, A_log, dt_bias = rnd(1, T, H, seed=64), rnd(H, seed=65) * 0.5, rnd(H * K, seed=66)
    cu = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
    ssm = torch.tensor(ssm, dtype=torch.int32)
    accepted = None if accepted is None else torch.tensor(accepted, dtype=torch.int32)
    pool = rnd(16, H, K, K, seed=67)
    kw = dict(cu_seqlens=cu, ssm_state_indices=ssm, num_accepted_tokens=accepted)
    if case == "uniform" and vendor == "amd":
        kw["uniform_sequence_length"] = 2
    results = []
    for fn in (plugin_on[(VENDOR_KDA[vendor], "fused_recurrent_kda")], current(VENDOR_KDA[vendor],
                                                                               "fused_recurrent_kda")):
        p, o = pool.clone(), torch.zeros(1, T, H, K)
        with vllm_kernels_on_cpu():
            got, ret = fn(q, k, v, raw_g, raw_beta, A_log, dt_bias, -5.0, p, out=o, **kw)
        assert got is o and ret is p
        results.append((o, p))
    (o_vllm, p_vllm), (o, p) = results
    close(o, o_vllm)
    close(p, p_vllm)
    written = {int(r) for n, c in enumerate(counts) for r in ssm.view(len(counts), -1)[n, :c] if r > 0}
    for r in set(range(16)) - written:
        assert torch.equal(p[r], pool[r]), r


@pytest.mark.parametrize("counts, accepted, says", [
    ([3, 1], [1, 4], "num_accepted_tokens: expected entries in [1, 3]"),
    ([4, 0], [1, 1], "cu_seqlens: a sequence has more tokens than ssm_state_indices' width W=3"),
])
def test_recurrent_refuses_what_vllms_kernel_would_read_past(plugin_on, counts, accepted, says):
    """vLLM's kernel reads past the index row there; ours writes no row and raises one line."""
    from ..helpers import refused

    T = sum(counts)
    q, k, v, raw_g = (rnd(1, T, H, K, seed=70 + i) for i in range(4))
    pool = rnd(8, H, K, K, seed=75)
    before = pool.clone()
    with refused(ValueError) as info:
        current(VENDOR_KDA["amd"], "fused_recurrent_kda")(
            q, k, v, raw_g, rnd(1, T, H), torch.zeros(H), None, None, pool,
            cu_seqlens=torch.tensor([0, *counts]).cumsum(0), ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]]),
            num_accepted_tokens=torch.tensor(accepted))
    assert str(info.value).startswith(says) and "\n" not in str(info.value), str(info.value)
    assert torch.equal(pool, before)


# ------------------------------------------------------------------- torch.compile


def _compile_cases():
    """(function, arguments) of each replacement as vLLM's layers call it."""
    from kda_engram.integrations import vllm_kimi_k3 as ours

    A_log, bias, pool = rnd(H, seed=80) * 0.5, rnd(H * K, seed=81), rnd(8, H, K, K, seed=82)
    B = 3
    packed = (rnd(B, 2 * H * K + H * K, seed=83), rnd(1, B, H, K, seed=84), rnd(1, B, H, seed=85), A_log, bias, -5.0,
              pool, torch.tensor([1, 0, 3]))
    T = 8
    q, k, v, g = (rnd(1, T, H, K, seed=86 + i) for i in range(4))
    spec = (q, k, v, g, rnd(1, T, H, seed=90), A_log, bias, -5.0, pool, torch.tensor([0, 3, 4, 6, 6]),
            torch.tensor([[1, 2, 3], [4, 5, 6], [7, 0, 0], [0, 0, 0]]), torch.tensor([1, 2, 1, 1]))
    q, k, v, raw_g, raw_beta, _, _, cu = prefill_inputs([64, 6], seed=91)
    prefill = dict(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, A_log=A_log, g_bias=bias, lower_bound=-5.0,
                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend="fused", out=torch.zeros(1, 70, H, K),
                   checkpoint_state=pool, checkpoint_offsets=torch.tensor([64, 20]),
                   checkpoint_state_indices=torch.tensor([5, 6]), state_cache=pool, state_indices=torch.tensor([1, 0]),
                   has_initial_state=torch.tensor([True, True]))
    gate = dict(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, A_log=A_log, g_bias=bias, lower_bound=-5.0,
                initial_state=rnd(2, H, K, K, seed=99), output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu, out=torch.zeros(1, 70, H, K))
    return {
        "packed_decode": (ours.fused_recurrent_kda_packed_decode, packed, {}),
        "spec_verify": (ours.fused_recurrent_kda, spec, dict(out=torch.zeros(1, T, H, K))),
        "prefill": (ours.chunk_kda_prefill, (), prefill),
        "fused_gate_nvidia": (ours.chunk_kda_with_fused_gate_nvidia, (), gate),
    }


@pytest.mark.parametrize("case", ["packed_decode", "spec_verify", "prefill", "fused_gate_nvidia"])
def test_torch_compile_fullgraph_takes_each_replacement_whole(case):
    """Issue 53 row 10: Dynamo failed on the adapters (``sys._getframe`` of the entry
    checks); while it traces they reach the kernels through their custom ops. The
    compiled call (backend "eager": Dynamo's graph, run op by op) equals the eager one,
    outputs and the pool it updates."""
    fn, args, kwargs = _compile_cases()[case]

    def fresh():
        memo = {}

        def c(x):
            return memo.setdefault(id(x), x.clone()) if isinstance(x, torch.Tensor) else x
        return [c(a) for a in args], {n: c(x) for n, x in kwargs.items()}

    eager_args, eager_kwargs = fresh()
    eager = fn(*eager_args, **eager_kwargs)
    torch._dynamo.reset()
    compiled_args, compiled_kwargs = fresh()
    got = torch.compile(fn, fullgraph=True, backend="eager")(*compiled_args, **compiled_kwargs)
    for a, b in zip(eager, got):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    for a, b in zip([*eager_args, *eager_kwargs.values()], [*compiled_args, *compiled_kwargs.values()]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)  # the pools, the outputs written in place


# ------------------------------------------------------------------- Engram gate

ENGRAM = "vllm.models.deepseek_v41.common.engram"


def engram_layer(hc, dim, seed=100):
    """vLLM's ``Engram`` with what its ``forward`` reads, assembled here: its
    constructor needs vLLM's config and distributed state, and its embedding and
    ``wkv`` projection (vLLM's parallel layers) are plain torch stand-ins. The gate
    path -- ``Engram.forward`` and the kernel it launches -- is vLLM's."""
    engram = sys.modules[ENGRAM]
    layer = engram.Engram.__new__(engram.Engram)
    torch.nn.Module.__init__(layer)
    table, wkv, q, k = engram_weights(hc, dim, seed)
    layer.embed = lambda ids: table[ids]
    layer.wkv = torch.nn.Linear(wkv.shape[1], wkv.shape[0], bias=False)
    with torch.no_grad():
        layer.wkv.weight.copy_(wkv)
    layer.hc_mult, layer.dim, layer.eps, layer.clamp_value = hc, dim, 1e-6, 1e-6
    layer.q_weight, layer.k_weight = q, k
    layer.use_sequence_parallel = False
    return layer


COLS, EMB = 3, 8


def engram_weights(hc, dim, seed=100):
    """The embedding table ``[50, EMB]``, the full ``wkv`` weight ``[(hc+1)*dim,
    COLS*EMB]`` and ``q_weight``, ``k_weight`` ``[hc, dim]`` (the same on every rank)."""
    return (rnd(50, EMB, seed=seed), rnd((hc + 1) * dim, COLS * EMB, seed=seed + 1), rnd(hc, dim, seed=seed + 2),
            rnd(hc, dim, seed=seed + 3))


@pytest.mark.parametrize("mask, tp", [(False, None), (True, None), (True, (2, 1)), (True, (2, 0))])
def test_engram_forward_matches_vllms_gate(plugin_on, monkeypatch, mask, tp):
    """vLLM's ``Engram.forward`` with its kernel, then with the plugin's launch under
    the kernel's name; with tensor parallelism (``tp``: size, rank; the distributed
    state faked) each rank holds a token shard and a mask of its ``num_kv_tokens``
    rows, fewer than the shard on the last rank (issue 53 row 8)."""
    engram = sys.modules[ENGRAM]
    hc, dim, T = 2, 24, 5
    layer = engram_layer(hc, dim)
    hash_ids = torch.randint(0, 50, (T, 3), generator=torch.Generator().manual_seed(7))
    token_mask = torch.tensor([True, False, True, True, False]) if mask else None
    rows = T
    if tp is not None:
        size, rank = tp
        layer.use_sequence_parallel = True
        monkeypatch.setattr(engram, "get_tensor_model_parallel_world_size", lambda: size)
        monkeypatch.setattr(engram, "get_tensor_model_parallel_rank", lambda: rank)
        rows = -(-T // size)
    hidden = rnd(rows, hc, dim, seed=8)
    from kda_engram.integrations import vllm_deepseek_v41

    assert current(ENGRAM, "_fused_engram_post_wkv_kernel") is vllm_deepseek_v41.fused_engram_post_wkv_kernel
    with torch.no_grad():
        ours = layer(hidden, hash_ids, token_mask)
        # vLLM's own kernel back under its name (the fixture restores it anyway).
        engram._fused_engram_post_wkv_kernel = plugin_on[(ENGRAM, "_fused_engram_post_wkv_kernel")]
        with vllm_kernels_on_cpu():
            theirs = layer(hidden, hash_ids, token_mask)
    close(ours, theirs)
    assert not torch.equal(ours, hidden)  # the gate did something


def test_engram_launch_refuses_a_grid_or_strides_it_does_not_match(vllm_own):
    from kda_engram.integrations.vllm_deepseek_v41 import fused_engram_post_wkv_kernel as kernel

    hc, dim, T = 2, 8, 3
    hidden, kv = rnd(T, hc, dim), rnd(T, (hc + 1) * dim)
    q, k, out = rnd(hc, dim), rnd(hc, dim), torch.empty(T, hc, dim)
    args = [hidden, kv, q, k, hidden, out, T, *hidden.stride(), *kv.stride(), *q.stride(), *k.stride(), 0,
            *out.stride(), 1e-6, 1e-6]
    kw = dict(DIM=dim, HC_MULT=hc, BLOCK_SIZE=8, HAS_MASK=False, num_warps=4)
    with pytest.raises(ValueError, match=r"^grid: expected \(T \* hc,\) = \(6,\), got \(5,\)$"):
        kernel[(5,)](*args, **kw)
    args[10] = 99  # kv_stride_t
    with pytest.raises(ValueError, match=r"^kv_stride_t: expected kv.stride\(0\) = 24, got 99$"):
        kernel[(6,)](*args, **kw)


def test_a_module_replaced_on_import_keeps_its_loader_interface(vllm_own, monkeypatch):
    """The hook's loader answers as the wrapped one (``get_source``, which inspect and
    Triton use for a kernel's source)."""
    import importlib
    import inspect

    name = f"{VENDOR_KDA['amd']}.fused_recurrent"
    for m in [m for m in sys.modules if m.startswith(VENDOR_KDA["amd"])]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setenv(vllm_plugin.SWITCH, "all")
    vllm_plugin.register()
    module = importlib.import_module(name)
    assert f"{name}.fused_recurrent_kda" in vllm_plugin.replaced()
    assert "def fused_recurrent_kda_packed_decode(" in module.__loader__.get_source(name)
    assert "def fused_recurrent_kda_fwd(" in inspect.getsource(module)


# ------------------------------------------------------------------- Engram hash

VOCAB, COMPRESSED = 40, 17


def hash_state(cache_slots=None, block_size=4):
    """vLLM's ``NgramHashState`` with what its ``forward`` reads, from vLLM's own
    ``EngramLayout`` and ``compute_hash_multipliers`` (its constructor needs the
    tokenizer; the token map here is a random many-to-one map instead)."""
    from types import SimpleNamespace

    engram = sys.modules[ENGRAM]
    config = SimpleNamespace(engram_layer_ids=[1, 3], engram_num_embeddings=[1000, 1000], engram_max_ngram_size=4,
                             engram_n_heads=2, engram_head_dim=8, engram_compressed_vocab_size=COMPRESSED,
                             engram_pad_token_id=2, engram_vocab_size=50)
    layout = engram.EngramLayout(config)
    state = engram.NgramHashState.__new__(engram.NgramHashState)
    torch.nn.Module.__init__(state)
    token_map = torch.randint(0, COMPRESSED, (VOCAB,), generator=torch.Generator().manual_seed(3)).int()
    state.layout, state.block_size, state.pad_id = layout, block_size, int(token_map[config.engram_pad_token_id])
    state.use_slot_cache = cache_slots is not None
    state._cache = None if cache_slots is None else cache_slots.clone()
    state.token_map, state.primes, state.offsets = token_map, torch.tensor(layout.primes), layout.offsets
    state.multipliers = engram.compute_hash_multipliers(layout.layer_ids, 4, COMPRESSED)
    return state


def hash_batch():
    """Five requests and three CUDA-graph padding tokens: a fresh prompt (position 0:
    the window reaches below 0), a continued chunk with lookback ids (an unknown -1
    and a dead one among them), a decode step at position 1, a zero-length padding
    request, a decode far into its sequence; then padding tokens past the last end
    with positions of their own. Dead tokens inside the batch too."""
    g = torch.Generator().manual_seed(11)
    lengths, starts = [4, 3, 1, 0, 2], [0, 6, 1, 0, 30]
    qsl = torch.tensor([0, 4, 7, 8, 8, 10])
    # Padding positions: 29 reads the last request's lookback window at lag 0, 32 the
    # batch (then the dead token 9), 0 the pad id.
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)] + [torch.tensor([29, 32, 0])])
    T = positions.numel()
    input_ids = torch.randint(0, VOCAB, (T,), generator=g)
    dead = torch.zeros(T, dtype=torch.bool)
    dead[[2, 9]] = True
    lookback = torch.randint(0, VOCAB, (5, 3), generator=g)
    lookback[1, 1] = -1  # unknown: pad, older ones still count
    lookback_dead = torch.zeros(5, 3, dtype=torch.bool)
    lookback_dead[4, 2] = True  # dead: hides what is older
    return input_ids, positions, qsl, dead, lookback, lookback_dead


def test_the_hash_launch_signature_is_vllms(vllm_own):
    from kda_engram.integrations import vllm_deepseek_v41

    names = list(inspect.signature(vllm_deepseek_v41.hash_ids).parameters)
    assert names == ["grid", *vllm_own[(ENGRAM, "_hash_ids_kernel")].arg_names, "num_warps"]


@pytest.mark.parametrize("depth", [3, 2, 0])
@pytest.mark.parametrize("slot_cache", [False, True])
def test_engram_hash_matches_vllms_kernel(plugin_on, depth, slot_cache):
    """vLLM's ``NgramHashState.forward`` with its ``_hash_ids_kernel``, then with the
    plugin's launch under that name: exact ids for every token, the padding ones
    included. ``depth`` < 3: lags past the window read the slot cache (V1) or pad
    (V2); ``slot_cache``: vLLM's V1 runner, a cache holding dead ids too, addressed
    through a block table (issue 53 row 8)."""
    engram = sys.modules[ENGRAM]
    input_ids, positions, qsl, dead, lookback, lookback_dead = hash_batch()
    lookback, lookback_dead = lookback[:, :depth], lookback_dead[:, :depth]
    cache = block_table = slot_mapping = None
    if slot_cache:
        g = torch.Generator().manual_seed(5)
        cache = torch.randint(0, COMPRESSED, (64,), generator=g).int()
        cache[torch.randperm(64, generator=g)[:12]] = engram.DEAD_ID
        block_table = torch.randperm(16, generator=g)[:10].view(5, 2)
        slot_mapping = torch.randint(-1, 64, (input_ids.numel(),), generator=g)
    from kda_engram.integrations import vllm_deepseek_v41

    assert current(ENGRAM, "_hash_ids_kernel") is vllm_deepseek_v41.hash_ids_kernel
    args = (input_ids, positions, qsl, dead, lookback, lookback_dead, slot_mapping, block_table)
    ours = hash_state(cache)(*args)
    engram._hash_ids_kernel = plugin_on[(ENGRAM, "_hash_ids_kernel")]
    with vllm_kernels_on_cpu():
        theirs = hash_state(cache)(*args)
    assert ours.shape == (input_ids.numel(), 2, 6) and ours.dtype == torch.int32
    mismatch = (ours != theirs).any(-1).any(-1).nonzero().flatten().tolist()
    assert mismatch == [], f"tokens whose ids differ: {mismatch}"


def test_engram_hash_conventions_matter(plugin_on):
    """The batch above tells vLLM's conventions apart: an unknown lookback id read as
    dead (hiding older ids), or the padding tokens left out, would change ids."""
    input_ids, positions, qsl, dead, lookback, lookback_dead = hash_batch()
    state = hash_state()
    base = state(input_ids, positions, qsl, dead, lookback, lookback_dead, None, None)
    hidden = lookback_dead.clone()
    hidden[1, 1] = True
    as_dead = state(input_ids, positions, qsl, dead, torch.where(hidden, 0, lookback), hidden, None, None)
    assert not torch.equal(base[4:7], as_dead[4:7])  # the continued chunk's older lags count
    assert (base[10:] >= 0).all()  # padding tokens hash as the last request's, into the tables


def test_engram_hash_launch_refuses_what_it_does_not_match(vllm_own):
    from kda_engram.integrations.vllm_deepseek_v41 import hash_ids_kernel as kernel

    state = hash_state()
    input_ids, positions, qsl, dead, lookback, lookback_dead = hash_batch()
    T = input_ids.numel()
    out = torch.empty(T, 2, 6, dtype=torch.int32)
    args = [input_ids, state.token_map, dead, positions, None, qsl, state.multipliers, state.primes, state.offsets,
            None, lookback, lookback_dead, out, T, 0, state.pad_id]
    kw = dict(input_stride=1, mask_stride=1, position_stride=1, table_stride=0, table_col_stride=0, query_stride=1,
              num_query_rows=5, num_table_rows=0, max_blocks=0, cache_block_size=4, MAX_NGRAM=4, num_heads=2,
              BLOCK_T=32, BLOCK_H=2, dead_id=-1, lookback_depth=3, lookback_row_stride=3, lookback_col_stride=1,
              lookback_mask_row_stride=3, lookback_mask_col_stride=1, num_warps=4)
    with pytest.raises(ValueError, match=r"^grid: expected \(cdiv\(T, BLOCK_T\), L\) = \(1, 2\), got \(1, 1\)$"):
        kernel[(1, 1)](*args, **kw)
    with pytest.raises(ValueError, match=r"^lookback_row_stride: expected lookback_token_ids.stride\(0\) = 3, got 1$"):
        kernel[(1, 2)](*args, **{**kw, "lookback_row_stride": 1})
    with pytest.raises(ValueError, match=r"^num_query_rows: expected query_start_loc.numel\(\) - 1 >= 1, got 4"):
        kernel[(1, 2)](*args, **{**kw, "num_query_rows": 4})
    with pytest.raises(ValueError, match=r"^dead_mask: expected \[num_tokens\] = \[13\], got \[12\]$"):
        kernel[(1, 2)](*args[:2], dead[:12], *args[3:], **kw)
    kernel[(1, 2)](*args, **kw)
    torch.testing.assert_close(out, state(input_ids, positions, qsl, dead, lookback, lookback_dead, None, None))



# ------------------------------------------------------- Engram's dim-sharded gate


class _VllmColumnParallelLinear(torch.nn.Module):
    """vLLM's ``ColumnParallelLinear`` as ``Engram.__init__`` builds ``wkv``,
    unquantized (vLLM's ``linear.py`` pulls in its whole quantization stack, so the
    harness stands it in): the weight ``[O/P, in]``, vLLM's plain column-parallel
    loader (contiguous rows ``[rank*O/P, ...)``) and its forward (the local output,
    all-gathered on the last dim when ``gather_output``)."""

    def __init__(self, input_size, output_size, *, bias, gather_output, quant_config, return_bias, prefix,
                 disable_tp):
        super().__init__()
        engram = sys.modules[ENGRAM]
        self.tp_size = 1 if disable_tp else engram.get_tensor_model_parallel_world_size()
        self.tp_rank = 0 if disable_tp else engram.get_tensor_model_parallel_rank()
        self.gather_output = gather_output
        self.weight = torch.nn.Parameter(torch.empty(output_size // self.tp_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight):
        rows = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)
        if self.gather_output and self.tp_size > 1:
            y = sys.modules[ENGRAM].tensor_model_parallel_all_gather(y, dim=-1)
        return y


def engram_inputs(hc, dim, T=6):
    g = torch.Generator().manual_seed(21)
    hash_ids = torch.randint(0, 50, (T, COLS), generator=g)
    mask = torch.tensor([True, False, True, True, True, False][:T])
    return rnd(T, hc, dim, seed=22), hash_ids, mask


def _sharded_engram_worker(rank, P, port, root, folder, hc, dim):
    """One gloo rank: vLLM's ``Engram.__init__`` and ``forward`` with the plugin on,
    vLLM's distributed names on this gloo group, its ``wkv`` loaded from the full
    weight through the parameter's loader, as vLLM's model loader does."""
    import datetime
    import importlib
    from types import SimpleNamespace

    import torch.distributed as dist

    from kda_engram.integrations import vllm_deepseek_v41
    from kda_engram.parallel import TensorParallelGroup, merged_column_parallel_shard

    torch.set_num_threads(1)  # the ranks share the CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=300))
    try:
        if root not in sys.path:
            sys.path.insert(0, root)
        os.environ[vllm_plugin.SWITCH] = "1"
        vllm_plugin.register()
        engram = importlib.import_module(ENGRAM)
        assert engram.Engram.forward is vllm_deepseek_v41.engram_forward
        group = TensorParallelGroup()
        engram.get_tensor_model_parallel_world_size = lambda: P
        engram.get_tensor_model_parallel_rank = lambda: rank
        engram.tensor_model_parallel_all_gather = lambda x, dim=-1: group.all_gather(x, dim=dim)
        engram.ColumnParallelLinear = _VllmColumnParallelLinear
        engram.get_current_vllm_config = lambda: SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=16))
        engram.Engram._create_embedding = lambda self, layout, index: SimpleNamespace(
            dp_size=1, tp_size=P, part_n_hash_cols=COLS, n_hash_cols=COLS, cpu_offload=False)
        config = SimpleNamespace(hidden_size=dim, hc_mult=hc, rms_norm_eps=1e-6)
        layout = SimpleNamespace(max_ngram_size=2, n_heads=COLS, head_dim=EMB, num_embeddings=[50],
                                 primes=[[(50,) * COLS]])
        layer = engram.Engram(config, None, layout, 0, False, "model.layers.0.engram")
        assert layer.kda_engram_dim_sharded and not layer.wkv.gather_output
        table, wkv, q, k = engram_weights(hc, dim)
        layer.wkv.weight.weight_loader(layer.wkv.weight, wkv)
        assert torch.equal(layer.wkv.weight, merged_column_parallel_shard(wkv, [dim] * (hc + 1), rank, P))
        layer.q_weight.data, layer.k_weight.data = q.clone(), k.clone()
        layer.embed = lambda ids: table[ids]
        hidden, hash_ids, mask = engram_inputs(hc, dim)
        with torch.no_grad():
            for name, m in (("mask", mask), ("none", None)):
                torch.save(layer(hidden, hash_ids, m), os.path.join(folder, f"{name}{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("P", [2, 4])
def test_sharded_gate_inside_vllms_engram_on_gloo_ranks(vllm_own, vllm_root, tmp_path, P):  # noqa: F811
    """Deliverable 3: ``wkv`` sharded by dim (``gather_output=False``, the dim-shard
    loader) and the exchange of value slices and partial sums, inside vLLM's
    ``Engram`` over ``P`` gloo ranks, against vLLM's own unsharded path (its
    ``forward`` and gate kernel, one rank): within 1e-5 in fp32, the same bits on
    every rank."""
    import torch.multiprocessing as mp

    hc, dim = 2, 24
    mp.spawn(_sharded_engram_worker, args=(P, free_port(), vllm_root, str(tmp_path), hc, dim), nprocs=P, join=True)
    layer = engram_layer(hc, dim)
    hidden, hash_ids, mask = engram_inputs(hc, dim)
    for name, m in (("mask", mask), ("none", None)):
        with torch.no_grad(), vllm_kernels_on_cpu():
            want = layer(hidden, hash_ids, m)
        outs = [torch.load(tmp_path / f"{name}{r}.pt") for r in range(P)]
        for out in outs:
            close(out, want)
            assert torch.equal(out, outs[0])
        assert not torch.equal(want, hidden)


def test_the_dim_sharded_gate_applies_only_where_it_can(plugin_on, monkeypatch):
    """``shard_engram_wkv`` leaves vLLM's path (its loader, ``gather_output``, its
    ``forward``) for one rank, sequence parallelism, a quantized ``wkv`` (a scale
    beside the weight) and a slice the packed partials cannot align."""
    from kda_engram.integrations.vllm_deepseek_v41 import engram_forward, shard_engram_wkv

    engram = sys.modules[ENGRAM]
    assert [n for n in inspect.signature(engram_forward).parameters] == \
        [n for n in inspect.signature(plugin_on[(ENGRAM, "Engram.forward")]).parameters]
    hc, dim = 2, 24

    def layer(P, *, sp=False, scale=False, dtype=torch.float32, d=dim):
        monkeypatch.setattr(engram, "get_tensor_model_parallel_world_size", lambda: P)
        monkeypatch.setattr(engram, "get_tensor_model_parallel_rank", lambda: P - 1)
        built = engram_layer(hc, d)
        built.wkv = _VllmColumnParallelLinear(COLS * EMB, (hc + 1) * d, bias=False, gather_output=True,
                                              quant_config=None, return_bias=False, prefix="wkv", disable_tp=sp)
        built.wkv.weight.data = built.wkv.weight.data.to(dtype)
        if scale:
            built.wkv.weight_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
        built.use_sequence_parallel = sp
        return built

    for kept in (layer(1), layer(2, sp=True), layer(2, scale=True), layer(4, dtype=torch.bfloat16, d=20)):
        plain = kept.wkv.weight.weight_loader
        assert shard_engram_wkv(kept) is False
        assert kept.wkv.gather_output and kept.wkv.weight.weight_loader == plain
        assert not getattr(kept, "kda_engram_dim_sharded", False)
    sharded = layer(4)
    assert shard_engram_wkv(sharded) is True and not sharded.wkv.gather_output


def test_torch_compile_fullgraph_takes_the_sharded_engram_forward(plugin_on, monkeypatch):
    """The dim-sharded ``Engram.forward`` under ``torch.compile(fullgraph=True)``
    (backend "eager"): the gate's entry points become their custom ops; two ranks
    faked in one process (rank 0, an all-gather that repeats its rows, the
    collective being vLLM's), compiled equal to eager."""
    from kda_engram.integrations.vllm_deepseek_v41 import engram_forward, shard_engram_wkv

    engram = sys.modules[ENGRAM]
    hc, dim = 2, 24
    monkeypatch.setattr(engram, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(engram, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(engram, "tensor_model_parallel_all_gather", lambda x, dim=-1: torch.cat([x, x], dim=dim))
    layer = engram_layer(hc, dim)
    table, wkv, _, _ = engram_weights(hc, dim)
    layer.wkv = _VllmColumnParallelLinear(COLS * EMB, (hc + 1) * dim, bias=False, gather_output=True,
                                          quant_config=None, return_bias=False, prefix="wkv", disable_tp=False)
    assert shard_engram_wkv(layer)
    layer.wkv.weight.weight_loader(layer.wkv.weight, wkv)
    layer.embed = lambda ids: table[ids]
    hidden, hash_ids, mask = engram_inputs(hc, dim)
    with torch.no_grad():
        eager = engram_forward(layer, hidden, hash_ids, mask)
        torch._dynamo.reset()
        got = torch.compile(engram_forward, fullgraph=True, backend="eager")(layer, hidden, hash_ids, mask)
    assert torch.equal(eager, got) and not torch.equal(eager, hidden)
