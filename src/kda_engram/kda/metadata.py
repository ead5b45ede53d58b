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

import sys

import torch
import triton
import triton.language as tl

from ..constants import CHUNK_SIZE
from ..platform import interpreting
from ..validation.common import can_read_back, check_int
from ..validation.entry import EntryChecks, check_mode
from ..validation.kda_inputs import check_cu_seqlens, check_cu_seqlens_on_host, chunk_offsets_of, chunk_rows

__all__ = ["max_chunks", "prepare_chunk_offsets", "prepare_chunk_indices", "prepare_chunk_metadata",
           "trusted_chunk_metadata"]

_NO_TOKEN_BOUND = 2**62  # prepare_chunk_offsets knows no token count: no bound on cu_seqlens[-1]


def _metadata_rules(cu_seqlens, total_tokens, chunk_size, check_inputs) -> EntryChecks | None:
    """The helpers' rules, the kernels' own: ``chunk_size`` an int >= 1, ``total_tokens``
    (None: unknown) an int >= 0, ``cu_seqlens`` int ``[N+1]`` (host, always); with
    ``check_inputs`` (True: deferred, ``"sync"``), ``cu_seqlens`` starts at 0, never
    decreases and ends at most at ``total_tokens`` (queued, no host sync: the verdict
    comes as every entry point's, :mod:`kda_engram.validation.entry`); while a CUDA
    graph is captured or ``torch.compile`` traces, host rules only (no verdict can be
    read there; the values are then the caller's contract). ``False``: the caller has
    checked those values (the entry points, which call these helpers)."""
    check_int("chunk_size", chunk_size, low=1)
    if total_tokens is not None:
        check_int("total_tokens", total_tokens, low=0)
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    check_mode(check_inputs)  # the value's type, also where no rule runs
    bound = _NO_TOKEN_BOUND if total_tokens is None else total_tokens
    if check_inputs is not False and device is not None and device.type == "cpu" and not interpreting():
        # CPU metadata on a machine whose kernels do not run on the CPU (a GPU box, or
        # no interpreter): the values are host memory, checked in place, no launch.
        check_cu_seqlens(cu_seqlens, bound, device, None, covers_all=False)
        check_cu_seqlens_on_host(cu_seqlens, bound, covers_all=False)
        return None
    checks = None if check_inputs is False or not can_read_back() else EntryChecks(check_inputs)
    if checks is not None:
        checks.origin = sys._getframe(1).f_code.co_name  # the helper's name in the verdict, not this function's
    check_cu_seqlens(cu_seqlens, bound, device, checks, covers_all=False)
    return checks


def max_chunks(total_tokens: int, num_seqs: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Static upper bound on the chunk count of ``num_seqs`` sequences of
    ``total_tokens`` tokens: ``sum ceil(l_n / C) <= T // C + N``."""
    check_int("total_tokens", total_tokens, low=0)
    check_int("num_seqs", num_seqs, low=0)
    check_int("chunk_size", chunk_size, low=1)
    return total_tokens // chunk_size + num_seqs


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE, *,
                          check_inputs: bool | str = True) -> torch.Tensor:
    """First chunk row of every sequence: int32 ``[N+1]``, ``offsets[n+1] -
    offsets[n] = ceil(len_n / chunk_size)`` and ``offsets[0] = 0``.

    ``check_inputs``: ``cu_seqlens`` starts at 0 and never decreases, checked on the
    device without a host sync (:func:`_metadata_rules`); ``False`` trusts the caller."""
    checks = _metadata_rules(cu_seqlens, None, chunk_size, check_inputs)
    offsets = _chunk_offsets(cu_seqlens, chunk_size)
    if checks is not None:
        checks.run()
    return offsets


def _chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    return chunk_offsets_of(cu_seqlens[1:] - cu_seqlens[:-1], chunk_size).to(torch.int32)


def prepare_chunk_indices(
    cu_seqlens: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    *,
    total_tokens: int | None = None,
    chunk_offsets: torch.Tensor | None = None,
    check_inputs: bool | str = True,
) -> torch.Tensor:
    """Per chunk row: (sequence id, chunk index within the sequence), int32 ``[NT_max, 2]``.

    ``NT_max = T // chunk_size + N`` with ``T = total_tokens``. Pass
    ``total_tokens`` (the flattened token count, ``q.shape[1]``) to stay free of
    host syncs; without it ``T`` is read from ``cu_seqlens[-1]``, which syncs on
    a GPU. Rows past the batch's real chunks hold ``(-1, -1)``. Row ``r`` of
    sequence ``n`` is ``chunk_offsets[n] + c``, the order the chunk-major
    workspaces use.

    ``check_inputs``: ``cu_seqlens`` starts at 0, never decreases and ends at most
    at ``total_tokens``, checked on the device without a host sync; a given
    ``chunk_offsets`` must be :func:`prepare_chunk_offsets`' (trusted: it is its
    output). ``False`` trusts the caller for ``cu_seqlens`` too.
    """
    checks = _metadata_rules(cu_seqlens, total_tokens, chunk_size, check_inputs)
    num_seqs = cu_seqlens.numel() - 1
    if total_tokens is None:
        total_tokens = int(cu_seqlens[-1].item())
    if chunk_offsets is None:
        chunk_offsets = _chunk_offsets(cu_seqlens, chunk_size)
    out = chunk_rows(chunk_offsets, max_chunks(total_tokens, num_seqs, chunk_size))
    if checks is not None:
        checks.run()
    return out


