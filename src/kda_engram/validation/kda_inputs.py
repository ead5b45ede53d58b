"""Rules on the KDA entry points' raw inputs and their forms: the output ``scale``, the
gate's ``lower_bound`` and form (``gate``, ``qk_l2norm``, ``beta_sigmoid``), the log-decay
values, ``cu_seqlens``, the prefill's projections and the chunk indices."""

from __future__ import annotations

import torch

from ..constants import CHUNK_SIZE, KDA_HEAD_DIMS
from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DeviceChecks,
    check_kernel_device,
    check_real,
    check_same_dtype,
    check_tensor,
)
from .index_rules import cu_seqlens_messages, cu_seqlens_rules


__all__ = [
    "GATE_FORMS",
    "check_chunk_indices",
    "check_cu_seqlens",
    "check_head_dims",
    "check_input_forms",
    "check_log_decay_values",
    "check_lower_bound",
    "check_prefill_inputs",
    "check_scale",
    "chunk_offsets_of",
    "chunk_rows",
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


def check_cu_seqlens_on_host(cu_seqlens: torch.Tensor, total_tokens: int, *, covers_all: bool) -> None:
    """The value rules of :func:`check_cu_seqlens` on a CPU ``cu_seqlens`` where no kernel
    runs on the CPU (no interpreter): its values are host memory, so they are read in
    place (no device sync) and a broken rule raises here, in the rules' own words."""
    cu = cu_seqlens.to(torch.int64)
    start, decreasing, end = cu_seqlens_messages("cu_seqlens", total_tokens, covers_all=covers_all)
    if cu[0].item() != 0:
        raise ValueError(start.format(cu[0].item()))
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() and lengths.min().item() < 0:
        raise ValueError(decreasing.format(lengths.min().item()))
    last = cu[-1].item()
    if last > total_tokens or (covers_all and last != total_tokens):
        raise ValueError(end.format(last))


def check_head_dims(K: int, V: int) -> None:
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
    check_head_dims(K, V)
    check_tensor("raw_g", raw_g, shape=[1, T, H, K], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("raw_beta", raw_beta, shape=[1, T, H], dtypes=FLOAT_DTYPES, device=dev)
    if A_log is None and dt_bias is None:  # gate='log_decay' (check_input_forms)
        return T, H, K, V
    check_tensor("A_log", A_log, shape=[H], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=dev)
    if tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        raise ValueError(f"dt_bias: expected shape [{H * K}] or [{H}, {K}], got {list(dt_bias.shape)}")
    return T, H, K, V


def chunk_offsets_of(lengths: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int64 ``[N+1]`` first chunk row of every sequence of ``lengths [N]``:
    ``offsets[n+1] - offsets[n] = ceil(len_n / chunk_size)``, ``offsets[0] = 0``."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(torch.div(lengths.to(torch.int64) + (chunk_size - 1), chunk_size, rounding_mode="floor"), 0,
                 out=offsets[1:])
    return offsets


def chunk_rows(chunk_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The chunk rows ``[rows, 2]`` (sequence id, chunk index; ``(-1, -1)`` past the
    batch's chunks) that ``chunk_offsets [N+1]`` (first row of every sequence)
    numbers: row ``offsets[n] + c`` is chunk ``c`` of sequence ``n``. Device ops
    only; what :func:`kda_engram.kda.metadata.prepare_chunk_indices` returns, and
    what :func:`check_chunk_indices` compares a caller's rows with."""
    num_seqs = chunk_offsets.numel() - 1
    row = torch.arange(rows, dtype=chunk_offsets.dtype, device=chunk_offsets.device)
    # The last n with offsets[n] <= row: zero-length sequences share their
    # successor's offset, and `right=True` steps past them to the real owner.
    seq = torch.searchsorted(chunk_offsets, row, right=True).to(torch.int32) - 1
    valid = row < chunk_offsets[-1]
    seq_clamped = seq.clamp(0, max(num_seqs - 1, 0))
    chunk = row - chunk_offsets[seq_clamped.long()] if num_seqs > 0 else row
    out = torch.stack([seq, chunk.to(torch.int32)], dim=1)
    return torch.where(valid[:, None], out, torch.full_like(out, -1))


def check_chunk_indices(chunk_indices, num_seqs: int, device, checks: DeviceChecks | None,
                        lengths: torch.Tensor | None) -> None:
    """``chunk_indices`` ``[rows, 2]`` (sequence id, chunk index): ids in ``[-1, N)``,
    every live row's chunk inside its sequence, and (with ``lengths``) the rows
    exactly :func:`chunk_rows`' for the batch: enough rows, each chunk once, in the
    order the chunk walk reads its operands (queued)."""
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
        # In range row by row is not enough (issue 54: all-zero rows left chunks
        # unwritten, NaN operands): the rows must be the batch's, each chunk once.
        offsets = chunk_offsets_of(lengths)
        rows = chunk_indices.shape[0]
        checks.add(offsets[-1] > rows, f"chunk_indices: the batch has {{}} chunks, got {rows} rows", offsets[-1])
        differ = (ci != chunk_rows(offsets, rows).to(torch.int64)).any(1)
        checks.add(differ.any(), "chunk_indices: row {} differs from prepare_chunk_indices(cu_seqlens)'s",
                   differ.to(torch.int8).argmax())
