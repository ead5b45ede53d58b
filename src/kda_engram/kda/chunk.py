"""The KDA chunk kernel: inter-chunk recurrence and output in one launch.

Consumes the operands of the fused prologue (documented, and computed in plain
PyTorch, by :func:`kda_engram.kda.reference.naive_chunk_operands`) and walks every
sequence's 64-token chunks with the recurrent state on chip. Per chunk, with
``S`` the V-first state ``[V, K]`` at the chunk start::

    v_new = u - w S^T
    o     = scale (qg S^T + tril(aqk) v_new)
    S     = S diag(decay) + v_new^T kg

Why one launch: fla-core writes every chunk's state to HBM (``h``, 32 KiB per
chunk and head in bf16) and reads it back in a second kernel for the output.
Here one program owns one (sequence, head, V-tile) and keeps its ``[K, BV]``
slice of the state in registers for the whole walk, so the only HBM traffic is
the operands read once and the output written once, plus the start and final
state. Programs never share a state row, so the in-place paged state cache
(read row ``state_indices[n]``, write the same row back) needs no
synchronisation (with groups, only the scan reads the row and only the
sequence's last group in pass two writes it: launch order serialises them).

The walk over chunks is serial per sequence. For long sequences on few heads
(where that leaves the GPU mostly idle) :func:`kda_prefill_walk` cuts every
sequence into parallel chunk groups joined by the exact transfer-operator scan
(:mod:`kda_engram.kda.groups`; ``reference.naive_chunk_walk(groups=...)`` is its
plain-PyTorch form): pass one (the same chunk step with the output switched
off, over the V state rows and the K operator rows), the scan and pass two (the
walk kernel with ``GROUPED``). With one group it is the single launch above. The
kernels are in :mod:`kda_engram.kda.chunk_kernels`; this module launches them.
"""

from __future__ import annotations

import math

import torch

from ..bundles import StateArgs
from ..constants import CHUNK_SIZE, KDA_CHECKPOINT_ALIGNMENT, MAX_GRID_DIM
from ..launch_config import ChunkConfig, chunk_config, chunk_launch  # noqa: F401 (chunk_config: public here too)
from ..platform import arch, interpreting, num_compute_units
from ..validation.common import INDEX_DTYPES, check_tensor
from ..validation.entry import EntryChecks
from ..validation.kda_inputs import check_cu_seqlens, check_scale
from ..validation.kda_prefill import (
    check_chunk_offsets,
    check_chunk_operands,
    check_state_arguments,
    check_state_structure,
)
from .chunk_kernels import _kda_chunk_walk_kernel, _kda_group_pass_one_kernel, _kda_group_scan_kernel
from .groups import group_workspace_layout, resolve_groups
from .state import state_launch_modes
from .metadata import prepare_chunk_metadata, prepare_chunk_offsets
from .state import allocate_final_state, guarded_state

__all__ = [
    "KDA_CHECKPOINT_ALIGNMENT",
    "chunk_config",
    "check_state_arguments",
    "kda_prefill_walk",
    "walk_chunks",
    "walk_rules",
]



