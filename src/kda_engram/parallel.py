"""Tensor parallelism on ``torch.distributed``: a small group and the ``wkv`` layouts.

:class:`TensorParallelGroup` wraps a process group (NCCL/RCCL on GPUs, gloo on the
CPU) with the one collective the Engram layer needs, a rank-major all-gather, plus a
single-process no-op group (:meth:`TensorParallelGroup.single`) so layers run
unchanged without ``torch.distributed``.

The ``wkv`` weight ``[(hc+1)*dim, in_dim]`` (output rows ``[key_0 | ... | key_{hc-1}
| value]``) can be sharded two ways over ``P`` ranks:

* **column-parallel** (:func:`column_parallel_shard`): rank ``r`` holds output rows
  ``[r*O/P, (r+1)*O/P)`` of the whole ``O = (hc+1)*dim``; an all-gather along the
  last dim rebuilds ``kv`` on every rank. The baseline: ``(hc+1)*dim`` elements per
  token cross the links.
* **merged column-parallel over** ``[dim] * (hc+1)`` (:func:`merged_column_parallel_shard`):
  rank ``r`` holds its ``dim/P`` slice of every key and of the value, so its local
  ``kv`` is ``[key_0 slice | ... | value slice]``, the layout the dim-sharded gate
  (engram/sharded_gate.py) consumes without any gather of the projection.

:class:`ColumnParallelLinear` holds one rank's shard in either layout and loads a
full checkpoint weight with one call (:meth:`ColumnParallelLinear.load_full_weight`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .validation.common import check_tensor


def _gather_into_tensor_fn():
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is its
    # deprecated alias); torch 2.11/2.12 only have all_gather_into_tensor.
    return getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


class TensorParallelGroup:
    """A tensor-parallel group: ``rank``, ``world_size`` and a rank-major all-gather.

    Args:
        group: a ``torch.distributed`` process group; ``None`` means the default
            (world) group, which must be initialised. Use :meth:`single` for a
            one-process group that needs no ``torch.distributed`` at all.
        use_gather_into_tensor: ``True`` forces ``all_gather_into_tensor`` (one
            collective into one preallocated buffer: no extra copy, what NCCL/RCCL
            do best), ``False`` forces the portable ``all_gather`` into a list and a
            ``cat``; ``None`` (default) tries the former and falls back, once and for
            good, if the backend rejects it.
    """

    def __init__(self, group=None, *, use_gather_into_tensor: bool | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TensorParallelGroup: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first or use TensorParallelGroup.single()"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        if use_gather_into_tensor and _gather_into_tensor_fn() is None:
            raise RuntimeError("use_gather_into_tensor=True: this torch has no all_gather_into_tensor")
        self._into_tensor = use_gather_into_tensor

    @classmethod
    def single(cls) -> TensorParallelGroup:
        """A one-rank group: ``rank 0``, ``world_size 1``, ``all_gather`` returns its input."""
        self = cls.__new__(cls)
        self.group = None
        self.rank = 0
        self.world_size = 1
        self.backend = "none"
        self._into_tensor = None
        return self

    @property
    def uses_gather_into_tensor(self) -> bool | None:
        """Which collective ``all_gather`` uses (``None``: not decided yet)."""
        return self._into_tensor

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    def _gather_dim0(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]))
        if self._into_tensor is not False:
            fn = _gather_into_tensor_fn()
            if fn is not None:
                try:
                    fn(out, x, group=self.group)
                    self._into_tensor = True
                    return out
                except (RuntimeError, NotImplementedError, ValueError):
                    if self._into_tensor:  # forced: report the backend's error
                        raise
            self._into_tensor = False
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=0, out=out)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, rank 0 first.

        All ranks pass tensors of one shape, dtype and device. Along ``dim = 0`` the
        result is the collective's own buffer (no copy); along another dim it is
        gathered on dim 0 and rearranged (one copy). The collective needs a dense
        buffer, so a non-contiguous ``x`` is copied first (this is a communication
        helper: the kernels themselves never copy their inputs).
        """
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        gathered = self._gather_dim0(x.contiguous())
        if dim == 0:
            return gathered
        shape = tuple(x.shape)
        blocks = gathered.view((self.world_size,) + shape).movedim(0, dim)
        return blocks.reshape(shape[:dim] + (self.world_size * shape[dim],) + shape[dim + 1 :])


