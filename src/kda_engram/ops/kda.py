"""The KDA entry points as custom ops: decode, the prefill and its two stages, the
conv, the layer's decode step."""

import torch

from ..bundles import ConvArgs, KDAInputs, StateArgs
from ..constants import CHUNK_SIZE
from ..kda.chunk import kda_prefill_walk as _kda_prefill_walk
from ..kda.chunk import walk_chunks, walk_rules
from ..kda.prefill import prefill_rules, run_prefill
from ..kda.state import allocate_final_state
from ..kda.conv import kda_conv_checkpoint as _kda_conv_checkpoint
from ..kda.conv import kda_conv_decode as _kda_conv_decode
from ..kda.conv import run_kda_conv_checkpoint, run_kda_conv_decode
from ..kda.decode import kda_decode as _kda_decode
from ..kda.decode import run_kda_decode
from ..kda.decode import kda_decode_multi as _kda_decode_multi
from ..kda.decode import run_kda_decode_multi
from ..kda.fused_decode import kda_layer_decode_step as _kda_layer_decode_step
from ..kda.fused_decode import run_kda_layer_decode_step
from ..kda.prefill import chunk_kda_prefill as _chunk_kda_prefill
from ..kda.prologue import kda_prefill_prologue as _kda_prefill_prologue
from ..kda.prologue import prepare_kda_prologue, prologue_rules
from ..validation.kda_conv import check_conv_checkpoint, check_conv_decode
from ..validation.kda_decode import (
    check_decode_indices,
    check_decode_inputs,
    check_decode_multi_arguments,
    check_fused_decode_arguments,
)
from ..validation.common import check_int
from ..validation.kda_inputs import check_input_forms
from .common import EntryOp, opt_float

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


def _decode_rules(a):
    """:func:`~kda_engram.kda.decode.kda_decode`'s host rules (no device read)."""
    check_input_forms(a["gate"], a["A_log"], a["dt_bias"], a["lower_bound"], a["qk_l2norm"], a["beta_sigmoid"])
    (batch,) = check_decode_inputs(a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
                                   a["state_cache"], None, a["scale"], a["lower_bound"], lead=1)
    check_decode_indices(a["state_indices"], batch, a["state_cache"], None)
    check_int("null_row", a["null_row"], low=-1)
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


def _decode_multi_rules(a):
    """:func:`~kda_engram.kda.decode.kda_decode_multi`'s host rules (no device read)."""
    check_input_forms(a["gate"], a["A_log"], a["dt_bias"], a["lower_bound"], a["qk_l2norm"], a["beta_sigmoid"])
    check_decode_multi_arguments(None, a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
                                 a["state_cache"], a["state_indices"], a["initial_state_indices"], None, a["scale"],
                                 a["lower_bound"], a["gate"], a["cu_seqlens"], a["num_accepted_tokens"], a["null_row"])
    a["scale"], a["lower_bound"] = opt_float(a["scale"]), opt_float(a["lower_bound"])


kda_decode_multi = EntryOp(
    "kda_decode_multi", _kda_decode_multi, host_only=("out",), mutates_args=("state_cache",), returns="Tensor",
    rules=_decode_multi_rules, run=lambda a: run_kda_decode_multi(**vars(a)),
    fake=lambda a: torch.empty(a.v.shape, dtype=a.v.dtype, device=a.v.device),
    doc=""":func:`kda_engram.kda.decode.kda_decode_multi` as an op (``state_cache``
    mutated, ``out`` allocated by the op); ``check_inputs`` as in :func:`kda_decode`.""",
).function


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


def _prologue_rules(a):
    """:func:`~kda_engram.kda.prologue.kda_prefill_prologue`'s host rules (no device read)."""
    prologue_rules(KDAInputs.pick(a), a["cu_seqlens"], ConvArgs.pick(a), a["chunk_indices"], None)
    a["scale"], a["lower_bound"] = float(a["scale"]), opt_float(a["lower_bound"])


def _prologue_run(a):
    args = vars(a)
    operands = prepare_kda_prologue(KDAInputs.pick(args), a.cu_seqlens, ConvArgs.pick(args), a.chunk_indices)()
    return tuple(operands[n] for n in PROLOGUE_OUTPUTS)


#: The prologue's op: every argument of :func:`kda_engram.kda.prologue.kda_prefill_prologue`
#: but ``num_warps`` (a launch override, an int or a pair). The op returns the
#: operands as a tuple (an op cannot return a dict), the function the entry
#: point's dict.
kda_prefill_prologue = EntryOp(
    "kda_prefill_prologue", _kda_prefill_prologue, host_only=("num_warps",), mutates_args=("conv_state",),
    returns="(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", rules=_prologue_rules, run=_prologue_run,
    fake=_prologue_fake, result=lambda a, value: dict(zip(PROLOGUE_OUTPUTS, value)),
    doc=""":func:`kda_engram.kda.prologue.kda_prefill_prologue` as an op (``conv_state``
    mutated); returns the same dict of operands. ``check_inputs`` as in :func:`kda_decode`.""",
).function


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
    a["scale"] = float(a["scale"])