def kda_prefill_walk(
    qg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    kg_t: torch.Tensor,
    aqk: torch.Tensor,
    decay: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_offsets: torch.Tensor | None = None,
    checkpoint_state: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    checkpoint_state_indices: torch.Tensor | None = None,
    state_cache: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    *,
    check_inputs: bool = True,
    config: dict | ChunkConfig | None = None,
    groups: int | None = None,
    min_group_chunks: int | None = None,
    group_workspace: torch.Tensor | None = None,
    final_state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the chunk recurrence and the output projection: one launch, or three
    with parallel chunk groups.

    Operands (what the prologue / ``reference.naive_chunk_operands`` produce; one float
    dtype for all but ``decay``):

    * ``qg``, ``w``: ``[1, T, H, K]``; ``u``: ``[1, T, H, V]``; ``aqk``: ``[1, T, H, 64]``
      (only its inclusive lower triangle is read).
    * ``kg_t``: chunk-major transposed gated keys ``[R, H, K, 64]``, ``decay``:
      ``[R', H, K]`` (any float dtype, read as fp32). Row ``chunk_offsets[n] + c``
      is chunk ``c`` of sequence ``n``; each of ``R``, ``R'`` is at least the batch's
      chunk count, checked per operand (the prologue allocates both at the static
      bound ``T // 64 + N``).
    * ``out``: ``[1, T, H, V]``, written for the tokens ``cu_seqlens`` covers and
      nowhere else. It may alias the ``v`` that ``u`` was computed from (the walk
      reads ``u``, never ``v``).
    * ``cu_seqlens``: ``[N+1]`` int32/int64; ``chunk_offsets``: ``[N+1]`` (computed
      on the device when omitted; pass the prologue's to save a launch).
    * ``scale``: output scale (the prologue does not fold it into ``qg``).

    State (V-first ``[*, H, V, K]``, any strides; stored fp32 or bf16, always
    fp32 on chip, rounded to bf16 with RTNE once per store; the cache or initial
    state and the checkpoint buffer share one dtype, else ``TypeError``):

    * ``initial_state`` ``[N, H, V, K]`` or ``None`` (zeros); ``output_final_state``
      returns a new ``[N, H, V, K]`` final state.
    * or ``state_cache`` ``[slots, H, V, K]`` with ``state_indices`` ``[N]`` and
      ``has_initial_state`` bool ``[N]``: sequence ``n`` starts from row
      ``state_indices[n]`` when ``has_initial_state[n]`` (else from zeros, and the
      row is not read) and its final state is written back to the same row; the
      returned final state is then ``None``. A negative index means no row: the
      walk starts from zeros, outputs are still written, and no row is read or
      written.
    * ``checkpoint_offsets`` int ``[N]``: snapshot of the state after that many
      tokens of sequence ``n`` (0 = none; otherwise a multiple of
      :data:`KDA_CHECKPOINT_ALIGNMENT` and at most the length), written to
      ``checkpoint_state[checkpoint_state_indices[n]]`` (``[rows, H, V, K]`` in the state's dtype,
      may be the state cache itself, which ``None`` stands for; negative row = none)
      or to row ``n`` of a staging ``checkpoint_state`` without indices. The kernel writes only
      snapshots it can place exactly; with ``check_inputs`` any other offset is a
      ``ValueError``, so nothing is dropped silently.

    ``check_inputs=True`` validates everything; the rules on ``cu_seqlens``, the
    indices and offsets are vectorised, the launches run on guarded indices (a
    broken rule writes nothing) and the verdict is raised by the next call into
    the library (``"sync"``: at once; :mod:`kda_engram.validation.entry`); with
    ``False`` the call launches one
    kernel (plus the ``chunk_offsets`` computation when not given) with no host
    synchronisation, so it can be captured in a CUDA graph. ``config`` overrides
    :func:`~kda_engram.launch_config.chunk_config` (a dict or a :class:`~kda_engram.launch_config.ChunkConfig`
    of the keys ``BV``, ``num_warps``, ``num_stages``, for tuning; an unknown key
    is a ``ValueError``;
    the grouped walk also reads ``BV_pass1``, ``num_warps_pass1``,
    ``num_stages_pass1``, ``BV_scan``, ``BJ_scan`` (contraction block of the
    scan's product), ``num_warps_scan``, ``num_stages_scan`` and
    ``scan_precision``: ``"ieee"``, ``"tf32x3"`` or ``"tf32"``, default from
    :func:`~kda_engram.launch_config.scan_precision_for`, ``"ieee"`` under the interpreter).

    Parallel chunk groups (:mod:`kda_engram.kda.groups`): ``groups=None`` lets
    :func:`~kda_engram.kda.groups.chunk_groups` choose ``G`` from the machine fit,
    with ``(T // 64) // N`` chunks per sequence as a static proxy (nothing is read
    back from the device) and at least :data:`~kda_engram.kda.groups.MIN_GROUP_CHUNKS`
    chunks per group; ``groups=G`` forces ``G`` with ``min_group_chunks=1``
    (each sequence's chunks cut into ``ceil(chunks / G)``-chunk groups, as
    ``reference.naive_chunk_walk(groups=G)`` does; a ``G`` past what any sequence
    can use, ``ceil(T / 64)`` chunks, launches only the usable groups, same results:
    :func:`~kda_engram.kda.groups.resolve_groups`). Per sequence, in the kernels, the
    group length is ``L_n = max(ceil(chunks_n / G), min_group_chunks)``, so a short
    sequence in a ragged batch stays one group and costs no pass one. ``G = 1`` is
    the single launch above. ``G > 1`` runs pass one (every group but each
    sequence's last composes its local state ``H_g`` and transfer operator
    ``M_g`` from zero), the scan (``S_{g+1} = S_g M_g + H_g`` from the initial
    state or cache row; fp32 state, products at ``tf32x3`` on NVIDIA with
    bf16/fp16 operands, ``ieee`` otherwise) and pass two (every group walks
    from its start state, writing outputs, the checkpoints in its range and,
    last group, the final state / cache row): same results contract, no host
    synchronisation.
    ``group_workspace`` (fp32, contiguous, at least
    :func:`~kda_engram.kda.groups.group_workspace_numel` elements; layout in
    :func:`~kda_engram.kda.groups.group_workspace_layout`) is allocated with
    ``torch.empty`` when not given; pass one to keep it caller-owned (e.g. inside
    a CUDA graph's pool).

    ``final_state_dtype`` (float32 or bfloat16; default ``initial_state``'s dtype,
    else float32) is the dtype of the returned final state. A bf16 checkpoint
    rounds the state the walk carries on (so resuming from it reproduces the
    uninterrupted walk bit for bit); it needs the serial walk, so ``groups=None``
    then runs one group and a forced ``groups > 1`` is a ``ValueError``.

    Returns ``(out, final_state | None)``.
    """
    state = StateArgs(initial_state=initial_state, output_final_state=output_final_state, state_cache=state_cache,
                      state_indices=state_indices, has_initial_state=has_initial_state,
                      checkpoint_state=checkpoint_state, checkpoint_offsets=checkpoint_offsets,
                      checkpoint_state_indices=checkpoint_state_indices, final_state_dtype=final_state_dtype)
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        expected = walk_rules(qg, w, u, kg_t, aqk, decay, out, scale, cu_seqlens, chunk_offsets, state, checks)
    else:
        check_state_structure(state)  # host only, even with check_inputs off: a wrong combination drops state
    if checks.on and chunk_offsets is None:
        chunk_offsets = expected  # the rules have built it already
    # Launch, then read back: a broken rule turns the batch into empty sequences
    # (cu_seqlens and chunk_offsets zeros) whose rows are all "none" and offsets
    # 0, so the launches below touch no cache, checkpoint or output row.
    cu_seqlens, chunk_offsets, state = guarded_state(checks, state, (cu_seqlens, 0), (chunk_offsets, 0))
    result = walk_chunks(qg, w, u, kg_t, aqk, decay, out, scale, cu_seqlens, chunk_offsets, state, config=config,
                         groups=groups, min_group_chunks=min_group_chunks, group_workspace=group_workspace)
    checks.run()  # the verdict, after the launches (deferred by default: validation.entry)
    return result


def walk_rules(qg, w, u, kg_t, aqk, decay, out, scale, cu_seqlens, chunk_offsets, state: StateArgs,
               checks) -> torch.Tensor | None:
    """Every rule of :func:`kda_prefill_walk`: the host rules at once and, with
    ``checks``, the rules on device values queued (``None``: host rules only, what its
    op runs with ``check_inputs=False``). With ``checks``, returns the chunk offsets
    built from ``cu_seqlens`` (the rules compare the caller's with them; the walk
    launches with them)."""
    check_state_structure(state)
    T, H, K, V = check_chunk_operands(qg, w, u, kg_t, aqk, decay, out)
    check_scale(scale, allow_none=False)
    check_cu_seqlens(cu_seqlens, T, u.device, checks, covers_all=False)
    check_state_arguments(checks, state, num_seqs=cu_seqlens.numel() - 1, num_heads=H, head_v=V, head_k=K,
                          device=u.device, cu_seqlens=cu_seqlens)
    if checks is None:
        if chunk_offsets is not None:
            check_tensor("chunk_offsets", chunk_offsets, shape=[cu_seqlens.numel()], dtypes=INDEX_DTYPES,
                         device=u.device)
        return None
    expected = prepare_chunk_offsets(cu_seqlens, CHUNK_SIZE, check_inputs=False)
    check_chunk_offsets(chunk_offsets, expected, {"kg_t": kg_t.shape[0], "decay": decay.shape[0]}, checks)
    return expected


def walk_chunks(qg, w, u, kg_t, aqk, decay, out, scale, cu_seqlens, chunk_offsets, state: StateArgs, *,
                config=None, groups=None, min_group_chunks=None,
                group_workspace=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kda_prefill_walk`'s launches without any rule: the caller has run them
    and guarded the indices (the prefill's portable path, the walk's op). A missing
    ``chunk_offsets`` is built on the device from ``cu_seqlens`` (one launch, no host
    sync). Returns ``(out, final_state | None)``."""
    device = u.device
    T, H, K, V = qg.shape[1], qg.shape[2], qg.shape[3], u.shape[3]
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_metadata(cu_seqlens, T, CHUNK_SIZE, check_inputs=False)[0]
    num_seqs = cu_seqlens.numel() - 1
    initial_state, state_cache, state_indices = state.initial_state, state.state_cache, state.state_indices
    has_initial_state, checkpoint_state = state.has_initial_state, state.snapshots
    checkpoint_offsets, checkpoint_state_indices = state.checkpoint_offsets, state.checkpoint_state_indices
    final_state = None
    if state.output_final_state:
        final_state = allocate_final_state(state, (num_seqs, H, V, K), device)
    if num_seqs == 0 or H == 0:
        return out, final_state
    if num_seqs > MAX_GRID_DIM or H > MAX_GRID_DIM:
        raise ValueError(f"cu_seqlens/qg: at most 65535 sequences and heads per launch (grid), got N={num_seqs}, H={H}")

    n_groups, min_len = resolve_groups(groups, min_group_chunks, T, num_seqs, H, K, V, device)
    ckpt_bf16 = checkpoint_offsets is not None and checkpoint_state.dtype == torch.bfloat16
    if ckpt_bf16 and n_groups > 1:
        # A bf16 checkpoint rounds the carried state mid-walk; the groups' start
        # states come from the scan, which cannot see that rounding.
        if groups is not None:
            raise ValueError(f"groups: bf16 checkpoints need the serial walk (groups=1 or None), got {groups}")
        n_groups, min_len = 1, 1
    if n_groups > 1:
        if num_seqs * n_groups > MAX_GRID_DIM:
            raise ValueError(f"groups: N x G must be at most 65535 (grid), got N={num_seqs}, G={n_groups}")
        if n_groups * H * max(V, K) * K >= 2**31:
            raise ValueError(f"groups: G x H x max(V, K) x K must stay below 2^31 (32-bit workspace offsets), "
                             f"got G={n_groups}, H={H}, V={V}, K={K}")
        layout = group_workspace_layout(n_groups, num_seqs, H, K, V)
        need = layout["numel"][0]
        if group_workspace is None:
            group_workspace = torch.empty(need, dtype=torch.float32, device=device)
        else:
            check_tensor("group_workspace", group_workspace, dtypes=[torch.float32], device=device)
            if not group_workspace.is_contiguous() or group_workspace.numel() < need:
                raise ValueError(
                    f"group_workspace: expected a contiguous fp32 tensor of at least {need} elements "
                    f"(group_workspace_numel(G={n_groups}, N={num_seqs}, H={H}, K={K}, V={V})), got "
                    f"{group_workspace.numel()} elements{'' if group_workspace.is_contiguous() else ', not contiguous'}"
                )
        flat = group_workspace.view(-1)
        parts = {name: flat[off: off + math.prod(shape)].view(shape)
                 for name, (off, shape) in layout.items() if name != "numel"}

    interp = interpreting()
    if interp and qg.dtype == torch.bfloat16:
        # The interpreter's tl.dot is wrong on bf16 operands: walk fp32 copies of
        # them on the CPU path (the compiled kernels read the caller's tensors).
        qg, w, u, kg_t, aqk = (x.float() for x in (qg, w, u, kg_t, aqk))
    launch = chunk_launch(config, num_seqs=num_seqs, n_groups=n_groups, num_heads=H, head_k=K, head_v=V,
                          ieee_operands=qg.dtype == torch.float32, arch=arch(device),
                          compute_units=num_compute_units(device), interpret=interp)

    load_mode, store_mode, s_in, s_out = state_launch_modes(initial_state, final_state, state_cache)
    dummy = u  # stands in for absent pointers; never dereferenced (constexpr-disabled paths)
    s_in_t = s_in if s_in is not None else dummy
    s_out_t = s_out if s_out is not None else dummy
    st4 = lambda x: tuple(x.stride()) if x is not None and x.dim() == 4 else (0, 0, 0, 0)  # noqa: E731
    st1 = lambda x: x.stride(0) if x is not None else 0  # noqa: E731
    # has_initial_state is bool; Triton reads it as bytes through a uint8 view (no copy).
    has_t = has_initial_state.view(torch.uint8) if has_initial_state is not None else cu_seqlens
    idx_t = state_indices if state_indices is not None else cu_seqlens
    has_ckpt = checkpoint_offsets is not None
    ck_indexed = checkpoint_state_indices is not None
    ieee = qg.dtype == torch.float32

    if n_groups > 1:
        h_ws, m_ws, s_ws = parts["h"], parts["m"], parts["s"]
        # Pass one: V state rows + K operator rows per (sequence, head, group).
        bv1, bvs, bj = launch.BV_pass1, launch.BV_scan, launch.BJ_scan
        _kda_group_pass_one_kernel[((V + K) // bv1, H, num_seqs * (n_groups - 1))](
            w, u, kg_t, decay, cu_seqlens, chunk_offsets, h_ws, m_ws,
            n_groups, min_len,
            *w.stride()[1:], *u.stride()[1:], *kg_t.stride(), *decay.stride(),
            *h_ws.stride(), *m_ws.stride(),
            cu_seqlens.stride(0), chunk_offsets.stride(0),
            K=K, V=V, BV=bv1, C=CHUNK_SIZE, IEEE=ieee, INTERPRET=interp,
            num_warps=launch.num_warps_pass1, num_stages=launch.num_stages_pass1,
        )
        # The scan: the only reader of the initial state / cache row.
        _kda_group_scan_kernel[(V // bvs, H, num_seqs)](
            cu_seqlens, s_in_t, idx_t, has_t, h_ws, m_ws, s_ws,
            n_groups, min_len,
            *st4(s_in), *h_ws.stride(), *m_ws.stride(), *s_ws.stride(),
            cu_seqlens.stride(0), st1(state_indices), st1(has_initial_state),
            K=K, V=V, BV=bvs, BJ=bj, C=CHUNK_SIZE, LOAD_STATE=load_mode, PRECISION=launch.scan_precision,
            INTERPRET=interp, num_warps=launch.num_warps_scan, num_stages=launch.num_stages_scan,
        )
        # Pass two reads its start state from the scan's output.
        walk_in, walk_in_strides, walk_load = s_ws, tuple(s_ws.stride()), 3
    else:
        walk_in = s_in_t
        st_in = st4(s_in)
        walk_in_strides, walk_load = (st_in[0], 0, *st_in[1:]), load_mode

    bv = launch.BV
    grid = (V // bv, H, num_seqs * n_groups)
    _kda_chunk_walk_kernel[grid](
        qg, w, u, kg_t, aqk, decay, out,
        cu_seqlens, chunk_offsets,
        walk_in, s_out_t, idx_t, has_t,
        checkpoint_state if has_ckpt else dummy,
        checkpoint_offsets if has_ckpt else cu_seqlens,
        checkpoint_state_indices if ck_indexed else cu_seqlens,
        float(scale), n_groups, min_len,
        *qg.stride()[1:], *w.stride()[1:], *u.stride()[1:],
        *kg_t.stride(), *aqk.stride()[1:], *decay.stride(), *out.stride()[1:],
        *walk_in_strides, *st4(s_out), *st4(checkpoint_state if has_ckpt else None),
        cu_seqlens.stride(0), chunk_offsets.stride(0), st1(state_indices), st1(has_initial_state),
        st1(checkpoint_offsets), st1(checkpoint_state_indices),
        K=K, V=V, BV=bv, C=CHUNK_SIZE,
        LOAD_STATE=walk_load, STORE_STATE=store_mode,
        HAS_CKPT=has_ckpt, CKPT_INDEXED=ck_indexed, GROUPED=n_groups > 1,
        IEEE=ieee, INTERPRET=interp,
        CKPT_BF16=ckpt_bf16, OUT_BF16=s_out is not None and s_out.dtype == torch.bfloat16,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out, final_state

