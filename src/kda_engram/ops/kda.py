"""The KDA entry points as custom ops: decode, the prefill and its two stages, the
conv, the layer's decode step."""

from typing import Optional

import torch

from ..bundles import ConvArgs, KDAInputs, StateArgs
from ..constants import CHUNK_SIZE
from ..kda.chunk import kda_prefill_walk as _kda_prefill_walk
from ..kda.chunk import walk_chunks, walk_rules
from ..kda.metadata import prepare_chunk_metadata
from ..kda.prefill import prefill_rules, run_prefill
from ..kda.state import allocate_final_state
from ..kda.conv import kda_conv_checkpoint as _kda_conv_checkpoint
from ..kda.conv import kda_conv_decode as _kda_conv_decode
from ..kda.decode import kda_decode as _kda_decode
from ..kda.decode import run_kda_decode
from ..kda.decode import kda_decode_multi as _kda_decode_multi
from ..kda.fused_decode import kda_layer_decode_step as _kda_layer_decode_step
from ..kda.prefill import chunk_kda_prefill as _chunk_kda_prefill
from ..kda.prologue import kda_prefill_prologue as _kda_prefill_prologue
from ..validation.kda import (
    check_conv_checkpoint,
    check_conv_decode,
    check_decode_indices,
    check_decode_inputs,
    check_decode_multi_indices,
    check_fused_decode_arguments,
    check_input_forms,
    check_prologue_arguments,
)
from .common import EntryOp, entry_checks, kernel_op, opt_float

Tensor = torch.Tensor

__all__ = [
    "chunk_kda_prefill",
    "kda_conv_checkpoint",
    "kda_conv_decode",
    "kda_decode",
    "kda_decode_multi",
    "kda_layer_decode_step",
    "kda_prefill_prologue",
    "kda_prefill_walk",
]


def _empty_state(H: int, V: int, K: int, device) -> Tensor:
    return torch.empty(0, H, V, K, dtype=torch.float32, device=device)


# ------------------------------------------------------------------------- KDA decode


@kernel_op("kda_decode_multi", mutates_args=("state_cache",),
           fake=lambda a: torch.empty(a.v.shape, dtype=a.v.dtype, device=a.v.device))
def _kda_decode_multi_op(
    q: Tensor, k: Tensor, v: Tensor, raw_g: Tensor, raw_beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    state_cache: Tensor, state_indices: Tensor, initial_state_indices: Optional[Tensor],
    scale: Optional[float], lower_bound: Optional[float],
) -> Tensor:
    return _kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                             initial_state_indices, scale=scale, lower_bound=lower_bound, check_inputs=False)


def _decode_rules(a):
    """:func:`~kda_engram.kda.decode.kda_decode`'s host rules (no device read)."""
    check_input_forms(a["gate"], a["A_log"], a["dt_bias"], a["lower_bound"], a["qk_l2norm"], a["beta_sigmoid"])
    (batch,) = check_decode_inputs(a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
                                   a["state_cache"], None, a["scale"], a["lower_bound"], lead=1)
    check_decode_indices(a["state_indices"], batch, a["state_cache"], None)
    a["scale"], a["lower_bound"] = opt_float(a["scale"]), opt_float(a["lower_bound"])


kda_decode = EntryOp(
    "kda_decode", _kda_decode, host_only=("out",), mutates_args=("state_cache",), returns="Tensor",
    rules=_decode_rules, run=lambda a: run_kda_decode(**vars(a)),
    fake=lambda a: torch.empty(a.v.shape, dtype=a.v.dtype, device=a.v.device),
    doc=""":func:`kda_engram.kda.decode.kda_decode` as an op (``state_cache`` mutated,
    ``out`` allocated by the op). ``check_inputs`` as in the function
    (:class:`~kda_engram.ops.common.EntryOp`): ``False`` runs the host rules only, the
    row indices are then the caller's contract.""",
).function


def kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                     initial_state_indices=None, *, scale: float | None = None,
                     lower_bound: float | None = None, check_inputs=True) -> Tensor:
    """:func:`kda_engram.kda.decode.kda_decode_multi` as an op (``state_cache``
    mutated); ``check_inputs`` as in :func:`kda_decode`."""
    if entry_checks(check_inputs):
        return _kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                                 initial_state_indices, scale=scale, lower_bound=lower_bound, check_inputs=check_inputs)
    B, S = check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, None, scale, lower_bound,
                               lead=2)
    check_decode_multi_indices(state_indices, initial_state_indices, B, S, state_cache, None)
    return _kda_decode_multi_op(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                                initial_state_indices, opt_float(scale), opt_float(lower_bound))


