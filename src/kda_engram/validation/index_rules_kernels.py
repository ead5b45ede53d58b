"""The ``@triton.jit`` kernels of the device rules: one program each, writing a small
int64 verdict (and, where the kernel guards, the guarded indices). Their launchers,
the verdicts' layouts and the messages are :mod:`kda_engram.validation.index_rules`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_verdict(verdict_ptr, words):
    """``verdict[i] = words[i]`` as int64 (flags and int64 details) for each word of the
    tuple ``words``, in order: a kernel's verdict layout written as the one tuple its
    docstring lists."""
    for i in tl.static_range(len(words)):
        tl.store(verdict_ptr + i, words[i].to(tl.int64))


@triton.jit
def _has_duplicate(x, valid, upper, N: tl.constexpr):
    """Whether two entries of ``x`` (int64 ``[N]``, ``valid`` marks the real ones)
    are equal and non-negative: sort, then compare each entry with the next
    (``O(N log^2 N)``; the pairwise compare it replaced cost ``O(N^2)`` on one SM).
    Entries are clamped to ``[-1, min(upper, 2^31 - 1)]`` first, so the int32 sort
    neither wraps nor calls padding or negative "no row" entries duplicates; an
    entry at or past ``upper`` breaks the range rule anyway."""
    key = tl.where(valid & (x >= 0), tl.minimum(tl.minimum(x, upper), 2**31 - 1), -1).to(tl.int32)
    s = tl.sort(key)
    o = tl.arange(0, N)
    after = tl.gather(s, tl.minimum(o + 1, N - 1), 0)
    return tl.max(((s == after) & (o + 1 < N) & (s >= 0)).to(tl.int32), axis=0) > 0


@triton.jit
def _range_and_duplicates(rows, m, upper, N: tl.constexpr):
    """The range and distinctness rules on register rows (negative = none; ``m``
    marks the real ones): ``(max >= upper, duplicate non-negative rows, max)`` as
    int64 scalars."""
    top = tl.max(tl.where(m, rows, -(2**62)), axis=0)
    return (top >= upper).to(tl.int64), _has_duplicate(rows, m, upper, N).to(tl.int64), top


@triton.jit
def _index_rules_kernel(idx_ptr, n, stride, upper, guarded_ptr, verdict_ptr,
                        N: tl.constexpr, ALLOW_NEGATIVE: tl.constexpr, DISTINCT: tl.constexpr):
    """One program; ``N`` (a power of two >= ``n``, so few compiled variants)
    entries in registers. ``verdict = [max >= upper, min < 0 (when negatives are
    not allowed), duplicate non-negative entries, max, min]``; ``guarded[i] =
    idx[i]``, or -1 for every i when any rule is broken."""
    o = tl.arange(0, N)
    m = o < n
    raw = tl.load(idx_ptr + o * stride, mask=m, other=0)
    x = raw.to(tl.int64)
    top = tl.max(tl.where(m, x, -(2**62)), axis=0)
    low = tl.min(tl.where(m, x, 2**62), axis=0)
    bad_range = top >= upper
    bad_negative = low < 0
    if ALLOW_NEGATIVE:
        bad_negative = low < -(2**62)  # never
    bad_dup = low < -(2**62)  # never, unless DISTINCT finds one
    if DISTINCT:
        bad_dup = _has_duplicate(x, m, upper, N)
    bad = bad_range | bad_negative | bad_dup
    tl.store(guarded_ptr + o, tl.where(bad, -1, raw), mask=m)
    _store_verdict(verdict_ptr, (bad_range, bad_negative, bad_dup, top, low))


# ----------------------------------------------------------------------- cu_seqlens


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
    if COVERS_ALL:
        bad_end = last != total
    else:
        bad_end = last > total
    _store_verdict(verdict_ptr, (first != 0, shortest < 0, bad_end, first, shortest, last))


# ----------------------------------------------------------------- a call's index sets

#: The index sets kernel's arguments compiled as plain ints (any size, one build).
_NOT_SPECIALISED = [f"{s}{k}" for s in "abc" for k in ("n0", "n1", "n2", "n", "upper")]


@triton.jit
def _segment_values(p0, n0, s0, p1, n1, s1, p2, n2, s2, i, other):
    """Entries ``i`` of the concatenation of three segments, as int64; ``other``
    past its end."""
    in0 = i < n0
    in1 = (i >= n0) & (i < n0 + n1)
    in2 = (i >= n0 + n1) & (i < n0 + n1 + n2)
    x0 = tl.load(p0 + i * s0, mask=in0, other=0).to(tl.int64)
    x1 = tl.load(p1 + (i - n0) * s1, mask=in1, other=0).to(tl.int64)
    x2 = tl.load(p2 + (i - n0 - n1) * s2, mask=in2, other=0).to(tl.int64)
    return tl.where(in0, x0, tl.where(in1, x1, tl.where(in2, x2, other)))


@triton.jit
def _set_verdict(verdict_ptr, k, num_sets, p0, n0, s0, p1, n1, s1, p2, n2, s2, n, upper, N: tl.constexpr):
    """Set ``k`` of ``n = n0 + n1 + n2 <= N`` entries: ``verdict[2k] = max >=
    upper``, ``verdict[2k + 1]`` = duplicate non-negative entries, ``verdict[2
    num_sets + k] = max``."""
    o = tl.arange(0, N)
    x = _segment_values(p0, n0, s0, p1, n1, s1, p2, n2, s2, o, -(2**62))
    out_of_range, duplicate, top = _range_and_duplicates(x, o < n, upper, N)
    tl.store(verdict_ptr + 2 * k, out_of_range)
    tl.store(verdict_ptr + 2 * k + 1, duplicate)
    tl.store(verdict_ptr + 2 * num_sets + k, top)


@triton.jit(do_not_specialize=_NOT_SPECIALISED)
def _index_sets_kernel(verdict_ptr,
                       a0, an0, as0, a1, an1, as1, a2, an2, as2, an, aupper,
                       b0, bn0, bs0, b1, bn1, bs1, b2, bn2, bs2, bn, bupper,
                       c0, cn0, cs0, c1, cn1, cs1, c2, cn2, cs2, cn, cupper,
                       NUM_SETS: tl.constexpr, N: tl.constexpr):
    """One program: the range and distinctness rules of up to three index sets,
    each the concatenation of up to three segments (rows one call writes into one
    cache). ``verdict = [range_0, dup_0, ..., max_0, ...]``."""
    _set_verdict(verdict_ptr, 0, NUM_SETS, a0, an0, as0, a1, an1, as1, a2, an2, as2, an, aupper, N)
    if NUM_SETS > 1:
        _set_verdict(verdict_ptr, 1, NUM_SETS, b0, bn0, bs0, b1, bn1, bs1, b2, bn2, bs2, bn, bupper, N)
    if NUM_SETS > 2:
        _set_verdict(verdict_ptr, 2, NUM_SETS, c0, cn0, cs0, c1, cn1, cs1, c2, cn2, cs2, cn, cupper, N)


# ----------------------------------------------------------------------- the guards


@triton.jit
def _guard_copy(x_ptr, y_ptr, n, stride, none, bad, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for blk in range(NUM_BLOCKS):
        start = blk * BLOCK
        m = start + offs < n
        x = tl.load(x_ptr + (start + offs) * stride, mask=m, other=0)
        tl.store(y_ptr + start + offs, tl.where(bad, none, x), mask=m)


@triton.jit(do_not_specialize=["n_flags", "n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"])
def _guard_kernel(flags_ptr, n_flags,
                  x0, y0, n0, s0, e0, x1, y1, n1, s1, e1, x2, y2, n2, s2, e2, x3, y3, n3, s3, e3,
                  x4, y4, n4, s4, e4, x5, y5, n5, s5, e5, x6, y6, n6, s6, e6, x7, y7, n7, s7, e7,
                  COUNT: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, FLAG_BLOCK: tl.constexpr):
    """One program: ``bad`` = any of the ``n_flags`` verdict flags; ``y_k = x_k``,
    or every entry ``e_k`` when ``bad``, for the ``COUNT`` tensors."""
    fo = tl.arange(0, FLAG_BLOCK)
    bad = tl.max((tl.load(flags_ptr + fo, mask=fo < n_flags, other=0) != 0).to(tl.int32), axis=0) > 0
    # The tensors come as separate arguments (slot k: x_k, y_k, n_k, s_k, e_k); the
    # slots past COUNT are placeholders, never read.
    xs, ys, ns = (x0, x1, x2, x3, x4, x5, x6, x7), (y0, y1, y2, y3, y4, y5, y6, y7), (n0, n1, n2, n3, n4, n5, n6, n7)
    ss, es = (s0, s1, s2, s3, s4, s5, s6, s7), (e0, e1, e2, e3, e4, e5, e6, e7)
    for k in tl.static_range(COUNT):
        _guard_copy(xs[k], ys[k], ns[k], ss[k], es[k], bad, BLOCK, NUM_BLOCKS)


# ------------------------------------------------ a prefill's state and checkpoint rules


@triton.jit
def _first_index(bad, o, N: tl.constexpr):
    """The smallest position where ``bad`` holds (``N`` when none)."""
    return tl.min(tl.where(bad, o, N), axis=0)


@triton.jit
def _pick(x, at, o):
    """``x[at]`` of a register vector, as an int64 scalar (0 when ``at`` is past it)."""
    return tl.sum(tl.where(o == at, x, 0).to(tl.int64), axis=0)


@triton.jit
def _first_broken(bad, o, N: tl.constexpr):
    """Whether ``bad`` holds anywhere (int64 0 or 1), and the first position where it
    does: 0 where it holds nowhere, as the PyTorch rule's argmax of all-false says."""
    first = _first_index(bad, o, N)
    first = tl.where(first < N, first, 0)
    return (tl.max(bad.to(tl.int32), axis=0) > 0).to(tl.int64), first


