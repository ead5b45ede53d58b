"""vLLM plugin: puts kda-engram's kernels under vLLM 0.33's Kimi-K3 / Kimi-Linear KDA calls.

Registered as a ``vllm.general_plugins`` entry point (``pyproject.toml``), so vLLM
calls :func:`register` in each of its processes before it builds a model. It
changes nothing unless

* vLLM is 0.33.x (on any other version it logs one warning and returns: the names
  and contracts below are 0.33's), and
* the switch :data:`SWITCH` is set in the environment: ``KDA_ENGRAM_VLLM=1`` replaces
  the calls where ours measured at least as fast as vLLM's kernel (every target of
  :data:`REPLACEMENTS` but those of :data:`KEPT_BY_DEFAULT`, and of the rest the calls
  :data:`KEPT_CALLS` picks go to vLLM's own function), ``KDA_ENGRAM_VLLM=all`` every
  target and call.

Then it replaces the functions of :data:`REPLACEMENTS` with the functions of
:mod:`kda_engram.integrations.vllm_kimi_k3` and
:mod:`kda_engram.integrations.vllm_deepseek_v41`, which have vLLM's exact contracts, in
the module that defines each name, right after vLLM imports that module (an import
hook; one already imported is patched at once, together with the modules that
imported the name from it), and logs once, at INFO, what it replaces. It imports
none of vLLM's model modules itself.

Replaced: the KDA prefill, packed decode, decode peel and speculative verify calls of
the Kimi-K3 (ROCm and NVIDIA) and Kimi-Linear layers, the Engram gate and hash kernel
launches, and ``Engram.__init__`` / ``forward`` (the dim-sharded gate where tensor
parallelism is on and the layer allows it): :data:`REPLACEMENTS` names each target and
its replacement; the README's "Using kda-engram from vLLM" says what each honours.

Everything else in those layers (the convolutions, the gated RMSNorm, the Engram
slot-cache write, lookup and ``wkv``) stays vLLM's own.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys

__all__ = ["KEPT_BY_DEFAULT", "KEPT_CALLS", "REPLACEMENTS", "SUPPORTED_VLLM", "SWITCH", "original", "register",
           "replaced", "resolve", "selected"]

#: The environment switch: ``1`` replaces the calls where ours is at least as fast,
#: ``all`` every call, unset or ``0`` leaves vLLM as is.
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


def _ours(path: str):
    """Our replacement named ``"module.attribute"`` within :mod:`kda_engram.integrations`."""
    module, attribute = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__package__}.{module}"), attribute)


#: ``(module that defines the name, name (``"Class.method"`` for a method), our
#: replacement as "module.attribute" of kda_engram.integrations, modules that import
#: the name from it)``.
REPLACEMENTS = (
    (f"{_AMD}.ops.kda_prefill", "chunk_kda_prefill", "vllm_kimi_k3.chunk_kda_prefill", (f"{_AMD}.kda",)),
    (f"{_AMD}.ops.kda_chunk", "is_fused_kda_chunk_supported", "vllm_plugin._fused_chunk_supported", (f"{_AMD}.kda",)),
    (f"{_AMD}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda_packed_decode",
     "vllm_kimi_k3.fused_recurrent_kda_packed_decode", (f"{_AMD}.ops.third_party.kda", f"{_AMD}.kda")),
    (f"{_NVIDIA}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda_packed_decode",
     "vllm_kimi_k3.fused_recurrent_kda_packed_decode", (f"{_NVIDIA}.ops.third_party.kda", f"{_NVIDIA}.kda")),
    (f"{_AMD}.ops.third_party.kda.chunk", "chunk_kda_with_fused_gate", "vllm_kimi_k3.chunk_kda_with_fused_gate",
     (f"{_AMD}.ops.third_party.kda",)),
    (f"{_NVIDIA}.ops.third_party.kda.chunk", "chunk_kda_with_fused_gate",
     "vllm_kimi_k3.chunk_kda_with_fused_gate_nvidia", (f"{_NVIDIA}.ops.third_party.kda", f"{_NVIDIA}.kda")),
    (f"{_AMD}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda", "vllm_kimi_k3.fused_recurrent_kda",
     (f"{_AMD}.ops.third_party.kda", f"{_AMD}.kda")),
    (f"{_NVIDIA}.ops.third_party.kda.fused_recurrent", "fused_recurrent_kda", "vllm_kimi_k3.fused_recurrent_kda_nvidia",
     (f"{_NVIDIA}.ops.third_party.kda", f"{_NVIDIA}.kda")),
    ("vllm.models.deepseek_v41.common.engram", "_fused_engram_post_wkv_kernel",
     "vllm_deepseek_v41.fused_engram_post_wkv_kernel", ()),
    ("vllm.models.deepseek_v41.common.engram", "_hash_ids_kernel", "vllm_deepseek_v41.hash_ids_kernel", ()),
    ("vllm.models.deepseek_v41.common.engram", "Engram.__init__", "vllm_deepseek_v41.engram_init", ()),
    ("vllm.models.deepseek_v41.common.engram", "Engram.forward", "vllm_deepseek_v41.engram_forward", ()),
)

#: Every target, ``"module.name"`` (``Class.method`` for a method).
_TARGETS = frozenset(f"{m}.{n}" for m, n, *_ in REPLACEMENTS)

#: Targets whose replacement measured slower than vLLM's own kernel (one H100, bf16,
#: ``bench_vllm_plugin --quick``; the runs: docs/design/vllm_plugin.md):
#: ``KDA_ENGRAM_VLLM=1`` leaves them vLLM's, ``KDA_ENGRAM_VLLM=all`` replaces them too.
#: Target -> what was measured.
KEPT_BY_DEFAULT = {
    f"{_AMD}.ops.third_party.kda.fused_recurrent.fused_recurrent_kda_packed_decode":
        "packed decode B 256: 0.59x eager, 0.98x in a CUDA graph",
    f"{_NVIDIA}.ops.third_party.kda.fused_recurrent.fused_recurrent_kda_packed_decode":
        "packed decode B 256: 0.56x eager, 0.98x in a CUDA graph",
    f"{_AMD}.ops.third_party.kda.fused_recurrent.fused_recurrent_kda":
        "decode peel B 256: 0.27x eager, 0.98x in a CUDA graph; speculative verify 256 x 4: 0.80x, 0.91x",
    f"{_NVIDIA}.ops.third_party.kda.fused_recurrent.fused_recurrent_kda":
        "speculative verify 256 x 4: 0.69x eager, 0.91x in a CUDA graph",
    "vllm.models.deepseek_v41.common.engram._hash_ids_kernel":
        "Engram hash T 4096: 0.28-0.30x eager, 0.59-0.70x in a CUDA graph",
}


def _softplus_gate(args, kwargs) -> bool:
    """Whether a ``chunk_kda_with_fused_gate`` call (either copy's signature:
    ``lower_bound`` is the 11th parameter) has the unbounded softplus gate."""
    lower_bound = kwargs["lower_bound"] if "lower_bound" in kwargs else (args[10] if len(args) > 10 else None)
    return lower_bound is None


#: Targets replaced by ``KDA_ENGRAM_VLLM=1`` whose replacement measured slower for some
#: calls: those calls go to vLLM's own function (``=all`` keeps ours for them too).
#: Target -> (the rule picking those calls, the calls in words, what was measured).
KEPT_CALLS = {
    f"{copy}.ops.third_party.kda.chunk.chunk_kda_with_fused_gate":
        (_softplus_gate, "with the softplus gate (Kimi-Linear)",
         "16 x 2048, H 32, one H100: the NVIDIA copy 0.94x (4.87 ms against 4.56; 0.23x before the "
         "per-sub-chunk diagonal form); the ROCm copy 1.38x there, not measured on an AMD GPU")
    for copy in (_NVIDIA, _AMD)
}


def _keeping_calls(ours, theirs, calls):
    """``ours``, except that the calls ``calls(args, kwargs)`` picks go to ``theirs``."""

    def dispatch(*args, **kwargs):
        return (theirs if calls(args, kwargs) else ours)(*args, **kwargs)

    dispatch.__name__, dispatch.__qualname__, dispatch.__doc__ = ours.__name__, ours.__qualname__, ours.__doc__
    dispatch.__wrapped__ = ours
    return dispatch


_state = {"done": False, "replaced": [], "finder": None, "originals": {}, "selected": set(), "modules": set()}


def replaced() -> list[str]:
    """The ``module.name`` targets this process has replaced so far (empty when off)."""
    return list(_state["replaced"])


def resolve(module, name: str):
    """``(owner, attribute)`` of a target ``name`` in ``module``: a module attribute,
    or ``"Class.method"`` (the class's attribute)."""
    owner, *path = name.split(".")
    if not path:
        return module, name
    owner = getattr(module, owner)
    for part in path[:-1]:
        owner = getattr(owner, part)
    return owner, path[-1]


def original(target: str):
    """vLLM's own object that the plugin replaced as ``target`` (``"module.name"``, as
    :func:`replaced` lists it), for a replacement that keeps vLLM's path in the cases it
    does not serve. ``KeyError`` naming ``target`` when it was not replaced."""
    try:
        return _state["originals"][target]
    except KeyError:
        raise KeyError(f"target: {target!r} was not replaced by the kda-engram plugin in this process") from None


def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in text.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def selected() -> set[str]:
    """The ``"module.name"`` targets :data:`SWITCH` asks for in this process: none (unset
    or ``0``), those not :data:`KEPT_BY_DEFAULT` (``1``), every one (``all``). Any other
    value: none, with one warning."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value in ("", "0"):
        return set()
    if value == "1":
        return set(_TARGETS - set(KEPT_BY_DEFAULT))
    if value == "all":
        return set(_TARGETS)
    logger.warning("kda-engram: %s=%r is none of 1, all or 0; vLLM's kernels stay in place", SWITCH, value)
    return set()


def _patch(module) -> None:
    """Replace the targets ``module`` defines, there and in its importers already loaded."""
    for module_name, name, our_name, importers in REPLACEMENTS:
        if module_name != module.__name__ or f"{module_name}.{name}" not in _state["selected"]:
            continue
        ours = _ours(our_name)
        owner, attribute = resolve(module, name)
        theirs = _state["originals"].setdefault(f"{module_name}.{name}", getattr(owner, attribute))
        kept = KEPT_CALLS.get(f"{module_name}.{name}")
        if kept is not None and _state["selected"] != _TARGETS:
            ours = _keeping_calls(ours, theirs, kept[0])  # the calls it picks stay vLLM's
        setattr(owner, attribute, ours)
        for importer in importers:
            loaded = sys.modules.get(importer)
            if loaded is not None and hasattr(loaded, name):
                setattr(loaded, name, ours)
        _state["replaced"].append(f"{module_name}.{name}")
        logger.debug("kda-engram: replaced %s.%s", module_name, name)


class _PatchingLoader(importlib.abc.Loader):
    """The loader of a target module, followed by :func:`_patch` once it has run."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name):
        # get_source, get_filename, is_package, ...: the wrapped loader's (inspect and
        # Triton read a kernel's source through them where the file is not at hand).
        return getattr(self.loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a target module it takes the spec the next finders
    give and wraps its loader, so the module is patched right after vLLM imports it
    (and before any module that imports names from it reads them)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _state["modules"]:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def register() -> None:
    """The entry point (idempotent: one check and one log line per process).

    Imports nothing of vLLM's but its version: the targets already imported are
    patched now, the others as vLLM imports them (an import hook on ``sys.meta_path``),
    so a build without one vendor's modules simply never patches them."""
    if _state["done"]:
        return
    _state["done"] = True
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if _version(version) != SUPPORTED_VLLM:
        logger.warning("kda-engram's vLLM plugin serves vLLM %d.%d.x, found %s: nothing replaced",
                       *SUPPORTED_VLLM, version)
        return
    chosen = selected()
    if not chosen:
        return
    _state["selected"] = chosen
    _state["modules"] = {m for m, n, *_ in REPLACEMENTS if f"{m}.{n}" in chosen}  # what the import hook watches
    finder = _PatchOnImport()
    sys.meta_path.insert(0, finder)
    _state["finder"] = finder
    for module_name in dict.fromkeys(m for m, *_ in REPLACEMENTS):
        loaded = sys.modules.get(module_name)
        if loaded is not None:
            _patch(loaded)
    kept = sorted(set(KEPT_BY_DEFAULT) - chosen)
    kept += [f"{t} {which}" for t, (_, which, _) in KEPT_CALLS.items() if chosen != _TARGETS and t in chosen]
    logger.info("kda-engram: vLLM's %s run on kda-engram's kernels (replaced as vLLM imports them; already: %s)%s",
                ", ".join(f"{m}.{n}" for m, n, *_ in REPLACEMENTS if f"{m}.{n}" in chosen),
                ", ".join(_state["replaced"]) or "none",
                f"; kept vLLM's, where ours measured slower ({SWITCH}=all replaces them too): {', '.join(kept)}"
                if kept else "")


def _reset() -> None:
    """Forget this process's registration (tests): the import hook goes, the state is
    cleared; replaced names stay replaced (restore them yourself)."""
    finder = _state["finder"]
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _state.update(done=False, replaced=[], finder=None, originals={}, selected=set(), modules=set())
