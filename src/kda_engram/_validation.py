"""Input checks shared by every public entry point.

Each raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
device or value) naming the argument, what was expected and what came. Entry
points run them only when ``check_inputs`` is on: the checks that read device
memory back (index ranges, duplicates) synchronise with the host and would break
CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    x,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if shape is not None:
        ok = x.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {str(x.dtype).replace('torch.', '')}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    if last_dim_contiguous and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must have stride 1, got strides {tuple(x.stride())}")
    return x


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(f"{n}={str(t.dtype).replace('torch.', '')}" for n, t in zip(names, tensors))
        raise TypeError(f"{', '.join(names)}: expected one dtype, got {got}")


def check_index_range(name: str, idx: torch.Tensor, upper: int, *, allow_negative: bool = True) -> None:
    """Entries of ``idx`` lie in ``[0, upper)`` (negative entries allowed as "no row"
    when ``allow_negative``), and the non-negative ones are distinct. Syncs."""
    if idx.numel() == 0:
        return
    valid = idx[idx >= 0] if allow_negative else idx
    if not allow_negative and bool((idx < 0).any()):
        raise ValueError(f"{name}: expected non-negative entries, got min {int(idx.min())}")
    if valid.numel() and int(valid.max()) >= upper:
        raise ValueError(f"{name}: entries must be < {upper} (rows available), got max {int(valid.max())}")
    if valid.numel() != torch.unique(valid).numel():
        raise ValueError(f"{name}: non-negative entries must be distinct (duplicates would race on one row)")