@triton.jit
def _checkpoint_offsets_rule(offs, length, m, o, ALIGN: tl.constexpr, BOUNDED: tl.constexpr, N: tl.constexpr):
    """The checkpoint offsets rule on register rows (``m`` marks the real ones): each
    offset a non-negative multiple of ``ALIGN``, with ``BOUNDED`` at most its
    sequence's ``length``. Returns int64 ``(broken, the first bad sequence (0 when
    none), its length, its offset)``: one rule for the prefill's and the layer
    step's kernels."""
    bad = (offs < 0) | (offs % ALIGN != 0)
    if BOUNDED:
        bad = bad | (offs > length)
    bad = bad & m
    broken, first = _first_broken(bad, o, N)
    return broken, first.to(tl.int64), _pick(length, first, o), _pick(offs, first, o)


@triton.jit
def _foreign_claim(w_rows, w_owner, w_ok, r_rows, r_owner, r_ok, OWNER_BITS: tl.constexpr, N: tl.constexpr):
    """Whether a row of ``r_rows`` (with owner ``r_owner``) is also a row of
    ``w_rows`` of another owner; ``*_ok`` mark the entries that count. Sorts the
    (row, kind, owner) keys of both sets, so a row held by both lands side by side
    (``w`` first); the caller's distinctness rules make each row appear at most once
    per set (when they are broken the verdict is broken anyway). Returns int64
    ``(found, the smallest such r owner, its row, the w owner)``. O(N log^2 N)."""
    mask = (1 << OWNER_BITS) - 1
    key_w = tl.where(w_ok, (w_rows << (OWNER_BITS + 1)) | w_owner.to(tl.int64), -1)
    key_r = tl.where(r_ok, (r_rows << (OWNER_BITS + 1)) | (1 << OWNER_BITS) | r_owner.to(tl.int64), -1)
    keys = tl.sort(tl.reshape(tl.join(key_w, key_r), [2 * N]))
    o2 = tl.arange(0, 2 * N)
    after = tl.gather(keys, tl.minimum(o2 + 1, 2 * N - 1), 0)
    clash = ((keys >= 0) & (o2 + 1 < 2 * N) & ((keys >> (OWNER_BITS + 1)) == (after >> (OWNER_BITS + 1)))
             & ((keys >> OWNER_BITS) & 1 == 0) & ((after >> OWNER_BITS) & 1 == 1)
             & ((keys & mask) != (after & mask)))
    seq = tl.where(clash, after & mask, 2**62)
    first = tl.min(seq, axis=0)
    hit = clash & (seq == first)
    found = (tl.max(clash.to(tl.int32), axis=0) > 0).to(tl.int64)
    return (found, tl.where(first < 2**62, first, 0), tl.sum(tl.where(hit, after >> (OWNER_BITS + 1), 0), axis=0),
            tl.sum(tl.where(hit, keys & mask, 0), axis=0))