@triton.jit
def _chunk_metadata_kernel(
    cu_ptr, st_cu, off_ptr, idx_ptr, st_idx_r, st_idx_c,
    num_seqs, rows,
    C: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
):
    """Grid ``cdiv(rows, BR)``. Every program walks the sequences in ``BN``-wide
    blocks, rebuilding the chunk offsets as a running cumsum of
    ``ceil(len_n / C)`` (program 0 stores them), and for each of its ``BR`` rows
    counts the offsets ``offsets[n+1] <= row`` (the sequence id, as
    ``searchsorted(right=True) - 1`` gives it: zero-length sequences share their
    successor's offset and are stepped past) and keeps the largest of them (the
    owner's first row). Recomputing the cumsum per program costs ``N`` loads
    each and saves a second launch."""
    pid = tl.program_id(0)
    row = pid * BR + tl.arange(0, BR)
    seq = tl.zeros([BR], dtype=tl.int32)
    first = tl.zeros([BR], dtype=tl.int32)
    carry = tl.sum(tl.zeros([BN], dtype=tl.int32), 0)
    n0 = 0
    while n0 < num_seqs:  # a while loop: the interpreter cannot range() over a runtime bound
        n = n0 + tl.arange(0, BN)
        live = n < num_seqs
        bos = tl.load(cu_ptr + n * st_cu, mask=live, other=0)
        eos = tl.load(cu_ptr + (n + 1) * st_cu, mask=live, other=0)
        count = ((eos - bos + (C - 1)) // C).to(tl.int32)
        ends = carry + tl.cumsum(count, 0)  # offsets[n + 1]
        tl.store(off_ptr + n + 1, ends, mask=live & (pid == 0))
        owned = (ends[None, :] <= row[:, None]) & live[None, :]
        seq += tl.sum(owned.to(tl.int32), 1)
        first = tl.maximum(first, tl.max(tl.where(owned, ends[None, :], 0), 1))
        carry += tl.sum(count, 0)
        n0 += BN
    real = row < carry
    in_range = row < rows
    tl.store(idx_ptr + row * st_idx_r, tl.where(real, seq, -1), mask=in_range)
    tl.store(idx_ptr + row * st_idx_r + st_idx_c, tl.where(real, row - first, -1), mask=in_range)
    tl.store(off_ptr + tl.arange(0, 1), tl.zeros([1], dtype=tl.int32), mask=pid == 0)


_META_ROWS = 128  # rows per program
_META_SEQS = 64  # sequences per step of the running cumsum


def prepare_chunk_metadata(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    chunk_size: int = CHUNK_SIZE,
    *,
    check_inputs: bool | str = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_offsets [N+1], chunk_indices [T // chunk_size + N, 2])``, both int32,
    equal to :func:`prepare_chunk_offsets` and :func:`prepare_chunk_indices`, in one
    launch and no host sync.

    Why a kernel: the two torch constructions are about ten small device ops,
    each with its own host-side dispatch, and a prefill whose GPU time is short is
    bound by that host work in eager mode (measured: docs/design/kda_prefill.md,
    "Chunk metadata in one launch"). On a CPU tensor without the Triton
    interpreter it falls back to the torch functions.

    ``check_inputs``: ``cu_seqlens`` starts at 0, never decreases and ends at most
    at ``total_tokens``, checked on the device without a host sync; ``False`` (the
    entry points, which have checked it) trusts the caller.
    """
    checks = _metadata_rules(cu_seqlens, total_tokens, chunk_size, check_inputs)
    offsets, indices = trusted_chunk_metadata(cu_seqlens, total_tokens, chunk_size)
    if checks is not None:
        checks.run()
    return offsets, indices


def trusted_chunk_metadata(cu_seqlens: torch.Tensor, total_tokens: int, chunk_size: int = CHUNK_SIZE):
    """:func:`prepare_chunk_metadata` with no rule at all, host or device: for the entry
    points, whose own checks have covered ``cu_seqlens`` and ``total_tokens`` (one
    validation per call, not one per helper)."""
    num_seqs = cu_seqlens.numel() - 1
    device = cu_seqlens.device
    if device.type != "cuda" and not interpreting():
        offsets = _chunk_offsets(cu_seqlens, chunk_size)
        return offsets, prepare_chunk_indices(cu_seqlens, chunk_size, total_tokens=total_tokens,
                                              chunk_offsets=offsets, check_inputs=False)
    rows = total_tokens // chunk_size + num_seqs  # max_chunks, its arguments already checked
    offsets = torch.empty(num_seqs + 1, dtype=torch.int32, device=device)
    indices = torch.empty(rows, 2, dtype=torch.int32, device=device)
    grid = (max(triton.cdiv(rows, _META_ROWS), 1),)
    _chunk_metadata_kernel[grid](
        cu_seqlens, cu_seqlens.stride(0), offsets, indices, indices.stride(0), indices.stride(1),
        num_seqs, rows, C=chunk_size, BR=_META_ROWS, BN=_META_SEQS,
    )
    return offsets, indices


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
