"""vLLM 0.33's Kimi-K3 KDA kernel calls, with vLLM's exact contracts, on kda-engram's kernels.

Plain functions (no vLLM import) with the signatures and conventions of the
functions vLLM 0.33's Kimi-K3 (ROCm and NVIDIA) and Kimi-Linear layers call, so
that :mod:`kda_engram.integrations.vllm_plugin` can put them under those names:

* :func:`chunk_kda_prefill` -- ``vllm/models/kimi_k3/amd/ops/kda_prefill.py``'s
  prefill (the paged state cache, checkpoints, ``out``, every ``backend``);
  onto :func:`kda_engram.kda.chunk_kda_prefill`.
* :func:`chunk_kda_with_fused_gate` (the ROCm copy's signature) and
  :func:`chunk_kda_with_fused_gate_nvidia` (the NVIDIA copy's, with ``out``) --
  ``ops/third_party/kda/chunk.py``'s prefill on per-sequence initial states, which
  the NVIDIA Kimi-K3 and Kimi-Linear layers call; onto :func:`chunk_kda_prefill` here.
* :func:`fused_recurrent_kda_packed_decode` -- the one-token decode from the packed
  post-conv QKV (``ops/third_party/kda/fused_recurrent.py`` of both vendors; the
  NVIDIA copy's ``out``); onto :func:`kda_engram.kda.kda_decode`.
* :func:`fused_recurrent_kda` (the ROCm copy's signature) and
  :func:`fused_recurrent_kda_nvidia` (the NVIDIA copy's) -- the decode peel and the
  speculative verify from the raw gate, uneven token counts per sequence and
  zero-length (CUDA-graph padding) sequences included; onto
  :func:`kda_engram.kda.kda_decode_multi` on the packed tokens (``cu_seqlens``,
  ``num_accepted_tokens`` and vLLM's null row read by the kernel: one launch).

The device rules of our kernels run in eager mode and are skipped (host rules
only) while a CUDA graph is captured or ``torch.compile`` traces, where vLLM calls
these. While ``torch.compile`` traces, the kernels are reached through their custom
ops (:mod:`kda_engram.ops`), so ``torch.compile(fullgraph=True)`` takes these
functions whole (an ``out`` is then filled by a copy from the op's output).

vLLM's conventions, adapted here on the device (no host sync), where our kernels
have their own:

* ``NULL_BLOCK_ID = 0``: a state or checkpoint row index ``<= 0`` is no row (our
  kernels: negative), mapped to -1.
* a checkpoint offset that is not a multiple of 64 is skipped (ours refuse it):
  mapped to 0 (none).
* the prefill's returned final state is fp32 (ours: the initial state's dtype).

States are V-first ``[*, H, V, K]`` in vLLM and in our kernels: nothing is transposed.
"""

from __future__ import annotations

import torch

from .. import ops
from ..constants import CHUNK_SIZE
from ..kda import decode as _decode
from ..kda import prefill as _prefill
from ..validation.common import INDEX_DTYPES, can_read_back, check_tensor
from ..validation.entry import EntryChecks
from ..validation.kda_decode import check_decode_multi_arguments
from ..validation.kda_inputs import check_input_forms
from .common import packed_varlen

__all__ = [
    "BACKENDS",
    "NULL_BLOCK_ID",
    "chunk_kda_prefill",
    "chunk_kda_with_fused_gate",
    "chunk_kda_with_fused_gate_nvidia",
    "fused_recurrent_kda",
    "fused_recurrent_kda_nvidia",
    "fused_recurrent_kda_packed_decode",
    "null_rows_to_none",
    "recurrent_varlen",
]

#: vLLM's ``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``: index 0 is no row.
NULL_BLOCK_ID = 0
#: The ``backend`` values vLLM's ROCm ``chunk_kda_prefill`` takes (all served by ours).
BACKENDS = ("triton", "fused", "gluon")


def _launch(entry, op_function, *args, out=None, check_inputs=True, **kwargs):
    """``entry(*args, out=out, **kwargs)`` in eager mode, checked (device rules too,
    unless a CUDA graph is being captured or ``check_inputs`` is False); while
    ``torch.compile`` traces, the custom op ``op_function`` (host rules only; it
    allocates its output, copied into ``out``). The result as ``entry`` returns it."""
    if not torch.compiler.is_compiling():
        return entry(*args, out=out, check_inputs=bool(check_inputs) and can_read_back(), **kwargs)
    result = op_function(*args, **kwargs)
    o = result[0] if isinstance(result, tuple) else result
    if out is not None:
        out.copy_(o)
        o = out
    return (o, *result[1:]) if isinstance(result, tuple) else o


