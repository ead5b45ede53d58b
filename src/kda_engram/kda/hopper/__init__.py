"""The KDA prefill's Hopper (sm_90a) path: the folded prologue and a Gluon walk
that keeps the state in wgmma registers. :func:`kda_engram.kda.chunk_kda_prefill`
picks it (``path="auto"``) where it serves the call; see
docs/design/kda_fused_prefill.md for the measurements behind the pick."""

from .prefill import HOPPER_HEAD_DIMS, hopper_kda_prefill, hopper_verdict

__all__ = ["HOPPER_HEAD_DIMS", "hopper_kda_prefill", "hopper_verdict"]
