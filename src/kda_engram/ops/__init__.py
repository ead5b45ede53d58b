"""Every public kernel entry point as a ``torch.library`` custom op (``torch.ops.kda_engram.*``).

Why: a serving engine captures its layers in CUDA graphs and compiles them with
``torch.compile(fullgraph=True)``. Dynamo cannot trace through a Triton launch
wrapped in host-side heuristics without graph breaks, and Inductor must not
reorder a kernel that writes a cache in place. A custom op is opaque to both:
it carries a schema that says which arguments it mutates (``mutates_args``), a
fake (meta) implementation that gives the output shapes from the input shapes
alone, and an eager implementation: the entry point's launch without rules (every
device read of the checks would be a host sync, forbidden under capture and a graph
break under compile; the Python functions below run the rules before the op, or
instead call the entry point with its checks).

Conventions of the ops:

* Outputs are allocated inside the op (``torch.empty``, contiguous); an op never
  returns an alias of an input (a custom-op rule). Mutated arguments are the
  caches the kernels update in place: ``state_cache`` / ``checkpoint_state``
  (KDA recurrent state), ``conv_state`` (KDA conv windows), history caches
  (Engram hash history).
* A checkpoint written into the state cache itself cannot be passed as a second
  tensor argument (two mutable arguments aliasing one buffer are not allowed by
  functionalization): ``checkpoint_state=None`` with ``checkpoint_offsets`` means
  "into ``state_cache``" in the entry points too, so it crosses as ``None`` (the
  wrappers turn ``checkpoint_state is state_cache`` into that).
* Outputs keep their entry point's contract: e.g. the prologue's ``kg_t`` /
  ``decay`` rows past the batch's real chunks (the static ``T // 64 + N`` bound)
  stay undefined, as nothing reads them.
* Optional returns are not expressible: a final state that was not asked for
  comes back as a ``[0, H, V, K]`` tensor; the Python wrappers turn it into
  ``None``.
* Non-tensor objects (an :class:`~kda_engram.engram.layout.EngramLayout`, an
  :class:`~kda_engram.engram.table.EngramTable`) travel as integer handles from
  :func:`handle`; the op resolves them in a weak registry. Under
  ``torch.compile`` the handle is a constant of the graph.

Every op and its Python function come from one definition,
:class:`~kda_engram.ops.common.EntryOp`, made from the entry point's own signature:
same names and defaults, minus what cannot cross an op (``out``, launch overrides),
plus the keyword ``check_inputs`` (:func:`~kda_engram.ops.common.entry_checks`). By
default (``True`` or ``"sync"``) the function calls the entry point with it, so an op
call is checked as the function is (host rules, device rules on guarded launches, the
deferred verdict); with ``check_inputs=False``, and while ``torch.compile`` traces, it
runs the entry point's host rules, the same rules function, once (shapes, dtypes,
devices, argument combinations: no device read) and calls the op: safe under capture
and compile. ``fn.unchecked(...)`` calls the op alone: a serving layer runs its step's
rules once and crosses the ops so. Every op's body first raises an earlier call's
pending broken verdict, as every entry point does. Each op's ``torch.ops`` name is its
Python function's name.

Modules: :mod:`~kda_engram.ops.kda` (KDA), :mod:`~kda_engram.ops.engram`
(Engram), :mod:`~kda_engram.ops.common` (handles, registration).
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
