"""Chunk metadata for varlen batches, built on the device with no host sync.

A varlen batch is flattened on the token axis and described by ``cu_seqlens``
``[N+1]``. The chunked kernels need, per 64-token chunk, which sequence it
belongs to and where it starts. The usual host-side construction reads
``cu_seqlens`` back to the CPU (a sync that breaks CUDA-graph capture) and
derives sequence ids by ``repeat_interleave`` of per-sequence chunk counts, which
mis-numbers every sequence after a zero-length one. Here everything is a fixed
shape computed with device ops: the number of rows is the static bound
``T // chunk_size + N`` (each sequence wastes less than one chunk), and rows past
the real chunks carry sequence id -1 for the kernels to skip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_SIZE = 64


def _check_cu_seqlens(cu_seqlens: torch.Tensor) -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 0, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")


def max_chunks(total_tokens: int, num_seqs: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Static upper bound on the chunk count of ``num_seqs`` sequences of
    ``total_tokens`` tokens: ``sum ceil(l_n / C) <= T // C + N``."""
    return total_tokens // chunk_size + num_seqs


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """First chunk row of every sequence: int32 ``[N+1]``, ``offsets[n+1] -
    offsets[n] = ceil(len_n / chunk_size)`` and ``offsets[0] = 0``."""
    _check_cu_seqlens(cu_seqlens)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    counts = torch.div(lengths + (chunk_size - 1), chunk_size, rounding_mode="floor")
    offsets = torch.zeros(cu_seqlens.numel(), dtype=torch.int64, device=cu_seqlens.device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    return offsets.to(torch.int32)


def prepare_chunk_indices(
    cu_seqlens: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    *,
    total_tokens: int | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per chunk row: (sequence id, chunk index within the sequence), int32 ``[NT_max, 2]``.

    ``NT_max = T // chunk_size + N`` with ``T = total_tokens``. Pass
    ``total_tokens`` (the flattened token count, ``q.shape[1]``) to stay free of
    host syncs; without it ``T`` is read from ``cu_seqlens[-1]``, which syncs on
    a GPU. Rows past the batch's real chunks hold ``(-1, -1)``. Row ``r`` of
    sequence ``n`` is ``chunk_offsets[n] + c``, the order the chunk-major
    workspaces use.
    """
    _check_cu_seqlens(cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1
    if total_tokens is None:
        total_tokens = int(cu_seqlens[-1].item())
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    rows = max_chunks(total_tokens, num_seqs, chunk_size)
    device = cu_seqlens.device
    row = torch.arange(rows, dtype=torch.int32, device=device)
    # The last n with offsets[n] <= row: zero-length sequences share their
    # successor's offset, and `right=True` steps past them to the real owner.
    seq = torch.searchsorted(chunk_offsets, row, right=True).to(torch.int32) - 1
    valid = row < chunk_offsets[-1]
    seq_clamped = seq.clamp(0, max(num_seqs - 1, 0))
    chunk = row - chunk_offsets[seq_clamped.long()] if num_seqs > 0 else row
    out = torch.stack([seq, chunk.to(torch.int32)], dim=1)
    return torch.where(valid[:, None], out, torch.full_like(out, -1))


@triton.jit
def chunk_row(cu_ptr, ci_ptr, sci_r, sci_c, r, BT: tl.constexpr):
    """Device side of :func:`prepare_chunk_indices` for the kernels: row ``r``
    (int64) of ``chunk_indices`` as ``(sequence id, chunk index, bos, eos, first
    token)``. ``seq < 0`` marks a padding row, which the caller must skip; for it
    no offset is read (the loads are masked), so nothing outside ``cu_seqlens``
    is touched even for a batch with no sequence."""
    seq = tl.load(ci_ptr + r * sci_r).to(tl.int32)
    cidx = tl.load(ci_ptr + r * sci_r + sci_c).to(tl.int64)
    live = seq >= 0
    bos = tl.load(cu_ptr + seq, mask=live, other=0).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1, mask=live, other=0).to(tl.int64)
    return seq, cidx, bos, eos, bos + cidx * BT