@triton.jit
def _state_rules_kernel(verdict_ptr, n, si_ptr, si_stride, slots, ck_ptr, ck_stride, ck_upper, off_ptr, off_stride,
                        cu_ptr, cu_stride, HAS_STATE: tl.constexpr, HAS_CKPT: tl.constexpr,
                        HAS_CK_IDX: tl.constexpr, HAS_LENGTHS: tl.constexpr, SAME_CACHE: tl.constexpr,
                        ALIGN: tl.constexpr, OWNER_BITS: tl.constexpr, N: tl.constexpr):
    """One program over ``n <= N`` sequences. ``verdict`` (int64 [14]): flags
    ``[0] state row >= slots, [1] duplicate state rows, [2] bad checkpoint offset,
    [3] checkpoint row >= ck_upper, [4] duplicate checkpoint rows, [5] a snapshot
    on another sequence's state row``, then details ``[6] max state row, [7] first
    bad offset's sequence, [8] its length (its offset without lengths), [9] its
    offset, [10] max checkpoint row, [11] first clashing sequence, [12] its
    checkpoint row, [13] the sequence owning that state row``. Entries of absent
    parts are 0."""
    o = tl.arange(0, N)
    m = o < n
    zero = tl.zeros([], tl.int64)
    state_range, state_dup, state_max = zero, zero, zero
    off_bad, off_seq, off_length, off_value = zero, zero, zero, zero
    ck_range, ck_dup, ck_max = zero, zero, zero
    clash, clash_seq, clash_row, clash_owner = zero, zero, zero, zero
    state = tl.full([N], -1, tl.int64)
    if HAS_STATE:
        state = tl.load(si_ptr + o * si_stride, mask=m, other=-1).to(tl.int64)
        state_range, state_dup, state_max = _range_and_duplicates(state, m, slots, N)
    if HAS_CKPT:
        offs = tl.load(off_ptr + o * off_stride, mask=m, other=0).to(tl.int64)
        length = offs  # without lengths the verdict reports the offset there
        if HAS_LENGTHS:
            start = tl.load(cu_ptr + o * cu_stride, mask=m, other=0).to(tl.int64)
            end = tl.load(cu_ptr + (o + 1) * cu_stride, mask=m, other=0).to(tl.int64)
            length = end - start
        off_bad, off_seq, off_length, off_value = _checkpoint_offsets_rule(offs, length, m, o, ALIGN, HAS_LENGTHS, N)
        # Only the sequences that export a snapshot claim a checkpoint row.
        active = m & (offs > 0)
        if HAS_CK_IDX:
            ck = tl.where(active, tl.load(ck_ptr + o * ck_stride, mask=m, other=-1).to(tl.int64), -1)
            ck_range, ck_dup, ck_max = _range_and_duplicates(ck, m, ck_upper, N)
        else:
            ck = tl.where(active, o.to(tl.int64), -1)
        if SAME_CACHE:  # the snapshots go into the state cache itself
            clash, clash_seq, clash_row, clash_owner = _foreign_claim(
                state, o, m & (state >= 0) & (state < slots), ck, o, (ck >= 0) & (ck < slots), OWNER_BITS, N)
    _store_verdict(verdict_ptr, (
        state_range, state_dup, off_bad, ck_range, ck_dup, clash,  # the flags, [0] to [5]
        state_max, off_seq, off_length, off_value, ck_max, clash_seq, clash_row, clash_owner,  # the details
    ))


