"""vLLM 0.33.0's own kernel-call code, loaded from its wheel on a CPU-only machine.

The wheel is fetched with ``pip download --no-deps vllm==0.33.0`` into a temporary
folder (or taken from ``$KDA_ENGRAM_VLLM_WHEEL``, a wheel file or a folder holding
one); the tests that need it skip, with the reason, when it cannot be had. Only the
files in :data:`FROM_WHEEL` are extracted, into a temporary folder that is put on
``sys.path`` as the ``vllm`` package; nothing of vLLM is committed here.

vLLM cannot be imported whole on a CPU box (its ``__init__`` pulls the engine, its
platform layer wants a GPU), so :data:`STUBS` and :data:`ABSENT` replace the modules
outside the kernel-call code that it imports, each with the minimum that code reads.
The code under test -- the ``FROM_WHEEL`` files -- is vLLM's own, byte for byte, but
for one package ``__init__`` that only re-exports other ops (the FLA ops package's,
in :data:`STUBS`). vLLM's Triton kernels run under the interpreter with
:func:`vllm_kernels_on_cpu` (the first autotune config, as vLLM's own
``VLLM_TRITON_FORCE_FIRST_CONFIG``, and three interpreter fixes on Triton's side).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import pytest

VERSION = "0.33.0"

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
    # A CPU "platform": no CUDA, no ROCm, no PDL.
    "vllm/platforms/__init__.py": (
        "class _Cpu:\n"
        "    def is_cuda(self): return False\n"
        "    def is_rocm(self): return False\n"
        "    def is_cuda_alike(self): return False\n"
        "    def has_device_capability(self, *a, **k): return False\n"
        "    def is_arch_support_pdl(self): return False\n"
        "current_platform = _Cpu()\n"
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
        "    def __call__(self, *a, **k): raise RuntimeError(f'{self.name}: not in the CPU harness')\n"
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


def fetch_wheel(folder: str) -> str:
    """The vllm 0.33.0 wheel's path; ``pytest.skip`` with the reason when it cannot be had."""
    given = os.environ.get("KDA_ENGRAM_VLLM_WHEEL")
    if given:
        found = [given] if given.endswith(".whl") else glob.glob(os.path.join(given, f"vllm-{VERSION}-*.whl"))
        if found and os.path.exists(found[0]):
            return found[0]
        pytest.skip(f"KDA_ENGRAM_VLLM_WHEEL={given} holds no vllm-{VERSION} wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"vllm=={VERSION}", "-d", folder]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot fetch the vllm {VERSION} wheel: {e}")
    found = glob.glob(os.path.join(folder, f"vllm-{VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"cannot fetch the vllm {VERSION} wheel (pip download: {last})")
    return found[0]


def extract(wheel: str, root: str) -> None:
    """:data:`FROM_WHEEL` unmodified, then :data:`STUBS`, :data:`ABSENT` and :data:`EMPTY_PACKAGES`."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist()
                 if any(n == w or (w.endswith("/") and n.startswith(w)) for w in FROM_WHEEL)]
        z.extractall(root, members=names)
    for path, text in STUBS.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    for path in ABSENT:
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        module = (path[:-len("/__init__.py")] if path.endswith("/__init__.py") else path[:-3]).replace("/", ".")
        with open(full, "w") as f:
            f.write(f"from vllm._absent import absent_names\n__getattr__ = absent_names({module!r})\n")
    for path in EMPTY_PACKAGES:
        full = os.path.join(root, path)
        if not os.path.exists(full):
            os.makedirs(os.path.dirname(full), exist_ok=True)
            open(full, "w").close()


def _forget_vllm() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def vllm_root():
    """The extracted tree on ``sys.path`` (as ``vllm``) for the session; removed after."""
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as folder:
        wheel = fetch_wheel(folder)
        root = os.path.join(folder, "tree")
        extract(wheel, root)
        _forget_vllm()
        sys.path.insert(0, root)
        try:
            importlib.invalidate_caches()
            yield root
        finally:
            sys.path.remove(root)
            _forget_vllm()


@contextlib.contextmanager
def interpreted_like_compiled():
    """Inside: Triton's interpreter also patches the builtins a kernel's module holds
    under its own names. vLLM's FLA code binds ``make_tensor_descriptor =
    triton.language.make_tensor_descriptor`` at import (``ops/op.py``); the
    interpreter patches builtins only where a kernel reaches them through the
    ``triton.language`` module, so the alias fails ("Did you forget to add
    @triton.jit?") where the compiler takes it. A harness fix on Triton's side
    (``triton.runtime.interpreter._patch_lang``, Triton's internals; triton is
    pinned to 3.5-3.6), restored on the way out; vLLM's code is not touched. Also
    two more places where the interpreter differs from the compiler, each below:
    a one-element block as an index, and the type of a ``range`` loop's variable
    (in vLLM's kernel modules only)."""
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang

    def with_aliases(fn):
        scope = patch_lang(fn)
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if module is not None and module.__name__.startswith("vllm."):
            interpreter._patch_builtin(module, interpreter.interpreter_builder, scope)
            # A loop over Python's range: compiled, its variable is an int32 tensor
            # (``i_t.to(tl.int64)`` in chunk_delta_h.py); interpreted, a Python int.
            scope.set_attr(module, "range", _tensor_range)
        # A one-element block as a Python int (``range(2, min(BC, T - i_ti))`` in
        # chunk_intra.py): numpy >= 2.? refuses int() of a 1-d array, .item() takes it.
        scope.set_attr(interpreter.tl.tensor, "__index__", lambda self: int(self.handle.data.item()))
        return scope

    def _tensor_range(*bounds):
        for i in range(*(int(b) for b in bounds)):
            handle = interpreter.TensorHandle(np.array(i, dtype=np.int32), interpreter.tl.int32)
            yield interpreter.tl.core.tensor(handle, interpreter.tl.int32)

    interpreter._patch_lang = with_aliases
    try:
        yield
    finally:
        interpreter._patch_lang = patch_lang


@contextlib.contextmanager
def first_config_autotune():
    """Inside: every Triton autotuner launches its first config once, without timing
    (vLLM's own ``VLLM_TRITON_FORCE_FIRST_CONFIG`` mode, ``triton_utils/
    force_first_config.py``, here restored on the way out). Timing runs would launch
    vLLM's in-place kernels more than once (``chunk_gla_fwd_o_gk`` writes ``o`` over
    ``v``), which the real path never does for a tuned key."""
    from triton.runtime.autotuner import Autotuner

    run = Autotuner.run

    def first(self, *args, **kwargs):
        config = self.configs[0]
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()})
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    Autotuner.run = first
    try:
        yield
    finally:
        Autotuner.run = run


@contextlib.contextmanager
def vllm_kernels_on_cpu():
    """Both harness settings above, for a call into vLLM's kernel code."""
    with first_config_autotune(), interpreted_like_compiled():
        yield
