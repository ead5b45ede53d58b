"""Argument rules of the KDA entry points (prefill, prologue, chunk walk, decode, conv).

Host rules (shapes, dtypes, devices, scalars, argument combinations) raise at
once. Rules about device values (``cu_seqlens``, state / checkpoint / conv
indices, checkpoint offsets, chunk indices) take a
:class:`~kda_engram.validation.common.DeviceChecks` and only queue vectorised
flags; the entry point reads all of them back with one ``run()`` before it
launches anything that writes a cache.
"""

from __future__ import annotations

import torch

from ..bundles import ConvArgs, KDAInputs, StateArgs
from ..constants import (
    STATE_DTYPES,
    CHUNK_SIZE,
    CONV_WIDTH,
    DECODE_MAX_HEAD_DIM,
    KDA_CHECKPOINT_ALIGNMENT,
    KDA_HEAD_DIMS,
)
from ..launch_config import is_pow2
from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_bool,
    check_index_values,
    value_at,
    check_kernel_device,
    check_real,
    check_same_dtype,
    check_tensor,
)

from .index_rules import (
    MAX_ONE_PROGRAM_INDICES,
    cu_seqlens_messages,
    cu_seqlens_rules,
    decode_multi_clash_message,
    decode_multi_rules,
    fits_decode_multi_rules,
    fits_index_set_rules,
    fits_kda_batch_rules,
    fits_state_rules,
    index_rules,
    index_set_rules,
    kda_batch_rules,
    snapshot_clash_message,
    state_rules,
)

__all__ = [
    "check_scale",
    "check_lower_bound",
    "check_input_forms",
    "check_log_decay_values",
    "check_state_structure",
    "final_state_dtype",
    "check_cu_seqlens",
    "check_prefill_inputs",
    "check_chunk_indices",
    "check_conv_arguments",
    "check_prologue_arguments",
    "check_chunk_operands",
    "check_chunk_offsets",
    "check_state_arguments",
    "check_decode_inputs",
    "check_decode_indices",
    "guard_decode_indices",
    "check_decode_multi_indices",
    "check_out_dtype",
    "check_conv_decode",
    "check_conv_checkpoint",
    "check_fused_decode_arguments",
    "check_state_dtype_match",
    "check_checkpoint_offsets",
    "check_kda_batch",
    "check_kda_requests",
    "check_index_rows",
    "check_checkpoint_pair",
    "check_kda_layer_inputs",
    "KDA_BATCH_GUARDS",
]


def check_scale(scale, *, allow_none: bool = True) -> None:
    """The output scale: ``None`` (``K ** -0.5``) or a finite number > 0."""
    check_real("scale", scale, sign="positive", allow_none=allow_none)


def check_lower_bound(lower_bound) -> None:
    """``None`` (softplus gate) or a finite log-decay bound ``<= 0`` (bounded gate)."""
    check_real("lower_bound", lower_bound, sign="non-positive", allow_none=True)


GATE_FORMS = ("raw", "log_decay")


def check_log_decay_values(gate, raw_g: torch.Tensor, checks: DeviceChecks | None) -> None:
    """Queue (device values): with ``gate="log_decay"`` every entry of ``raw_g`` is the
    log of a decay, so ``<= 0``; a positive one makes the state grow without bound
    (the output turns to inf / NaN). Nothing for ``gate="raw"``."""
    if checks is None or gate != "log_decay" or raw_g.numel() == 0:
        return
    checks.add((raw_g > 0).any(), "raw_g: with gate='log_decay' every entry is a log decay and must be <= 0 "
                                  "(a positive one makes the state grow without bound), got a positive entry")


def check_input_forms(gate, A_log, dt_bias, lower_bound, qk_l2norm=True, beta_sigmoid=True) -> None:
    """The input forms (host only; they pick kernel branches, so the entry points
    run it even with ``check_inputs=False``): ``gate`` is ``"raw"`` (``raw_g``
    with ``A_log`` and ``dt_bias``) or ``"log_decay"`` (``raw_g`` is the
    per-channel log decay; ``A_log``, ``dt_bias`` and ``lower_bound`` are then
    None, since nothing would apply them); ``qk_l2norm``/``beta_sigmoid`` are bools."""
    if not isinstance(gate, str) or gate not in GATE_FORMS:
        raise ValueError(f"gate: expected one of {GATE_FORMS}, got {gate!r}")
    if gate == "log_decay":
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if x is not None:
                raise ValueError(f"{name}: expected None with gate='log_decay' (raw_g is the log decay), got a value")
    else:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is None:
                raise ValueError(f"{name}: required with gate='raw' (pass gate='log_decay' for a precomputed gate)")
    for name, x in (("qk_l2norm", qk_l2norm), ("beta_sigmoid", beta_sigmoid)):
        if not isinstance(x, bool):
            raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")


def check_state_structure(state: StateArgs) -> None:
    """Argument combinations of a call's state and checkpoint arguments (host only:
    the entry points run it even with ``check_inputs=False``, since a wrong
    combination would drop state silently)."""
    check_bool("output_final_state", state.output_final_state)  # "yes" would otherwise read as true
    if state.state_cache is not None:
        if state.initial_state is not None or state.output_final_state:
            raise ValueError(
                "state_cache replaces initial_state/output_final_state: pass either state_cache "
                "(with state_indices and has_initial_state) or initial_state/output_final_state"
            )
        if state.state_indices is None or state.has_initial_state is None:
            raise ValueError("state_cache needs state_indices and has_initial_state")
    elif state.state_indices is not None or state.has_initial_state is not None:
        raise ValueError("state_indices/has_initial_state are only meaningful with state_cache")
    if state.checkpoint_offsets is not None and state.checkpoint_state is None and state.state_cache is None:
        raise ValueError("checkpoint_offsets needs checkpoint_state or state_cache (the destination of the snapshots)")
    if state.checkpoint_offsets is None and (state.checkpoint_state is not None
                                             or state.checkpoint_state_indices is not None):
        raise ValueError("checkpoint_state/checkpoint_state_indices need checkpoint_offsets")
    # One storage dtype per state chain (a resumed checkpoint must equal the walk's state).
    check_state_dtype_match(["state_cache", "initial_state", "checkpoint_state"],
                            [state.state_cache, state.initial_state, state.checkpoint_state])
    if state.final_state_dtype is not None and state.final_state_dtype not in STATE_DTYPES:
        raise TypeError(f"final_state_dtype: expected float32 or bfloat16, got {state.final_state_dtype}")
    if state.output_final_state and state.checkpoint_offsets is not None and state.checkpoint_state is not None:
        final, ck = final_state_dtype(state), state.checkpoint_state.dtype
        if ck != final:
            raise TypeError(f"checkpoint_state: expected the dtype of final_state_dtype ({_dtype_name(final)}), "
                            f"got {_dtype_name(ck)}")


