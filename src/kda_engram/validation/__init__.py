"""The argument rules of every public entry point, in one place.

* :mod:`.common`: tensor, dtype, shape, device and scalar primitives and
  :class:`~.common.DeviceChecks`, which reads every device-side rule of a call
  back in one transfer;
* :mod:`.entry`: :class:`~.entry.EntryChecks`, the helper every entry point runs
  its checks with, and the deferred verdicts (:func:`~.entry.raise_pending_errors`);
* :mod:`.kda`: the KDA rules (raw projections, ``cu_seqlens``, state, checkpoints,
  conv, decode indices, scale, lower_bound);
* :mod:`.engram`: the Engram rules (gate tensors and scalars, table, hashing).

Bottom layer: imports only torch, :mod:`kda_engram.platform` and
:mod:`kda_engram.constants`.
"""

from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_bool,
    check_index_range,
    check_index_values,
    check_int,
    check_kernel_device,
    check_real,
    check_same_dtype,
    check_tensor,
)
from .entry import EntryChecks, raise_pending_errors

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "DeviceChecks",
    "EntryChecks",
    "check_bool",
    "check_index_range",
    "check_index_values",
    "check_int",
    "check_kernel_device",
    "check_real",
    "check_same_dtype",
    "check_tensor",
    "raise_pending_errors",
]