# ---------------------------------------------------- kda_decode_multi's rules


@triton.jit
def _decode_multi_rules_kernel(verdict_ptr, batch, steps, w_ptr, w_stride_b, w_stride_s, r_ptr, r_stride, slots,
                               OWNER_BITS: tl.constexpr, N: tl.constexpr):
    """One program over the ``batch * steps <= N`` written rows ``w [B, S]`` and the
    ``B`` initial rows ``r``. ``verdict`` (int64 [10]): flags ``[0] written row >=
    slots, [1] duplicate written rows, [2] initial row >= slots, [3] duplicate
    initial rows, [4] a sequence starting from a row another sequence writes``,
    then details ``[5] max written row, [6] max initial row, [7] that sequence,
    [8] its initial row, [9] the writing sequence``."""
    o = tl.arange(0, N)
    mw = o < batch * steps
    seq = o // steps
    w = tl.load(w_ptr + seq * w_stride_b + (o % steps) * w_stride_s, mask=mw, other=-1).to(tl.int64)
    w_range, w_dup, w_max = _range_and_duplicates(w, mw, slots, N)
    mr = o < batch
    r = tl.load(r_ptr + o * r_stride, mask=mr, other=-1).to(tl.int64)
    r_range, r_dup, r_max = _range_and_duplicates(r, mr, slots, N)
    clash, clash_seq, clash_row, clash_owner = _foreign_claim(
        w, seq, mw & (w >= 0) & (w < slots), r, o, mr & (r >= 0) & (r < slots), OWNER_BITS, N)
    _store_verdict(verdict_ptr, (
        w_range, w_dup, r_range, r_dup, clash,  # the flags, [0] to [4]
        w_max, r_max, clash_seq, clash_row, clash_owner,  # the details
    ))


