"""Every public kernel entry point as a ``torch.library`` custom op (``torch.ops.kda_engram.*``).

Why: a serving engine captures its layers in CUDA graphs and compiles them with
``torch.compile(fullgraph=True)``. Dynamo cannot trace through a Triton launch
wrapped in host-side heuristics without graph breaks, and Inductor must not
reorder a kernel that writes a cache in place. A custom op is opaque to both:
it carries a schema that says which arguments it mutates (``mutates_args``), a
fake (meta) implementation that gives the output shapes from the input shapes
alone, and an eager implementation that calls the kernel entry point with
``check_inputs=False`` (every device read of the checks would be a host sync,
forbidden under capture and a graph break under compile).

Conventions of the ops:

* Outputs are allocated inside the op (``torch.empty``, contiguous); an op never
  returns an alias of an input (a custom-op rule). Mutated arguments are the
  caches the kernels update in place: ``state_cache`` / ``checkpoint_state``
  (KDA recurrent state), ``conv_state`` (KDA conv windows), history caches
  (Engram hash history).
* A checkpoint written into the state cache itself cannot be passed as a second
  tensor argument (two mutable arguments aliasing one buffer are not allowed by
  functionalization); such calls pass ``checkpoint_into_cache=True`` instead.
* Outputs keep their entry point's contract: e.g. the prologue's ``kg_t`` /
  ``decay`` rows past the batch's real chunks (the static ``T // 64 + N`` bound)
  stay undefined, as nothing reads them.
* Optional returns are not expressible: a final state that was not asked for
  comes back as a ``[0, H, V, K]`` tensor; the Python wrappers below turn it into
  ``None``.
* Non-tensor objects (an :class:`~kda_engram.engram.layout.EngramLayout`, an
  :class:`~kda_engram.engram.table.EngramTable`) travel as integer handles from
  :func:`handle`; the op resolves them in a weak registry. Under
  ``torch.compile`` the handle is a constant of the graph.

The Python functions of this module (same names as the entry points) call the
ops and validate on the host only what needs no device read (shapes, dtypes,
devices, argument combinations): they are safe under capture and compile.
"""

import itertools
import weakref
from typing import Optional

import torch

from .constants import CHUNK_SIZE
from .engram.gate import engram_post_wkv as _engram_post_wkv
from .engram.hashing import next_history as _next_history
from .engram.hashing import ngram_hash as _ngram_hash
from .engram.history import checkpoint_history as _checkpoint_history
from .engram.history import gather_history as _gather_history
from .engram.history import scatter_history as _scatter_history
from .engram.layout import EngramLayout
from .engram.sharded_gate import engram_gate_finish as _engram_gate_finish
from .engram.sharded_gate import engram_gate_partials as _engram_gate_partials
from .engram.sharded_gate import send_width
from .engram.table import EngramTable
from .kda.chunk import fused_kda_chunk as _fused_kda_chunk
from .kda.conv import kda_conv_checkpoint as _kda_conv_checkpoint
from .kda.conv import kda_conv_decode as _kda_conv_decode
from .kda.decode import kda_decode as _kda_decode
from .kda.decode import kda_decode_multi as _kda_decode_multi
from .kda.fused_decode import fused_kda_decode_step as _fused_kda_decode_step
from .kda.prefill import chunk_kda_prefill as _chunk_kda_prefill
from .kda.prologue import fused_kda_prologue as _fused_kda_prologue
from .validation.common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from .validation.engram import check_gate_common, check_gate_scalars, check_hash_arguments, check_tp_rank
from .validation.kda import (
    check_chunk_operands,
    check_conv_checkpoint,
    check_conv_decode,
    check_cu_seqlens,
    check_decode_indices,
    check_decode_inputs,
    check_decode_multi_indices,
    check_fused_decode_arguments,
    check_prologue_arguments,
    check_scale,
    check_state_arguments,
    check_state_structure,
)

Tensor = torch.Tensor
NAMESPACE = "kda_engram"

__all__ = [
    "NAMESPACE",
    "handle",
    "resolve",
    "kda_decode",
    "kda_decode_multi",
    "fused_kda_prologue",
    "fused_kda_chunk",
    "chunk_kda_prefill",
    "kda_conv_decode",
    "kda_conv_checkpoint",
    "engram_post_wkv",
    "engram_gate_partials",
    "engram_gate_finish",
    "ngram_hash",
    "next_history",
    "engram_lookup",
    "engram_history_gather",
    "engram_history_scatter",
    "engram_history_checkpoint",
]

# --------------------------------------------------------------------- object handles

