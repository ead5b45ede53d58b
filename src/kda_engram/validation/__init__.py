"""The argument rules of every public entry point, in one place.

* :mod:`.common`: tensor, dtype, shape, device and scalar primitives and
  :class:`~.common.DeviceChecks`, which reads every device-side rule of a call
  back in one transfer;
* :mod:`.entry`: :class:`~.entry.EntryChecks`, the helper every entry point runs
  its checks with, and the deferred verdicts (:func:`~.entry.raise_pending_errors`);
* the KDA rules by what they check: :mod:`.kda_inputs` (the raw projections and
  their forms, ``scale``, ``lower_bound``, ``cu_seqlens``), :mod:`.kda_prefill` (the
  prologue's arguments, the walk's operands, the state and checkpoints),
  :mod:`.kda_decode` (the decode entry points), :mod:`.kda_conv` (the short
  convolution) and :mod:`.kda_batch` (a layer step);
* :mod:`.engram`: the Engram rules (gate tensors and scalars, table, hashing);
* :mod:`.index_rules`: the rules on device values (indices, ``cu_seqlens``, offsets),
  one launch each, queued on the call's :class:`~.common.DeviceChecks`; their
  ``@triton.jit`` kernels are :mod:`.index_rules_kernels`.

Bottom layer: imports only torch, Triton, :mod:`kda_engram.platform`,
:mod:`kda_engram.constants`, :mod:`kda_engram.bundles` and
:mod:`kda_engram.launch_config`.
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
