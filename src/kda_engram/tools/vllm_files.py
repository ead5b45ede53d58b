"""vLLM 0.33.0's own kernel-call files, taken from its wheel, with stubs for what they import.

vLLM cannot be imported whole away from a serving machine (its ``__init__`` pulls the
engine, its platform layer probes the hardware), so :func:`extract` writes only the
files in :data:`FROM_WHEEL`, unmodified, into a folder that goes on ``sys.path`` as the
``vllm`` package, and replaces the modules around them that the code reads with the
minimum it reads (:data:`STUBS`, :data:`ABSENT`, :data:`EMPTY_PACKAGES`, and one of
:data:`PLATFORMS`). The code extracted is vLLM's own, byte for byte, but for one package
``__init__`` that only re-exports other ops (the FLA ops package's, in :data:`STUBS`).

Two users, one definition of each list: the CPU tests
(``tests/integrations/vllm_wheel.py``: the ``"cpu"`` platform, vLLM's Triton kernels
under the interpreter) and the GPU comparison
:mod:`kda_engram.tools.benchmarks.bench_vllm_plugin` (``"cuda"``: compiled Triton on
the GPU), whose ``--prepare`` writes the folder on a machine that has the wheel.
Nothing of vLLM is committed here.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

__all__ = [
    "ABSENT", "EMPTY_PACKAGES", "FROM_WHEEL", "MARKER", "PLATFORMS", "STUBS", "VERSION", "WHEEL_ENV",
    "WheelNotFound", "extract", "find_wheel", "prepare", "read_marker",
]

VERSION = "0.33.0"
#: A wheel file, or a folder holding one, to use instead of ``pip download``.
WHEEL_ENV = "KDA_ENGRAM_VLLM_WHEEL"
#: The file :func:`prepare` writes beside ``vllm/`` (what it holds: :func:`read_marker`).
MARKER = "kda_engram_vllm_files.json"

#: vLLM's own files, extracted unmodified (folders end with "/").
FROM_WHEEL = (
    "vllm/_version.py",
    "vllm/utils/math_utils.py",
    "vllm/third_party/__init__.py",
    "vllm/third_party/flash_linear_attention/",
    "vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
    "vllm/models/kimi_k3/amd/ops/",
    "vllm/models/kimi_k3/nvidia/ops/third_party/",
    "vllm/models/deepseek_v41/common/engram.py",
)

#: Modules outside the kernel-call code, as the minimum that code reads from them.
STUBS = {
    # The real __init__ imports the engine; the plugin reads only __version__.
    "vllm/__init__.py": "from ._version import __version__, __version_tuple__\n",
    # The real one resolves the platform (a GPU) and reads vllm.envs; the kernels
    # take triton, tl and tldevice from it.
    "vllm/triton_utils/__init__.py": (
        "import triton\nimport triton.language as tl\nimport triton.language.extra.libdevice as tldevice\n"
    ),
    "vllm/platforms/rocm.py": "def on_gfx950(): return False\ndef on_gfx942(): return False\n",
    "vllm/logger.py": (
        "import logging\n"
        "class _Logger(logging.LoggerAdapter):\n"
        "    def info_once(self, *a, **k): self.info(*a)\n"
        "    def warning_once(self, *a, **k): self.warning(*a)\n"
        "def init_logger(name): return _Logger(logging.getLogger(name), {})\n"
    ),
    # index.py's chunk-index helper: a sync guard and a host-to-device copy.
    "vllm/utils/__init__.py": "",
    "vllm/utils/gpu_sync_debug.py": (
        "import contextlib\n@contextlib.contextmanager\ndef gpu_sync_allowed():\n    yield\n"
    ),
    "vllm/utils/torch_utils.py": (
        "def async_tensor_h2d(data, dtype, device, pin_memory=False):\n"
        "    return data.to(device=device, dtype=dtype)\n"
        "from vllm._absent import absent_names\n__getattr__ = absent_names('vllm.utils.torch_utils')\n"
    ),
    # engram.py's imports outside its gate: the engine's config, distributed state,
    # layers and memory helpers. Names that exist and fail if called; the gate path
    # (Engram.forward without tensor parallelism, its kernel) calls none of them.
    "vllm/_absent.py": (
        "class Absent:\n"
        "    def __init__(self, name): self.name = name\n"
        "    def __call__(self, *a, **k): raise RuntimeError(f'{self.name}: not among the extracted vLLM files')\n"
        "    def __getattr__(self, attr): return Absent(f'{self.name}.{attr}')\n"
        "    def __or__(self, other): return self\n"
        "    __ror__ = __or__\n"
        "def absent_names(module):\n"
        "    def __getattr__(name):\n"
        "        if name.startswith('__'): raise AttributeError(name)\n"
        "        return Absent(f'{module}.{name}')\n"
        "    return __getattr__\n"
    ),
    # Its methods' decorator: the identity outside CUDA-graph capture.
    "vllm/compilation/__init__.py": "",
    "vllm/compilation/breakable_cudagraph.py": "def eager_break_during_capture(fn):\n    return fn\n",
    # AITER (ROCm only): absent.
    "vllm/_aiter_ops.py": "class rocm_aiter_ops:\n    pass\n",
    # The FLA package's __init__ re-exports the gated-delta-rule ops (and their
    # CustomOp / warmup imports); the KDA files import its submodules directly.
    "vllm/third_party/flash_linear_attention/ops/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    # The one name kda_chunk.py reads (vLLM's value).
    "vllm/v1/attention/backends/utils.py": "NULL_BLOCK_ID = 0\n",
}

#: ``vllm/platforms/__init__.py``, by platform: what the kernel-call code reads of
#: ``current_platform``.
PLATFORMS = {
    # No CUDA, no ROCm, no PDL.
    "cpu": (
        "class _Cpu:\n"
        "    def is_cuda(self): return False\n"
        "    def is_rocm(self): return False\n"
        "    def is_cuda_alike(self): return False\n"
        "    def has_device_capability(self, *a, **k): return False\n"
        "    def is_arch_support_pdl(self): return False\n"
        "current_platform = _Cpu()\n"
    ),
    # vLLM's CUDA platform as the kernels read it, answered for the GPU torch sees
    # (asked at launch, not at import): capability checks as vLLM's DeviceCapability
    # compares them, and PDL as vLLM's CudaPlatform.is_arch_support_pdl (compute
    # capability 9 and up) unless KDA_ENGRAM_VLLM_PDL=0.
    "cuda": (
        "import os\n"
        "import torch\n"
        "class _Cuda:\n"
        "    def is_cuda(self): return True\n"
        "    def is_rocm(self): return False\n"
        "    def is_cuda_alike(self): return True\n"
        "    def get_device_capability(self, device_id=0): return torch.cuda.get_device_capability(device_id)\n"
        "    def has_device_capability(self, capability, device_id=0):\n"
        "        major, minor = torch.cuda.get_device_capability(device_id)\n"
        "        if isinstance(capability, tuple): return (major, minor) >= tuple(capability)\n"
        "        return major * 10 + minor >= capability\n"
        "    def is_device_capability_family(self, capability, device_id=0):\n"
        "        return torch.cuda.get_device_capability(device_id)[0] == capability // 10\n"
        "    def get_device_name(self, device_id=0): return torch.cuda.get_device_name(device_id)\n"
        "    def get_device_properties(self, device=None): return torch.cuda.get_device_properties(device)\n"
        "    def is_arch_support_pdl(self):\n"
        "        if os.environ.get('KDA_ENGRAM_VLLM_PDL', '1') == '0': return False\n"
        "        try: return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9\n"
        "        except Exception: return False\n"
        "current_platform = _Cuda()\n"
    ),
}

#: Modules engram.py imports names from, none of which its gate path calls (see
#: ``vllm/_absent.py`` in :data:`STUBS`).
ABSENT = (
    "vllm/config/__init__.py",
    "vllm/distributed/__init__.py",
    "vllm/distributed/device_communicators/shm_broadcast.py",
    "vllm/distributed/parallel_state.py",
    "vllm/forward_context.py",
    "vllm/model_executor/layers/fusion/quant_activation.py",
    "vllm/model_executor/layers/linear.py",
    "vllm/model_executor/layers/quantization/__init__.py",
    "vllm/model_executor/layers/quantization/utils/quant_utils.py",
    "vllm/model_executor/utils.py",
    "vllm/models/deepseek_v41/common/ops/query_quant.py",
    "vllm/utils/platform_utils.py",
)

#: Packages whose __init__ the wheel has but the extraction skips (they import more).
EMPTY_PACKAGES = (
    "vllm/model_executor/__init__.py",
    "vllm/model_executor/layers/__init__.py",
    "vllm/model_executor/layers/mamba/__init__.py",
    "vllm/model_executor/layers/mamba/ops/__init__.py",
    "vllm/models/__init__.py",
    "vllm/models/kimi_k3/__init__.py",
    "vllm/models/kimi_k3/amd/__init__.py",
    "vllm/models/kimi_k3/nvidia/__init__.py",
    "vllm/models/kimi_k3/nvidia/ops/__init__.py",
    "vllm/models/deepseek_v41/__init__.py",
    "vllm/models/deepseek_v41/common/__init__.py",
    "vllm/models/deepseek_v41/common/ops/__init__.py",
    "vllm/distributed/device_communicators/__init__.py",
    "vllm/model_executor/layers/fusion/__init__.py",
    "vllm/model_executor/layers/quantization/utils/__init__.py",
)


class WheelNotFound(Exception):
    """The vllm wheel cannot be had; the message says why (one line)."""


def find_wheel(given: str | None = None, download_to: str | None = None) -> str:
    """The vllm :data:`VERSION` wheel's path: ``given`` (a wheel file, or a folder
    holding one), else ``$KDA_ENGRAM_VLLM_WHEEL``, else ``pip download --no-deps`` into
    ``download_to`` (when given). :class:`WheelNotFound` with the reason otherwise."""
    where = given or f"{WHEEL_ENV}={os.environ.get(WHEEL_ENV)}"
    given = given or os.environ.get(WHEEL_ENV)
    if given:
        found = [given] if given.endswith(".whl") else glob.glob(os.path.join(given, f"vllm-{VERSION}-*.whl"))
        if found and os.path.exists(found[0]):
            return found[0]
        raise WheelNotFound(f"{where} holds no vllm-{VERSION} wheel")
    if download_to is None:
        raise WheelNotFound(f"no vllm-{VERSION} wheel given (--wheel, or {WHEEL_ENV})")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"vllm=={VERSION}", "-d", download_to]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WheelNotFound(f"cannot fetch the vllm {VERSION} wheel: {e}") from None
    found = glob.glob(os.path.join(download_to, f"vllm-{VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelNotFound(f"cannot fetch the vllm {VERSION} wheel (pip download: {last})")
    return found[0]


def _write(root: str, path: str, text: str) -> None:
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)


def extract(wheel: str, root: str, platform: str = "cpu") -> list[str]:
    """:data:`FROM_WHEEL` unmodified into ``root``, then :data:`STUBS`, the
    ``platform`` stub of :data:`PLATFORMS`, :data:`ABSENT` and :data:`EMPTY_PACKAGES`.
    Returns the paths (relative to ``root``) of the files written."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform: expected one of {sorted(PLATFORMS)}, got {platform!r}")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist()
                 if any(n == w or (w.endswith("/") and n.startswith(w)) for w in FROM_WHEEL)]
        z.extractall(root, members=names)
    written = [n for n in names if not n.endswith("/")]
    for path, text in {**STUBS, "vllm/platforms/__init__.py": PLATFORMS[platform]}.items():
        _write(root, path, text)
        written.append(path)
    for path in ABSENT:
        module = (path[:-len("/__init__.py")] if path.endswith("/__init__.py") else path[:-3]).replace("/", ".")
        _write(root, path, f"from vllm._absent import absent_names\n__getattr__ = absent_names({module!r})\n")
        written.append(path)
    for path in EMPTY_PACKAGES:
        if not os.path.exists(os.path.join(root, path)):
            _write(root, path, "")
            written.append(path)
    return list(dict.fromkeys(written))  # a stub over a wheel file counts once


def read_marker(folder: str) -> dict | None:
    """What :func:`prepare` recorded in ``folder`` (``vllm``, ``platform``, ``wheel``,
    ``files``, ``bytes``), or None where it prepared nothing there."""
    path = os.path.join(folder, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def prepare(folder: str, wheel: str, platform: str = "cuda") -> dict:
    """The files a GPU run needs, extracted from ``wheel`` into ``folder/vllm`` with
    the ``platform`` stub, and :data:`MARKER` beside it; a ``vllm/`` this function
    wrote before is replaced, any other one refused (``FileExistsError``). Returns
    what the marker records."""
    target = os.path.join(folder, "vllm")
    if os.path.exists(target):
        if read_marker(folder) is None:
            raise FileExistsError(f"{target}: exists and was not prepared by kda-engram (no {MARKER} beside it)")
        shutil.rmtree(target)
    os.makedirs(folder, exist_ok=True)
    written = extract(wheel, folder, platform)
    size = sum(os.path.getsize(os.path.join(folder, p)) for p in written)
    record = {"vllm": VERSION, "platform": platform, "wheel": os.path.basename(wheel), "files": len(written),
              "bytes": size}
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(record, f, indent=1)
    return record
