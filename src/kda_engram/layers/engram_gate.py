"""``Engram``, the ``nn.Module`` of the Engram branch: ``wkv`` projection of the
looked-up embeddings, then the gate (its kernels: ``engram/gate.py``,
``engram/sharded_gate.py``). :class:`~kda_engram.layers.engram.EngramLayer` holds one
beside its table.

``Engram.forward(hidden_states [T, hc, dim], embeddings [T, in_dim])`` computes
``kv = embeddings @ wkv.T`` (``[T, (hc+1)*dim]`` = ``[key_0 | ... | value]``) and
returns ``hidden + gate * value`` (engram/gate.py). Under tensor parallelism over
``P`` ranks it takes one of two paths, chosen once at construction:

* **gather** (the baseline): ``wkv`` is column-parallel, each rank projects
  ``(hc+1)*dim/P`` output columns and all-gathers them, then runs the fused gate.
  ``(hc+1)*dim`` elements per token cross the links.
* **sharded gate**: ``wkv`` is merged column-parallel over ``[dim] * (hc+1)``, each
  rank projects its ``dim/P`` slice of every key and of the value, packs its value
  slice and per-stream partial sums (engram/sharded_gate.py), all-gathers those
  ``dim/P + 4*hc`` elements per token (bf16) and finishes the gate locally. Every
  rank ends with bit-identical outputs.

Both paths compute the same function (up to fp32 summation order); both load the
same full checkpoint weight through :meth:`Engram.load_checkpoint`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ..engram.gate import engram_post_wkv
from ..engram.sharded_gate import engram_gate_finish, engram_gate_partials
from ..parallel import ColumnParallelLinear, TensorParallelGroup
from ..validation.common import FLOAT_DTYPES, check_tensor

# "1"/"0" (also true/false, on/off, yes/no) overrides the vendor default of
# shards_engram_gate. It never turns sharding on for tp_size 1 or sequence parallelism.
SHARD_GATE_ENV = "KDA_ENGRAM_SHARD_GATE"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def shards_engram_gate(
    tp_size: int, use_sequence_parallel: bool = False, device: torch.device | str | None = None
) -> bool:
    """Whether TP ranks keep a dim slice of ``wkv`` and exchange gate partial sums.

    Off when ``tp_size == 1`` (nothing to exchange) or under sequence parallelism
    (each rank then gates its own tokens, with the whole ``kv`` already local). Else
    on, on every vendor: the sharded scheme moves ``(dim + 4*hc*P)*2`` bytes per token
    instead of ``(hc+1)*dim*2`` over the links and less HBM traffic in the kernels.
    The reference engine limits it to AMD CDNA3/4; the H200 measurement is in
    ``kda_engram.tools.benchmarks.bench_engram_gate``. ``device`` is accepted so a vendor rule can
    be reinstated in one place; the environment variable ``KDA_ENGRAM_SHARD_GATE``
    (``1``/``0``) overrides the default.
    """
    if tp_size <= 1 or use_sequence_parallel:
        return False
    env = os.environ.get(SHARD_GATE_ENV, "").strip().lower()
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    if env:
        raise ValueError(f"{SHARD_GATE_ENV}: expected 1/0 (true/false, on/off, yes/no), got {env!r}")
    return True


class GateKernels(NamedTuple):
    """The three gate entry points :meth:`Engram.gate` calls, with the signatures of
    :func:`~kda_engram.engram.gate.engram_post_wkv`,
    :func:`~kda_engram.engram.sharded_gate.engram_gate_partials` and
    :func:`~kda_engram.engram.sharded_gate.engram_gate_finish` less
    ``check_inputs``. Why: the module calls the kernels directly, the serving layer
    calls the same branch through its ``torch.ops`` wrappers (:mod:`kda_engram.ops`)."""

    post_wkv: Callable
    partials: Callable
    finish: Callable


class Engram(nn.Module):
    """Writes the Engram lookup into the ``hc`` residual streams, gated per stream.

    Args:
        dim: hidden size of each stream.
        hc_mult: number of hyper-connection streams ``hc``.
        in_dim: width of the looked-up embedding row (``n_hash_cols * head_dim``).
        eps: RMS epsilon of the gate.
        clamp_value: lower bound of ``|dot|`` under the gate's square root.
        tp: tensor-parallel group (``None``: one process).
        shard_gate: ``True``/``False`` forces the sharded / gather path; ``None`` asks
            :func:`shards_engram_gate` (which reads ``KDA_ENGRAM_SHARD_GATE``).
        dtype, device: of the parameters (``wkv`` shard, ``q_weight``, ``k_weight``).

    Parameters: ``wkv.weight`` (this rank's shard of ``[(hc+1)*dim, in_dim]``),
    ``q_weight`` and ``k_weight`` ``[hc, dim]`` (replicated). They are created with
    ``torch.empty``; load them with :meth:`load_checkpoint` (or :meth:`reset_parameters`
    for a random layer).
    """

    def __init__(
        self,
        dim: int,
        hc_mult: int,
        in_dim: int,
        *,
        eps: float,
        clamp_value: float = 1e-6,
        tp: TensorParallelGroup | None = None,
        shard_gate: bool | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if dim < 1 or hc_mult < 1 or in_dim < 1:
            raise ValueError(f"Engram: expected positive dim, hc_mult, in_dim, got {dim}, {hc_mult}, {in_dim}")
        self.dim = dim
        self.hc_mult = hc_mult
        self.in_dim = in_dim
        self.eps = float(eps)
        self.clamp_value = float(clamp_value)
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        P = self.tp.world_size
        if shard_gate is None:
            param_device = torch.device(device) if device is not None else None
            shard_gate = shards_engram_gate(P, False, param_device)
        self.shard_gate = bool(shard_gate)
        if self.shard_gate and dim % P:
            raise ValueError(f"Engram: dim {dim} is not divisible by tp_size {P} (needed by shard_gate=True)")
        self.wkv = ColumnParallelLinear(
            in_dim, [dim] * (hc_mult + 1), tp=self.tp, merged=self.shard_gate, dtype=dtype, device=device
        )
        self.q_weight = nn.Parameter(torch.empty(hc_mult, dim, dtype=dtype, device=device), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(hc_mult, dim, dtype=dtype, device=device), requires_grad=False)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random full weights (the same on every rank for one generator seed), sharded."""
        dev = self.q_weight.device
        full = torch.randn((self.hc_mult + 1) * self.dim, self.in_dim, generator=generator, device="cpu")
        q = 1.0 + 0.1 * torch.randn(self.hc_mult, self.dim, generator=generator, device="cpu")
        k = 1.0 + 0.1 * torch.randn(self.hc_mult, self.dim, generator=generator, device="cpu")
        self.load_checkpoint(full.mul_(self.in_dim**-0.5).to(dev), q.to(dev), k.to(dev))

    @torch.no_grad()
    def load_checkpoint(self, wkv_weight: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> None:
        """Load the full (unsharded) checkpoint tensors: ``wkv_weight [(hc+1)*dim, in_dim]``,
        ``q_weight``/``k_weight [hc, dim]``; this rank keeps its shard of ``wkv``."""
        self.wkv.load_full_weight(wkv_weight)
        check_tensor("q_weight", q_weight, shape=(self.hc_mult, self.dim))
        check_tensor("k_weight", k_weight, shape=(self.hc_mult, self.dim))
        self.q_weight.copy_(q_weight)
        self.k_weight.copy_(k_weight)

    def forward(
        self,
        hidden_states: torch.Tensor,
        embeddings: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """``hidden_states [T, hc, dim]``, ``embeddings [T, in_dim]`` (both replicated
        over the group), ``token_mask`` bool ``[T]`` (false: ``out = hidden``) ->
        ``[T, hc, dim]`` in hidden's dtype."""
        if check_inputs:
            check_tensor("hidden_states", hidden_states, shape=(None, self.hc_mult, self.dim), dtypes=FLOAT_DTYPES)
            check_tensor(
                "embeddings", embeddings, shape=(hidden_states.shape[0], self.in_dim),
                dtypes=(self.wkv.weight.dtype,), device=self.wkv.weight.device,
            )
            if token_mask is not None:  # before any collective, so every rank fails alike
                check_tensor(
                    "token_mask", token_mask, shape=(hidden_states.shape[0],), dtypes=(torch.bool,),
                    device=hidden_states.device,
                )
        return self.gate(hidden_states, self.wkv(embeddings), token_mask, num_kv_tokens=embeddings.shape[0],
                         check_inputs=check_inputs)

    def gate(
        self,
        hidden_states: torch.Tensor,
        kv_local: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        num_kv_tokens: int | None = None,
        kernels: GateKernels | None = None,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """The gate branch after ``wkv``: ``kv_local`` is this rank's ``wkv`` output
        ``[T, ...]``; the gather path all-gathers it and runs the fused gate, the
        sharded path exchanges partial sums (module docstring). ``kernels``: the
        entry points to call (default: the kernels, with ``check_inputs``)."""
        if kernels is None:
            kernels = GateKernels(
                functools.partial(engram_post_wkv, check_inputs=check_inputs),
                functools.partial(engram_gate_partials, check_inputs=check_inputs),
                functools.partial(engram_gate_finish, check_inputs=check_inputs),
            )
        P = self.tp.world_size
        if not self.shard_gate:
            kv = self.tp.all_gather(kv_local, dim=-1)
            return kernels.post_wkv(
                hidden_states, kv, self.q_weight, self.k_weight, eps=self.eps, clamp_value=self.clamp_value,
                token_mask=token_mask, num_kv_tokens=num_kv_tokens,
            )
        send = kernels.partials(hidden_states, kv_local, self.q_weight, self.k_weight, rank=self.tp.rank, tp_size=P)
        gathered = self.tp.all_gather(send, dim=0)
        return kernels.finish(
            hidden_states, gathered, tp_size=P, eps=self.eps, clamp_value=self.clamp_value, token_mask=token_mask,
        )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, hc_mult={self.hc_mult}, in_dim={self.in_dim}, eps={self.eps}, "
            f"tp_size={self.tp.world_size}, shard_gate={self.shard_gate}"
        )
