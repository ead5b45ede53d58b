"""vLLM plugin: puts kda-engram's kernels under vLLM 0.33's Kimi-K3 / Kimi-Linear KDA calls.

Registered as a ``vllm.general_plugins`` entry point (``pyproject.toml``), so vLLM
calls :func:`register` in each of its processes before it builds a model. It
changes nothing unless

* vLLM is 0.33.x (on any other version it logs one warning and returns: the names
  and contracts below are 0.33's), and
* the switch :data:`SWITCH` (``KDA_ENGRAM_VLLM=1``) is set in the environment.

Then it replaces, in the module that defines each name and in the modules that
import it (those already imported; later imports take the replaced name), the
functions of :data:`REPLACEMENTS` with the functions of
:mod:`kda_engram.integrations.vllm_kimi_k3`, which have vLLM's exact contracts,
and logs once what it replaced. A module that cannot be imported here (another
vendor's build) is skipped and named in that log line.

Replaced so far:

* ``vllm.models.kimi_k3.amd.ops.kda_prefill.chunk_kda_prefill`` (the ROCm Kimi-K3
  layer's prefill, every ``kda_prefill_backend``), and
  ``kda_chunk.is_fused_kda_chunk_supported`` as seen by that layer (True: the layer
  enables the ``"fused"`` backend and its prefill checkpoints, which ours serve);
* ``chunk_kda_with_fused_gate``, ``fused_recurrent_kda_packed_decode`` and
  ``fused_recurrent_kda`` of both vendors' ``ops/third_party/kda`` (the NVIDIA
  Kimi-K3 layer's and Kimi-Linear's prefill, the Kimi-K3 layers' and Kimi-Linear's
  pure-decode step, decode peel and speculative verify; the layers import them from
  there at each forward).

Everything else in those layers (the convolutions, the gated RMSNorm, the Engram
layer) stays vLLM's own.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

__all__ = ["REPLACEMENTS", "SUPPORTED_VLLM", "SWITCH", "register", "replaced"]

#: The environment switch: ``1`` turns the replacement on, unset or ``0`` leaves vLLM as is.
SWITCH = "KDA_ENGRAM_VLLM"
#: The vLLM release line whose names and contracts the replacements follow.
SUPPORTED_VLLM = (0, 33)

# Under vLLM's logger tree, so vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.plugins.kda_engram")

_AMD = "vllm.models.kimi_k3.amd"
_NVIDIA = "vllm.models.kimi_k3.nvidia"


def _fused_chunk_supported() -> bool:
    """``is_fused_kda_chunk_supported`` with the plugin on: the ``"fused"`` prefill
    backend (and its checkpoints) is served by kda-engram's kernels on any device."""
    return True


def _ours(name: str):
    if name == "is_fused_kda_chunk_supported":
        return _fused_chunk_supported
    from . import vllm_kimi_k3

    return getattr(vllm_kimi_k3, name)


#: ``(module that defines the name, name, our function's name in
#: :mod:`~kda_engram.integrations.vllm_kimi_k3`, modules that import it by name)``.
REPLACEMENTS = (
    (f"{_AMD}.ops.kda_prefill", "chunk_kda_prefill", "chunk_kda_prefill", (f"{_AMD}.kda",)),
    (f"{_AMD}.ops.kda_chunk", "is_fused_kda_chunk_supported", "is_fused_kda_chunk_supported", (f"{_AMD}.kda",)),
    (f"{_AMD}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda_packed_decode",
     "fused_recurrent_kda_packed_decode", (f"{_AMD}.ops.third_party.kda", f"{_AMD}.kda")),
    (f"{_NVIDIA}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda_packed_decode",
     "fused_recurrent_kda_packed_decode", (f"{_NVIDIA}.ops.third_party.kda", f"{_NVIDIA}.kda")),
    (f"{_AMD}.ops.third_party.kda.chunk", "chunk_kda_with_fused_gate", "chunk_kda_with_fused_gate",
     (f"{_AMD}.ops.third_party.kda",)),
    (f"{_NVIDIA}.ops.third_party.kda.chunk", "chunk_kda_with_fused_gate", "chunk_kda_with_fused_gate_nvidia",
     (f"{_NVIDIA}.ops.third_party.kda", f"{_NVIDIA}.kda")),
    (f"{_AMD}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda", "fused_recurrent_kda",
     (f"{_AMD}.ops.third_party.kda", f"{_AMD}.kda")),
    (f"{_NVIDIA}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda", "fused_recurrent_kda_nvidia",
     (f"{_NVIDIA}.ops.third_party.kda", f"{_NVIDIA}.kda")),
)

_state = {"done": False, "replaced": [], "skipped": []}


def replaced() -> list[str]:
    """The ``module.name`` targets this process replaced (empty when off)."""
    return list(_state["replaced"])


def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in text.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def _switch_on() -> bool:
    value = os.environ.get(SWITCH, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    logger.warning("kda-engram: %s=%r is neither 1 nor 0; vLLM's kernels stay in place", SWITCH, value)
    return False


def register() -> None:
    """The entry point (idempotent: one check and one log line per process)."""
    if _state["done"]:
        return
    _state["done"] = True
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if _version(version) != SUPPORTED_VLLM:
        logger.warning("kda-engram's vLLM plugin serves vLLM %d.%d.x, found %s: nothing replaced",
                       *SUPPORTED_VLLM, version)
        return
    if not _switch_on():
        return
    for module_name, name, our_name, importers in REPLACEMENTS:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # another vendor's build, a missing extension
            _state["skipped"].append(f"{module_name}.{name} ({type(e).__name__}: {e})")
            continue
        ours = _ours(our_name)
        setattr(module, name, ours)
        for importer in importers:
            loaded = sys.modules.get(importer)
            if loaded is not None and hasattr(loaded, name):
                setattr(loaded, name, ours)
        _state["replaced"].append(f"{module_name}.{name}")
    logger.info("kda-engram: replaced %s with kda-engram's kernels%s", ", ".join(_state["replaced"]) or "nothing",
                f"; skipped {'; '.join(_state['skipped'])}" if _state["skipped"] else "")