_counter = itertools.count(1)
_handle_of: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_object_of: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def handle(obj) -> int:
    """A stable integer handle for ``obj`` (an ``EngramLayout`` or ``EngramTable``),
    valid while ``obj`` lives; the registry holds it weakly. An ``int`` is returned
    as it is (already a handle). Layers take their handles at construction: the
    registry lookup is plain Python that ``torch.compile`` need not trace."""
    if isinstance(obj, int):
        return obj
    if not isinstance(obj, (EngramLayout, EngramTable)):
        raise TypeError(f"obj: expected an EngramLayout or EngramTable, got {type(obj).__name__}")
    h = _handle_of.get(obj)
    if h is None:
        h = next(_counter)
        _handle_of[obj] = h
        _object_of[h] = obj
    return h


def resolve(h: int, kind: type):
    """The object behind handle ``h``; ``ValueError`` when it is gone or of another kind."""
    obj = _object_of.get(int(h))
    if obj is None or not isinstance(obj, kind):
        raise ValueError(f"handle {h}: no live {kind.__name__} is registered under it (see kda_engram.ops.handle)")
    return obj


def _empty_state(H: int, V: int, K: int, device) -> Tensor:
    return torch.empty(0, H, V, K, dtype=torch.float32, device=device)


# ------------------------------------------------------------------------- KDA decode


@torch.library.custom_op(f"{NAMESPACE}::kda_decode", mutates_args=("state_cache",))
def _kda_decode_op(
    q: Tensor, k: Tensor, v: Tensor, raw_g: Tensor, raw_beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    state_cache: Tensor, state_indices: Tensor, scale: Optional[float], lower_bound: Optional[float],
) -> Tensor:
    return _kda_decode(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                       scale=scale, lower_bound=lower_bound, check_inputs=False)


@_kda_decode_op.register_fake
def _(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, scale, lower_bound):
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


@torch.library.custom_op(f"{NAMESPACE}::kda_decode_multi", mutates_args=("state_cache",))
def _kda_decode_multi_op(
    q: Tensor, k: Tensor, v: Tensor, raw_g: Tensor, raw_beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    state_cache: Tensor, state_indices: Tensor, initial_state_indices: Optional[Tensor],
    scale: Optional[float], lower_bound: Optional[float],
) -> Tensor:
    return _kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                             initial_state_indices, scale=scale, lower_bound=lower_bound, check_inputs=False)


@_kda_decode_multi_op.register_fake
def _(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, initial_state_indices, scale,
      lower_bound):
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def kda_decode(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, *,
               scale: float | None = None, lower_bound: float | None = None) -> Tensor:
    """:func:`kda_engram.kda.decode.kda_decode` as an op (``state_cache`` mutated).
    Host-side shape checks only; index ranges are the caller's contract."""
    (batch,) = check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, None, scale, lower_bound,
                                   lead=1)
    check_decode_indices(state_indices, batch, state_cache, None)
    return _kda_decode_op(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                          _opt_float(scale), _opt_float(lower_bound))


def kda_decode_multi(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                     initial_state_indices=None, *, scale: float | None = None,
                     lower_bound: float | None = None) -> Tensor:
    """:func:`kda_engram.kda.decode.kda_decode_multi` as an op (``state_cache`` mutated)."""
    B, S = check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, None, scale, lower_bound,
                               lead=2)
    check_decode_multi_indices(state_indices, initial_state_indices, B, S, state_cache, None)
    return _kda_decode_multi_op(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices,
                                initial_state_indices, _opt_float(scale), _opt_float(lower_bound))


def _opt_float(x):
    return None if x is None else float(x)


# ------------------------------------------------------------------------ KDA prefill


def _num_chunk_rows(T, num_seqs, chunk_indices):
    return chunk_indices.shape[0] if chunk_indices is not None else T // CHUNK_SIZE + num_seqs


@torch.library.custom_op(f"{NAMESPACE}::fused_kda_prologue", mutates_args=("conv_state",))
def _fused_kda_prologue_op(
    q: Tensor, k: Tensor, v: Tensor, raw_g: Tensor, raw_beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    scale: float, lower_bound: Optional[float], cu_seqlens: Tensor,
    conv_weight: Optional[Tensor], conv_state: Optional[Tensor], conv_state_indices: Optional[Tensor],
    conv_has_initial_state: Optional[Tensor], chunk_indices: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ops = _fused_kda_prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                              conv_weight, conv_state, conv_state_indices, conv_has_initial_state, chunk_indices,
                              check_inputs=False)
    return ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"]