def _walk_out(a: dict):
    """The walk's output ``[1, T, H, V]`` in ``u``'s dtype (the op allocates it)."""
    u = a["u"]
    return torch.empty(1, *u.shape[1:], dtype=u.dtype, device=u.device)


def _walk_run(a):
    H, V, K = a.u.shape[2], a.u.shape[3], a.qg.shape[3]
    out = _walk_out(vars(a))
    _, final = walk_chunks(a.qg, a.w, a.u, a.kg_t, a.aqk, a.decay, out, a.scale, a.cu_seqlens, a.chunk_offsets,
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
    prepare=_cache_snapshots_as_none,
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
    prepare=_cache_snapshots_as_none, run=_prefill_run, result=_no_empty_final,
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


def _conv_decode_rules(a):
    """:func:`~kda_engram.kda.conv.kda_conv_decode`'s host rules (no device read)."""
    check_conv_decode(a["x"], a["conv_weight"], a["conv_state"], a["conv_state_indices"], None, None,
                      out_dtype=a["out_dtype"])


kda_conv_decode = EntryOp(
    "kda_conv_decode", _kda_conv_decode, host_only=("out",), mutates_args=("conv_state",), returns="Tensor",
    rules=_conv_decode_rules, run=lambda a: run_kda_conv_decode(**vars(a)),
    fake=lambda a: torch.empty(a.x.shape, dtype=a.out_dtype or a.x.dtype, device=a.x.device),
    doc=""":func:`kda_engram.kda.conv.kda_conv_decode` as an op (``conv_state``
    mutated, ``out`` allocated by the op, of ``out_dtype``); ``check_inputs`` as in
    :func:`kda_decode`.""",
).function


def _conv_checkpoint_rules(a):
    """:func:`~kda_engram.kda.conv.kda_conv_checkpoint`'s host rules (no device read)."""
    check_conv_checkpoint(a["x"], a["cu_seqlens"], a["checkpoint_offsets"], a["checkpoint_indices"], a["conv_state"],
                          None)


kda_conv_checkpoint = EntryOp(
    "kda_conv_checkpoint", _kda_conv_checkpoint, mutates_args=("conv_state",), returns="()",
    rules=_conv_checkpoint_rules, run=lambda a: run_kda_conv_checkpoint(**vars(a)), fake=lambda a: None,
    result=lambda a, value: a["conv_state"],
    doc=""":func:`kda_engram.kda.conv.kda_conv_checkpoint` as an op (``conv_state``
    mutated; the op returns nothing, the function ``conv_state`` as the entry point
    does); ``check_inputs`` as in :func:`kda_decode`.""",
).function


# ------------------------------------------------------------ KDA layer decode step


def _layer_decode_rules(a):
    """:func:`~kda_engram.kda.fused_decode.kda_layer_decode_step`'s host rules (no device read)."""
    check_fused_decode_arguments(
        None, a["x"], a["raw_g"], a["raw_beta"], a["g_out"], a["conv_weight"], a["conv_state"],
        a["conv_state_indices"], a["A_log"], a["dt_bias"], a["o_norm_weight"], a["state_cache"], a["state_indices"],
        a["initial_state_indices"], a["initial_conv_indices"], a["scale"], a["lower_bound"], a["norm_eps"], None,
        out_dtype=a["out_dtype"])
    a["scale"], a["lower_bound"] = opt_float(a["scale"]), opt_float(a["lower_bound"])
    a["norm_eps"] = float(a["norm_eps"])


def _layer_decode_out(a):
    H, V = a.state_cache.shape[1], a.state_cache.shape[2]
    return torch.empty(*a.x.shape[:-1], H * V, dtype=a.out_dtype or a.x.dtype, device=a.x.device)


#: The layer decode step's op: every argument of
#: :func:`kda_engram.kda.fused_decode.kda_layer_decode_step` but ``out`` (allocated
#: by the op, of ``out_dtype``) and the launch overrides ``block_v``, ``num_warps``.
kda_layer_decode_step = EntryOp(
    "kda_layer_decode_step", _kda_layer_decode_step, host_only=("out", "block_v", "num_warps"),
    mutates_args=("conv_state", "state_cache"), returns="Tensor", rules=_layer_decode_rules,
    run=lambda a: run_kda_layer_decode_step(**vars(a)), fake=_layer_decode_out,
    doc=""":func:`kda_engram.kda.fused_decode.kda_layer_decode_step` as an op (one token
    or S tokens per sequence; ``state_cache`` and ``conv_state`` mutated, ``out``
    allocated by the op, of ``out_dtype``). ``check_inputs`` as in :func:`kda_decode`.""",
).function
