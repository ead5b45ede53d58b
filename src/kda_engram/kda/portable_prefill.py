"""The portable prefill path as two registered backends (:mod:`kda_engram.kda.prefill_paths`):
:func:`~kda_engram.kda.prologue.prepare_kda_prologue` then
:func:`~kda_engram.kda.chunk.walk_chunks`, on every device the Triton kernels run on.

* ``"portable"`` (priority 10): the fallback of ``path="auto"``;
* ``"grouped"`` (priority 30, runs as ``path="portable"``): the same path where its walk
  cuts the sequences into parallel chunk groups (long sequences on few heads, where the
  groups' parallel walk beats one CTA per sequence and head, Hopper's included).
"""

from __future__ import annotations

from ..bundles import ConvArgs, KDAInputs, StateArgs
from ..constants import KDA_HEAD_DIMS
from ..platform import interpreting, is_gpu
from .chunk import walk_chunks
from .groups import resolve_groups
from .prefill_paths import PrefillBackend, PrefillCall, Verdict, register
from .prologue import prepare_kda_prologue

__all__ = ["grouped_verdict", "portable_kda_prefill", "portable_verdict"]


def portable_verdict(call: PrefillCall) -> Verdict:
    """The ``"portable"`` backend's verifier: the device runs the kernels (a CUDA/ROCm
    GPU, or any device under the interpreter) and the head dims are served."""
    if not (is_gpu(call.q.device) or interpreting()):
        return False, f"needs a CUDA/ROCm device (or TRITON_INTERPRET=1), got {call.q.device}"
    K, V = call.q.shape[3], call.v.shape[3]
    if K not in KDA_HEAD_DIMS or V not in KDA_HEAD_DIMS:
        return False, f"needs head dims K, V in {KDA_HEAD_DIMS}, got K={K}, V={V}"
    return True, None


def grouped_verdict(call: PrefillCall) -> Verdict:
    """The ``"grouped"`` backend's verifier: the portable path serves the call and its
    walk cuts the sequences into chunk groups (:func:`~kda_engram.kda.groups.resolve_groups`)."""
    ok, reason = portable_verdict(call)
    if not ok:
        return ok, reason
    H, K, V = call.q.shape[2], call.q.shape[3], call.v.shape[3]
    n_groups, _ = resolve_groups(call.groups, None, call.tokens, call.num_seqs, H, K, V, call.q.device)
    if n_groups == 1:
        return False, "takes one chunk group here (the serial walk)"
    return True, None


def portable_kda_prefill(x: KDAInputs, *, cu_seqlens, chunk_offsets, chunk_indices, out, state: StateArgs,
                         conv: ConvArgs, groups=None):
    """The prefill on the portable path (the ``"portable"`` and ``"grouped"`` backends):
    :func:`~kda_engram.kda.prologue.prepare_kda_prologue` then
    :func:`~kda_engram.kda.chunk.walk_chunks`, which cuts the sequences into chunk
    groups where ``groups`` (or its heuristic) says so. Returns ``(out, final_state |
    None)`` as :func:`~kda_engram.kda.prefill.chunk_kda_prefill` does (no checks here: the caller has validated
    and guarded every argument)."""
    ops = prepare_kda_prologue(x, cu_seqlens, conv, chunk_indices)()
    return walk_chunks(ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"], out, x.scale, cu_seqlens,
                       chunk_offsets, state, groups=groups)


register(PrefillBackend("portable", path="portable", title="the portable path", verify=portable_verdict,
                        run=portable_kda_prefill, priority=10))
register(PrefillBackend("grouped", path="portable", title="the grouped walk", verify=grouped_verdict,
                        run=portable_kda_prefill, priority=30))