# ------------------------------------------------------------------------ KDA prefill

PROLOGUE_OUTPUTS = ("qg", "w", "u", "kg_t", "aqk", "decay")


def _prologue_fake(a):
    _, T, H, K = a.q.shape
    V = a.v.shape[3]
    rows = a.chunk_indices.shape[0] if a.chunk_indices is not None else T // CHUNK_SIZE + a.cu_seqlens.shape[0] - 1
    dev, dt = a.q.device, a.q.dtype
    return (
        torch.empty(1, T, H, K, dtype=dt, device=dev),
        torch.empty(1, T, H, K, dtype=dt, device=dev),
        torch.empty(1, T, H, V, dtype=dt, device=dev),
        torch.empty(rows, H, K, CHUNK_SIZE, dtype=dt, device=dev),
        torch.empty(1, T, H, CHUNK_SIZE, dtype=dt, device=dev),
        torch.empty(rows, H, K, dtype=torch.float32, device=dev),
    )


@kernel_op("kda_prefill_prologue", mutates_args=("conv_state",), fake=_prologue_fake)
def _kda_prefill_prologue_op(
    q: Tensor, k: Tensor, v: Tensor, raw_g: Tensor, raw_beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    scale: float, lower_bound: Optional[float], cu_seqlens: Tensor,
    conv_weight: Optional[Tensor], conv_state: Optional[Tensor], conv_state_indices: Optional[Tensor],
    conv_has_initial_state: Optional[Tensor], chunk_indices: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ops = _kda_prefill_prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                                conv_weight, conv_state, conv_state_indices, conv_has_initial_state, chunk_indices,
                                check_inputs=False)
    return tuple(ops[n] for n in PROLOGUE_OUTPUTS)


def kda_prefill_prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale: float, lower_bound: float | None,
                         cu_seqlens, conv_weight=None, conv_state=None, conv_state_indices=None,
                         conv_has_initial_state=None, chunk_indices=None, *, check_inputs=True) -> dict[str, Tensor]:
    """:func:`kda_engram.kda.prologue.kda_prefill_prologue` as an op (``conv_state``
    mutated); returns the same dict of operands. ``check_inputs`` as in :func:`kda_decode`."""
    if entry_checks(check_inputs):
        got = _kda_prefill_prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                                    conv_weight, conv_state, conv_state_indices, conv_has_initial_state, chunk_indices,
                                    check_inputs=check_inputs)
        return {n: got[n] for n in PROLOGUE_OUTPUTS}
    check_prologue_arguments(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens, conv_weight,
                             conv_state, conv_state_indices, conv_has_initial_state, chunk_indices, None)
    out = _kda_prefill_prologue_op(q, k, v, raw_g, raw_beta, A_log, dt_bias, float(scale), opt_float(lower_bound),
                                   cu_seqlens, conv_weight, conv_state, conv_state_indices, conv_has_initial_state,
                                   chunk_indices)
    return dict(zip(PROLOGUE_OUTPUTS, out))


def _prefill_outputs_fake(a, T, H, V, K, dtype, device):
    """``(out [1, T, H, V], final [N | 0, H, V, K])`` as the prefill and the walk
    return them (an absent final state is ``[0, H, V, K]`` fp32)."""
    out = torch.empty(1, T, H, V, dtype=dtype, device=device)
    if not a.output_final_state:
        return out, _empty_state(H, V, K, device)
    return out, allocate_final_state(StateArgs.pick(vars(a)), (a.cu_seqlens.shape[0] - 1, H, V, K), device)


def _cache_snapshots_as_none(a: dict) -> None:
    """A checkpoint buffer that *is* the state cache crosses the op as ``None`` (its
    meaning there: an op cannot take one buffer as two mutated arguments)."""
    if StateArgs.pick(a).snapshots_in_cache:
        a["checkpoint_state"] = None


def _walk_rules(a):
    """:func:`~kda_engram.kda.chunk.kda_prefill_walk`'s host rules (no device read)."""
    walk_rules(a["qg"], a["w"], a["u"], a["kg_t"], a["aqk"], a["decay"], None, a["scale"], a["cu_seqlens"],
               a["chunk_offsets"], StateArgs.pick(a), None)
    _cache_snapshots_as_none(a)
    a["scale"] = float(a["scale"])