@_fused_kda_prologue_op.register_fake
def _(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens, conv_weight, conv_state,
      conv_state_indices, conv_has_initial_state, chunk_indices):
    _, T, H, K = q.shape
    V = v.shape[3]
    R = _num_chunk_rows(T, cu_seqlens.shape[0] - 1, chunk_indices)
    dev, dt = q.device, q.dtype
    return (
        torch.empty(1, T, H, K, dtype=dt, device=dev),
        torch.empty(1, T, H, K, dtype=dt, device=dev),
        torch.empty(1, T, H, V, dtype=dt, device=dev),
        torch.empty(R, H, K, CHUNK_SIZE, dtype=dt, device=dev),
        torch.empty(1, T, H, CHUNK_SIZE, dtype=dt, device=dev),
        torch.empty(R, H, K, dtype=torch.float32, device=dev),
    )


def fused_kda_prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale: float, lower_bound: float | None,
                       cu_seqlens, conv_weight=None, conv_state=None, conv_state_indices=None,
                       conv_has_initial_state=None, chunk_indices=None) -> dict[str, Tensor]:
    """:func:`kda_engram.kda.prologue.fused_kda_prologue` as an op (``conv_state``
    mutated); returns the same dict of operands."""
    check_prologue_arguments(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens, conv_weight,
                             conv_state, conv_state_indices, conv_has_initial_state, chunk_indices, None)
    out = _fused_kda_prologue_op(q, k, v, raw_g, raw_beta, A_log, dt_bias, float(scale), _opt_float(lower_bound),
                                 cu_seqlens, conv_weight, conv_state, conv_state_indices, conv_has_initial_state,
                                 chunk_indices)
    return dict(zip(("qg", "w", "u", "kg_t", "aqk", "decay"), out))


def _chunk_launch(qg, w, u, kg_t, aqk, decay, scale, cu_seqlens, initial_state, output_final_state,
                  chunk_offsets, checkpoint_state, checkpoint_offsets, checkpoint_state_indices,
                  checkpoint_into_cache, state_cache, state_indices, has_initial_state):
    T, H, V, K = u.shape[1], u.shape[2], u.shape[3], qg.shape[3]
    out = torch.empty(1, T, H, V, dtype=u.dtype, device=u.device)
    if checkpoint_into_cache:
        checkpoint_state = state_cache
    _, final = _fused_kda_chunk(
        qg, w, u, kg_t, aqk, decay, out, scale, cu_seqlens, initial_state, output_final_state,
        chunk_offsets=chunk_offsets, checkpoint_state=checkpoint_state, checkpoint_offsets=checkpoint_offsets,
        checkpoint_state_indices=checkpoint_state_indices, state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state, check_inputs=False,
    )
    return out, (final if final is not None else _empty_state(H, V, K, u.device))


