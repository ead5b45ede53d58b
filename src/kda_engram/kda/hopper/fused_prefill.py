"""The fused Hopper prefill as a registered prefill backend (``path="fused"``):
:func:`fused_verdict` says whether a call can take it and, if not, why in one line;
:func:`fused_kda_prefill` runs it with the contract of
:func:`kda_engram.kda.chunk_kda_prefill` (arguments assumed valid, guarded by the
caller). The kernel is :mod:`kda_engram.kda.hopper.fused`.
"""

from __future__ import annotations

from ...bundles import ConvArgs, KDAInputs, StateArgs
from ..prefill_paths import PrefillBackend, PrefillCall, Verdict, register
from .fused import fused_prefill, fused_unsupported
from .prefill import hopper_verdict, walk_state

__all__ = ["fused_kda_prefill", "fused_verdict"]


def fused_verdict(call: PrefillCall) -> Verdict:
    """Whether the fused kernel serves ``call``: where the Hopper path does (sm_90, bf16,
    K = V = 128, TMA-readable tensors, no chunk groups), without a conv, and for the
    input forms :func:`~kda_engram.kda.hopper.fused.fused_unsupported` accepts."""
    ok, reason = hopper_verdict(call)
    if not ok:
        return ok, reason
    if call.conv_weight is not None:
        return False, "has no conv (the Hopper path runs the conv prologue)"
    x = call.inputs
    if x is None:
        return False, "needs the call's input forms (gate, lower_bound, raw_g's layout)"
    reason = fused_unsupported(x.q, x.k, x.v, x.raw_g, x.raw_beta, call.out, gate=x.gate, lower_bound=x.lower_bound)
    return reason is None, reason


def fused_kda_prefill(x: KDAInputs, *, cu_seqlens, chunk_offsets, chunk_indices, out, state: StateArgs,
                      conv: ConvArgs, groups=None):
    """The prefill in one fused launch: returns ``(out, final_state | None)`` exactly as
    :func:`kda_engram.kda.chunk_kda_prefill` does (no checks here: the caller has
    validated and guarded every argument, and :func:`fused_verdict` said yes). The chunk
    metadata is unused (the kernel walks each sequence from ``cu_seqlens``)."""
    final_state, state_kw = walk_state(x, cu_seqlens, state)
    fused_prefill(x.q, x.k, x.v, x.raw_g, x.raw_beta, x.A_log, x.dt_bias, out, x.scale, cu_seqlens,
                  lower_bound=x.lower_bound, gate=x.gate, qk_l2norm=x.qk_l2norm, beta_sigmoid=x.beta_sigmoid,
                  **state_kw)
    return out, final_state


# No priority yet: path="auto" takes it once its GPU tests and benchmark have passed on a
# Hopper GPU (docs/design/kda_fused_prefill.md); path="fused" runs it.
register(PrefillBackend("fused", path="fused", title="the fused Hopper prefill", verify=fused_verdict,
                        run=fused_kda_prefill, priority=None))
