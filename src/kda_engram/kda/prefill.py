"""``chunk_kda_prefill``: the public KDA prefill, two fused stages.

1. :func:`kda_engram.kda.prologue.kda_prefill_prologue` turns the raw projections
   into the per-chunk operands (L2 norms, gate, gate cumsum, the intra-chunk
   matrices and the WY/UT ``w``/``u``; two launches, split for register room), and
2. :func:`kda_engram.kda.chunk.kda_prefill_walk` walks the chunks with the state
   on chip and writes the output (and the final state, the state-cache rows and
   the checkpoints).

That is the portable path. Each path is a registered backend
(:mod:`kda_engram.kda.prefill_paths`, the only list of them): ``"portable"`` and
``"grouped"`` (its walk cut into chunk groups) in
:mod:`kda_engram.kda.portable_prefill`, ``"hopper"`` in
:mod:`kda_engram.kda.hopper.prefill`; the call takes the one ``path=`` names, or with
``"auto"`` the first of the registry's :func:`~kda_engram.kda.prefill_paths.auto_order`
whose verifier says yes (:func:`prefill_path`).

Everything between and around the launches (chunk metadata, workspaces) is
computed on the device from static shapes, so with ``check_inputs=False`` a
whole prefill runs with no host synchronisation and can be captured in a CUDA
graph and replayed with new ``cu_seqlens`` contents of the same size.
"""

from __future__ import annotations

import torch

from ..bundles import ConvArgs, KDAInputs, StateArgs
from ..constants import CHUNK_SIZE
from ..validation.common import FLOAT_DTYPES, check_tensor
from ..validation.entry import EntryChecks
from ..validation.kda_inputs import check_input_forms, check_log_decay_values, check_lower_bound
from ..validation.kda_prefill import check_prologue_arguments, check_state_arguments, check_state_structure
# The backends' modules, one line each: importing one registers its backends.
from . import portable_prefill as _portable_prefill  # noqa: F401 ("portable", "grouped")
from .hopper import prefill as _hopper_prefill  # noqa: F401 ("hopper")
from .hopper import fused_prefill as _fused_prefill  # noqa: F401 ("fused")
from .metadata import trusted_chunk_metadata
from .prefill_paths import PrefillBackend, PrefillCall, Verdict, path_names, serving
from .state import guarded_state

__all__ = ["chunk_kda_prefill", "prefill_host_rules", "prefill_path", "prefill_rules", "prefill_verdict",
           "run_prefill"]


def prefill_verdict(call: PrefillCall, path: str = "auto") -> Verdict:
    """Whether ``chunk_kda_prefill(path=path)`` serves ``call`` and, if not, the one-line
    refusal it raises after ``"path: "`` (:func:`~kda_engram.kda.prefill_paths.refusal`)."""
    backend, why = serving(call, path)
    return backend is not None, why


def _backend(call: PrefillCall, path: str) -> PrefillBackend:
    """The backend that serves ``call`` on ``path``, or a ``ValueError`` saying why none does."""
    if path not in path_names():
        raise ValueError(f"path: expected one of {path_names()}, got {path!r}")
    backend, why = serving(call, path)
    if backend is None:
        raise ValueError(f"path: {why}")
    return backend


def prefill_path(q, v, out, *, cu_seqlens, groups=None, conv_weight=None, path="auto", inputs=None) -> str:
    """The path :func:`chunk_kda_prefill` takes for this call, one of the registry's
    :func:`~kda_engram.kda.prefill_paths.path_names` but ``"auto"`` (``"hopper"`` or
    ``"portable"`` today).

    ``path=<name>`` gives that backend's path; ``"auto"`` the first backend of the
    registry's :func:`~kda_engram.kda.prefill_paths.auto_order` that serves the call:
    the grouped portable walk where it cuts the sequences into chunk groups (long
    sequences on few heads, where the groups' parallel walk is faster than one CTA per
    sequence and head), else the Hopper path where it serves the call, else the portable
    one. A path that cannot serve the call is a ``ValueError`` saying why (the backends'
    verifiers, :mod:`kda_engram.kda.prefill_paths`). Host facts only: no device value is
    read. ``inputs``: the call's :class:`~kda_engram.bundles.KDAInputs`, for a backend
    that serves some input forms only (the fused Hopper prefill)."""
    call = PrefillCall(q, v, out, cu_seqlens=cu_seqlens, groups=groups, conv_weight=conv_weight, inputs=inputs)
    return _backend(call, path).path


