"""The argument bundles of the KDA prefill: what travels together from the entry point
to the kernels, as one immutable value each.

The public functions keep the seed's keyword arguments and build the bundles once,
at entry (an op's body picks them by name from its arguments, ``StateArgs.pick(a)``);
the rules (:mod:`kda_engram.validation.kda_prefill`),
the prefill paths and their launchers take the bundles. Why: the prefill's ~29
arguments were spelled out at every hop, and a new state argument touched each.
Custom-op schemas stay flat (torch.library needs them so); they are generated from
the entry point's signature (:class:`kda_engram.ops.common.EntryOp`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import torch

__all__ = ["ConvArgs", "KDAInputs", "StateArgs"]

Tensor = torch.Tensor


class _Picked:
    """``pick(args)``: the bundle of the fields found in ``args`` (a mapping of the
    call's arguments by name, e.g. a bound op call or ``locals()``); absent fields
    keep their defaults."""

    names: ClassVar[tuple[str, ...]]

    @classmethod
    def pick(cls, args: Mapping):
        picked = {}  # (a loop, not a comprehension: no call per pick on the serving path)
        for n in cls.names:
            if n in args:
                picked[n] = args[n]
        return cls(**picked)

    def replace(self, **changes):
        """A copy with ``changes`` (the bundles are immutable)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class StateArgs(_Picked):
    """The recurrent state of a prefill or walk call (V-first ``[*, H, V, K]``, fp32
    or bf16): either ``initial_state`` / ``output_final_state`` (returned as a new
    tensor of ``final_state_dtype``), or the paged ``state_cache`` read at
    ``state_indices`` where ``has_initial_state`` and written back in place; and the
    prefix-cache checkpoints: ``checkpoint_offsets`` snapshot the state into
    ``checkpoint_state`` (``None``: the state cache itself) at
    ``checkpoint_state_indices``."""

    initial_state: Tensor | None = None
    output_final_state: bool = False
    state_cache: Tensor | None = None
    state_indices: Tensor | None = None
    has_initial_state: Tensor | None = None
    checkpoint_state: Tensor | None = None
    checkpoint_offsets: Tensor | None = None
    checkpoint_state_indices: Tensor | None = None
    final_state_dtype: torch.dtype | None = None

    @property
    def snapshots(self) -> Tensor | None:
        """Where the checkpoint snapshots go: ``checkpoint_state``, or the state cache
        itself when snapshots are asked for without a buffer. Why the ``None`` form:
        a custom op cannot take one buffer as two mutated arguments."""
        if self.checkpoint_state is None and self.checkpoint_offsets is not None:
            return self.state_cache
        return self.checkpoint_state

    @property
    def snapshots_in_cache(self) -> bool:
        """The snapshots land in the state cache itself (given as ``None`` or as the
        cache tensor)."""
        return (self.checkpoint_offsets is not None and self.state_cache is not None
                and (self.checkpoint_state is None or self.checkpoint_state is self.state_cache))


StateArgs.names = tuple(f.name for f in dataclasses.fields(StateArgs))


@dataclasses.dataclass(frozen=True)
class ConvArgs(_Picked):
    """The prefill's fused short convolution: ``conv_weight [2HK + HV, 4]`` (``None``:
    no conv, q/k/v are the conv's outputs), the windows ``conv_state [slots, 2HK + HV,
    3]`` read at ``conv_state_indices`` where ``conv_has_initial_state`` and written
    back in place."""

    conv_weight: Tensor | None = None
    conv_state: Tensor | None = None
    conv_state_indices: Tensor | None = None
    conv_has_initial_state: Tensor | None = None

    @property
    def on(self) -> bool:
        return self.conv_weight is not None


ConvArgs.names = tuple(f.name for f in dataclasses.fields(ConvArgs))


@dataclasses.dataclass(frozen=True)
class KDAInputs(_Picked):
    """The raw projections of a prefill and the forms they come in: ``q, k, raw_g
    [1, T, H, K]``, ``v [1, T, H, V]``, ``raw_beta [1, T, H]``, the gate's ``A_log
    [H]`` / ``dt_bias`` and ``lower_bound``, the output ``scale``; ``gate``
    (``"raw"`` or ``"log_decay"``), ``qk_l2norm``, ``beta_sigmoid``."""

    q: Tensor
    k: Tensor
    v: Tensor
    raw_g: Tensor
    raw_beta: Tensor
    A_log: Tensor | None = None
    dt_bias: Tensor | None = None
    scale: float | None = None
    lower_bound: float | None = None
    gate: str = "raw"
    qk_l2norm: bool = True
    beta_sigmoid: bool = True


KDAInputs.names = tuple(f.name for f in dataclasses.fields(KDAInputs))