# ------------------------------------------------------- a serving layer step's batch


@triton.jit
def _checkpoint_rows(ck_ptr, ck_stride, off_ptr, off_stride, i, n):
    """Entries ``i`` (``0 <= i < n``, else -1) of the rows the sequences that export
    a checkpoint write: ``checkpoint_indices[i]`` where ``checkpoint_offsets[i] >
    0``, else -1 (none)."""
    m = (i >= 0) & (i < n)
    offs = tl.load(off_ptr + i * off_stride, mask=m, other=0).to(tl.int64)
    rows = tl.load(ck_ptr + i * ck_stride, mask=m, other=-1).to(tl.int64)
    return tl.where(m & (offs > 0), rows, -1)


@triton.jit
def _batch_set(verdict_ptr, k, upper, o, B, N, d_ptr, d_stride, p_ptr, p_stride, ck_ptr, ck_stride, off_ptr,
               off_stride, KIND: tl.constexpr, WITH_CK: tl.constexpr, N_REG: tl.constexpr):
    """Set ``k`` (``KIND`` 1: rows ``d`` of the ``B`` decode rows then ``p`` of the
    ``N`` prefill sequences, then the checkpoint rows when ``WITH_CK``; 3: the
    checkpoint rows alone): stores its range and distinctness flags and its max;
    returns whether one is broken."""
    if KIND == 3:
        x = _checkpoint_rows(ck_ptr, ck_stride, off_ptr, off_stride, o, N)
        n = N
    else:
        d = tl.load(d_ptr + o * d_stride, mask=o < B, other=-1).to(tl.int64)
        p = tl.load(p_ptr + (o - B) * p_stride, mask=(o >= B) & (o < B + N), other=-1).to(tl.int64)
        x = tl.where(o < B, d, p)
        n = B + N
        if WITH_CK:
            x = tl.where(o >= n, _checkpoint_rows(ck_ptr, ck_stride, off_ptr, off_stride, o - n, N), x)
            n = n + N
    out_of_range, duplicate, top = _range_and_duplicates(x, o < n, upper, N_REG)
    tl.store(verdict_ptr + 5 + 2 * k, out_of_range)
    tl.store(verdict_ptr + 6 + 2 * k, duplicate)
    tl.store(verdict_ptr + 21 + k, top)
    return (out_of_range | duplicate) != 0


