"""The KDA gate, once: the ``@triton.jit`` gate forms every kernel calls, the
kernels' copies of the numeric constants, and the host-side ``dt_bias`` stride rule.

The gate turns the raw gate ``raw_g [.., H, K]`` into the per-channel log decay
``a <= 0`` (natural log) of one token:

* softplus (``lower_bound`` None): ``a = -exp(A_log) softplus(raw_g + dt_bias)``;
* bounded (``lower_bound = L``): ``a = L sigmoid(exp(A_log) (raw_g + dt_bias))``;
* precomputed (``gate="log_decay"``): ``a = raw_g`` (no ``A_log`` / ``dt_bias``).

:func:`log_decay` computes the three forms; the chunk kernels keep the gate in log2
units (:func:`chunk_log2_gate`: the floor, then ``a log2(e)``), the decode kernels
apply ``exp(a)`` directly. The reference is :func:`kda_engram.kda.reference.kda_gate`
(references stay out of the kernel paths: ``tests/test_layering.py``).

The floor (``LOG_DECAY_FLOOR = -128``, chunk kernels only, unbounded forms only): a
``+inf`` raw gate gives ``a = -inf``, and the chunk kernels take differences of the
gate's cumsum (``-inf - -inf = NaN``). ``exp(-128)`` is already exactly 0 in fp32
(and ``2^(-128 log2 e)`` too), so the floor changes no finite result; a ``where``, not a
``max``, so a NaN stays NaN. The decode kernels need no floor: they never take a
difference, and ``exp(-inf) = 0``.

Gluon (:mod:`kda_engram.kda.hopper.prologue`) calls these ``@triton.jit`` helpers as
they are: a ``@gluon.jit`` kernel compiles a plain jit function it calls with its own
(Gluon) semantics, and the gate is elementwise, so no layout is needed.

Every kernel compiles for one ``GATE`` constexpr (:func:`gate_form` picks it on the
host), so a new gate form that takes the existing operands (``raw_g``, ``A_log``,
``dt_bias``, ``lower_bound``) touches four files: this one (a ``GATE_*`` value, its
branch in :func:`log_decay` and :func:`gate_form`), its reference in
:func:`kda_engram.kda.reference.kda_gate`, its host rule in ``validation/kda_inputs.py``
(``check_input_forms``), and its test. The kernels and launchers do not change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import L2NORM_EPS, LOG2E, MAX_ANCHOR_SPAN, SUB_CHUNK

__all__ = ["LOG2E_JIT", "L2NORM_EPS_JIT", "LOG_DECAY_FLOOR", "GATE_SOFTPLUS", "GATE_BOUNDED", "GATE_LOG_DECAY",
           "softplus", "gate_operands", "log_decay", "chunk_log2_gate", "gate_form", "dt_bias_strides",
           "gate_pointers", "subchunk_span_bound", "needs_exact_diagonal"]

#: The kernels' copies of :mod:`kda_engram.constants` (a ``@triton.jit`` function reads a
#: module-level global only as a ``tl.constexpr``); the values are constants.py's.
LOG2E_JIT = tl.constexpr(LOG2E)
L2NORM_EPS_JIT = tl.constexpr(L2NORM_EPS)
#: The gate forms (a kernel's ``GATE`` constexpr, picked by :func:`gate_form`).
GATE_SOFTPLUS = tl.constexpr(0)
GATE_BOUNDED = tl.constexpr(1)
GATE_LOG_DECAY = tl.constexpr(2)
#: The chunk kernels' floor on the natural-log decay of the unbounded forms (see above).
LOG_DECAY_FLOOR = tl.constexpr(-128.0)


@triton.jit
def softplus(x):
    """``max(x, 0) + log(1 + exp(-|x|))``: exact for large ``|x|`` of either sign and never
    overflows (no log1p: it is not in Triton's portable math)."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def gate_operands(alog_ptr, sa_h, dtb_ptr, sd_h, sd_k, h, offs_k, GATE: tl.constexpr):
    """``(a_scale, bias)`` of head ``h`` (fp32): ``exp(A_log[h])`` and ``dt_bias[h, offs_k]``
    (strides from :func:`dt_bias_strides`); the precomputed form reads neither pointer
    (``0`` and zeros)."""
    if GATE == GATE_LOG_DECAY:
        return 0.0, tl.zeros(offs_k.shape, dtype=tl.float32)
    else:
        return (tl.exp(tl.load(alog_ptr + h * sa_h).to(tl.float32)),
                tl.load(dtb_ptr + h * sd_h + offs_k * sd_k).to(tl.float32))


@triton.jit
def log_decay(g, bias, a_scale, lower_bound, GATE: tl.constexpr):
    """Per-channel natural-log decay ``a`` (fp32) from the raw gate ``g`` (fp32, any
    shape), ``bias`` (``dt_bias``, broadcast to ``g``) and ``a_scale = exp(A_log)``
    (:func:`gate_operands`), for the form ``GATE`` (:func:`gate_form`): ``g`` itself
    (``GATE_LOG_DECAY``; ``bias`` and ``a_scale`` unused),
    ``lower_bound sigmoid(a_scale (g + bias))`` (``GATE_BOUNDED``) or
    ``-a_scale softplus(g + bias)`` (``GATE_SOFTPLUS``)."""
    if GATE == GATE_LOG_DECAY:
        return g
    elif GATE == GATE_BOUNDED:
        return lower_bound * tl.sigmoid(a_scale * (g + bias))
    else:
        return -a_scale * softplus(g + bias)


@triton.jit
def chunk_log2_gate(g, bias, a_scale, lower_bound, GATE: tl.constexpr):
    """The chunk kernels' gate: :func:`log_decay` floored at ``LOG_DECAY_FLOOR`` (the
    unbounded forms: softplus and precomputed), in log2 units (times ``log2(e)``)."""
    a = log_decay(g, bias, a_scale, lower_bound, GATE)
    if GATE != GATE_BOUNDED:
        a = tl.where(a < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, a)
    return a * LOG2E_JIT


def subchunk_span_bound(gate: str, lower_bound: float | None) -> float:
    """The widest decay span (log2 units) a ``SUB_CHUNK``-token sub-chunk can have under
    this gate: ``SUB_CHUNK |L| log2 e`` for the bounded gate, unbounded (``inf``) for the
    softplus and precomputed forms."""
    if gate == "log_decay" or lower_bound is None:
        return float("inf")
    return SUB_CHUNK * abs(float(lower_bound)) * LOG2E


def needs_exact_diagonal(gate: str, lower_bound: float | None) -> bool:
    """Whether a sub-chunk may span more than ``MAX_ANCHOR_SPAN``, past which the
    anchored (factored) diagonal products leave the normal fp32 / bf16 range: the
    unbounded gates, and a bounded one with ``|lower_bound| > 5.459``. Such a kernel
    checks each sub-chunk's span at run time and forms the wide ones' diagonal blocks
    exactly."""
    return subchunk_span_bound(gate, lower_bound) > MAX_ANCHOR_SPAN


def gate_form(gate: str, lower_bound: float | None) -> int:
    """The ``GATE`` constexpr a kernel compiles for: ``gate="log_decay"`` (the
    precomputed form), else bounded with a ``lower_bound``, else softplus. The entry
    points' rules (``validation/kda_inputs.py`` ``check_input_forms``) have already
    refused the combinations no kernel serves."""
    if gate == "log_decay":
        return GATE_LOG_DECAY.value
    return GATE_BOUNDED.value if lower_bound is not None else GATE_SOFTPLUS.value


def dt_bias_strides(dt_bias: torch.Tensor, k_dim: int) -> tuple[int, int]:
    """``(head stride, channel stride)`` of ``dt_bias`` ``[H, K]`` or flat ``[H*K]``: a
    strided 1-D view is read through its stride (head ``h``, channel ``c`` at
    ``(h K + c) stride``), never reshaped or copied."""
    if dt_bias.dim() == 2:
        return dt_bias.stride(0), dt_bias.stride(1)
    return k_dim * dt_bias.stride(0), dt_bias.stride(0)


def gate_pointers(raw_g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, k_dim: int,
                  gate: str) -> tuple[torch.Tensor, int, torch.Tensor, int, int]:
    """A gate kernel's launch arguments, in its order: ``(A_log, A_log stride, dt_bias,
    dt_bias head stride, channel stride)``. The precomputed form (``gate="log_decay"``)
    has no ``A_log`` / ``dt_bias``: the kernel never reads them, so ``raw_g`` stands in
    for both pointers (a pointer argument must be a tensor) with zero strides."""
    if gate == "log_decay":
        return raw_g, 0, raw_g, 0, 0
    return (A_log, A_log.stride(0), dt_bias, *dt_bias_strides(dt_bias, k_dim))
