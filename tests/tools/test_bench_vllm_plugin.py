"""``bench_vllm_plugin``'s CPU half: ``--prepare`` against the vllm 0.33.0 wheel, the
prepared folder importing vLLM's kernel modules with the CUDA platform stub (imports
only, no launch), the exit without a GPU, and every row's calls walked at small sizes
in fp32 under the Triton interpreter (the CPU platform, as the conformance tests).

The wheel comes as in ``tests/integrations/test_vllm_plugin.py``
(``$KDA_ENGRAM_VLLM_WHEEL`` or ``pip download``; skipped with the reason when it cannot
be had). Each run is a subprocess: the benchmark registers the plugin in its process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kda_engram.tools import vllm_files

from ..integrations.vllm_wheel import fetch_wheel

ROOT = Path(__file__).resolve().parents[2]
MODULE = "kda_engram.tools.benchmarks.bench_vllm_plugin"


def env(interpret: bool) -> dict:
    """This checkout's package (and its tests) first; the interpreter on or off."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**base, "PYTHONPATH": path, **({"TRITON_INTERPRET": "1"} if interpret else {})}


def python(*args, interpret=False, timeout=600):
    return subprocess.run([sys.executable, *args], env=env(interpret), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return fetch_wheel(str(tmp_path_factory.mktemp("wheel")))


@pytest.fixture(scope="module")
def prepared(wheel, tmp_path_factory):
    """The folder ``--prepare`` wrote (as a user runs it) and its output."""
    folder = tmp_path_factory.mktemp("prepare") / ".vllm_files"
    done = python("-m", MODULE, "--prepare", str(folder), "--wheel", wheel)
    return folder, done


def test_prepare_writes_the_files_a_gpu_run_needs(prepared, wheel):
    folder, done = prepared
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"prepared {folder}: ") and done.stdout.count("\n") == 1, done.stdout
    marker = vllm_files.read_marker(str(folder))
    assert marker["vllm"] == "0.33.0" and marker["platform"] == "cuda" and marker["wheel"] == os.path.basename(wheel)
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != vllm_files.MARKER]
    assert len(files) == marker["files"] and sum(p.stat().st_size for p in files) == marker["bytes"] < 4 << 20
    for entry in vllm_files.FROM_WHEEL:
        assert (folder / entry).exists(), entry
    for path in [*vllm_files.STUBS, *vllm_files.ABSENT, *vllm_files.EMPTY_PACKAGES]:
        assert (folder / path).is_file(), path
    assert (folder / "vllm/platforms/__init__.py").read_text() == vllm_files.PLATFORMS["cuda"]


def test_prepare_replaces_its_own_folder_and_refuses_another(prepared, wheel, tmp_path):
    folder, _ = prepared
    again = python("-m", MODULE, "--prepare", str(folder), "--wheel", wheel)
    assert again.returncode == 0, again.stderr
    foreign = tmp_path / "other"
    (foreign / "vllm").mkdir(parents=True)
    refused = python("-m", MODULE, "--prepare", str(foreign), "--wheel", wheel)
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, refused.stderr
    assert "was not prepared by kda-engram" in refused.stderr
    missing = python("-m", MODULE, "--prepare", str(tmp_path / "x"), "--wheel", str(tmp_path / "none.whl"))
    assert missing.returncode == 2 and missing.stderr == f"bench_vllm_plugin --prepare: {tmp_path / 'none.whl'} " \
                                                         "holds no vllm-0.33.0 wheel\n", missing.stderr


#: In the GPU run's process, before any launch: vLLM's files load as the GPU run
#: loads them (compiled Triton: no interpreter), the plugin replaces every target, and
#: each row pairs vLLM's own function with ours as the layer reads it.
IMPORT_ONLY = """
import json, sys
from kda_engram.tools.benchmarks import bench_vllm_plugin as b
plugin = b.load_vllm(sys.argv[1])
platform = sys.modules["vllm.platforms"].current_platform
cases = b.cases(plugin, quick=False)
pairs = [case.fns() for case in cases]
print(json.dumps({
    "cuda": [platform.is_cuda(), platform.is_cuda_alike(), platform.is_rocm()],
    "replaced": plugin.replaced(),
    "modules": {m: getattr(sys.modules[m], "__file__", None) for m in sys.modules if m.split(".")[0] == "vllm"},
    "rows": [[c.call, c.shape, c.target, c.layer_module] for c in cases],
}))
"""


