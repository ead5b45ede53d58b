"""The Hopper prefill path: the folded prologue (two Triton launches,
:mod:`kda_engram.kda.hopper.folded_prologue`) then the Gluon walk (one launch,
:mod:`kda_engram.kda.hopper.walk`).

:func:`hopper_verdict` (the registered verifier of the ``"hopper"`` backend,
:mod:`kda_engram.kda.prefill_paths`) says whether a call can take this path and, if
not, why in one line; :func:`hopper_kda_prefill` runs it with the contract of
:func:`kda_engram.kda.chunk_kda_prefill` (arguments assumed valid, guarded by the
caller). Why a separate path: the portable walk's operands (``w, u, kg_t, aqk``)
cost the prologue a second ``[64, V]`` solve and the walk 0.5 KB more per
token-head, and Triton cannot keep the state in wgmma registers across chunks.
"""

from __future__ import annotations

import torch

from ...bundles import ConvArgs, KDAInputs, StateArgs
from ...platform import arch, interpreting
from ..prefill_paths import PrefillBackend, PrefillCall, Verdict, register
from ..state import allocate_final_state
from .folded_prologue import prepare_folded_prologue
from .walk import folded_walk, tma_compatible

__all__ = ["HOPPER_HEAD_DIMS", "hopper_kda_prefill", "hopper_verdict"]

HOPPER_HEAD_DIMS = (128,)  # K = V: the head size compiled and checked on the GPU


def hopper_verdict(call: PrefillCall) -> Verdict:
    """Whether the Hopper path serves ``call`` and, if not, why (one line): the
    ``"hopper"`` backend's verifier (:mod:`kda_engram.kda.prefill_paths`)."""
    q, v, out = call.q, call.v, call.out
    dev = q.device
    if dev.type != "cuda" or interpreting():
        return False, (f"needs a CUDA device running compiled kernels "
                       f"(got {dev.type}{', interpreter' if interpreting() else ''})")
    if arch(dev) != "sm_90":
        return False, f"needs an sm_90 GPU (Hopper), got {arch(dev)}"
    if q.dtype != torch.bfloat16:  # the dtype its GPU tests check
        return False, f"needs bf16 inputs, got {q.dtype}"
    K, V = q.shape[3], v.shape[3]
    if K not in HOPPER_HEAD_DIMS or V not in HOPPER_HEAD_DIMS or K != V:
        return False, f"needs K = V in {HOPPER_HEAD_DIMS}, got K = {K}, V = {V}"
    if q.shape[1] == 0:
        return False, "an empty batch (T = 0) needs no walk"
    if call.groups is not None and call.groups != 1:
        return False, f"has no chunk groups (groups={call.groups})"
    if call.conv_weight is None and not tma_compatible(v):
        return False, "v must have unit channel stride, packed heads and a 16-byte token stride (TMA)"
    if out is not None and not tma_compatible(out):
        return False, "out must have unit channel stride, packed heads and a 16-byte token stride (TMA)"
    return True, None


def hopper_kda_prefill(x: KDAInputs, *, cu_seqlens, chunk_offsets, chunk_indices, out, state: StateArgs,
                       conv: ConvArgs, groups=None):
    """The prefill on the Hopper path: returns ``(out, final_state | None)`` exactly as
    :func:`kda_engram.kda.chunk_kda_prefill` does (no checks here: the caller has
    validated and guarded every argument, and :func:`hopper_verdict` said yes; so
    ``groups`` is ``None`` or 1: the path has no chunk groups).

    ``out`` ``[1, T, H, V]`` is written only inside the sequences; it may be ``v``
    (each chunk's ``v`` tile is read before its ``o`` tile is stored, by the same CTA)."""
    final_state, state_kw = walk_state(x, cu_seqlens, state)
    ops = prepare_folded_prologue(x, cu_seqlens, chunk_indices, conv)()
    folded_walk(ops["qg"], ops["kd"], ops["t_fold"], ops["a_fold"], ops["v"], ops["decay"], out, x.scale, cu_seqlens,
                chunk_offsets, **state_kw)
    return out, final_state


def walk_state(x: KDAInputs, cu_seqlens, state: StateArgs) -> tuple[torch.Tensor | None, dict]:
    """``(final_state | None, state keywords)`` of a prefill that walks on the Hopper
    path (this one and :func:`~kda_engram.kda.hopper.fused_prefill.fused_kda_prefill`):
    the final state ``[N, H, V, K]`` allocated where ``state`` asks for it, and
    ``state``'s tensors as the keywords :func:`~kda_engram.kda.hopper.walk.folded_walk`
    and :func:`~kda_engram.kda.hopper.fused.fused_prefill` take (``has_initial_state``
    viewed as uint8, the snapshots only with their checkpoint offsets)."""
    N = cu_seqlens.numel() - 1
    _, T, H, K = x.q.shape
    V = x.v.shape[3]
    final_state = None
    if state.output_final_state:
        final_state = allocate_final_state(state, (N, H, V, K), x.q.device)
    has = state.has_initial_state.view(torch.uint8) if state.has_initial_state is not None else None
    return final_state, dict(
        initial_state=state.initial_state, final_state=final_state, state_cache=state.state_cache,
        state_indices=state.state_indices, has_initial_state=has,
        checkpoint_state=state.snapshots if state.checkpoint_offsets is not None else None,
        checkpoint_offsets=state.checkpoint_offsets, checkpoint_state_indices=state.checkpoint_state_indices)


# Priority 20: ``path="auto"`` takes it after the grouped walk, before the portable path
# (since its GPU tests, walk check and benchmark passed on an H100:
# docs/design/kda_fused_prefill.md).
register(PrefillBackend("hopper", path="hopper", title="the Hopper path", verify=hopper_verdict,
                        run=hopper_kda_prefill, priority=20))