@torch.library.custom_op(f"{NAMESPACE}::fused_kda_chunk", mutates_args=("checkpoint_state", "state_cache"))
def _fused_kda_chunk_op(
    qg: Tensor, w: Tensor, u: Tensor, kg_t: Tensor, aqk: Tensor, decay: Tensor, scale: float, cu_seqlens: Tensor,
    initial_state: Optional[Tensor], output_final_state: bool, chunk_offsets: Optional[Tensor],
    checkpoint_state: Optional[Tensor], checkpoint_offsets: Optional[Tensor],
    checkpoint_state_indices: Optional[Tensor], checkpoint_into_cache: bool,
    state_cache: Optional[Tensor], state_indices: Optional[Tensor], has_initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    return _chunk_launch(qg, w, u, kg_t, aqk, decay, scale, cu_seqlens, initial_state, output_final_state,
                         chunk_offsets, checkpoint_state, checkpoint_offsets, checkpoint_state_indices,
                         checkpoint_into_cache, state_cache, state_indices, has_initial_state)


def _fake_prefill_outputs(T, H, V, K, N, dtype, device, output_final_state, initial_state=None):
    out = torch.empty(1, T, H, V, dtype=dtype, device=device)
    # The final state takes the initial state's dtype (fp32 or bf16), fp32 without one.
    state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    final = torch.empty(N if output_final_state else 0, H, V, K, dtype=state_dtype, device=device)
    return out, final


@_fused_kda_chunk_op.register_fake
def _(qg, w, u, kg_t, aqk, decay, scale, cu_seqlens, initial_state, output_final_state, chunk_offsets,
      checkpoint_state, checkpoint_offsets, checkpoint_state_indices, checkpoint_into_cache, state_cache,
      state_indices, has_initial_state):
    return _fake_prefill_outputs(u.shape[1], u.shape[2], u.shape[3], qg.shape[3], cu_seqlens.shape[0] - 1,
                                 u.dtype, u.device, output_final_state, initial_state)


def _split_checkpoint(checkpoint_state, state_cache):
    """``(checkpoint_state or None, into_cache)``: a checkpoint buffer that *is* the
    state cache is passed as the flag, not as a second aliasing argument."""
    if checkpoint_state is not None and state_cache is not None and checkpoint_state is state_cache:
        return None, True
    return checkpoint_state, False


def _check_state_host(cu_seqlens, H, V, K, device, initial_state, state_cache, state_indices, has_initial_state,
                      checkpoint_state, checkpoint_offsets, checkpoint_state_indices):
    """The state / checkpoint rules without their device-value part (the ops stay sync-free)."""
    check_state_arguments(
        None, num_seqs=cu_seqlens.numel() - 1, num_heads=H, head_v=V, head_k=K, device=device, lengths=None,
        initial_state=initial_state, state_cache=state_cache, state_indices=state_indices,
        has_initial_state=has_initial_state, checkpoint_state=checkpoint_state,
        checkpoint_offsets=checkpoint_offsets, checkpoint_state_indices=checkpoint_state_indices,
    )


def fused_kda_chunk(qg, w, u, kg_t, aqk, decay, scale: float, cu_seqlens, initial_state=None,
                    output_final_state: bool = False, chunk_offsets=None, checkpoint_state=None,
                    checkpoint_offsets=None, checkpoint_state_indices=None, state_cache=None, state_indices=None,
                    has_initial_state=None):
    """:func:`kda_engram.kda.chunk.fused_kda_chunk` as an op; ``out`` is allocated by
    the op. Returns ``(out, final_state | None)``. ``checkpoint_state`` may be
    ``state_cache`` itself."""
    check_state_structure(initial_state, output_final_state, state_cache, state_indices, has_initial_state,
                          checkpoint_state, checkpoint_offsets, checkpoint_state_indices)
    T, H, K, V = check_chunk_operands(qg, w, u, kg_t, aqk, decay, None)
    check_scale(scale, allow_none=False)
    check_cu_seqlens(cu_seqlens, T, qg.device, None, covers_all=False)
    _check_state_host(cu_seqlens, H, V, K, qg.device, initial_state, state_cache, state_indices, has_initial_state,
                      checkpoint_state, checkpoint_offsets, checkpoint_state_indices)
    if chunk_offsets is not None:
        check_tensor("chunk_offsets", chunk_offsets, shape=[cu_seqlens.numel()], dtypes=INDEX_DTYPES,
                     device=qg.device)
    ck, into = _split_checkpoint(checkpoint_state, state_cache)
    out, final = _fused_kda_chunk_op(qg, w, u, kg_t, aqk, decay, float(scale), cu_seqlens, initial_state,
                                     bool(output_final_state), chunk_offsets, ck, checkpoint_offsets,
                                     checkpoint_state_indices, into, state_cache, state_indices, has_initial_state)
    return out, (final if output_final_state else None)


def _prefill_impl(q, k, v, raw_g, raw_beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, initial_state,
                  output_final_state, state_cache, state_indices, has_initial_state, checkpoint_state,
                  checkpoint_offsets, checkpoint_state_indices, checkpoint_into_cache, conv_weight, conv_state,
                  conv_state_indices, conv_has_initial_state):
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if checkpoint_into_cache:
        checkpoint_state = state_cache
    out, final = _chunk_kda_prefill(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
        initial_state=initial_state, output_final_state=output_final_state, state_cache=state_cache,
        state_indices=state_indices, has_initial_state=has_initial_state, checkpoint_state=checkpoint_state,
        checkpoint_offsets=checkpoint_offsets, checkpoint_state_indices=checkpoint_state_indices,
        conv_weight=conv_weight, conv_state=conv_state, conv_state_indices=conv_state_indices,
        conv_has_initial_state=conv_has_initial_state, check_inputs=False,
    )
    return out, (final if final is not None else _empty_state(H, V, K, q.device))


@torch.library.custom_op(f"{NAMESPACE}::chunk_kda_prefill",
                         mutates_args=("state_cache", "checkpoint_state", "conv_state"))
def _chunk_kda_prefill_op(
    q: Tensor, k: Tensor, v: Tensor, raw_g: Tensor, raw_beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    cu_seqlens: Tensor, scale: Optional[float], lower_bound: Optional[float], initial_state: Optional[Tensor],
    output_final_state: bool, state_cache: Optional[Tensor], state_indices: Optional[Tensor],
    has_initial_state: Optional[Tensor], checkpoint_state: Optional[Tensor], checkpoint_offsets: Optional[Tensor],
    checkpoint_state_indices: Optional[Tensor], checkpoint_into_cache: bool, conv_weight: Optional[Tensor],
    conv_state: Optional[Tensor], conv_state_indices: Optional[Tensor], conv_has_initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    return _prefill_impl(q, k, v, raw_g, raw_beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, initial_state,
                         output_final_state, state_cache, state_indices, has_initial_state, checkpoint_state,
                         checkpoint_offsets, checkpoint_state_indices, checkpoint_into_cache, conv_weight, conv_state,
                         conv_state_indices, conv_has_initial_state)


@_chunk_kda_prefill_op.register_fake
def _(q, k, v, raw_g, raw_beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, initial_state, output_final_state,
      state_cache, state_indices, has_initial_state, checkpoint_state, checkpoint_offsets, checkpoint_state_indices,
      checkpoint_into_cache, conv_weight, conv_state, conv_state_indices, conv_has_initial_state):
    return _fake_prefill_outputs(q.shape[1], q.shape[2], v.shape[3], q.shape[3], cu_seqlens.shape[0] - 1, v.dtype,
                                 v.device, output_final_state, initial_state)


def chunk_kda_prefill(q, k, v, raw_g, raw_beta, A_log, dt_bias, *, cu_seqlens, scale: float | None = None,
                      lower_bound: float | None = None, initial_state=None, output_final_state: bool = False,
                      state_cache=None, state_indices=None, has_initial_state=None, checkpoint_state=None,
                      checkpoint_offsets=None, checkpoint_state_indices=None, conv_weight=None, conv_state=None,
                      conv_state_indices=None, conv_has_initial_state=None):
    """:func:`kda_engram.kda.prefill.chunk_kda_prefill` (with the prologue's conv
    pass-through) as an op: ``state_cache``, ``checkpoint_state`` and ``conv_state``
    mutated, ``out`` allocated by the op. Returns ``(out, final_state | None)``."""
    check_state_structure(initial_state, output_final_state, state_cache, state_indices, has_initial_state,
                          checkpoint_state, checkpoint_offsets, checkpoint_state_indices)
    _, H, K, V = check_prologue_arguments(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                                          conv_weight, conv_state, conv_state_indices, conv_has_initial_state, None,
                                          None, scale_optional=True)
    _check_state_host(cu_seqlens, H, V, K, q.device, initial_state, state_cache, state_indices, has_initial_state,
                      checkpoint_state, checkpoint_offsets, checkpoint_state_indices)
    ck, into = _split_checkpoint(checkpoint_state, state_cache)
    out, final = _chunk_kda_prefill_op(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, cu_seqlens, _opt_float(scale), _opt_float(lower_bound),
        initial_state, bool(output_final_state), state_cache, state_indices, has_initial_state, ck,
        checkpoint_offsets, checkpoint_state_indices, into, conv_weight, conv_state, conv_state_indices,
        conv_has_initial_state,
    )
    return out, (final if output_final_state else None)


# --------------------------------------------------------------------------- KDA conv


@torch.library.custom_op(f"{NAMESPACE}::kda_conv_decode", mutates_args=("conv_state",))
def _kda_conv_decode_op(
    x: Tensor, conv_weight: Tensor, conv_state: Tensor, conv_state_indices: Tensor, out_dtype: Optional[torch.dtype],
) -> Tensor:
    return _kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, out_dtype=out_dtype, check_inputs=False)


@_kda_conv_decode_op.register_fake
def _(x, conv_weight, conv_state, conv_state_indices, out_dtype):
    return torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)


