"""Test set-up: kernels run under the Triton interpreter on a machine without a GPU.

GPU-only tests carry ``@pytest.mark.gpu``; they are skipped where no CUDA/ROCm
device is visible (CI) and run through ``scripts/gpu-check`` on the device machine.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported (triton.jit reads it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (run scripts/gpu-check on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu():
    """The CUDA device for ``@pytest.mark.gpu`` tests."""
    return torch.device("cuda")