def _walk_out(a):
    """The walk's output ``[1, T, H, V]`` in ``u``'s dtype (the op allocates it)."""
    u = a["u"] if isinstance(a, dict) else a.u
    return torch.empty(1, *u.shape[1:], dtype=u.dtype, device=u.device)


def _walk_run(a):
    H, V, K = a.u.shape[2], a.u.shape[3], a.qg.shape[3]
    T = a.u.shape[1]
    out = _walk_out(a)
    chunk_offsets = a.chunk_offsets
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_metadata(a.cu_seqlens, T, CHUNK_SIZE)[0]
    _, final = walk_chunks(a.qg, a.w, a.u, a.kg_t, a.aqk, a.decay, out, a.scale, a.cu_seqlens, chunk_offsets,
                           StateArgs.pick(vars(a)), groups=a.groups, min_group_chunks=a.min_group_chunks)
    return out, (final if final is not None else _empty_state(H, V, K, a.u.device))


def _no_empty_final(a, value):
    out, final = value
    return out, (final if a["output_final_state"] else None)


#: The walk's op: every argument of :func:`kda_engram.kda.chunk.kda_prefill_walk`
#: but ``out`` (allocated by the op: an op's output cannot alias an input),
#: ``config`` (a Python object; tuning only) and ``group_workspace`` (allocated by
#: the op).
kda_prefill_walk = EntryOp(
    "kda_prefill_walk", _kda_prefill_walk,
    host_only={"out": _walk_out, "config": None, "group_workspace": None},
    mutates_args=("checkpoint_state", "state_cache"), returns="(Tensor, Tensor)", rules=_walk_rules, run=_walk_run,
    fake=lambda a: _prefill_outputs_fake(a, a.u.shape[1], a.u.shape[2], a.u.shape[3], a.qg.shape[3], a.u.dtype,
                                         a.u.device),
    result=_no_empty_final,
    doc=""":func:`kda_engram.kda.chunk.kda_prefill_walk` as an op (the same arguments
    but ``out``, ``config`` and ``group_workspace``; ``state_cache`` and
    ``checkpoint_state`` mutated). Returns ``(out, final_state | None)``.
    ``check_inputs`` as in :func:`kda_decode`.""",
).function


def _prefill_rules(a):
    """:func:`~kda_engram.kda.prefill.chunk_kda_prefill`'s host rules (no device read)."""
    prefill_rules(KDAInputs.pick(a), StateArgs.pick(a), ConvArgs.pick(a), a["cu_seqlens"], None, None)
    _cache_snapshots_as_none(a)
    a["scale"], a["lower_bound"] = opt_float(a["scale"]), opt_float(a["lower_bound"])


def _prefill_run(a):
    H, K, V = a.q.shape[2], a.q.shape[3], a.v.shape[3]
    args = vars(a)
    out, final = run_prefill(KDAInputs.pick(args), a.cu_seqlens, StateArgs.pick(args), ConvArgs.pick(args),
                             groups=a.groups, path=a.path)
    return out, (final if final is not None else _empty_state(H, V, K, a.q.device))


#: The prefill's op: every argument of :func:`kda_engram.kda.prefill.chunk_kda_prefill`
#: but ``out`` (allocated by the op: an op's output cannot alias an input, and
#: ``out=v`` would make a mutated argument alias another).
chunk_kda_prefill = EntryOp(
    "chunk_kda_prefill", _chunk_kda_prefill,
    host_only=("out",),
    mutates_args=("state_cache", "checkpoint_state", "conv_state"), returns="(Tensor, Tensor)", rules=_prefill_rules,
    run=_prefill_run, result=_no_empty_final,
    fake=lambda a: _prefill_outputs_fake(a, a.q.shape[1], a.q.shape[2], a.v.shape[3], a.q.shape[3], a.v.dtype,
                                         a.v.device),
    doc=""":func:`kda_engram.kda.prefill.chunk_kda_prefill` as an op, with its
    signature but ``out``: ``state_cache``, ``checkpoint_state`` and ``conv_state``
    mutated, ``out`` allocated by the op. ``check_inputs`` as in :func:`kda_decode`:
    by default the function's own checks; with ``False`` (or while ``torch.compile``
    traces) the host rules run here, once (no device read: capture- and
    compile-safe). Returns ``(out, final_state | None)``.""",
).function


# --------------------------------------------------------------------------- KDA conv


@kernel_op("kda_conv_decode", mutates_args=("conv_state",),
           fake=lambda a: torch.empty(a.x.shape, dtype=a.out_dtype or a.x.dtype, device=a.x.device))
