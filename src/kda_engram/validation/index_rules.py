"""Rules on device values in one launch each: a decode step's row indices
(range, distinctness, and the guarded copy the kernels index with) and a varlen
batch's ``cu_seqlens``.

As separate PyTorch ops (max, sort, compare, any, stack, where, ...) these rules
cost ~15 launches of host time per call, enough to make a default decode call
(0.29 ms of GPU time at B = 256, H = 32) host-bound on the H200; here each is one
Triton program writing a small int64 verdict for the one read-back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DeviceChecks, index_rule_messages

__all__ = ["MAX_ONE_PROGRAM_INDICES", "cu_seqlens_rules", "index_rules"]

# One program compares all pairs: fine up to a few thousand indices (4096: 256
# tile pairs of 128 x 128); larger index sets use the sort-based rules.
MAX_ONE_PROGRAM_INDICES = 4096


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


def index_rules(checks: DeviceChecks, name: str, idx: torch.Tensor, upper: int, *, allow_negative: bool = True,
                distinct: bool = True) -> torch.Tensor:
    """Queue the rules on a 1-d index tensor (``idx.numel() <=
    MAX_ONE_PROGRAM_INDICES``, checked by the caller) on ``checks``: entries in
    ``[0, upper)``, negative ones allowed as "no row" when ``allow_negative``,
    non-negative ones distinct when ``distinct``. Returns the indices to launch
    with: a new contiguous tensor of ``idx``'s dtype, all -1 when one of these
    rules is broken (the kernel guards them itself: no ``checks.guard`` op). One
    launch, no host sync; :meth:`DeviceChecks.run` reads the verdict back."""
    n = idx.numel()
    guarded = torch.empty(n, dtype=idx.dtype, device=idx.device)
    verdict = torch.empty(5, dtype=torch.int64, device=idx.device)
    block = 128 if n > 64 else 64
    _index_rules_kernel[(1,)](
        idx, n, idx.stride(0) if n else 1, upper, guarded, verdict,
        BLOCK=block, NUM_BLOCKS=triton.next_power_of_2(max(1, triton.cdiv(n, block))),
        ALLOW_NEGATIVE=allow_negative, DISTINCT=distinct, num_warps=8 if block == 128 else 4,
    )
    negative, out_of_range, duplicate = index_rule_messages(name, upper)
    # verdict = [range, negative, duplicate, max, min]: rules in check_index_values' order.
    rules = [] if allow_negative else [(1, negative, (4,))]
    rules += [(0, out_of_range, (3,)), (2, duplicate, ())]
    checks.add_packed(verdict, rules)
    return guarded


@triton.jit
def _cu_seqlens_rules_kernel(cu_ptr, num_seqs, stride, total, verdict_ptr,
                             BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, COVERS_ALL: tl.constexpr):
    """One program. ``verdict = [cu[0] != 0, some length < 0, cu[N] != total
    (COVERS_ALL) or > total, cu[0], the smallest length, cu[N]]``."""
    offs = tl.arange(0, BLOCK)
    low = tl.full([BLOCK], 2**62, tl.int64)
    for blk in range(NUM_BLOCKS):
        i = blk * BLOCK + offs
        m = i < num_seqs
        a = tl.load(cu_ptr + i * stride, mask=m, other=0).to(tl.int64)
        b = tl.load(cu_ptr + (i + 1) * stride, mask=m, other=0).to(tl.int64)
        low = tl.minimum(low, tl.where(m, b - a, 2**62))
    shortest = tl.min(low, axis=0)
    first = tl.load(cu_ptr).to(tl.int64)
    last = tl.load(cu_ptr + num_seqs * stride).to(tl.int64)
    tl.store(verdict_ptr + 0, (first != 0).to(tl.int64))
    tl.store(verdict_ptr + 1, (shortest < 0).to(tl.int64))
    if COVERS_ALL:
        tl.store(verdict_ptr + 2, (last != total).to(tl.int64))
    else:
        tl.store(verdict_ptr + 2, (last > total).to(tl.int64))
    tl.store(verdict_ptr + 3, first)
    tl.store(verdict_ptr + 4, shortest)
    tl.store(verdict_ptr + 5, last)


def cu_seqlens_rules(cu_seqlens: torch.Tensor, total_tokens: int, *, covers_all: bool, name: str = "cu_seqlens",
                     tokens: str = "the tokens of the inputs"):
    """``(verdict, rules)`` for :meth:`~kda_engram.validation.common.DeviceChecks.add_packed`:
    ``cu_seqlens [N+1]`` (N >= 0, checked by the caller) starts at 0, never
    decreases, and ends at ``total_tokens`` (``covers_all``) or at most there;
    ``name`` is the argument the messages blame, ``tokens`` what ``total_tokens`` counts. One launch, no host sync."""
    num_seqs = cu_seqlens.numel() - 1
    verdict = torch.empty(6, dtype=torch.int64, device=cu_seqlens.device)
    block = 1024 if num_seqs > 256 else 256
    _cu_seqlens_rules_kernel[(1,)](
        cu_seqlens, num_seqs, cu_seqlens.stride(0), total_tokens, verdict,
        BLOCK=block, NUM_BLOCKS=triton.next_power_of_2(max(1, triton.cdiv(num_seqs, block))),
        COVERS_ALL=covers_all, num_warps=4,
    )
    end = (f"{name}: must end at T={total_tokens} ({tokens}), got {{}}" if covers_all else
           f"{name}: last entry {{}} exceeds the {total_tokens} tokens of the inputs")
    rules = [(0, f"{name}: must start at 0, got {{}}", (3,)),
             (1, f"{name}: must be non-decreasing, got a sequence of length {{}}", (4,)),
             (2, end, (5,))]
    return verdict, rules
