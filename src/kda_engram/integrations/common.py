"""What the fla and vLLM adapters share: folding a ``[B, T, ...]`` batch into the
varlen ``[1, B*T, ...]`` layout of the kernels without a copy, and the refusal type
their host-side planning raises."""

from __future__ import annotations

import torch


class NotServed(ValueError):
    """A call the kernels do not serve exactly; the message is the one-line reason."""


def fold_batch(x: torch.Tensor, name: str) -> torch.Tensor:
    """``[B, T, *rest]`` as a ``[1, B*T, *rest]`` view (never a copy: an input whose
    batch stride does not continue its token stride is refused)."""
    if x.shape[0] == 1:
        return x
    try:
        return x.view(1, x.shape[0] * x.shape[1], *x.shape[2:])
    except RuntimeError:
        raise NotServed(f"{name}: batch dim does not fold into tokens without a copy "
                        f"(shape {list(x.shape)}, strides {list(x.stride())})") from None


def even_cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    """``[0, T, 2T, ..., B*T]`` (int32) for ``batch`` sequences of ``length`` tokens, on the device."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length


def packed_varlen(q: torch.Tensor, cu_seqlens: torch.Tensor | None, named) -> tuple[torch.Tensor, list]:
    """The varlen form of a call taking ``[B, T, ...]`` tensors: without ``cu_seqlens``
    the batch is folded into ``[1, B*T, ...]`` views (:func:`fold_batch`) with
    ``B`` sequences of ``T`` tokens; with it ``B`` must be 1 (the sequences are
    packed along T). ``named``: ``(name, tensor or None)`` pairs, returned in order.
    ``ValueError`` naming the argument otherwise."""
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"q: with cu_seqlens the batch dim must be 1 (the sequences are packed along T), "
                             f"got {list(q.shape)}")
        return cu_seqlens, [x for _, x in named]
    try:
        return even_cu_seqlens(B, T, q.device), [None if x is None else fold_batch(x, n) for n, x in named]
    except NotServed as reason:
        raise ValueError(str(reason)) from None


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (no host sync allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