def final_state_dtype(state: StateArgs) -> torch.dtype:
    """The returned final state's dtype: ``final_state_dtype``, else ``initial_state``'s,
    else fp32."""
    if state.final_state_dtype is not None:
        return state.final_state_dtype
    return state.initial_state.dtype if state.initial_state is not None else torch.float32


def check_state_dtype_match(names: list[str], tensors: list[torch.Tensor | None]) -> None:
    """States that feed one another share one storage dtype (TypeError otherwise).

    ``names[0]`` is the reference argument (the cache / initial state)."""
    present = [(n, t) for n, t in zip(names, tensors) if t is not None]
    if len(present) < 2:
        return
    ref_name, ref = present[0]
    for n, t in present[1:]:
        if t.dtype != ref.dtype:
            raise TypeError(f"{n}: expected the dtype of {ref_name} ({_dtype_name(ref.dtype)}), "
                            f"got {_dtype_name(t.dtype)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_cu_seqlens(cu_seqlens, total_tokens: int, device: torch.device, checks: DeviceChecks | None, *,
                     covers_all: bool, return_lengths: bool = False) -> torch.Tensor | None:
    """``cu_seqlens``: int32/int64 ``[N+1]`` on ``device``; its values (queued on
    ``checks`` as one launch, :func:`kda_engram.validation.index_rules.cu_seqlens_rules`;
    skipped when ``checks`` is None) start at 0, never decrease and end at
    ``total_tokens`` (``covers_all``) or at most there. Returns the int64
    per-sequence lengths ``[N]`` on the device when ``return_lengths`` and
    ``checks`` are given (for rules that need them), else None."""
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, device=device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 0, got {list(cu_seqlens.shape)}")
    if checks is None:
        return None
    checks.add_packed(*cu_seqlens_rules(cu_seqlens, total_tokens, covers_all=covers_all))
    if not return_lengths:
        return None
    cu = cu_seqlens.to(torch.int64)
    return cu[1:] - cu[:-1]


def _check_head_dims(K: int, V: int) -> None:
    for name, d in (("K (q.shape[-1])", K), ("V (v.shape[-1])", V)):
        if d not in KDA_HEAD_DIMS:
            raise ValueError(f"{name}: expected one of {KDA_HEAD_DIMS} (128 in production), got {d}")