def test_the_prepared_folder_imports_vllms_kernel_modules_with_the_cuda_stub(prepared):
    folder, done = prepared
    assert done.returncode == 0, done.stderr
    run = python("-c", IMPORT_ONLY, str(folder))
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout)
    assert seen["cuda"] == [True, True, False]
    from kda_engram.integrations.vllm_plugin import REPLACEMENTS

    assert sorted(seen["replaced"]) == sorted(f"{m}.{n}" for m, n, *_ in REPLACEMENTS)
    for module in ("vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk",
                   "vllm.models.kimi_k3.amd.ops.third_party.kda.fused_recurrent",
                   "vllm.models.kimi_k3.amd.ops.kda_prefill",
                   "vllm.third_party.flash_linear_attention.ops.chunk_delta_h",
                   "vllm.model_executor.layers.mamba.ops.gather_initial_states",
                   "vllm.models.deepseek_v41.common.engram"):
        assert module in seen["modules"], module
    for module, file in seen["modules"].items():  # nothing from another vLLM
        assert file is None or file.startswith(str(folder)), (module, file)
    calls = {row[0] for row in seen["rows"]}
    assert {"K3 NVIDIA prefill (out)", "Kimi-Linear prefill, ROCm copy", "K3 ROCm prefill (pool, triton)",
            "K3 NVIDIA packed decode", "K3 ROCm decode peel", "K3 NVIDIA spec verify", "Engram gate",
            "Engram hash V1 (slot cache)"} <= calls
    assert len(seen["rows"]) == 17
    for row in seen["rows"]:
        assert row[2] in seen["replaced"], row


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_without_a_gpu_one_line_and_exit_2(tmp_path):
    # Before anything else (the folder is not even read), as the other GPU-only scripts.
    done = python("-m", MODULE, "--vllm-files", str(tmp_path))
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("bench_vllm_plugin needs a GPU") and done.stderr.count("\n") == 1


#: The rows at small sizes, fp32, under the interpreter on the CPU platform (vLLM's
#: kernels with the conformance tests' interpreter fixes): the same input builders,
#: calls and comparisons as the GPU run, the timing replaced by one call. vLLM's ROCm
#: prefill is left out (its row-gather asserts a GPU), and so are the slower copies of
#: rows that differ only in arguments (the conformance tests cover those calls).
SMALL_ROWS = """
import json, sys
from tests.integrations.vllm_wheel import vllm_kernels_on_cpu
from kda_engram.tools.benchmarks import bench_vllm_plugin as b
from kda_engram.tools.vllm_files import extract
extract(sys.argv[1], sys.argv[2], "cpu")
b.DEVICE, b.DTYPE, b.H, b.K, b.V = "cpu", "float32", 2, 32, 32
b.UNIFORM, b.DECODE_B, b.PADDING, b.SPEC_N, b.SPEC_W = [3, 70], 4, 1, 3, 2
b.ENGRAM_T, b.ENGRAM_DIM, b.ENGRAM_HC = 48, 24, 2
b.bench_ms = lambda fn, quick=False: (fn(), 1.0)[1]
plugin = b.load_vllm(sys.argv[2])
rows = []
with vllm_kernels_on_cpu():
    for case in b.cases(plugin, quick=True):
        if case.call in sys.argv[3:]:
            rows.append(b.measure(case, True, False, 1e-5))
print(json.dumps(rows))
"""
SMALL = ["K3 NVIDIA prefill (out)", "K3 NVIDIA packed decode", "K3 ROCm packed decode", "K3 ROCm decode peel",
         "K3 NVIDIA spec verify", "K3 ROCm spec verify", "Engram gate", "Engram hash V2",
         "Engram hash V1 (slot cache)"]


def test_the_rows_at_small_sizes_on_the_cpu(wheel, tmp_path):
    run = python("-c", SMALL_ROWS, wheel, str(tmp_path / "cpu"), *SMALL, interpret=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {row["call"]: row for row in json.loads(run.stdout.splitlines()[-1])}
    assert sorted(rows) == sorted(SMALL)
    for row in rows.values():
        assert row["ok"], row
    # Two implementations, not one: vLLM's chunked prefill and ours round differently.
    assert 0 < rows["K3 NVIDIA prefill (out)"]["rel_rms_out"] < 1e-5
    assert rows["Engram hash V1 (slot cache)"]["max_abs_out"] == 0
