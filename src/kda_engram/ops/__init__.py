"""Every public kernel entry point as a ``torch.library`` custom op (``torch.ops.kda_engram.*``).

Why: a serving engine captures its layers in CUDA graphs and compiles them with
``torch.compile(fullgraph=True)``. Dynamo cannot trace a Triton launch wrapped in
host-side heuristics without graph breaks, and Inductor must not reorder a kernel
that writes a cache in place. A custom op is opaque to both: a schema that says
which arguments it mutates, a fake implementation (output shapes from input shapes)
and an eager body, the entry point's launch without rules (a device read of the
checks would be a host sync: forbidden under capture, a graph break under compile).

Each op and its Python function (same name, same arguments but ``out`` and launch
overrides, plus ``check_inputs``) come from one definition,
:class:`~kda_engram.ops.common.EntryOp`: by default the function calls the entry point,
checked as the function is; with ``check_inputs=False`` (and while ``torch.compile``
traces) it runs the entry point's host rules once, then the op; ``fn.unchecked(...)``
crosses the op alone, for a caller that ran the rules (the layers, once per step).
Every op's body first raises an earlier call's pending broken verdict.

Conventions: outputs are allocated inside the op and never alias an input; the
mutated arguments are the caches (``state_cache``, ``checkpoint_state``,
``conv_state``, Engram history caches). A checkpoint buffer that is the state cache
crosses as ``None`` ("into ``state_cache``", as in the entry points): mutated
arguments must not alias. Rows the entry point leaves undefined stay undefined (the
prologue's ``kg_t`` / ``decay`` past the real chunks). A final state not asked for
comes back as ``[0, H, V, K]`` and the function turns it into ``None``. An
``EngramLayout`` / ``EngramTable`` travels as an integer :func:`handle` (a constant of
a compiled graph).

Modules: :mod:`~kda_engram.ops.kda` (KDA), :mod:`~kda_engram.ops.engram` (Engram),
:mod:`~kda_engram.ops.common` (handles, the op definition).
"""

from .common import NAMESPACE, handle, resolve
from .engram import (
    engram_gate_finish,
    engram_gate_partials,
    engram_history_checkpoint,
    engram_history_gather,
    engram_history_scatter,
    engram_lookup,
    engram_post_wkv,
    next_history,
    ngram_hash,
)
from .kda import (
    chunk_kda_prefill,
    kda_conv_checkpoint,
    kda_conv_decode,
    kda_decode,
    kda_decode_multi,
    kda_layer_decode_step,
    kda_prefill_prologue,
    kda_prefill_walk,
)

__all__ = [
    "NAMESPACE",
    "handle",
    "resolve",
    "kda_decode",
    "kda_decode_multi",
    "kda_prefill_prologue",
    "kda_prefill_walk",
    "chunk_kda_prefill",
    "kda_layer_decode_step",
    "kda_conv_decode",
    "kda_conv_checkpoint",
    "engram_post_wkv",
    "engram_gate_partials",
    "engram_gate_finish",
    "ngram_hash",
    "next_history",
    "engram_lookup",
    "engram_history_gather",
    "engram_history_scatter",
    "engram_history_checkpoint",
]