def check_prefill_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias) -> tuple[int, int, int, int]:
    """Raw projections of the prefill / prologue (host only). Returns ``(T, H, K, V)``."""
    check_tensor("q", q, shape=[1, None, None, None], dtypes=FLOAT_DTYPES)
    check_kernel_device("q", q)
    _, T, H, K = q.shape
    dev = q.device
    check_tensor("k", k, shape=[1, T, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("v", v, shape=[1, T, H, None], dtypes=FLOAT_DTYPES, device=dev)
    check_same_dtype(("q", "k", "v"), (q, k, v))
    V = v.shape[3]
    _check_head_dims(K, V)
    check_tensor("raw_g", raw_g, shape=[1, T, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("raw_beta", raw_beta, shape=[1, T, H], dtypes=FLOAT_DTYPES, device=dev)
    if A_log is None and dt_bias is None:  # gate='log_decay' (check_input_forms)
        return T, H, K, V
    check_tensor("A_log", A_log, shape=[H], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=dev)
    if tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        raise ValueError(f"dt_bias: expected shape [{H * K}] or [{H}, {K}], got {list(dt_bias.shape)}")
    return T, H, K, V


def check_chunk_indices(chunk_indices, num_seqs: int, device, checks: DeviceChecks | None,
                        lengths: torch.Tensor | None) -> None:
    """``chunk_indices`` ``[rows, 2]`` (sequence id, chunk index): ids in ``[-1, N)``,
    and every live row's chunk inside its sequence (queued)."""
    check_tensor("chunk_indices", chunk_indices, shape=[None, 2], dtypes=INDEX_DTYPES, device=device)
    if checks is None or chunk_indices.shape[0] == 0:
        return
    ci = chunk_indices.to(torch.int64)
    seq, c = ci[:, 0], ci[:, 1]
    checks.add((seq < -1).any() | (seq >= num_seqs).any(),
               f"chunk_indices: sequence ids must lie in [-1, {num_seqs}), got min {{}} max {{}}", seq.min(), seq.max())
    if lengths is not None and num_seqs > 0:
        live = seq >= 0
        length = lengths[seq.clamp(0, num_seqs - 1)]
        outside = live & ((c < 0) | (c * CHUNK_SIZE >= length))
        checks.add(outside.any(), "chunk_indices: a chunk index lies outside its sequence (need 0 <= c*64 < length)")


def check_conv_arguments(conv_weight, conv_state, conv_state_indices, conv_has_initial_state, *,
                         channels: int, num_seqs: int, device, checks: DeviceChecks | None) -> None:
    """The prefill's conv arguments: ``conv_weight [C, 4]``; ``conv_state
    [slots, C, 3]`` with ``conv_state_indices [N]`` (negative = no row; the others
    in range and distinct, queued) and optional bool ``conv_has_initial_state [N]``."""
    if conv_weight is None:
        for name, x in (("conv_state", conv_state), ("conv_state_indices", conv_state_indices),
                        ("conv_has_initial_state", conv_has_initial_state)):
            if x is not None:
                raise ValueError(f"{name}: given without conv_weight (the conv path needs conv_weight)")
        return
    check_tensor("conv_weight", conv_weight, shape=[channels, CONV_WIDTH], dtypes=FLOAT_DTYPES, device=device)
    if conv_state is None:
        for name, x in (("conv_state_indices", conv_state_indices), ("conv_has_initial_state", conv_has_initial_state)):
            if x is not None:
                raise ValueError(f"{name}: given without conv_state")
        return
    check_tensor("conv_state", conv_state, shape=[None, channels, CONV_WIDTH - 1], dtypes=FLOAT_DTYPES, device=device)
    if conv_state_indices is None:
        raise ValueError("conv_state_indices: required with conv_state (int [N], negative = no row)")
    check_tensor("conv_state_indices", conv_state_indices, shape=[num_seqs], dtypes=INDEX_DTYPES, device=device)
    if conv_has_initial_state is not None:
        check_tensor("conv_has_initial_state", conv_has_initial_state, shape=[num_seqs], dtypes=(torch.bool,),
                     device=device)
    if checks is not None:
        check_index_values(checks, "conv_state_indices", conv_state_indices, conv_state.shape[0])


def check_prologue_arguments(x: KDAInputs, cu_seqlens, conv: ConvArgs, chunk_indices, checks: DeviceChecks | None,
                             *, scale_optional: bool = False):
    """Every rule of :func:`kda_prefill_prologue` (and of the prefill's raw inputs) on
    its arguments (the inputs and the conv as their bundles): host rules at once,
    value rules queued on ``checks`` (None: host rules only). ``scale_optional``:
    ``None`` stands for ``K ** -0.5`` (the prefill's default). Returns ``(T, H, K, V)``."""
    q = x.q
    T, H, K, V = check_prefill_inputs(q, x.k, x.v, x.raw_g, x.raw_beta, x.A_log, x.dt_bias)
    check_scale(x.scale, allow_none=scale_optional)
    check_lower_bound(x.lower_bound)
    lengths = check_cu_seqlens(cu_seqlens, T, q.device, checks, covers_all=True,
                               return_lengths=chunk_indices is not None)
    N = cu_seqlens.numel() - 1
    if chunk_indices is not None:
        check_chunk_indices(chunk_indices, N, q.device, checks, lengths)
    check_conv_arguments(conv.conv_weight, conv.conv_state, conv.conv_state_indices, conv.conv_has_initial_state,
                         channels=2 * H * K + H * V, num_seqs=N, device=q.device, checks=checks)
    return T, H, K, V


def check_chunk_operands(qg, w, u, kg_t, aqk, decay, out) -> tuple[int, int, int, int]:
    """The chunk walk's operands (host only; ``out`` None: allocated by the caller's
    wrapper). Returns ``(T, H, K, V)``."""
    check_tensor("qg", qg, shape=[1, None, None, None], dtypes=FLOAT_DTYPES)
    check_kernel_device("qg", qg)
    device = qg.device
    _, T, H, K = qg.shape
    check_tensor("u", u, shape=[1, T, H, None], dtypes=FLOAT_DTYPES, device=device)
    V = u.shape[3]
    _check_head_dims(K, V)
    check_tensor("w", w, shape=[1, T, H, K], dtypes=FLOAT_DTYPES, device=device)
    check_tensor("aqk", aqk, shape=[1, T, H, CHUNK_SIZE], dtypes=FLOAT_DTYPES, device=device)
    check_tensor("kg_t", kg_t, shape=[None, H, K, CHUNK_SIZE], dtypes=FLOAT_DTYPES, device=device)
    check_same_dtype(["qg", "w", "u", "aqk", "kg_t"], [qg, w, u, aqk, kg_t])
    check_tensor("decay", decay, shape=[kg_t.shape[0], H, K], dtypes=FLOAT_DTYPES, device=device)
    if out is not None:
        check_tensor("out", out, shape=[1, T, H, V], dtypes=FLOAT_DTYPES, device=device)
    return T, H, K, V


def check_chunk_offsets(chunk_offsets, expected: torch.Tensor, rows: int, checks: DeviceChecks) -> None:
    """A caller's ``chunk_offsets`` equal ``expected`` (from ``cu_seqlens``), and the
    batch's chunk count fits the ``rows`` of ``kg_t``/``decay`` (queued)."""
    if chunk_offsets is not None:
        check_tensor("chunk_offsets", chunk_offsets, shape=[expected.numel()], dtypes=INDEX_DTYPES,
                     device=expected.device)
        checks.add((chunk_offsets.to(torch.int64) != expected.to(torch.int64)).any(),
                   "chunk_offsets: does not match prepare_chunk_offsets(cu_seqlens)")
    checks.add(expected[-1] > rows, f"kg_t/decay: the batch has {{}} chunks, got {rows} rows", expected[-1])


def check_checkpoint_offsets(checks: DeviceChecks, name: str, offsets: torch.Tensor,
                             lengths: torch.Tensor | None) -> torch.Tensor:
    """The state-checkpoint offset rule (queued): every entry of ``offsets [N]``
    (N >= 1) is 0 (none) or a multiple of :data:`KDA_CHECKPOINT_ALIGNMENT` at most
    its sequence's length (``lengths [N]``; None: not checked). Returns the
    offsets as int64 (the callers' next rules need them)."""
    offs = offsets.to(torch.int64)
    bad = (offs < 0) | (offs % KDA_CHECKPOINT_ALIGNMENT != 0)
    if lengths is not None:
        bad = bad | (offs > lengths)
    first = torch.argmax(bad.to(torch.int8))
    length = value_at(lengths if lengths is not None else offs, first)
    checks.add(bad.any(), checkpoint_offsets_message(name), first, length, value_at(offs, first))
    return offs


def checkpoint_offsets_message(name: str) -> str:
    """The checkpoint-offset rule's message; ``{}`` stand for the sequence, its
    length and its offset."""
    return (f"{name}[{{}}]: expected 0 (none) or a multiple of {KDA_CHECKPOINT_ALIGNMENT} "
            "(KDA_CHECKPOINT_ALIGNMENT) at most the sequence length {}, got {}")


def _owner_of_rows(indices: torch.Tensor, slots: int) -> torch.Tensor:
    """``owner[r]`` = the position ``n`` with ``indices[n] == r`` (-1: none), int64
    ``[slots + 1]``; negative indices land on the spare entry ``slots``. With
    duplicate indices one of the positions wins (the distinctness rule reports them)."""
    idx = indices.reshape(-1).to(torch.int64)
    idx = torch.where((idx >= 0) & (idx < slots), idx, slots)
    owner = torch.full((slots + 1,), -1, dtype=torch.int64, device=indices.device)
    owner.scatter_(0, idx, torch.arange(idx.numel(), dtype=torch.int64, device=indices.device))
    owner[slots:].fill_(-1)  # a view and a fill: no host-to-device copy, no sync
    return owner



def check_state_arguments(
    checks: DeviceChecks | None,
    state: StateArgs,
    *,
    num_seqs: int,
    num_heads: int,
    head_v: int,
    head_k: int,
    device: torch.device,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """The state and checkpoint arguments (:class:`~kda_engram.bundles.StateArgs`) of
    the prefill and the chunk walk: shapes and
    dtypes at once; with ``checks``, queued: state rows in range and distinct,
    checkpoint offsets 0 or multiples of :data:`KDA_CHECKPOINT_ALIGNMENT` within
    the sequence (from ``cu_seqlens``; None: not bounded), active checkpoint rows
    in range and distinct, and, when the snapshots go into the state cache itself,
    no snapshot on another sequence's state row. The value rules run as one
    launch (:func:`~kda_engram.validation.index_rules.state_rules`) up to
    :data:`~kda_engram.validation.index_rules.MAX_STATE_RULE_SEQS` sequences, as
    PyTorch ops beyond."""
    initial_state, state_cache, state_indices = state.initial_state, state.state_cache, state.state_indices
    has_initial_state, checkpoint_state = state.has_initial_state, state.snapshots
    checkpoint_offsets, checkpoint_state_indices = state.checkpoint_offsets, state.checkpoint_state_indices
    N, H, V, K = num_seqs, num_heads, head_v, head_k
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=[N, H, V, K], dtypes=STATE_DTYPES, device=device)
    if state_cache is not None:
        check_tensor("state_cache", state_cache, shape=[None, H, V, K], dtypes=STATE_DTYPES, device=device)
        check_tensor("state_indices", state_indices, shape=[N], dtypes=INDEX_DTYPES, device=device)
        check_tensor("has_initial_state", has_initial_state, shape=[N], dtypes=[torch.bool], device=device)
    if checkpoint_offsets is not None:
        check_tensor("checkpoint_offsets", checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=device)
        check_tensor("checkpoint_state", checkpoint_state, shape=[None, H, V, K], dtypes=STATE_DTYPES,
                     device=device)
        rows = checkpoint_state.shape[0]
        if checkpoint_state_indices is not None:
            check_tensor("checkpoint_state_indices", checkpoint_state_indices, shape=[N], dtypes=INDEX_DTYPES,
                         device=device)
        elif rows < N:
            raise ValueError(f"checkpoint_state: without checkpoint_state_indices it needs N={N} rows, got {rows}")
    if checks is None or N == 0 or (state_cache is None and checkpoint_offsets is None):
        return
    same_cache = (state_cache is not None and checkpoint_offsets is not None
                  and checkpoint_state.data_ptr() == state_cache.data_ptr())
    if fits_state_rules(N, cu_seqlens, state_indices, checkpoint_offsets, checkpoint_state_indices):
        state_rules(checks, num_seqs=N, cu_seqlens=cu_seqlens,
                    state_indices=None if state_cache is None else state_indices,
                    slots=0 if state_cache is None else state_cache.shape[0], checkpoint_offsets=checkpoint_offsets,
                    checkpoint_state_indices=checkpoint_state_indices,
                    checkpoint_rows=0 if checkpoint_offsets is None else checkpoint_state.shape[0],
                    same_cache=same_cache, alignment=KDA_CHECKPOINT_ALIGNMENT,
                    offsets_message=checkpoint_offsets_message("checkpoint_offsets"))
        return
    if state_cache is not None:
        check_index_values(checks, "state_indices", state_indices, state_cache.shape[0])
    if checkpoint_offsets is None:
        return
    rows = checkpoint_state.shape[0]
    lengths = None
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
    offs = check_checkpoint_offsets(checks, "checkpoint_offsets", checkpoint_offsets, lengths)
    active = offs > 0
    if checkpoint_state_indices is not None:
        # Only sequences that actually export claim their row.
        ck_rows = torch.where(active, checkpoint_state_indices.to(torch.int64), -1)
        check_index_values(checks, "checkpoint_state_indices", ck_rows, rows)
    else:
        ck_rows = torch.where(active, torch.arange(N, device=device), -1)
    if same_cache:
        # Snapshots into the paged cache itself: one sequence's snapshot must not
        # land on another sequence's state row (two programs would race on it).
        owner = _owner_of_rows(state_indices, state_cache.shape[0])
        slot = torch.where((ck_rows >= 0) & (ck_rows < state_cache.shape[0]), ck_rows, state_cache.shape[0])
        who = owner[slot]
        clash = (who >= 0) & (who != torch.arange(N, device=device))
        n = torch.argmax(clash.to(torch.int8))
        checks.add(clash.any(), snapshot_clash_message(), n, value_at(ck_rows, n), value_at(who, n))


def check_decode_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, out, scale, lower_bound,
                        lead: int) -> tuple[int, ...]:
    """Host rules shared by both decode entry points; ``lead`` is 1 (``[B]``) or 2
    (``[B, S]``). Returns the leading sizes."""
    check_tensor("state_cache", state_cache, dtypes=STATE_DTYPES)
    check_kernel_device("state_cache", state_cache)
    if state_cache.dim() != 4:
        raise ValueError(f"state_cache: expected shape [slots, H, V, K], got {list(state_cache.shape)}")
    dev = state_cache.device
    _, H, V, K = state_cache.shape
    check_tensor("q", q, dtypes=FLOAT_DTYPES, device=dev)
    if q.dim() != lead + 2:
        want = "[B, S, H, K]" if lead == 2 else "[B, H, K]"
        raise ValueError(f"q: expected shape {want}, got {list(q.shape)}")
    lead_sizes = [q.shape[i] for i in range(lead)]
    check_tensor("q", q, shape=[*lead_sizes, H, K])
    check_tensor("k", k, shape=[*lead_sizes, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("v", v, shape=[*lead_sizes, H, V], dtypes=FLOAT_DTYPES, device=dev)
    check_same_dtype(["q", "k", "v"], [q, k, v])
    check_tensor("raw_g", raw_g, shape=[*lead_sizes, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("raw_beta", raw_beta, shape=[*lead_sizes, H], dtypes=FLOAT_DTYPES, device=dev)
    if A_log is not None or dt_bias is not None:  # both None: gate='log_decay' (check_input_forms)
        check_tensor("A_log", A_log, shape=[H], dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=dev)
        if list(dt_bias.shape) not in ([H, K], [H * K]):
            raise ValueError(f"dt_bias: expected shape [{H}, {K}] or [{H * K}], got {list(dt_bias.shape)}")
    if not (is_pow2(K) and is_pow2(V) and 16 <= K <= DECODE_MAX_HEAD_DIM and 16 <= V <= DECODE_MAX_HEAD_DIM):
        raise ValueError(
            f"state_cache: head dims K and V must be powers of two in [16, {DECODE_MAX_HEAD_DIM}], got K={K}, V={V}"
        )
    if out is not None:
        check_tensor("out", out, shape=[*lead_sizes, H, V], dtypes=FLOAT_DTYPES, device=dev)
    check_scale(scale)
    check_lower_bound(lower_bound)
    return tuple(lead_sizes)


def check_decode_indices(state_indices, batch: int, state_cache, checks: DeviceChecks | None) -> None:
    """``kda_decode``'s ``state_indices [B]``: in range, negative = padding,
    distinct (queued)."""
    check_tensor("state_indices", state_indices, shape=[batch], dtypes=INDEX_DTYPES, device=state_cache.device)
    if checks is not None:
        check_index_values(checks, "state_indices", state_indices, state_cache.shape[0])


def guard_decode_indices(state_indices, batch: int, state_cache, checks: DeviceChecks) -> torch.Tensor:
    """:func:`check_decode_indices` for a launch-then-read-back call: queues the
    value rules on ``checks`` and returns the indices to launch with (all -1 when
    a rule is broken), with ``checks`` sealed (the last rule of the call). One
    Triton launch for up to ``MAX_ONE_PROGRAM_INDICES`` rows
    (:mod:`kda_engram.validation.index_rules`), the PyTorch rules and
    :meth:`DeviceChecks.guard` beyond."""
    check_decode_indices(state_indices, batch, state_cache, None)
    slots = state_cache.shape[0]
    if state_indices.numel() <= MAX_ONE_PROGRAM_INDICES:
        guarded = index_rules(checks, "state_indices", state_indices, slots)
        checks.seal()  # the verdict complete before the decode launch (the next call waits for it only)
        return guarded
    check_index_values(checks, "state_indices", state_indices, slots)
    return checks.guard(state_indices, -1)


def check_decode_multi_indices(state_indices, initial_state_indices, batch: int, steps: int, state_cache,
                               checks: DeviceChecks | None) -> None:
    """``kda_decode_multi``: ``state_indices [B, S]`` written rows in range and
    distinct; ``initial_state_indices [B]`` (default ``state_indices[:, 0]``) in
    range and distinct; no sequence starts from a row another sequence writes (the
    write could land before the read). Value rules queued on ``checks``: one
    launch (:func:`~kda_engram.validation.index_rules.decode_multi_rules`) up to
    :data:`~kda_engram.validation.index_rules.MAX_STATE_RULE_SEQS` written rows,
    PyTorch ops beyond."""
    dev = state_cache.device
    check_tensor("state_indices", state_indices, shape=[batch, steps], dtypes=INDEX_DTYPES, device=dev)
    if initial_state_indices is not None:
        check_tensor("initial_state_indices", initial_state_indices, shape=[batch], dtypes=INDEX_DTYPES, device=dev)
    if checks is None or steps == 0 or batch == 0:
        return
    init = state_indices[:, 0] if initial_state_indices is None else initial_state_indices
    slots = state_cache.shape[0]
    if fits_decode_multi_rules(batch, steps):
        decode_multi_rules(checks, state_indices, init, slots)  # one launch
        return
    check_index_values(checks, "state_indices", state_indices, slots)
    check_index_values(checks, "initial_state_indices", init, slots)
    # owner[r] = the flat position b * S + s writing row r; its sequence is position // S.
    owner = _owner_of_rows(state_indices, slots)
    start = init.to(torch.int64)
    who = owner[torch.where((start >= 0) & (start < slots), start, slots)]
    seq = torch.arange(batch, device=dev)
    clash = (who >= 0) & (torch.div(who, steps, rounding_mode="floor") != seq)
    b = torch.argmax(clash.to(torch.int8))
    checks.add(clash.any(), decode_multi_clash_message(), b, value_at(start, b))


def _check_conv_tensors(x_name, x, conv_weight, conv_state, lead):
    check_tensor(x_name, x, shape=[lead, None], dtypes=FLOAT_DTYPES)
    check_kernel_device(x_name, x)
    dev = x.device
    C = x.shape[1]
    check_tensor("conv_weight", conv_weight, shape=[C, None], dtypes=FLOAT_DTYPES, device=dev)
    W = conv_weight.shape[1]
    if W < 2:
        raise ValueError(f"conv_weight: expected a width of at least 2 taps, got {W}")
    check_tensor("conv_state", conv_state, shape=[None, C, W - 1], dtypes=FLOAT_DTYPES, device=dev)
    return C, W


def check_out_dtype(out_dtype) -> None:
    """``out_dtype``: None (the input's dtype) or a float dtype of the outputs."""
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        raise TypeError(f"out_dtype: expected None or one of {names}, got {out_dtype!r}")


def check_conv_decode(x, conv_weight, conv_state, conv_state_indices, out, checks: DeviceChecks | None, *,
                      out_dtype=None):
    """``kda_conv_decode``: ``x [B, C]``, ``conv_weight [C, W]``, ``conv_state
    [slots, C, W - 1]``, ``conv_state_indices [B]`` (in range, distinct: queued),
    ``out [B, C]``, ``out_dtype`` a float dtype. Returns ``(C, W)``."""
    C, W = _check_conv_tensors("x", x, conv_weight, conv_state, None)
    check_tensor("conv_state_indices", conv_state_indices, shape=[x.shape[0]], dtypes=INDEX_DTYPES, device=x.device)
    if out is not None:
        check_tensor("out", out, shape=[x.shape[0], C], dtypes=FLOAT_DTYPES, device=x.device)
    check_out_dtype(out_dtype)
    if checks is not None:
        check_index_values(checks, "conv_state_indices", conv_state_indices, conv_state.shape[0])
    return C, W


def check_conv_checkpoint(x, cu_seqlens, checkpoint_offsets, checkpoint_indices, conv_state,
                          checks: DeviceChecks | None) -> int:
    """``kda_conv_checkpoint``: ``x [T, C]``, ``conv_state [slots, C, W - 1]``,
    ``cu_seqlens`` (at most T), ``checkpoint_offsets [N]`` (0 = none, else in
    ``[W - 1, length]``) and ``checkpoint_indices [N]`` (rows of the active ones in
    range and distinct); value rules queued. Returns N."""
    check_tensor("x", x, shape=[None, None], dtypes=FLOAT_DTYPES)
    check_kernel_device("x", x)
    dev = x.device
    check_tensor("conv_state", conv_state, shape=[None, x.shape[1], None], dtypes=FLOAT_DTYPES, device=dev)
    lengths = check_cu_seqlens(cu_seqlens, x.shape[0], dev, checks, covers_all=False, return_lengths=True)
    N = cu_seqlens.numel() - 1
    check_tensor("checkpoint_offsets", checkpoint_offsets, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    check_tensor("checkpoint_indices", checkpoint_indices, shape=[N], dtypes=INDEX_DTYPES, device=dev)
    if checks is None or N == 0:
        return N
    W = conv_state.shape[2] + 1
    offs = checkpoint_offsets.to(torch.int64)
    bad = (offs < 0) | ((offs > 0) & ((offs < W - 1) | (offs > lengths)))
    first = torch.argmax(bad.to(torch.int8))
    checks.add(bad.any(), f"checkpoint_offsets[{{}}]: expected 0 (none) or {W - 1} <= p <= the sequence length "
               "{}, got {}", first, value_at(lengths, first), value_at(offs, first))
    active = torch.where(offs > 0, checkpoint_indices.to(torch.int64), -1)
    check_index_values(checks, "checkpoint_indices", active, conv_state.shape[0])
    return N


def check_fused_decode_arguments(checks: DeviceChecks | None, x, raw_g, raw_beta, g_out, conv_weight, conv_state,
                                 conv_state_indices, A_log, dt_bias, o_norm_weight, state_cache, state_indices,
                                 initial_state_indices, initial_conv_indices, scale, lower_bound, norm_eps,
                                 out, *, out_dtype=None) -> None:
    """``kda_layer_decode_step``: host rules raise at once; the index rules (rows
    in range, distinct, no sequence starting from a row another one writes) are
    queued on ``checks`` for the caller's one read-back (``None``: host rules only)."""
    check_tensor("state_cache", state_cache, dtypes=STATE_DTYPES)
    check_kernel_device("state_cache", state_cache)
    if state_cache.dim() != 4 or state_cache.shape[2] != state_cache.shape[3] or state_cache.shape[3] not in KDA_HEAD_DIMS:
        raise ValueError(f"state_cache: expected [slots, H, D, D] with D in {KDA_HEAD_DIMS}, "
                         f"got {list(state_cache.shape)}")
    _, H, V, K = state_cache.shape
    C = 2 * H * K + H * V
    dev = state_cache.device
    check_tensor("x", x, dtypes=FLOAT_DTYPES, device=dev)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected shape [B, {C}] or [B, S, {C}], got {list(x.shape)}")
    multi = x.dim() == 3
    lead = list(x.shape[:-1])
    check_tensor("x", x, shape=[*lead, C])
    check_tensor("raw_g", raw_g, shape=[*lead, H * K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("raw_beta", raw_beta, shape=[*lead, H], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("g_out", g_out, shape=[*lead, H * V], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("conv_weight", conv_weight, shape=[C, CONV_WIDTH], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("conv_state", conv_state, shape=[None, C, CONV_WIDTH - 1], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("A_log", A_log, shape=[H], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=dev)
    if list(dt_bias.shape) not in ([H, K], [H * K]):
        raise ValueError(f"dt_bias: expected shape [{H}, {K}] or [{H * K}], got {list(dt_bias.shape)}")
    check_tensor("o_norm_weight", o_norm_weight, shape=[V], dtypes=FLOAT_DTYPES, device=dev)
    if out is not None:
        check_tensor("out", out, shape=[*lead, H * V], dtypes=FLOAT_DTYPES, device=dev)
    check_out_dtype(out_dtype)
    check_scale(scale)
    check_lower_bound(lower_bound)
    check_real("norm_eps", norm_eps, sign="non-negative")
    if not multi:
        for name, t in (("initial_state_indices", initial_state_indices),
                        ("initial_conv_indices", initial_conv_indices)):
            if t is not None:
                raise ValueError(f"{name}: only with S tokens per sequence (x [B, S, C])")
        check_decode_indices(state_indices, lead[0], state_cache, None)
        check_tensor("conv_state_indices", conv_state_indices, shape=lead, dtypes=INDEX_DTYPES, device=dev)
        if checks is not None:  # both index sets in one launch
            queue_index_sets(checks, [("state_indices", [state_indices], state_cache.shape[0]),
                                      ("conv_state_indices", [conv_state_indices], conv_state.shape[0])])
        return
    B, S = lead
    check_decode_multi_indices(state_indices, initial_state_indices, B, S, state_cache, checks)
    check_tensor("conv_state_indices", conv_state_indices, shape=lead, dtypes=INDEX_DTYPES, device=dev)
    if initial_conv_indices is not None:
        check_tensor("initial_conv_indices", initial_conv_indices, shape=[B], dtypes=INDEX_DTYPES, device=dev)
    if checks is not None and B and S:
        cinit = conv_state_indices[:, 0] if initial_conv_indices is None else initial_conv_indices
        queue_index_sets(checks, [("conv_state_indices", [conv_state_indices], conv_state.shape[0]),
                                  ("initial_conv_indices", [cinit], conv_state.shape[0])])  # one launch


#: The index fields of a ``KDABatch`` the layer's launches read, with the value a
#: guarded copy takes when a rule is broken (-1: no row; 0: no token, no checkpoint).
KDA_BATCH_GUARDS = (("decode_state_indices", -1), ("decode_conv_indices", -1), ("prefill_cu_seqlens", 0),
                    ("prefill_state_indices", -1), ("prefill_conv_indices", -1), ("checkpoint_offsets", 0),
                    ("checkpoint_indices", -1))


def check_index_rows(name: str, x, rows: int, device: torch.device | None) -> None:
    """An index tensor of one entry per row or request: int32/int64 ``[rows]`` on
    ``device`` (None: any)."""
    check_tensor(name, x, shape=[rows], dtypes=INDEX_DTYPES, device=device)


def check_checkpoint_pair(offsets, indices, prefix: str = "") -> bool:
    """Checkpoint offsets and rows come together: both or neither (``prefix`` names
    their owner, e.g. ``"batch."``). Returns whether they are given."""
    if (offsets is None) != (indices is None):
        raise ValueError(f"{prefix}checkpoint_offsets and {prefix}checkpoint_indices: give both or neither")
    return offsets is not None


def check_kda_requests(query_lens, state_indices, has_initial_state, num_decode, conv_state_indices,
                       checkpoint_offsets, checkpoint_indices) -> int:
    """The per-request tensors ``KDABatch.from_query_lens`` takes, in engine order
    (host only): ``query_lens [N]``, ``state_indices`` / ``conv_state_indices`` (None:
    the state rows) ``[N]``, ``has_initial_state`` bool ``[N]`` (optional), the
    checkpoint pair ``[N]`` (both or neither), all on ``query_lens``' device, and
    ``0 <= num_decode <= N``. Returns ``num_decode`` as an int."""
    check_tensor("query_lens", query_lens, shape=[None], dtypes=INDEX_DTYPES)
    N, dev = query_lens.shape[0], query_lens.device
    num_decode = int(num_decode)
    if not 0 <= num_decode <= N:
        raise ValueError(f"num_decode: expected 0 <= num_decode <= {N} requests, got {num_decode}")
    check_index_rows("state_indices", state_indices, N, dev)
    if conv_state_indices is not None:
        check_index_rows("conv_state_indices", conv_state_indices, N, dev)
    if has_initial_state is not None:
        check_tensor("has_initial_state", has_initial_state, shape=[N], dtypes=(torch.bool,), device=dev)
    if check_checkpoint_pair(checkpoint_offsets, checkpoint_indices):
        check_index_rows("checkpoint_offsets", checkpoint_offsets, N, dev)
        check_index_rows("checkpoint_indices", checkpoint_indices, N, dev)
    return num_decode


def check_kda_batch(batch, num_tokens: int, device: torch.device | None, checks: DeviceChecks | None, *,
                    state_slots: int | None = None, conv_slots: int | None = None,
                    checkpoint_rows: int | None = None, conv_checkpoint_rows: int | None = None,
                    guard: bool = False) -> dict:
    """A ``KDABatch`` (:mod:`kda_engram.layers.kda`) of a step of ``num_tokens``
    tokens: host rules (field types, dtypes, shapes, devices, the token count) at
    once; with ``checks``, the value rules queued: decode query lengths 1;
    ``prefill_cu_seqlens`` from 0, non-decreasing, to the prefill tokens;
    checkpoint offsets; and with the cache sizes, every row in range and, per
    cache, all rows the step writes distinct (decode, prefill and the checkpoints
    that land in the cache itself: ``checkpoint_rows`` / ``conv_checkpoint_rows``
    None). Rules that cannot apply to the batch's shapes queue nothing (no
    checkpoint rule without prefill sequences, no empty index set).

    With ``guard`` (launch, then read back) it returns ``{field: copy}``, the
    guarded copies of the fields the step's launches read (:data:`KDA_BATCH_GUARDS`:
    all "none" when a rule is broken), with ``checks`` sealed; else ``{}``.

    One launch for all of it (:func:`~kda_engram.validation.index_rules.kda_batch_rules`)
    up to ``MAX_ONE_PROGRAM_INDICES`` rows per set, PyTorch rules and
    :meth:`DeviceChecks.guard_many` beyond: the same rules, order and messages.
    Why one function: :meth:`KDABatch.validate` and the layer's forward run the
    same rules."""
    B = batch.num_decode
    if isinstance(B, bool) or not isinstance(B, int) or B < 0:
        raise TypeError(f"batch.num_decode: expected a non-negative Python int, got {B!r}")
    check_index_rows("batch.decode_state_indices", batch.decode_state_indices, B, device)
    dev = batch.decode_state_indices.device
    check_index_rows("batch.decode_conv_indices", batch.decode_conv_indices, B, dev)
    cu = batch.prefill_cu_seqlens
    check_tensor("batch.prefill_cu_seqlens", cu, dtypes=INDEX_DTYPES, device=dev)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"batch.prefill_cu_seqlens: expected shape [N_p+1] with N_p >= 0, got {list(cu.shape)}")
    N = cu.numel() - 1
    check_index_rows("batch.prefill_state_indices", batch.prefill_state_indices, N, dev)
    check_index_rows("batch.prefill_conv_indices", batch.prefill_conv_indices, N, dev)
    check_tensor("batch.prefill_has_initial_state", batch.prefill_has_initial_state, shape=[N],
                 dtypes=(torch.bool,), device=dev)
    ck_off, ck_idx = batch.checkpoint_offsets, batch.checkpoint_indices
    if check_checkpoint_pair(ck_off, ck_idx, "batch."):
        check_index_rows("batch.checkpoint_offsets", ck_off, N, dev)
        check_index_rows("batch.checkpoint_indices", ck_idx, N, dev)
    lens = getattr(batch, "decode_query_lens", None)
    if lens is not None:
        check_index_rows("batch.decode_query_lens", lens, B, dev)
    if num_tokens < B or (N == 0 and num_tokens != B):
        raise ValueError(f"hidden_states: {num_tokens} tokens do not match num_decode={B} decode rows and "
                         f"{N} prefill sequences")
    if checks is None:
        return {}
    lens_message = None
    if lens is not None and B:
        lens_message = (f"query_lens[{{}}]: the first num_decode={B} requests are decode rows of one token, "
                        "got {}")
    checkpoints = ck_off is not None and N > 0  # no sequence, no checkpoint
    cu_names = dict(name="batch.prefill_cu_seqlens", tokens=f"the prefill tokens: {num_tokens} tokens - num_decode={B}")
    # The index sets in rule order: (name, kind, with the checkpoint rows, rows available).
    sets = []
    for kind, slots, ck_slots in (("state", state_slots, checkpoint_rows), ("conv", conv_slots, conv_checkpoint_rows)):
        if ck_slots is not None and checkpoints:
            sets.append(("batch.checkpoint_indices", "checkpoint", False, ck_slots))
        if slots is None or B + N == 0:
            continue
        if ck_slots is None and checkpoints:  # the checkpoints land in this cache itself
            sets.append((f"batch.decode_{kind}_indices/prefill_{kind}_indices/checkpoint_indices "
                         f"({kind} rows written this step)", kind, True, slots))
        else:
            sets.append((f"batch.decode_{kind}_indices/prefill_{kind}_indices", kind, False, slots))
    offsets_message = checkpoint_offsets_message("batch.checkpoint_offsets") if checkpoints else None
    if fits_kda_batch_rules(B, N, checkpoints, len(sets)):
        guarded = kda_batch_rules(checks, batch, num_tokens - B, sets, query_lens_message=lens_message,
                                  cu_messages=cu_seqlens_messages(total_tokens=num_tokens - B, covers_all=True,
                                                                  **cu_names),
                                  offsets_message=offsets_message,
                                  alignment=KDA_CHECKPOINT_ALIGNMENT, guard=guard)
        if guard:
            checks.seal()  # the verdict complete before the step's launches (the next call waits for it only)
        return guarded
    # Past one program: the same rules as PyTorch ops and one-launch rules, then the guards.
    if lens_message is not None:
        bad = lens != 1
        first = torch.argmax(bad.to(torch.int8))
        checks.add(bad.any(), lens_message, first, value_at(lens, first))
    checks.add_packed(*cu_seqlens_rules(cu, num_tokens - B, covers_all=True, **cu_names))
    ck_rows = None
    if checkpoints:
        cu64 = cu.to(torch.int64)
        offs = check_checkpoint_offsets(checks, "batch.checkpoint_offsets", ck_off, cu64[1:] - cu64[:-1])
        ck_rows = torch.where(offs > 0, ck_idx.to(torch.int64), -1)  # only sequences taking a checkpoint
    segments = {"checkpoint": []}
    for kind in ("state", "conv"):
        segments[kind] = [getattr(batch, f"decode_{kind}_indices"), getattr(batch, f"prefill_{kind}_indices")]
    queue_index_sets(checks, [(name, segments[kind] + ([ck_rows] if with_ck or kind == "checkpoint" else []), upper)
                              for name, kind, with_ck, upper in sets])
    if not guard:
        return {}
    read = {"decode": B > 0, "prefill": N > 0, "checkpoint": checkpoints}  # by the step's launches
    fields = [(f, none) for f, none in KDA_BATCH_GUARDS if read[f.split("_")[0]]]
    return dict(zip((f for f, _ in fields), checks.guard_many(*((getattr(batch, f), none) for f, none in fields))))


def queue_index_sets(checks: DeviceChecks, sets) -> None:
    """Queue the range and distinctness rules of ``sets`` (``(name, segments,
    rows available)``, a set's rows being all its segments together): in one launch
    when :func:`~kda_engram.validation.index_rules.fits_index_set_rules`, else the
    PyTorch rules per set (:func:`check_index_values`). The same rules in the same
    order with the same messages either way; empty sets queue nothing."""
    sets = [(name, [x if x.dim() == 1 else x.reshape(-1) for x in segments], upper) for name, segments, upper in sets]
    sets = [(name, segments, upper) for name, segments, upper in sets if sum(x.numel() for x in segments)]
    if not sets:
        return
    if fits_index_set_rules(sets):
        index_set_rules(checks, sets)
        return
    for name, segments, upper in sets:
        rows = segments[0] if len(segments) == 1 else torch.cat([x.to(torch.int64) for x in segments])
        check_index_values(checks, name, rows, upper)


def check_kda_layer_inputs(hidden_states, state_cache, conv_state, checkpoint_state, checkpoint_conv_state, *,
                           hidden_size: int, heads: int, head_dim: int, conv_channels: int, dtype: torch.dtype,
                           device: torch.device) -> None:
    """The tensors of a ``KimiDeltaAttention`` forward (host only): ``hidden_states
    [T, hidden]`` in the weights' dtype, the caches ``[slots, H, K, K]`` /
    ``[slots, C, 3]`` and the optional checkpoint buffers of the same row shapes,
    all on the weights' device, every state of one storage dtype."""
    check_tensor("hidden_states", hidden_states, shape=[None, hidden_size], dtypes=(dtype,), device=device)
    H, K = heads, head_dim
    check_tensor("state_cache", state_cache, shape=[None, H, K, K], dtypes=STATE_DTYPES, device=device)
    check_tensor("conv_state", conv_state, shape=[None, conv_channels, CONV_WIDTH - 1], dtypes=FLOAT_DTYPES,
                 device=device)
    if checkpoint_state is not None:
        check_tensor("checkpoint_state", checkpoint_state, shape=[None, H, K, K], dtypes=STATE_DTYPES, device=device)
        check_state_dtype_match(["state_cache", "checkpoint_state"], [state_cache, checkpoint_state])
    if checkpoint_conv_state is not None:
        check_tensor("checkpoint_conv_state", checkpoint_conv_state, shape=[None, conv_channels, CONV_WIDTH - 1],
                     dtypes=FLOAT_DTYPES, device=device)