def kda_conv_decode(x, conv_weight, conv_state, conv_state_indices, *, out_dtype: torch.dtype | None = None) -> Tensor:
    """:func:`kda_engram.kda.conv.kda_conv_decode` as an op (``conv_state`` mutated)."""
    check_conv_decode(x, conv_weight, conv_state, conv_state_indices, None, None)
    return _kda_conv_decode_op(x, conv_weight, conv_state, conv_state_indices, out_dtype)


@torch.library.custom_op(f"{NAMESPACE}::kda_conv_checkpoint", mutates_args=("conv_state",))
def _kda_conv_checkpoint_op(
    x: Tensor, cu_seqlens: Tensor, checkpoint_offsets: Tensor, checkpoint_indices: Tensor, conv_state: Tensor,
) -> None:
    _kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state, check_inputs=False)


@_kda_conv_checkpoint_op.register_fake
def _(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state):
    return None


def kda_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state) -> None:
    """:func:`kda_engram.kda.conv.kda_conv_checkpoint` as an op (``conv_state`` mutated)."""
    check_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state, None)
    _kda_conv_checkpoint_op(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state)


# ------------------------------------------------------------------------ Engram gate


@torch.library.custom_op(f"{NAMESPACE}::engram_post_wkv", mutates_args=())
def _engram_post_wkv_op(
    hidden_states: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, clamp_value: float,
    token_mask: Optional[Tensor], num_kv_tokens: Optional[int],
) -> Tensor:
    return _engram_post_wkv(hidden_states, kv, q_weight, k_weight, eps=eps, clamp_value=clamp_value,
                            token_mask=token_mask, num_kv_tokens=num_kv_tokens, check_inputs=False)


