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


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (no host sync allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
