"""The index rules of a decode step in one launch: range, distinctness and the
guarded copy the kernels index with.

A decode step's only device-value rules are about its row indices. As separate
PyTorch ops (max, sort, compare, any, stack, where, ...) they cost ~15 launches
of host time per call, more than the decode kernel itself at serving batch
sizes; here they are one Triton program. It reads the indices, decides, and
writes both the verdict (for the one read-back) and the guarded indices (every
entry ``-1`` = no row when a rule is broken, so the launch that follows touches
no cache row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import read_back

__all__ = ["IndexVerdict", "MAX_ONE_PROGRAM_INDICES", "index_rules"]

# One program compares all pairs: fine up to a few thousand indices (4096: 256
# tile pairs of 128 x 128); larger index sets use the sort-based rules.
MAX_ONE_PROGRAM_INDICES = 4096

# Fields of the verdict tensor (int64).
_RANGE, _NEGATIVE, _DUPLICATE, _MAX, _MIN = range(5)


@triton.jit
def _index_rules_kernel(idx_ptr, n, stride, upper, guarded_ptr, verdict_ptr,
                        BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, ALLOW_NEGATIVE: tl.constexpr,
                        DISTINCT: tl.constexpr):
    """One program; ``NUM_BLOCKS`` (a power of two, so few compiled variants) blocks
    of ``BLOCK`` cover ``n``. ``verdict = [max >= upper, min < 0 (when negatives are not
    allowed), duplicate non-negative entries, max, min]``; ``guarded[i] = idx[i]``,
    or -1 for every i when any rule is broken."""
    offs = tl.arange(0, BLOCK)
    hi = tl.full([BLOCK], -(2**62), tl.int64)
    lo = tl.full([BLOCK], 2**62, tl.int64)
    for blk in range(NUM_BLOCKS):
        start = blk * BLOCK
        m = start + offs < n
        x = tl.load(idx_ptr + (start + offs) * stride, mask=m, other=0).to(tl.int64)
        hi = tl.maximum(hi, tl.where(m, x, -(2**62)))
        lo = tl.minimum(lo, tl.where(m, x, 2**62))
    top = tl.max(hi, axis=0)
    low = tl.min(lo, axis=0)
    bad_range = top >= upper
    bad_negative = low < 0
    if ALLOW_NEGATIVE:
        bad_negative = low < -(2**62)  # never
    dup = tl.zeros([BLOCK, BLOCK], tl.int32)
    if DISTINCT:
        for bi in range(NUM_BLOCKS):
            i0 = bi * BLOCK
            mi = i0 + offs < n
            a = tl.load(idx_ptr + (i0 + offs) * stride, mask=mi, other=-1).to(tl.int64)
            for bj in range(bi, NUM_BLOCKS):
                j0 = bj * BLOCK
                mj = j0 + offs < n
                b = tl.load(idx_ptr + (j0 + offs) * stride, mask=mj, other=-1).to(tl.int64)
                later = (j0 + offs)[None, :] > (i0 + offs)[:, None]  # each unordered pair once
                same = (a[:, None] == b[None, :]) & (a[:, None] >= 0) & later & mi[:, None] & mj[None, :]
                dup = tl.maximum(dup, same.to(tl.int32))
    bad_dup = tl.max(tl.max(dup, axis=1), axis=0) > 0
    bad = bad_range | bad_negative | bad_dup
    for blk in range(NUM_BLOCKS):
        start = blk * BLOCK
        m = start + offs < n
        x = tl.load(idx_ptr + (start + offs) * stride, mask=m, other=0)
        tl.store(guarded_ptr + start + offs, tl.where(bad, -1, x), mask=m)
    tl.store(verdict_ptr + 0, bad_range.to(tl.int64))
    tl.store(verdict_ptr + 1, bad_negative.to(tl.int64))
    tl.store(verdict_ptr + 2, bad_dup.to(tl.int64))
    tl.store(verdict_ptr + 3, top)
    tl.store(verdict_ptr + 4, low)


class IndexVerdict:
    """The pending verdict of :func:`index_rules`; :meth:`run` reads it back (one
    transfer, on a side stream that waits only for the rules' launch) and raises
    the first broken rule as a one-line ``ValueError`` naming the argument."""

    def __init__(self, name: str, upper: int, verdict: torch.Tensor, ready) -> None:
        self.name, self.upper, self.verdict, self.ready = name, upper, verdict, ready

    def run(self) -> None:
        bad_range, bad_negative, bad_dup, top, low = read_back(self.verdict, self.ready)
        if bad_negative:
            raise ValueError(f"{self.name}: expected non-negative entries, got min {low}")
        if bad_range:
            raise ValueError(f"{self.name}: entries must be < {self.upper} (rows available), got max {top}")
        if bad_dup:
            raise ValueError(f"{self.name}: non-negative entries must be distinct (duplicates would race on one row)")


def index_rules(name: str, idx: torch.Tensor, upper: int, *, allow_negative: bool = True,
                distinct: bool = True) -> tuple[torch.Tensor, IndexVerdict]:
    """Queue the rules on a 1-d index tensor (``idx.numel() <=
    MAX_ONE_PROGRAM_INDICES``, checked by the caller): entries in ``[0, upper)``,
    negative ones allowed as "no row" when ``allow_negative``, non-negative ones
    distinct when ``distinct``. Returns ``(guarded, verdict)``: the indices to
    launch with (a new contiguous tensor, ``idx``'s dtype) and the verdict to
    :meth:`IndexVerdict.run` after the launch. One launch, no host sync."""
    n = idx.numel()
    guarded = torch.empty(n, dtype=idx.dtype, device=idx.device)
    verdict = torch.empty(5, dtype=torch.int64, device=idx.device)
    block = 128 if n > 64 else 64
    _index_rules_kernel[(1,)](
        idx, n, idx.stride(0) if n else 1, upper, guarded, verdict,
        BLOCK=block, NUM_BLOCKS=triton.next_power_of_2(max(1, triton.cdiv(n, block))), ALLOW_NEGATIVE=allow_negative, DISTINCT=distinct, num_warps=8 if block == 128 else 4,
    )
    ready = None
    if idx.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(idx.device))
    return guarded, IndexVerdict(name, upper, verdict, ready)