@_engram_post_wkv_op.register_fake
def _(hidden_states, kv, q_weight, k_weight, eps, clamp_value, token_mask, num_kv_tokens):
    return torch.empty_like(hidden_states)


def engram_post_wkv(hidden_states, kv, q_weight, k_weight, *, eps: float, clamp_value: float = 1e-6,
                    token_mask=None, num_kv_tokens: int | None = None) -> Tensor:
    """:func:`kda_engram.engram.gate.engram_post_wkv` as an op (host checks run: they read no device memory)."""
    check_gate_common(hidden_states, q_weight, k_weight, token_mask, None)
    check_gate_scalars(eps, clamp_value)
    check_tensor("kv", kv, shape=[None, (hidden_states.shape[1] + 1) * hidden_states.shape[2]], dtypes=FLOAT_DTYPES,
                 device=hidden_states.device)
    return _engram_post_wkv_op(hidden_states, kv, q_weight, k_weight, float(eps), float(clamp_value), token_mask,
                               None if num_kv_tokens is None else int(num_kv_tokens))


@torch.library.custom_op(f"{NAMESPACE}::engram_gate_partials", mutates_args=())
def _engram_gate_partials_op(
    hidden_states: Tensor, kv_local: Tensor, q_weight: Tensor, k_weight: Tensor, rank: int, tp_size: int,
) -> Tensor:
    return _engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, rank=rank, tp_size=tp_size,
                                 check_inputs=False)


@_engram_gate_partials_op.register_fake
def _(hidden_states, kv_local, q_weight, k_weight, rank, tp_size):
    T, hc, dim = hidden_states.shape
    return torch.empty(T, send_width(dim, hc, tp_size, kv_local.dtype), dtype=kv_local.dtype, device=kv_local.device)


def engram_gate_partials(hidden_states, kv_local, q_weight, k_weight, *, rank: int, tp_size: int) -> Tensor:
    """:func:`kda_engram.engram.sharded_gate.engram_gate_partials` as an op."""
    check_gate_common(hidden_states, q_weight, k_weight, None, None)
    check_tp_rank(rank, tp_size)
    return _engram_gate_partials_op(hidden_states, kv_local, q_weight, k_weight, rank, tp_size)


@torch.library.custom_op(f"{NAMESPACE}::engram_gate_finish", mutates_args=())
def _engram_gate_finish_op(
    hidden_states: Tensor, gathered: Tensor, tp_size: int, eps: float, clamp_value: float,
    token_mask: Optional[Tensor],
) -> Tensor:
    return _engram_gate_finish(hidden_states, gathered, tp_size=tp_size, eps=eps, clamp_value=clamp_value,
                               token_mask=token_mask, check_inputs=False)


@_engram_gate_finish_op.register_fake
def _(hidden_states, gathered, tp_size, eps, clamp_value, token_mask):
    return torch.empty_like(hidden_states)


def engram_gate_finish(hidden_states, gathered, *, tp_size: int, eps: float, clamp_value: float = 1e-6,
                       token_mask=None) -> Tensor:
    """:func:`kda_engram.engram.sharded_gate.engram_gate_finish` as an op."""
    check_gate_common(hidden_states, None, None, token_mask, None, with_weights=False)
    check_gate_scalars(eps, clamp_value)
    check_tensor("gathered", gathered, shape=[None, None], dtypes=FLOAT_DTYPES, device=hidden_states.device)
    return _engram_gate_finish_op(hidden_states, gathered, int(tp_size), float(eps), float(clamp_value), token_mask)


# --------------------------------------------------------------------- Engram memory


@torch.library.custom_op(f"{NAMESPACE}::ngram_hash", mutates_args=())
def _ngram_hash_op(
    token_ids: Tensor, cu_seqlens: Tensor, layout: int, history: Optional[Tensor], dead_mask: Optional[Tensor],
    token_map: Optional[Tensor], global_rows: bool,
) -> Tensor:
    return _ngram_hash(token_ids, cu_seqlens, resolve(layout, EngramLayout), history=history, dead_mask=dead_mask,
                       token_map=token_map, global_rows=global_rows, check_inputs=False)