@triton.jit
def _guarded_copy(out_ptr, x_ptr, x_stride, n, o, none, bad):
    """``out[:n] = x[:n]``, or ``none`` everywhere when ``bad`` (int64)."""
    m = o < n
    x = tl.load(x_ptr + o * x_stride, mask=m, other=0).to(tl.int64)
    tl.store(out_ptr + o, tl.where(bad, none, x), mask=m)


@triton.jit(do_not_specialize=["B", "N", "prefill_tokens", "upper0", "upper1", "upper2", "upper3"])
def _kda_batch_rules_kernel(
    out_ptr, B, N, prefill_tokens,
    ds_ptr, ds_stride, dc_ptr, dc_stride, ps_ptr, ps_stride, pc_ptr, pc_stride,
    cu_ptr, cu_stride, lens_ptr, lens_stride, off_ptr, off_stride, ck_ptr, ck_stride,
    upper0, upper1, upper2, upper3,
    HAS_LENS: tl.constexpr, HAS_CKPT: tl.constexpr,
    SET0: tl.constexpr, SET1: tl.constexpr, SET2: tl.constexpr, SET3: tl.constexpr,
    CK0: tl.constexpr, CK1: tl.constexpr, CK2: tl.constexpr, CK3: tl.constexpr,
    GUARD_DECODE: tl.constexpr, GUARD_PREFILL: tl.constexpr, GUARD_CKPT: tl.constexpr,
    ALIGN: tl.constexpr, WORDS: tl.constexpr, N_REG: tl.constexpr,
):
    """One program: every device rule of a layer step's batch (``B`` decode rows,
    ``N <= N_REG - 1`` prefill sequences, ``B + 2N <= N_REG``) and the guarded copies
    of its index tensors. ``out`` (int64): the verdict (``WORDS`` words, see the
    positions above; absent parts 0), then the copies the launches read, each all
    "none" when any rule is broken: decode state and conv rows (``GUARD_DECODE``,
    ``B`` each), ``cu_seqlens`` and the prefill state and conv rows
    (``GUARD_PREFILL``: ``N + 1``, ``N``, ``N``), checkpoint offsets and rows
    (``GUARD_CKPT``: ``N`` each). ``SETk``: 0 none, 1 state rows, 2 conv rows, 3
    the checkpoint rows alone; ``CKk``: the set takes the checkpoint rows too."""
    o = tl.arange(0, N_REG)
    zero = tl.zeros([], tl.int64)
    # The decode rows' query lengths are 1.
    lens_bad, lens_first, lens_value = zero, zero, zero
    if HAS_LENS:
        lens = tl.load(lens_ptr + o * lens_stride, mask=o < B, other=1).to(tl.int64)
        lens_bad, first = _first_broken((lens != 1) & (o < B), o, N_REG)
        lens_first, lens_value = first.to(tl.int64), _pick(lens, first, o)
    # cu_seqlens: from 0, non-decreasing, to the prefill tokens.
    m = o < N
    start = tl.load(cu_ptr + o * cu_stride, mask=m, other=0).to(tl.int64)
    length = tl.load(cu_ptr + (o + 1) * cu_stride, mask=m, other=0).to(tl.int64) - start
    shortest = tl.min(tl.where(m, length, 2**62), axis=0)
    cu_first = tl.load(cu_ptr).to(tl.int64)
    cu_last = tl.load(cu_ptr + N * cu_stride).to(tl.int64)
    cu_start, cu_decreasing, cu_end = cu_first != 0, shortest < 0, cu_last != prefill_tokens
    # Checkpoint offsets: 0 or a multiple of ALIGN at most the length.
    off_bad, off_seq, off_length, off_value = zero, zero, zero, zero
    if HAS_CKPT:
        offs = tl.load(off_ptr + o * off_stride, mask=m, other=0).to(tl.int64)
        off_bad, off_seq, off_length, off_value = _checkpoint_offsets_rule(offs, length, m, o, ALIGN, True, N_REG)
    bad = (lens_bad != 0) | cu_start | cu_decreasing | cu_end | (off_bad != 0)
    # The index sets: rows in range, and the rows one cache takes this step distinct.
    sets, uppers, with_ck = (SET0, SET1, SET2, SET3), (upper0, upper1, upper2, upper3), (CK0, CK1, CK2, CK3)
    for k in tl.static_range(4):
        if sets[k] == 1:  # state rows
            bad = bad | _batch_set(out_ptr, k, uppers[k], o, B, N, ds_ptr, ds_stride, ps_ptr, ps_stride, ck_ptr,
                                   ck_stride, off_ptr, off_stride, 1, with_ck[k], N_REG)
        if sets[k] == 2:  # conv rows
            bad = bad | _batch_set(out_ptr, k, uppers[k], o, B, N, dc_ptr, dc_stride, pc_ptr, pc_stride, ck_ptr,
                                   ck_stride, off_ptr, off_stride, 1, with_ck[k], N_REG)
        if sets[k] == 3:  # the checkpoint rows alone
            bad = bad | _batch_set(out_ptr, k, uppers[k], o, B, N, ds_ptr, ds_stride, ps_ptr, ps_stride, ck_ptr,
                                   ck_stride, off_ptr, off_stride, 3, False, N_REG)
    # Words [0, 5) and [13, 21); _batch_set wrote each set's.
    _store_verdict(out_ptr, (lens_bad, cu_start, cu_decreasing, cu_end, off_bad))
    _store_verdict(out_ptr + 13, (lens_first, lens_value, cu_first, shortest, cu_last, off_seq, off_length, off_value))
    # The copies the launches read (decode, prefill, checkpoint parts in that order).
    decode_base = out_ptr + WORDS
    if GUARD_DECODE:
        _guarded_copy(decode_base, ds_ptr, ds_stride, B, o, -1, bad)
        _guarded_copy(decode_base + B, dc_ptr, dc_stride, B, o, -1, bad)
        prefill_base = decode_base + 2 * B
    else:
        prefill_base = decode_base
    if GUARD_PREFILL:
        _guarded_copy(prefill_base, cu_ptr, cu_stride, N + 1, o, 0, bad)
        _guarded_copy(prefill_base + N + 1, ps_ptr, ps_stride, N, o, -1, bad)
        _guarded_copy(prefill_base + 2 * N + 1, pc_ptr, pc_stride, N, o, -1, bad)
        ckpt_base = prefill_base + 3 * N + 1
    else:
        ckpt_base = prefill_base
    if GUARD_CKPT:
        _guarded_copy(ckpt_base, off_ptr, off_stride, N, o, 0, bad)
        _guarded_copy(ckpt_base + N, ck_ptr, ck_stride, N, o, -1, bad)