def null_rows_to_none(indices: torch.Tensor | None, null_row: int = NULL_BLOCK_ID) -> torch.Tensor | None:
    """Row indices where ``<= null_row`` is no row (vLLM's: ``NULL_BLOCK_ID``) as ours
    (-1: no row), on the device."""
    if indices is None:
        return None
    return torch.where(indices > null_row, indices, torch.full_like(indices, -1))


def chunk_kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    backend: str = "triton",
    out: torch.Tensor | None = None,
    checkpoint_state: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    checkpoint_state_indices: torch.Tensor | None = None,
    state_cache: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA prefill from the raw gate and beta (vLLM 0.33's ROCm Kimi-K3 ``chunk_kda_prefill``).

    ``q, k, raw_g``: ``[1, T, H, K]``; ``v``: ``[1, T, H, V]``; ``raw_beta``:
    ``[1, T, H]`` (before its sigmoid); ``A_log [H]``; ``g_bias`` ``[H*K]`` or None
    (zeros). ``cu_seqlens`` int ``[N+1]`` (None: ``[B, T, ...]`` inputs, ``B``
    sequences of ``T`` tokens). Gate ``-exp(A_log) softplus(raw_g + g_bias)``, or
    ``lower_bound * sigmoid(exp(A_log) (raw_g + g_bias))`` with ``lower_bound``.
    ``use_qk_l2norm_in_kernel`` (default False, as vLLM's) L2-normalises q and k.

    State, V-first: ``initial_state [N, H, V, K]`` / ``output_final_state`` (the
    final state is fp32), or the paged ``state_cache [slots, H, V, K]`` (fp32 or
    bf16) with ``state_indices [N]`` and bool ``has_initial_state [N]``, updated in
    place (the returned final state is then None; a row index ``<= 0`` is no row:
    the sequence starts from zeros and writes no row). ``checkpoint_offsets`` int
    ``[N]`` snapshot the state after that many tokens (0, or any offset that is not
    a multiple of 64: none) into ``checkpoint_state`` (the cache itself in vLLM's
    layer) at ``checkpoint_state_indices`` (``<= 0``: none), or at row ``n`` of a
    staging ``checkpoint_state`` without indices. Served on every ``backend``
    (vLLM's own path serves checkpoints only on ``"fused"``).

    ``chunk_indices`` and ``chunk_offsets`` (vLLM's precomputed chunk metadata) are
    accepted and not read: the kernels build the same from ``cu_seqlens`` on the
    device. ``out`` ``[1, T, H, V]``: the output lands there (returned). Unlike
    vLLM's Triton path, ``v`` is never overwritten.

    Rules on values (index ranges, offsets at most the length) are checked on the
    device and raised by the next kda-engram call (:func:`kda_engram.raise_pending_errors`).
    Returns ``(o [1, T, H, V], final_state [N, H, V, K] fp32 | None)``.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q: expected [1, T, H, K] (or [B, T, H, K] without cu_seqlens), got {list(q.shape)}")
    B, T, H, K = q.shape
    if g_bias is None:
        g_bias = torch.zeros(H * K, dtype=torch.float32, device=q.device)
    cu_seqlens, (q, k, v, raw_g, raw_beta, out) = packed_varlen(
        q, cu_seqlens, (("q", q), ("k", k), ("v", v), ("raw_g", raw_g), ("raw_beta", raw_beta), ("out", out)))
    if checkpoint_offsets is not None:
        check_tensor("checkpoint_offsets", checkpoint_offsets)
        aligned = torch.remainder(checkpoint_offsets, CHUNK_SIZE) == 0
        checkpoint_offsets = torch.where(aligned, checkpoint_offsets, torch.zeros_like(checkpoint_offsets))
    for name, x in (("state_indices", state_indices), ("checkpoint_state_indices", checkpoint_state_indices)):
        if x is not None:
            check_tensor(name, x)
    o, final = _launch(
        _prefill.chunk_kda_prefill, ops.chunk_kda_prefill,
        q, k, v, raw_g, raw_beta, A_log, g_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
        initial_state=initial_state, output_final_state=output_final_state, state_cache=state_cache,
        state_indices=null_rows_to_none(state_indices), has_initial_state=has_initial_state,
        checkpoint_state=checkpoint_state, checkpoint_offsets=checkpoint_offsets,
        checkpoint_state_indices=null_rows_to_none(checkpoint_state_indices), out=out,
        final_state_dtype=torch.float32 if output_final_state else None,
        qk_l2norm=bool(use_qk_l2norm_in_kernel),
    )
    return o.view(B, T, *o.shape[2:]), final


def _no_other_keywords(kwargs: dict, served: tuple[str, ...]) -> None:
    """vLLM's ``chunk_kda_with_fused_gate`` swallows unknown keywords (``**kwargs``);
    ours refuses what it does not serve rather than drop it."""
    other = sorted(set(kwargs) - set(served))
    if other:
        raise TypeError(f"{other[0]}: not an argument kda-engram serves for chunk_kda_with_fused_gate "
                        f"(served: {', '.join(served)}), got {', '.join(other)}")


def chunk_kda_with_fused_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA prefill on per-sequence initial states (vLLM 0.33's ROCm
    ``ops/third_party/kda`` ``chunk_kda_with_fused_gate``): :func:`chunk_kda_prefill`
    with ``initial_state [N, H, V, K]`` / ``output_final_state`` (fp32 final state).
    ``chunk_indices``/``chunk_offsets`` are accepted and not read; of the other
    keywords (which vLLM's copy ignores) ``out`` ``[1, T, H, V]`` is served and any
    other is a ``TypeError``. ``v`` is never overwritten (vLLM's copy writes its
    output over it). Returns ``(o, final_state | None)``."""
    _no_other_keywords(kwargs, ("out",))
    return chunk_kda_prefill(q, k, v, raw_g, raw_beta, A_log, g_bias, scale, initial_state, output_final_state,
                             lower_bound, use_qk_l2norm_in_kernel, cu_seqlens, out=kwargs.get("out"))


def chunk_kda_with_fused_gate_nvidia(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_kda_with_fused_gate` with the NVIDIA copy's signature (``out``
    after ``cu_seqlens``; ``chunk_indices``/``chunk_offsets`` accepted as keywords
    and not read); the same contract."""
    _no_other_keywords(kwargs, ("chunk_indices", "chunk_offsets"))
    return chunk_kda_prefill(q, k, v, raw_g, raw_beta, A_log, g_bias, scale, initial_state, output_final_state,
                             lower_bound, use_qk_l2norm_in_kernel, cu_seqlens, out=out)


def fused_recurrent_kda_packed_decode(
    mixed_qkv: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA decode step per sequence from the packed post-conv QKV (vLLM 0.33's
    ``fused_recurrent_kda_packed_decode``, both vendors' copies).

    ``mixed_qkv``: ``[B, 2*H*K + H*V]`` (q, k, v channel ranges, last dim
    contiguous; the token stride may be wider); ``raw_g``: ``[1, B, H, K]`` (before
    ``dt_bias`` and the gate); ``raw_beta``: ``[1, B, H]`` (before its sigmoid);
    ``A_log [H]``; ``dt_bias [H*K]``; ``lower_bound``: None (softplus gate) or the
    bounded gate's bound. q and k are L2-normalised, ``scale`` defaults to
    ``K ** -0.5``. ``initial_state``: the V-first pool ``[slots, H, V, K]`` (fp32 or
    bf16), updated in place at ``state_indices [B]``; an index ``<= 0`` is padding:
    no row is read or written and its output is zero. ``out``: optional
    ``[1, B, H, V]`` (the NVIDIA copy's argument).

    Returns ``(out [1, B, H, V] in mixed_qkv's dtype, initial_state)``.
    """
    check_tensor("mixed_qkv", mixed_qkv, last_dim_contiguous=True)
    check_tensor("initial_state", initial_state)
    if mixed_qkv.dim() != 2:
        raise ValueError(f"mixed_qkv: expected [B, 2*H*K + H*V], got {list(mixed_qkv.shape)}")
    if initial_state.dim() != 4:
        raise ValueError(f"initial_state: expected the pool [slots, H, V, K], got {list(initial_state.shape)}")
    B = mixed_qkv.shape[0]
    _, H, V, K = initial_state.shape
    if mixed_qkv.shape[1] != 2 * H * K + H * V:
        raise ValueError(f"mixed_qkv: expected [{B}, {2 * H * K + H * V}] (2*H*K + H*V with the pool's H={H}, "
                         f"V={V}, K={K}), got {list(mixed_qkv.shape)}")
    check_tensor("raw_g", raw_g, shape=[1, B, H, K])
    check_tensor("raw_beta", raw_beta, shape=[1, B, H])
    check_tensor("state_indices", state_indices, shape=[B])
    q = mixed_qkv[:, :H * K].unflatten(1, (H, K))
    k = mixed_qkv[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = mixed_qkv[:, 2 * H * K:].unflatten(1, (H, V))
    if out is None:
        out = torch.empty(1, B, H, V, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    else:
        check_tensor("out", out, shape=[1, B, H, V])
    _launch(_decode.kda_decode, ops.kda_decode, q, k, v, raw_g[0], raw_beta[0], A_log, dt_bias, initial_state,
            state_indices, scale=scale, lower_bound=lower_bound, null_row=NULL_BLOCK_ID, out=out[0])
    return out, initial_state


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    uniform_sequence_length: int | None = None,
    out: torch.Tensor | None = None,
    fuse_gate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent KDA steps on the state pool from the raw gate and beta (vLLM 0.33's
    ROCm ``ops/third_party/kda`` ``fused_recurrent_kda``: the Kimi-K3 decode peel and
    speculative verify).

    ``q, k, raw_g``: ``[1, T, H, K]``; ``v``: ``[1, T, H, V]``; ``raw_beta``:
    ``[1, T, H]`` (before its sigmoid); ``A_log [H]``; ``dt_bias [H*K]`` or None;
    gate as in :func:`chunk_kda_prefill`; q and k L2-normalised, scale ``K ** -0.5``.
    ``cu_seqlens`` int ``[N+1]``: sequence ``n`` is tokens ``cu[n]:cu[n+1]``, any
    count from 0 (CUDA-graph padding: nothing read or written) to ``W``.
    ``ssm_state_indices``: ``[N]`` (one token per sequence, ``T == N``) or ``[N, W]``:
    the state after token ``s`` of sequence ``n`` is written to row
    ``ssm_state_indices[n, s]``; the walk starts from row
    ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
    ``num_accepted_tokens``). A row ``<= 0`` is no row: not written, and as the start
    row it makes the sequence padding (zero output, nothing written).
    ``initial_state``: the V-first pool ``[slots, H, V, K]``, updated in place.
    ``uniform_sequence_length`` and ``fuse_gate`` are vLLM's launch hints: accepted,
    not needed. ``out``: optional ``[1, T, H, V]``; tokens outside every sequence are
    left as they are.

    Device rules (eager mode only): ``num_accepted_tokens`` in ``[1, W]``, every
    sequence at most ``W`` tokens, ``cu_seqlens`` from 0, non-decreasing, ending at
    most at ``T``; a call that breaks one writes no row, its error is raised by the
    next kda-engram call. Returns ``(out, initial_state)``.
    """
    return _recurrent_from_raw(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                               ssm_state_indices, num_accepted_tokens, out)


def fused_recurrent_kda_nvidia(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    fuse_gate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_recurrent_kda` with the NVIDIA copy's signature (no
    ``uniform_sequence_length``); the same contract."""
    return _recurrent_from_raw(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                               ssm_state_indices, num_accepted_tokens, out)


def _recurrent_from_raw(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                        ssm_state_indices, num_accepted_tokens, out):
    """The body of both :func:`fused_recurrent_kda` signatures (see there)."""
    check_tensor("q", q)
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected [1, T, H, K], got {list(q.shape)}")
    T = q.shape[1]
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, device=q.device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected [N+1], got {list(cu_seqlens.shape)}")
    N = cu_seqlens.numel() - 1
    check_tensor("ssm_state_indices", ssm_state_indices, dtypes=INDEX_DTYPES, device=q.device)
    if ssm_state_indices.dim() == 1:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: needs the 2-D ssm_state_indices [N, W] (one column per token)")
        if T != N or ssm_state_indices.shape[0] != N:
            raise ValueError(f"ssm_state_indices: a 1-D [N] index serves one token per sequence (T == N), got "
                             f"{list(ssm_state_indices.shape)} for N={N} sequences of T={T} tokens")
        ssm_state_indices = ssm_state_indices[:, None]
    if dt_bias is None:
        dt_bias = torch.zeros(q.shape[2] * q.shape[3], dtype=torch.float32, device=q.device)
    return recurrent_varlen(q, k, v, raw_g, raw_beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices,
                            num_accepted_tokens, out, lower_bound=lower_bound)


def recurrent_varlen(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices,
                     num_accepted_tokens, out, *, lower_bound=None, scale=None, gate="raw", qk_l2norm=True,
                     beta_sigmoid=True, null_row=NULL_BLOCK_ID, start_rows=None, check_inputs=True):
    """Recurrent KDA steps on the state pool for a varlen batch of uneven token counts,
    in one :func:`kda_engram.kda.kda_decode_multi` launch on the packed tokens
    (``[1, T, ...]``, sequence ``n`` at ``cu_seqlens[n]:cu_seqlens[n+1]``, 0 to ``W``
    tokens, ``W`` the width of ``ssm_state_indices [N, W]``): the kernel reads each
    sequence's tokens where they are and writes their outputs into ``out``
    ``[1, T, H, V]`` (allocated, zeros, when None; tokens no sequence owns are left
    as they are, or zeroed while ``torch.compile`` traces, where the op's own output is
    copied into ``out``).

    Rows: the state after token ``s`` of sequence ``n`` goes to
    ``ssm_state_indices[n, s]``; the walk starts from ``start_rows[n]`` or else
    ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
    ``num_accepted_tokens``); an index ``<= null_row`` is no row (as the start: a
    padding sequence, zero output, nothing written); a zero-length sequence touches
    nothing. ``gate``, ``qk_l2norm``, ``beta_sigmoid``, ``scale``, ``lower_bound``:
    as in :func:`kda_engram.kda.kda_decode_multi`. With ``check_inputs`` (and outside
    capture and tracing) the kernel's rules run under vLLM's names, those on values
    queued (``cu_seqlens``, at most ``W`` tokens a sequence, ``num_accepted_tokens`` in
    ``[1, W]``, the rows really written in range and distinct): broken, no row is
    written and the next kda-engram call raises. Returns ``(out, initial_state)``.
    """
    T, N = q.shape[1], cu_seqlens.numel() - 1
    if ssm_state_indices.dim() != 2 or ssm_state_indices.shape[0] != N or ssm_state_indices.shape[1] < 1:
        raise ValueError(f"ssm_state_indices: expected [{N}] or [{N}, W >= 1], got {list(ssm_state_indices.shape)}")
    if num_accepted_tokens is not None:
        check_tensor("num_accepted_tokens", num_accepted_tokens, shape=[N], dtypes=INDEX_DTYPES, device=q.device)
        if start_rows is not None:
            num_accepted_tokens = None  # the given start rows win
    if out is None:
        out = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    else:
        check_tensor("out", out, shape=list(v.shape), device=q.device)
    if N == 0 or T == 0:
        return out, initial_state
    call = dict(initial_state_indices=start_rows, scale=scale, lower_bound=lower_bound, gate=gate,
                qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid, cu_seqlens=cu_seqlens,
                num_accepted_tokens=num_accepted_tokens, null_row=null_row)
    if torch.compiler.is_compiling():  # the op (host rules only), its output copied into out
        out.copy_(ops.kda_decode_multi(q, k, v, g, beta, A_log, dt_bias, initial_state, ssm_state_indices, **call,
                                       check_inputs=False))
        return out, initial_state
    # Eager: kda_decode_multi's own body, with vLLM's name for the rows in its messages.
    check_input_forms(gate, A_log, dt_bias, lower_bound, qk_l2norm, beta_sigmoid)
    checks = EntryChecks(bool(check_inputs) and can_read_back())
    rows = ssm_state_indices
    if checks.on:
        check_decode_multi_arguments(checks, q, k, v, g, beta, A_log, dt_bias, initial_state, rows, start_rows, out,
                                     scale, lower_bound, gate, cu_seqlens, num_accepted_tokens, null_row,
                                     rows_name="ssm_state_indices")
        rows, call["initial_state_indices"] = checks.guard_many((rows, -1), (start_rows, -1))
    _decode.run_kda_decode_multi(q, k, v, g, beta, A_log, dt_bias, initial_state, rows, out=out, **call)
    checks.run()
    return out, initial_state