def chunk_kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_cache: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    checkpoint_state: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    checkpoint_state_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    conv_weight: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    conv_has_initial_state: torch.Tensor | None = None,
    groups: int | None = None,
    final_state_dtype: torch.dtype | None = None,
    check_inputs: bool = True,
    gate: str = "raw",
    qk_l2norm: bool = True,
    beta_sigmoid: bool = True,
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA prefill of a varlen batch: raw projections in, output and state out.

    Shapes (``T`` tokens flattened over ``N = len(cu_seqlens) - 1`` sequences):

    * ``q``, ``k``, ``raw_g``: ``[1, T, H, K]``; ``v``: ``[1, T, H, V]`` (K = V = 128
      in the model); ``raw_beta``: ``[1, T, H]``. Any strides: ``raw_g`` and
      ``raw_beta`` typically are column slices of one fused projection and are
      read in place, never copied.
    * ``A_log``: ``[H]``; ``dt_bias``: ``[H * K]`` or ``[H, K]``.
    * ``cu_seqlens``: int32/int64 ``[N+1]``, from 0 to ``T``, non-decreasing;
      zero-length sequences are allowed.

    Gate: ``lower_bound=None`` gives ``a = -exp(A_log) softplus(raw_g + dt_bias)``;
    ``lower_bound=L <= 0`` gives ``a = L sigmoid(exp(A_log) (raw_g + dt_bias))``.
    ``scale`` defaults to ``K ** -0.5``. q and k are L2-normalised and
    ``beta = sigmoid(raw_beta)`` inside the prologue.

    Input forms (what fla's and Hugging Face's callers pass): ``gate="log_decay"``
    makes ``raw_g`` the per-channel log decay ``a`` itself (natural log, ``<= 0``,
    any float dtype, e.g. the output of a separate gate kernel); ``A_log``,
    ``dt_bias`` and ``lower_bound`` are then ``None``. Any strength is finite: a
    log decay below -128 (down to -inf) acts as -128, whose ``exp`` is 0 in fp32.
    ``qk_l2norm=False`` uses q and k as given (already normalised by the
    caller); ``beta_sigmoid=False`` takes ``raw_beta`` as beta itself.

    State (V-first ``[*, H, V, K]``, stored fp32 or bf16: fp32 on chip, rounded
    to bf16 with RTNE once per store; ``final_state_dtype`` defaults to
    ``initial_state``'s dtype, else fp32) and checkpoints follow
    :func:`kda_engram.kda.chunk.kda_prefill_walk`: either ``initial_state`` /
    ``output_final_state``, or the paged ``state_cache`` with ``state_indices``
    and ``has_initial_state`` (updated in place; the returned final state is then
    ``None``; a negative index reads and writes nothing and the sequence starts
    from zeros); ``checkpoint_offsets`` (multiples of 64, 0 = none) snapshot the
    state after that many tokens into ``checkpoint_state`` (``None``: into
    ``state_cache`` itself, at ``checkpoint_state_indices``).

    ``out`` (``[1, T, H, V]``) defaults to a new tensor of ``v``'s dtype; it may be
    ``v`` itself (the prologue has consumed ``v`` into ``u`` before the chunk
    kernel writes). The operand workspaces are ``torch.empty`` of the caching
    allocator, released when the call returns.

    ``conv_weight`` (``[2HK + HV, 4]``) turns on the prologue's depthwise causal
    conv + SiLU (a launch of its own before the prologue's two): ``q``, ``k``, ``v`` are then the raw bands of the QKV
    projection and ``conv_state`` ``[slots, 2HK + HV, 3]`` (the last three raw
    inputs per sequence, oldest first) is read at ``conv_state_indices[n]`` where
    ``conv_has_initial_state[n]`` and written back in place (see
    :func:`kda_engram.kda.prologue.kda_prefill_prologue`).

    ``groups`` (``None``: chosen by :func:`kda_engram.kda.groups.chunk_groups`;
    an int forces it) cuts long sequences into parallel chunk groups joined by an
    exact scan, see :func:`kda_engram.kda.chunk.kda_prefill_walk`; the results
    contract does not change.

    ``path`` picks the implementation (:func:`prefill_path`): ``"auto"`` (the
    Hopper path of :mod:`kda_engram.kda.hopper` on sm_90 where it serves the call,
    else the portable one), ``"hopper"`` or ``"portable"`` (every registered backend:
    :mod:`kda_engram.kda.prefill_paths`). All have this one results contract.

    ``check_inputs=True`` validates every argument; the rules on device values
    (``cu_seqlens``, indices, offsets) are vectorised and read back to the host in
    one transfer after the launches, which a broken rule turns into no-ops on
    every cache (guarded indices; the read-back waits only for the flags). With
    ``False`` nothing synchronises (the
    chunk metadata is built on the device with the static bound ``T // 64 + N``
    rows), so the call can be captured in a CUDA graph.

    A NaN in ``k``, ``v``, the gate or beta at token ``t`` reaches every output of
    its 64-token chunk, also those before ``t`` (the chunk form solves the chunk
    as one system); earlier chunks stay clean.

    Returns ``(out [1, T, H, V], final_state [N, H, V, K] | None)``.
    """
    # The arguments as three values from here on: the inputs, the state, the conv.
    x = KDAInputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound, gate=gate,
                  qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid)
    state = StateArgs(initial_state=initial_state, output_final_state=output_final_state, state_cache=state_cache,
                      state_indices=state_indices, has_initial_state=has_initial_state,
                      checkpoint_state=checkpoint_state, checkpoint_offsets=checkpoint_offsets,
                      checkpoint_state_indices=checkpoint_state_indices, final_state_dtype=final_state_dtype)
    conv = ConvArgs(conv_weight, conv_state, conv_state_indices, conv_has_initial_state)
    # Raises an earlier call's pending error first. Host rules raise at once; the
    # value rules (cu_seqlens, indices, offsets) are queued, their verdict taken
    # after the guarded launches (below).
    checks = EntryChecks(check_inputs)
    if checks.on:
        prefill_rules(x, state, conv, cu_seqlens, out, checks)
    else:
        prefill_host_rules(x, state)  # even with check_inputs off: they pick branches or would drop state
    # Launch, then read back: a broken rule turns the batch into empty sequences
    # whose rows are all "none", so the launches touch no cache, no checkpoint row
    # and no conv row. (No-ops without queued rules.)
    cu_seqlens, conv_rows, state = guarded_state(checks, state, (cu_seqlens, 0), (conv.conv_state_indices, -1))
    result = run_prefill(x, cu_seqlens, state, conv.replace(conv_state_indices=conv_rows), out=out, groups=groups,
                         path=path)
    checks.run()  # the verdict, after the launches (deferred by default: validation.entry)
    return result


def prefill_host_rules(x: KDAInputs, state: StateArgs) -> None:
    """The rules :func:`chunk_kda_prefill` runs even with ``check_inputs=False`` (host
    only): the state's argument combinations (a wrong one would drop state silently)
    and the input forms and ``lower_bound`` (they pick the kernels' branches)."""
    check_state_structure(state)
    check_lower_bound(x.lower_bound)
    check_input_forms(x.gate, x.A_log, x.dt_bias, x.lower_bound, x.qk_l2norm, x.beta_sigmoid)


def prefill_rules(x: KDAInputs, state: StateArgs, conv: ConvArgs, cu_seqlens, out, checks) -> None:
    """Every rule of :func:`chunk_kda_prefill`: the host rules at once and, with
    ``checks``, the rules on device values queued (``None``: host rules only, what its
    op runs with ``check_inputs=False``)."""
    prefill_host_rules(x, state)
    T, H, K, V = check_prologue_arguments(x, cu_seqlens, conv, None, checks, scale_optional=True)
    check_log_decay_values(x.gate, x.raw_g, checks)
    if out is not None:
        check_tensor("out", out, shape=[1, T, H, V], dtypes=FLOAT_DTYPES, device=x.q.device)
    check_state_arguments(checks, state, num_seqs=cu_seqlens.numel() - 1, num_heads=H, head_v=V, head_k=K,
                          device=x.q.device, cu_seqlens=cu_seqlens)


def run_prefill(x: KDAInputs, cu_seqlens, state: StateArgs, conv: ConvArgs, *, out=None, groups=None,
                path="auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_kda_prefill` without any rule (the caller has run them and guarded
    the indices; the prefill's op runs this): the path's choice, the chunk metadata
    (one launch, on the device, from static shapes: no host sync), ``out`` and the
    path's launches. Returns ``(out, final_state | None)``."""
    backend = _backend(PrefillCall(x.q, x.v, out, cu_seqlens=cu_seqlens, groups=groups,
                                   conv_weight=conv.conv_weight, inputs=x), path)
    T, H, V = x.q.shape[1], x.q.shape[2], x.v.shape[3]
    if x.scale is None:
        x = x.replace(scale=x.q.shape[3] ** -0.5)
    chunk_offsets, chunk_indices = trusted_chunk_metadata(cu_seqlens, T, CHUNK_SIZE)
    if out is None:
        out = torch.empty(1, T, H, V, dtype=x.v.dtype, device=x.v.device)
    return backend.run(x, cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, chunk_indices=chunk_indices, out=out,
                       state=state, conv=conv, groups=groups)