@_ngram_hash_op.register_fake
def _(token_ids, cu_seqlens, layout, history, dead_mask, token_map, global_rows):
    lay = resolve(layout, EngramLayout)
    return torch.empty(token_ids.shape[0], lay.n_layers, lay.n_hash_cols, dtype=torch.int32, device=token_ids.device)


def _check_hash(token_ids, cu_seqlens, layout, token_map, history, dead_mask):
    """The hashing rules without their device-value part (the ops stay sync-free)."""
    # A handle is not resolved here (a weakref lookup breaks a Dynamo graph); the
    # history width is then the op's to check.
    max_ngram = layout.max_ngram if isinstance(layout, EngramLayout) else None
    check_hash_arguments(token_ids, cu_seqlens, max_ngram, 0, token_map, history, dead_mask, None)


def ngram_hash(token_ids, cu_seqlens, layout, *, history=None, dead_mask=None, token_map=None,
               global_rows: bool = False) -> Tensor:
    """:func:`kda_engram.engram.hashing.ngram_hash` as an op; ``layout`` (an
    ``EngramLayout`` or its :func:`handle`) travels as a handle. Call it once
    eagerly before a CUDA-graph capture: the layout's device arrays are copied to
    the device on first use."""
    _check_hash(token_ids, cu_seqlens, layout, token_map, history, dead_mask)
    return _ngram_hash_op(token_ids, cu_seqlens, handle(layout), history, dead_mask, token_map, bool(global_rows))


@torch.library.custom_op(f"{NAMESPACE}::next_history", mutates_args=())
def _next_history_op(
    token_ids: Tensor, cu_seqlens: Tensor, layout: int, history: Optional[Tensor], dead_mask: Optional[Tensor],
) -> Tensor:
    return _next_history(token_ids, cu_seqlens, resolve(layout, EngramLayout), history=history, dead_mask=dead_mask,
                         check_inputs=False)


@_next_history_op.register_fake
def _(token_ids, cu_seqlens, layout, history, dead_mask):
    lay = resolve(layout, EngramLayout)
    return torch.empty(cu_seqlens.shape[0] - 1, lay.max_ngram - 1, dtype=token_ids.dtype, device=token_ids.device)


def next_history(token_ids, cu_seqlens, layout, *, history=None, dead_mask=None) -> Tensor:
    """:func:`kda_engram.engram.hashing.next_history` as an op (a new tensor: the
    in-place ``out=history`` form is :func:`engram_history_scatter`'s job)."""
    _check_hash(token_ids, cu_seqlens, layout, None, history, dead_mask)
    return _next_history_op(token_ids, cu_seqlens, handle(layout), history, dead_mask)


@torch.library.custom_op(f"{NAMESPACE}::engram_lookup", mutates_args=())
def _engram_lookup_op(rows: Tensor, table: int, local: bool) -> Tensor:
    tab = resolve(table, EngramTable)
    if local:
        return tab.lookup_local(rows, check_inputs=False)
    return tab.lookup(rows, check_inputs=False)


@_engram_lookup_op.register_fake
def _(rows, table, local):
    tab = resolve(table, EngramTable)
    cols = tab.n_local_cols if local else tab.n_cols
    return torch.empty(rows.shape[0], cols, tab.head_dim, dtype=tab.out_dtype, device=tab.device)


def engram_lookup(rows, table, *, local: bool = False) -> Tensor:
    """:meth:`EngramTable.lookup` (``local=False``: all columns, zeros where other
    ranks own them) or :meth:`EngramTable.lookup_local` as an op; ``rows [T, n_cols]``;
    ``table`` an ``EngramTable`` or its :func:`handle`."""
    check_tensor("rows", rows, shape=[None, None], dtypes=INDEX_DTYPES)
    return _engram_lookup_op(rows, handle(table), bool(local))


# ------------------------------------------------------------ Engram history cache


@torch.library.custom_op(f"{NAMESPACE}::engram_history_gather", mutates_args=())
def _engram_history_gather_op(cache: Tensor, slot_indices: Tensor, has_initial_state: Optional[Tensor]) -> Tensor:
    return _gather_history(cache, slot_indices, has_initial_state, check_inputs=False)


@_engram_history_gather_op.register_fake
def _(cache, slot_indices, has_initial_state):
    return torch.empty(slot_indices.shape[0], cache.shape[1], dtype=cache.dtype, device=cache.device)


