"""Device facts the kernels and heuristics need, in one place.

Heuristics (how many chunk groups, how many programs per launch) are written in
terms of these facts rather than constants tuned to one GPU, so the same code
fits an H200 (132 SMs), an H100 (132), an MI300X (304 CUs) or an MI355X (256).
"""

from __future__ import annotations

import functools
import os

import torch

# What the Triton interpreter (and so the CPU test path) pretends to have. Only
# heuristics read it; any positive value gives correct results.
CPU_COMPUTE_UNITS = 8


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def is_amd() -> bool:
    """True when torch is a ROCm build (the kernels then compile for AMD GPUs)."""
    return torch.version.hip is not None


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_compute_units(device: torch.device | str | int | None = None) -> int:
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) of ``device``.

    On the CPU, and whenever the interpreter runs the kernels, returns
    :data:`CPU_COMPUTE_UNITS` so heuristics still take their multi-program
    branches in tests.
    """
    dev = device if isinstance(device, torch.device) else _as_device(device)
    if dev.type != "cuda" or interpreting():
        return CPU_COMPUTE_UNITS
    return int(_cuda_properties(_cuda_index(dev)).multi_processor_count)


def arch(device: torch.device | str | int | None = None) -> str:
    """Architecture name: ``"sm_90"`` (Hopper), ``"gfx942"`` (MI300), ``"gfx950"``
    (MI350), ... or ``"cpu"`` for the host and the interpreter."""
    dev = _as_device(device)
    if dev.type != "cuda":
        return "cpu"
    props = _cuda_properties(_cuda_index(dev))
    if is_amd():
        # gcnArchName looks like "gfx942:sramecc+:xnack-"; the feature flags do
        # not change which kernels fit.
        return str(props.gcnArchName).split(":")[0]
    return f"sm_{props.major}{props.minor}"


def is_gpu(device: torch.device) -> bool:
    """Whether tensors on ``device`` are run by compiled kernels (not the interpreter)."""
    return device.type == "cuda" and not interpreting()
