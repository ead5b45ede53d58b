"""Storage dtype of the KDA recurrent state: fp32 or bf16.

Every kernel keeps the state in fp32 on chip and converts only at the memory
boundary: a load widens bf16 to fp32 exactly, a store rounds fp32 to bf16 once
with round-to-nearest-even (:func:`rtne_bf16`). Where a kernel carries the state
past a store (multi-token decode, a prefill checkpoint) it carries the rounded
value, so resuming from the stored row gives bit for bit the state of the
uninterrupted run.

Why a hand-written rounding: Triton's ``x.to(tl.bfloat16)`` (default and
``fp_downcast_rounding="rtne"``) is an ``fptrunc`` that the NVIDIA backend lowers
to ``cvt.rn.bf16.f32`` (RTNE), but the interpreter (the CPU tests) truncates
towards zero, so the two disagree in the last bit. The integer form below is
RTNE on every backend, NaN stays NaN and infinities stay infinite.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import STATE_DTYPES  # noqa: F401 (re-exported)

__all__ = ["STATE_DTYPES", "rtne_bf16", "round_state"]


@triton.jit
def rtne_bf16(x):
    """fp32 -> bf16, round to nearest, ties to even (bitwise like ``torch``'s cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    up = bits + 0x7FFF + ((bits >> 16) & 1)
    up = tl.where(x == x, up, bits | 0x400000)  # NaN: keep it a (quiet) NaN, never round it to inf
    return (up >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_bf16(x, NATIVE: tl.constexpr):
    # NATIVE: the hardware conversion (cvt.rn.bf16.f32 on NVIDIA, RTNE as well, one
    # instruction per pair); only a compiled kernel may take it, the interpreter
    # truncates.
    if NATIVE:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return rtne_bf16(x)


@triton.jit
def round_state(x, STATE_BF16: tl.constexpr, NATIVE: tl.constexpr = False):
    """The fp32 value the stored tile reads back as (identity for fp32 storage)."""
    if STATE_BF16:
        return _to_bf16(x, NATIVE).to(tl.float32)
    else:
        return x
