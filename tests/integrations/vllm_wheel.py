"""vLLM 0.33.0's own kernel-call code, loaded from its wheel on a CPU-only machine.

The wheel is fetched with ``pip download --no-deps vllm==0.33.0`` into a temporary
folder (or taken from ``$KDA_ENGRAM_VLLM_WHEEL``, a wheel file or a folder holding
one); the tests that need it skip, with the reason, when it cannot be had. Only the
files in ``FROM_WHEEL`` are extracted, into a temporary folder that is put on
``sys.path`` as the ``vllm`` package; nothing of vLLM is committed here.

What is extracted and what is stubbed (``FROM_WHEEL``, ``STUBS``, ``ABSENT``,
``EMPTY_PACKAGES``, the CPU platform of ``PLATFORMS``) is defined once, in
:mod:`kda_engram.tools.vllm_files`, which the GPU comparison
(``kda_engram.tools.benchmarks.bench_vllm_plugin``) shares with a CUDA platform.
The code under test -- the ``FROM_WHEEL`` files -- is vLLM's own, byte for byte, but
for one package ``__init__`` that only re-exports other ops (the FLA ops package's).
vLLM's Triton kernels run under the interpreter with :func:`vllm_kernels_on_cpu` (the
first autotune config, as vLLM's own ``VLLM_TRITON_FORCE_FIRST_CONFIG``, and three
interpreter fixes on Triton's side).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile

import numpy as np
import pytest

from kda_engram.tools.vllm_files import WheelNotFound, extract, find_wheel


def fetch_wheel(folder: str) -> str:
    """The vllm 0.33.0 wheel's path (``$KDA_ENGRAM_VLLM_WHEEL``, else ``pip download``
    into ``folder``); ``pytest.skip`` with the reason when it cannot be had."""
    try:
        return find_wheel(download_to=folder)
    except WheelNotFound as e:
        pytest.skip(str(e))


def _forget_vllm() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def vllm_root():
    """The extracted tree (CPU platform) on ``sys.path`` (as ``vllm``) for the session;
    removed after."""
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