def _kda_conv_decode_op(
    x: Tensor, conv_weight: Tensor, conv_state: Tensor, conv_state_indices: Tensor, out_dtype: Optional[torch.dtype],
) -> Tensor:
    return _kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, out_dtype=out_dtype, check_inputs=False)


def kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, *, out_dtype: torch.dtype | None = None,
                    check_inputs=True) -> Tensor:
    """:func:`kda_engram.kda.conv.kda_conv_decode` as an op (``conv_state`` mutated);
    ``check_inputs`` as in :func:`kda_decode`."""
    if entry_checks(check_inputs):
        return _kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, out_dtype=out_dtype,
                                check_inputs=check_inputs)
    check_conv_decode(x, conv_weight, conv_state, conv_state_indices, None, None)
    return _kda_conv_decode_op(x, conv_weight, conv_state, conv_state_indices, out_dtype)


@kernel_op("kda_conv_checkpoint", mutates_args=("conv_state",), fake=lambda a: None)
def _kda_conv_checkpoint_op(
    x: Tensor, cu_seqlens: Tensor, checkpoint_offsets: Tensor, checkpoint_indices: Tensor, conv_state: Tensor,
) -> None:
    _kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state, check_inputs=False)


def kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state, *,
                        check_inputs=True) -> None:
    """:func:`kda_engram.kda.conv.kda_conv_checkpoint` as an op (``conv_state``
    mutated); ``check_inputs`` as in :func:`kda_decode`."""
    if entry_checks(check_inputs):
        _kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state,
                             check_inputs=check_inputs)
        return
    check_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state, None)
    _kda_conv_checkpoint_op(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state)


# ------------------------------------------------------------ KDA layer decode step


def _layer_decode_out(a):
    H, V = a.state_cache.shape[1], a.state_cache.shape[2]
    return torch.empty(*a.x.shape[:-1], H * V, dtype=a.out_dtype or a.x.dtype, device=a.x.device)


@kernel_op("kda_layer_decode_step", mutates_args=("conv_state", "state_cache"), fake=_layer_decode_out)
def _kda_layer_decode_step_op(
    x: Tensor, raw_g: Tensor, raw_beta: Tensor, g_out: Tensor, conv_weight: Tensor, conv_state: Tensor,
    conv_state_indices: Tensor, A_log: Tensor, dt_bias: Tensor, o_norm_weight: Tensor, state_cache: Tensor,
    state_indices: Tensor, scale: Optional[float], lower_bound: Optional[float], norm_eps: float,
    out_dtype: Optional[torch.dtype],
) -> Tensor:
    H, V = state_cache.shape[1], state_cache.shape[2]
    out = torch.empty(*x.shape[:-1], H * V, dtype=out_dtype or x.dtype, device=x.device)
    return _kda_layer_decode_step(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                  dt_bias, o_norm_weight, state_cache, state_indices, scale=scale,
                                  lower_bound=lower_bound, norm_eps=norm_eps, out=out, check_inputs=False)


def kda_layer_decode_step(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias,
                          o_norm_weight, state_cache, state_indices, *, scale: float | None = None,
                          lower_bound: float | None = None, norm_eps: float = 1e-5,
                          out_dtype: torch.dtype | None = None, check_inputs=True) -> Tensor:
    """:func:`kda_engram.kda.fused_decode.kda_layer_decode_step` as an op (one token
    or S tokens per sequence with the default initial rows; ``state_cache`` and
    ``conv_state`` mutated, ``out`` allocated by the op). ``check_inputs`` as in
    :func:`kda_decode`."""
    if entry_checks(check_inputs):
        out = None  # the function's default: x's dtype
        shaped = isinstance(x, Tensor) and isinstance(state_cache, Tensor) and state_cache.dim() == 4
        if out_dtype is not None and shaped:
            H, V = state_cache.shape[1], state_cache.shape[2]
            out = torch.empty(*x.shape[:-1], H * V, dtype=out_dtype, device=x.device)
        return _kda_layer_decode_step(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                      dt_bias, o_norm_weight, state_cache, state_indices, scale=scale,
                                      lower_bound=lower_bound, norm_eps=norm_eps, out=out, check_inputs=check_inputs)
    check_fused_decode_arguments(None, x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                 dt_bias, o_norm_weight, state_cache, state_indices, None, None, scale, lower_bound,
                                 norm_eps, None)
    return _kda_layer_decode_step_op(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                     dt_bias, o_norm_weight, state_cache, state_indices, opt_float(scale),
                                     opt_float(lower_bound), float(norm_eps), out_dtype)

