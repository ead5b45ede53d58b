"""What the command-line tools share: picking the device, the check rows and the
stage timer.

Kept apart from :mod:`kda_engram.tools.cli` so that ``demo`` and ``check`` can use them
without importing the command line (and the command line without importing them
back): ``cli`` -> ``demo``/``check`` -> ``reporting``.
"""

from __future__ import annotations

import os
import time

import torch

from ..platform import interpreting

#: The largest seed torch's generators take (a signed 64-bit integer).
MAX_SEED = 2**63 - 1


def check_seed(seed) -> None:
    """``seed``: an int in ``[0, MAX_SEED]`` (one line otherwise, not torch's
    "Overflow when unpacking long long" from deep inside a run)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed}")
    if seed > MAX_SEED:
        raise ValueError(f"seed: expected at most {MAX_SEED} (a signed 64-bit seed), got {seed}")


#: Device types the tools run on (a ROCm build of torch names its GPUs ``cuda`` too).
DEVICE_TYPES = ("cpu", "cuda")


class DeviceError(ValueError):
    """The device asked for does not exist or is not available here (one line)."""


def pick_device(device: str | torch.device | None) -> torch.device:
    """``device`` (``None``: ``cuda`` when available, else ``cpu``) as a
    ``torch.device``, or a one-line :class:`DeviceError` if it is not one of
    :data:`DEVICE_TYPES` or not available in this process.

    On the CPU it sets ``TRITON_INTERPRET=1`` (unless already set): kernels run
    under the Triton interpreter there, and the variable must be set before any
    kernel module is imported."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"--device: expected one of {', '.join(DEVICE_TYPES)}, got {device!r}") from None
    if dev.type not in DEVICE_TYPES:
        raise DeviceError(f"--device: expected one of {', '.join(DEVICE_TYPES)}, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: this torch sees no GPU (CPU-only build or no device); "
                              "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not interpreting():
            raise DeviceError(f"--device {device}: the kernels run on the CPU only under the Triton interpreter, "
                              f"but TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} is set; unset it or set "
                              "TRITON_INTERPRET=1")
    return dev


class Checks:
    """Collects (name, error, bound) rows, prints them as they come, and fails the run
    if any error is past its bound."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def error(self, name: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> float:
        err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        ok = err <= bound and got.shape == want.shape
        print(f"  {'ok ' if ok else 'FAIL'} {name:<58} max|err| {err:.2e}  (bound {bound:.0e})", flush=True)
        if not ok:
            self.failed.append(name)
        return err


class Stage:
    """``with Stage("prefill"):`` prints the stage's name, then its wall time."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self):
        print(f"[{self.name}]", flush=True)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        print(f"  ({time.perf_counter() - self.start:.2f} s)", flush=True)
        return False