def engram_history_gather(cache, slot_indices, has_initial_state=None) -> Tensor:
    """:func:`kda_engram.engram.history.gather_history` as an op."""
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES)
    check_tensor("slot_indices", slot_indices, shape=[None], dtypes=INDEX_DTYPES, device=cache.device)
    return _engram_history_gather_op(cache, slot_indices, has_initial_state)


@torch.library.custom_op(f"{NAMESPACE}::engram_history_scatter", mutates_args=("cache",))
def _engram_history_scatter_op(cache: Tensor, slot_indices: Tensor, history: Tensor) -> None:
    _scatter_history(cache, slot_indices, history, check_inputs=False)


@_engram_history_scatter_op.register_fake
def _(cache, slot_indices, history):
    return None


def engram_history_scatter(cache, slot_indices, history) -> None:
    """:func:`kda_engram.engram.history.scatter_history` as an op (``cache`` mutated)."""
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES)
    check_tensor("history", history, shape=[slot_indices.shape[0], cache.shape[1]], dtypes=INDEX_DTYPES,
                 device=cache.device)
    _engram_history_scatter_op(cache, slot_indices, history)


@torch.library.custom_op(f"{NAMESPACE}::engram_history_checkpoint", mutates_args=("cache",))
def _engram_history_checkpoint_op(
    token_ids: Tensor, cu_seqlens: Tensor, history: Optional[Tensor], dead_mask: Optional[Tensor],
    checkpoint_offsets: Tensor, checkpoint_indices: Tensor, cache: Tensor,
) -> None:
    _checkpoint_history(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices, cache,
                        check_inputs=False)


@_engram_history_checkpoint_op.register_fake
def _(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices, cache):
    return None


def engram_history_checkpoint(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices,
                              cache) -> None:
    """:func:`kda_engram.engram.history.checkpoint_history` as an op (``cache`` mutated)."""
    check_tensor("token_ids", token_ids, shape=[None], dtypes=INDEX_DTYPES)
    check_tensor("cache", cache, shape=[None, None], dtypes=INDEX_DTYPES, device=token_ids.device)
    _engram_history_checkpoint_op(token_ids, cu_seqlens, history, dead_mask, checkpoint_offsets, checkpoint_indices,
                                  cache)


# ------------------------------------------------------------ KDA fused layer decode step


@torch.library.custom_op(f"{NAMESPACE}::fused_kda_decode_step", mutates_args=("conv_state", "state_cache"))
def _fused_kda_decode_step_op(
    x: Tensor, raw_g: Tensor, raw_beta: Tensor, g_out: Tensor, conv_weight: Tensor, conv_state: Tensor,
    conv_state_indices: Tensor, A_log: Tensor, dt_bias: Tensor, o_norm_weight: Tensor, state_cache: Tensor,
    state_indices: Tensor, scale: Optional[float], lower_bound: Optional[float], norm_eps: float,
    out_dtype: Optional[torch.dtype],
) -> Tensor:
    H, V = state_cache.shape[1], state_cache.shape[2]
    out = torch.empty(*x.shape[:-1], H * V, dtype=out_dtype or x.dtype, device=x.device)
    return _fused_kda_decode_step(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                  dt_bias, o_norm_weight, state_cache, state_indices, scale=scale,
                                  lower_bound=lower_bound, norm_eps=norm_eps, out=out, check_inputs=False)


@_fused_kda_decode_step_op.register_fake
def _(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias, o_norm_weight,
      state_cache, state_indices, scale, lower_bound, norm_eps, out_dtype):
    H, V = state_cache.shape[1], state_cache.shape[2]
    return torch.empty(*x.shape[:-1], H * V, dtype=out_dtype or x.dtype, device=x.device)


def fused_kda_decode_step(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias,
                          o_norm_weight, state_cache, state_indices, *, scale: float | None = None,
                          lower_bound: float | None = None, norm_eps: float = 1e-5,
                          out_dtype: torch.dtype | None = None) -> Tensor:
    """:func:`kda_engram.kda.fused_decode.fused_kda_decode_step` as an op (one token
    or S tokens per sequence with the default initial rows; ``state_cache`` and
    ``conv_state`` mutated, ``out`` allocated by the op). Host-side shape checks
    only; index ranges are the caller's contract."""
    check_fused_decode_arguments(None, x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                 dt_bias, o_norm_weight, state_cache, state_indices, None, None, scale, lower_bound,
                                 norm_eps, None)
    return _fused_kda_decode_step_op(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log,
                                     dt_bias, o_norm_weight, state_cache, state_indices, _opt_float(scale),
                                     _opt_float(lower_bound), float(norm_eps), out_dtype)