def _check_shardable(name: str, size: int, tp_size: int) -> int:
    if size % tp_size:
        raise ValueError(f"{name}: {size} output rows are not divisible by tp_size {tp_size}")
    return size // tp_size


def _check_rank(rank: int, tp_size: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: expected a positive int, got {tp_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"rank: expected an int in [0, {tp_size}), got {rank!r}")


def column_parallel_shard(weight: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows ``[r*O/P, (r+1)*O/P)`` of a ``[O, in]`` weight (a view)."""
    _check_rank(rank, tp_size)
    check_tensor("weight", weight, shape=(None, None))
    rows = _check_shardable("weight", weight.shape[0], tp_size)
    return weight[rank * rows : (rank + 1) * rows]


def merged_column_parallel_shard(
    weight: torch.Tensor, output_sizes: Sequence[int], rank: int, tp_size: int
) -> torch.Tensor:
    """Rank ``rank``'s slice of each output block of a ``[sum(output_sizes), in]``
    weight, concatenated in block order: ``[block_0 rows r*s_0/P .. | block_1 .. |
    ...]`` (a new tensor). With ``output_sizes = [dim] * (hc+1)`` this is the
    dim-sharded ``wkv`` layout."""
    _check_rank(rank, tp_size)
    check_tensor("weight", weight, shape=(sum(output_sizes), None))
    parts, start = [], 0
    for i, size in enumerate(output_sizes):
        rows = _check_shardable(f"weight block {i}", size, tp_size)
        parts.append(weight[start + rank * rows : start + (rank + 1) * rows])
        start += size
    return torch.cat(parts, dim=0)


class ColumnParallelLinear(nn.Module):
    """A bias-free linear layer whose output rows are sharded over a TP group.

    Args:
        in_features: input width.
        output_sizes: the output blocks (e.g. ``[dim] * (hc+1)`` for ``wkv``); the full
            output width is their sum.
        tp: the group (``None``: single process).
        merged: ``False`` for plain column-parallel (rank ``r`` holds rows
            ``[r*O/P, (r+1)*O/P)`` of the whole output), ``True`` for merged
            column-parallel (its slice of every block).
        dtype, device: of the weight.

    ``weight`` is this rank's ``[sum(output_sizes)/P, in_features]`` shard; ``forward``
    returns the local output ``x @ weight.T``. Gathering it (plain layout) is the
    caller's choice: see :class:`kda_engram.layers.engram_gate.Engram`.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        tp: TensorParallelGroup | None = None,
        merged: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        self.in_features = in_features
        self.output_sizes = tuple(int(s) for s in output_sizes)
        self.merged = merged
        P = self.tp.world_size
        if merged:
            for i, size in enumerate(self.output_sizes):
                _check_shardable(f"output_sizes[{i}]", size, P)
        else:
            _check_shardable("sum(output_sizes)", sum(self.output_sizes), P)
        self.out_features_local = sum(self.output_sizes) // P
        self.weight = nn.Parameter(
            torch.empty(self.out_features_local, in_features, dtype=dtype, device=device), requires_grad=False
        )

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full ``[sum(output_sizes), in_features]`` weight."""
        check_tensor("full_weight", full_weight, shape=(sum(self.output_sizes), self.in_features))
        if self.merged:
            return merged_column_parallel_shard(full_weight, self.output_sizes, self.tp.rank, self.tp.world_size)
        return column_parallel_shard(full_weight, self.tp.rank, self.tp.world_size)

    @torch.no_grad()
    def load_full_weight(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's shard of a full checkpoint weight into ``weight`` (any
        dtype/device: converted on copy)."""
        self.weight.copy_(self.shard(full_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> local output ``[..., sum(output_sizes)/P]``."""
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={list(self.output_sizes)}, "
            f"merged={self.merged}, tp_size={self.tp.world_size}"
        )
