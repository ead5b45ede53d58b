"""The KDA chunk walk over the folded operands on Hopper (sm_90a), in Gluon.

Per (sequence n, head h) and 64-token chunk, exactly
:func:`kda_engram.kda.reference.naive_folded_chunk_step`::

    R      = v - kd S^T                       [L, V]
    o      = scale (qg S^T + a_fold R)        [L, V]
    S_next = S diag(decay) + R^T t_fold       [V, K]   (S V-first, fp32)

written transposed so that the fp32 state ``S [VB, K]`` stays in registers as a
wgmma accumulator for the whole sequence and is the register A operand of both
products that read it (rounded to the operand dtype there); ``qg, kd, t_fold,
a_fold, v`` arrive by TMA into a two-stage shared-memory ring, ``o`` leaves by TMA
(masked stores on a sequence's partial last chunk). One CTA per (sequence, head,
V-block of ``VB`` rows): ``VB = 128`` runs two warpgroups, one per V half, so the
shared operand tiles are loaded once per head.

Partial last chunks (``L = len % 64``): rows past a sequence's end inside the
batch hold the next sequence's tokens, so ``R``'s columns ``>= L`` are zeroed in
registers and ``t_fold`` rows / ``a_fold`` columns ``>= L`` in shared memory
before they are read (a NaN or inf of a neighbour cannot reach ``o`` or ``S``).

State contract (as :func:`kda_engram.kda.chunk.kda_prefill_walk`): the start state
is zeros, ``initial_state[n]``, or cache row ``state_indices[n]`` where
``has_initial_state[n]`` (a negative row reads nothing); the final state goes to
``final_state[n]`` or back to the cache row (a negative row writes nothing);
a checkpoint at ``checkpoint_offsets[n]`` (a positive multiple of 64 inside the
sequence) stores the state after that many tokens into
``checkpoint_state[checkpoint_state_indices[n]]`` (or row ``n``). States are fp32
or bf16 in memory (bf16 rounded to nearest-even once per store; after a bf16
checkpoint the walk carries the rounded state on, so a prefill resumed from it
continues from exactly this state).

Memory contract: the TMA-read tensors are ``[1, T, H, D]`` with unit channel
stride, heads packed (``stride(2) == D``), a token stride that is a multiple of
16 bytes and a 16-byte aligned base; :func:`tma_compatible` says whether a tensor
is, and the caller routes other calls to the portable path (nothing is copied
here). The experiment record is docs/design/kda_fused_prefill.md.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.runtime.jit import constexpr_function

from ...constants import CHUNK_SIZE
from ..state import state_launch_modes

__all__ = ["WALK_STAGES", "folded_walk", "tma_compatible"]

#: Registers of the warp-specialised variant's one-warp TMA loader (a few scalars): at 24
#: the walk's warps get 240 and do not spill on sm_90a; at 40 they get 232 and spill 16 B
#: with checkpoints.
WALK_LOADER_REGS = 24
WALK_STAGES = 2  # three stages need 237,592 B of shared memory, past the 232,448 B an SM offers


@constexpr_function
def _row_tile_layout(cols, num_warps):
    """Blocked layout of a [rows, cols] 16-bit tile, 16 contiguous bytes per thread."""
    cols = int(cols)
    tpw1 = min(cols // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tpw1, tpw1], [int(num_warps), 1], [1, 0])


@gluon.jit
def _issue_loads(c, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s, bars,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of chunk ``c`` into stage ``c % STAGES`` (predicated off past the last chunk)."""
    NBYTES: gl.constexpr = (qg_desc.block_type.nbytes + kd_desc.block_type.nbytes + tf_desc.block_type.nbytes
                            + af_desc.block_type.nbytes + v_desc.block_type.nbytes)
    st = c % STAGES
    pred = c < NT
    bar = bars.index(st)
    r = bos + c * BT
    mbarrier.expect(bar, NBYTES, pred=pred)
    tma.async_copy_global_to_shared(qg_desc, [r, h * K], bar, qg_s.index(st), pred=pred)
    tma.async_copy_global_to_shared(kd_desc, [r, h * K], bar, kd_s.index(st), pred=pred)
    tma.async_copy_global_to_shared(tf_desc, [r, h * K], bar, tf_s.index(st), pred=pred)
    tma.async_copy_global_to_shared(af_desc, [r, h * BT], bar, af_s.index(st), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [r, h * V + v0], bar, v_s.index(st), pred=pred)


@gluon.jit
def _walk_chunk(c, Lc, S, NT, bos, h, v0, scale,
                qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc,
                qg_s, kd_s, tf_s, af_s, v_s, o_s, ready, empty,
                o_ptr, s_ot, s_oh, dec_src, dec_row, s_dc,
                K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                TAIL: gl.constexpr, ASYNC: gl.constexpr, WS: gl.constexpr, PRODUCER_RING: gl.constexpr,
                num_warps: gl.constexpr):
    """One chunk: returns ``S_next``. ``Lc`` valid rows (``BT`` unless ``TAIL``). The
    chunk's per-channel decay is ``dec_src + dec_row * s_dc`` (a ``[K]`` pointer vector).
    ``PRODUCER_RING``: the ring is the fused prefill's producer's, which writes the decay
    into the fp32 ``[STAGES, K]`` shared buffer ``dec_src``, and zero ``t_fold`` rows and
    ``a_fold`` columns past the sequence end (the tail needs no masking of its tiles)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, K, 16])
    C_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    A_FOR_C: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=C_L, k_width=2)
    A_FOR_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    op_dt: gl.constexpr = kd_desc.dtype

    st = c % STAGES
    mbarrier.wait(ready.index(st), (c // STAGES) & 1)
    qs = qg_s.index(st)
    ks = kd_s.index(st)
    ts = tf_s.index(st)
    as_ = af_s.index(st)
    vs = v_s.index(st)

    if TAIL and not PRODUCER_RING:
        # The rows past the sequence end are the next sequence's: zero t_fold's rows
        # and a_fold's columns there, so 0 * inf/NaN cannot reach S_next or o. (The
        # fused producer writes them zero: its k rows and beta are zero past the end.)
        T_BL: gl.constexpr = _row_tile_layout(K, num_warps)
        A_BL: gl.constexpr = _row_tile_layout(BT, num_warps)
        tr = gl.arange(0, BT, gl.SliceLayout(1, T_BL))
        t_tile = ts.load(T_BL)
        ts.store(gl.where((tr < Lc)[:, None], t_tile, gl.zeros_like(t_tile)))
        ac = gl.arange(0, BT, gl.SliceLayout(0, A_BL))
        a_tile = as_.load(A_BL)
        as_.store(gl.where((ac < Lc)[None, :], a_tile, gl.zeros_like(a_tile)))
        fence_async_shared()
        gl.thread_barrier()

    vT = vs.permute((1, 0)).load(C_L).to(gl.float32)  # v^T [VB, BT]
    S_op = gl.convert_layout((-S).to(op_dt), A_FOR_C)
    zero_c = gl.zeros([VB, BT], gl.float32, C_L)
    rT = warpgroup_mma(S_op, ks.permute((1, 0)), vT, is_async=ASYNC)  # v^T - S kd^T
    oqn = warpgroup_mma(S_op, qs.permute((1, 0)), zero_c, use_acc=False, is_async=ASYNC)  # -S qg^T
    if ASYNC:
        rT, oqn = warpgroup_mma_wait(0, deps=(rT, oqn))
    if TAIL:
        tok = gl.arange(0, BT, gl.SliceLayout(0, C_L))
        rT = gl.where((tok < Lc)[None, :], rT, gl.zeros_like(rT))
    r16 = rT.to(op_dt)
    oT = warpgroup_mma(gl.convert_layout(r16, A_FOR_C), as_.permute((1, 0)), -oqn, is_async=ASYNC)
    if PRODUCER_RING:
        d = dec_src.index(st).load(gl.SliceLayout(0, S_L))
    else:
        d = gl.load(dec_src + dec_row * s_dc).to(gl.float32)
    S = S * d[None, :]
    S = warpgroup_mma(gl.convert_layout(r16, A_FOR_S), ts, S, is_async=ASYNC)
    if ASYNC:
        oT, S = warpgroup_mma_wait(0, deps=(oT, S))

    if WS:
        # Every consumer warp's wgmmas on stage st are complete: release it to the loader.
        gl.thread_barrier()
        mbarrier.arrive(empty.index(st))
    else:
        # Both warpgroups' wgmmas on stage st are complete (the lowering puts a CTA
        # barrier before the TMA issue): prefetch chunk c + STAGES into it.
        _issue_loads(c + STAGES, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s,
                     v_s, ready, K, V, BT, STAGES)

    tma.store_wait(0)  # the previous chunk's o store has read o_s
    o_s.permute((1, 0)).store((oT * scale).to(o_desc.dtype))
    r = bos + c * BT
    if TAIL:
        O_BL: gl.constexpr = _row_tile_layout(VB, num_warps)
        gl.thread_barrier()
        o_tile = o_s.load(O_BL)
        orow = gl.arange(0, BT, gl.SliceLayout(1, O_BL))
        ocol = gl.arange(0, VB, gl.SliceLayout(0, O_BL))
        base = o_ptr + r.to(gl.int64) * s_ot + h.to(gl.int64) * s_oh + v0
        ptrs = base + orow.to(gl.int64)[:, None] * s_ot + ocol[None, :]
        gl.store(ptrs, o_tile, mask=(orow < Lc)[:, None])
    else:
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [r, h * V + v0], o_s)
    return S


@gluon.jit
def _walk_loader(qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s, ready, empty,
                 NT, bos, h, v0, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition (one warp): chunk ``c``'s TMA loads into stage ``c % STAGES``
    once the consumers have released it (``empty``; the first pass through the ring
    waits for nothing)."""
    for c in range(NT):
        st = c % STAGES
        mbarrier.wait(empty.index(st), ((c // STAGES) & 1) ^ 1, pred=c >= STAGES)
        _issue_loads(c, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s,
                     ready, K, V, BT, STAGES)


@gluon.jit
def _walk_sequence(qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc, qg_s, kd_s, tf_s, af_s, v_s, o_s, ready, empty,
                   o_ptr, decay_ptr, s_in_ptr, s_out_ptr, s_idx_ptr, has_ptr, ck_ptr, ck_off_ptr, ck_idx_ptr,
                   n, h, v0, bos, seqlen, NF, NT, crow0, scale,
                   s_ot, s_oh, s_dc, s_dh, s_dk,
                   s_in_n, s_in_h, s_in_v, s_in_k,
                   s_out_n, s_out_h, s_out_v, s_out_k,
                   s_ck_n, s_ck_h, s_ck_v, s_ck_k,
                   K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                   LOAD_STATE: gl.constexpr, STORE_STATE: gl.constexpr, HAS_CKPT: gl.constexpr,
                   CKPT_INDEXED: gl.constexpr, CKPT_BF16: gl.constexpr, ASYNC: gl.constexpr, WS: gl.constexpr,
                   PRODUCER_RING: gl.constexpr, num_warps: gl.constexpr):
    """The walk of one (sequence, head, V-block): the start state, every chunk, the
    checkpoint and the final state (the consumer partition when ``WS``). ``decay_ptr``:
    the ``decay [chunks, H, K]`` rows, or with ``PRODUCER_RING`` the ring's shared
    decay buffer (``crow0``, ``s_dc``, ``s_dh``, ``s_dk`` then unused)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, K, 16])
    rv = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck = gl.arange(0, K, gl.SliceLayout(0, S_L))
    tile_in = (v0 + rv)[:, None] * s_in_v + ck[None, :] * s_in_k
    if LOAD_STATE == 1:
        S = gl.load(s_in_ptr + n.to(gl.int64) * s_in_n + h.to(gl.int64) * s_in_h + tile_in).to(gl.float32)
    elif LOAD_STATE == 2:
        slot = gl.load(s_idx_ptr + n).to(gl.int64)
        has = gl.load(has_ptr + n) != 0
        rd = has & (slot >= 0)
        # A row that is not read stays unread (garbage or NaN there is harmless).
        S = gl.load(s_in_ptr + gl.where(rd, slot, 0) * s_in_n + h.to(gl.int64) * s_in_h + tile_in,
                    mask=(rv < VB)[:, None] & rd, other=0.0).to(gl.float32)
    else:
        S = gl.zeros([VB, K], gl.float32, S_L)

    ck_on = n < 0
    ck_off = n * 0
    ck_base = ck_ptr
    if HAS_CKPT:
        ck_off = gl.load(ck_off_ptr + n).to(gl.int32)
        if CKPT_INDEXED:
            ck_row = gl.load(ck_idx_ptr + n).to(gl.int64)
        else:
            ck_row = n.to(gl.int64)
        # Only an exactly placeable snapshot: a positive multiple of BT inside the
        # sequence with a real destination row (it then falls on a full chunk).
        ck_on = (ck_off > 0) & (ck_off % BT == 0) & (ck_off <= seqlen) & (ck_row >= 0)
        ck_base = ck_ptr + gl.where(ck_on, ck_row, 0) * s_ck_n + h.to(gl.int64) * s_ck_h

    if PRODUCER_RING:
        dec_base = decay_ptr
    else:
        dec_base = decay_ptr + h.to(gl.int64) * s_dh + ck * s_dk
    for c in range(NF):
        S = _walk_chunk(c, BT, S, NT, bos, h, v0, scale, qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc,
                        qg_s, kd_s, tf_s, af_s, v_s, o_s, ready, empty, o_ptr, s_ot, s_oh,
                        dec_base, crow0 + c, s_dc, K, V, VB, BT, STAGES, False, ASYNC, WS, PRODUCER_RING, num_warps)
        if HAS_CKPT:
            if ck_on & (ck_off == (c + 1) * BT):
                if CKPT_BF16:
                    S = S.to(gl.bfloat16).to(gl.float32)  # walk on from the stored value
                # The tile's offsets from a loop-variant zero ((c + 1) BT - ck_off): a
                # loop-invariant [VB, K] offset tile would stay in registers across the loop.
                rz = v0 + rv + ((c + 1) * BT - ck_off)
                gl.store(ck_base + rz[:, None] * s_ck_v + ck[None, :] * s_ck_k, S.to(ck_ptr.dtype.element_ty))
    if NF < NT:
        S = _walk_chunk(NF, seqlen - NF * BT, S, NT, bos, h, v0, scale, qg_desc, kd_desc, tf_desc, af_desc, v_desc,
                        o_desc, qg_s, kd_s, tf_s, af_s, v_s, o_s, ready, empty, o_ptr, s_ot, s_oh,
                        dec_base, crow0 + NF, s_dc, K, V, VB, BT, STAGES, True, ASYNC, WS, PRODUCER_RING,
                        num_warps)

    tma.store_wait(0)
    tile_out = (v0 + rv)[:, None] * s_out_v + ck[None, :] * s_out_k
    if STORE_STATE == 1:
        gl.store(s_out_ptr + n.to(gl.int64) * s_out_n + h.to(gl.int64) * s_out_h + tile_out,
                 S.to(s_out_ptr.dtype.element_ty))
    elif STORE_STATE == 2:
        slot_out = gl.load(s_idx_ptr + n).to(gl.int64)
        gl.store(s_out_ptr + gl.where(slot_out >= 0, slot_out, 0) * s_out_n + h.to(gl.int64) * s_out_h + tile_out,
                 S.to(s_out_ptr.dtype.element_ty), mask=(rv < VB)[:, None] & (slot_out >= 0))


@gluon.jit
def _folded_walk_kernel(qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc,
                        o_ptr, decay_ptr, s_in_ptr, s_out_ptr, s_idx_ptr, has_ptr, ck_ptr, ck_off_ptr, ck_idx_ptr,
                        cu_ptr, coff_ptr, scale, H,
                        s_ot, s_oh,
                        s_dc, s_dh, s_dk,
                        s_in_n, s_in_h, s_in_v, s_in_k,
                        s_out_n, s_out_h, s_out_v, s_out_k,
                        s_ck_n, s_ck_h, s_ck_v, s_ck_k,
                        K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                        LOAD_STATE: gl.constexpr, STORE_STATE: gl.constexpr, HAS_CKPT: gl.constexpr,
                        CKPT_INDEXED: gl.constexpr, CKPT_BF16: gl.constexpr, ASYNC: gl.constexpr,
                        WS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(N * H * V / VB,)``, V-blocks of a head adjacent. ``LOAD_STATE``: 0 zeros,
    1 ``initial_state[n]``, 2 cache row ``s_idx[n]`` where ``has[n]``; ``STORE_STATE``:
    0 none, 1 ``final_state[n]``, 2 cache row ``s_idx[n]``. ``WS``: a one-warp loader
    partition (``LOADER_REGS`` registers) issues the TMA loads and the walk's warps only
    compute (the consumer side of the fused prefill); otherwise the walk's warps
    prefetch ``STAGES`` chunks ahead themselves."""
    gl.static_assert(VB == 16 * num_warps, "VB rows = 16 per warp (one m64 wgmma per warpgroup)")
    NVB: gl.constexpr = V // VB
    pid = gl.program_id(0)
    vb = pid % NVB
    h = (pid // NVB) % H
    n = pid // (NVB * H)
    v0 = vb * VB

    bos = gl.load(cu_ptr + n).to(gl.int32)
    eos = gl.load(cu_ptr + n + 1).to(gl.int32)
    seqlen = eos - bos
    NF = seqlen // BT  # full chunks
    NT = (seqlen + BT - 1) // BT  # all chunks (NT - NF is 0 or 1)
    crow0 = gl.load(coff_ptr + n).to(gl.int64)  # decay row of chunk 0

    qg_s = gl.allocate_shared_memory(qg_desc.dtype, [STAGES, BT, K], qg_desc.layout)
    kd_s = gl.allocate_shared_memory(kd_desc.dtype, [STAGES, BT, K], kd_desc.layout)
    tf_s = gl.allocate_shared_memory(tf_desc.dtype, [STAGES, BT, K], tf_desc.layout)
    af_s = gl.allocate_shared_memory(af_desc.dtype, [STAGES, BT, BT], af_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BT, VB], v_desc.layout)
    o_s = gl.allocate_shared_memory(o_desc.dtype, [BT, VB], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    # The argument list is spelled out in both branches: a tuple kept in a variable loses
    # its constexprs in Gluon, and a jit call cannot unpack one with *.
    if WS:
        gl.warp_specialize([
            (_walk_sequence, (qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc, qg_s, kd_s, tf_s, af_s, v_s, o_s,
                              ready, empty, o_ptr, decay_ptr, s_in_ptr, s_out_ptr, s_idx_ptr, has_ptr, ck_ptr,
                              ck_off_ptr, ck_idx_ptr,
                              n, h, v0, bos, seqlen, NF, NT, crow0, scale,
                              s_ot, s_oh, s_dc, s_dh, s_dk,
                              s_in_n, s_in_h, s_in_v, s_in_k,
                              s_out_n, s_out_h, s_out_v, s_out_k,
                              s_ck_n, s_ck_h, s_ck_v, s_ck_k,
                              K, V, VB, BT, STAGES, LOAD_STATE, STORE_STATE, HAS_CKPT, CKPT_INDEXED, CKPT_BF16,
                              ASYNC, WS, False, num_warps)),
            (_walk_loader, (qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s, ready, empty,
                            NT, bos, h, v0, K, V, BT, STAGES)),
        ], [1], [LOADER_REGS])
    else:
        for s in gl.static_range(STAGES):
            _issue_loads(s, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s,
                         ready, K, V, BT, STAGES)
        _walk_sequence(qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc, qg_s, kd_s, tf_s, af_s, v_s, o_s, ready,
                       empty, o_ptr, decay_ptr, s_in_ptr, s_out_ptr, s_idx_ptr, has_ptr, ck_ptr, ck_off_ptr, ck_idx_ptr,
                       n, h, v0, bos, seqlen, NF, NT, crow0, scale,
                       s_ot, s_oh, s_dc, s_dh, s_dk,
                       s_in_n, s_in_h, s_in_v, s_in_k,
                       s_out_n, s_out_h, s_out_v, s_out_k,
                       s_ck_n, s_ck_h, s_ck_v, s_ck_k,
                       K, V, VB, BT, STAGES, LOAD_STATE, STORE_STATE, HAS_CKPT, CKPT_INDEXED, CKPT_BF16, ASYNC, WS,
                       False, num_warps)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


# --------------------------------------------------------------------------- host side


def tma_compatible(x: torch.Tensor, element_sizes=(2,)) -> bool:
    """Whether ``x [1, T, H, D]`` (16-bit, or an element size in ``element_sizes``) can
    be read or written by the walk's 2-D TMA descriptors over ``[T, H * D]`` as it is:
    unit channel stride, heads packed, a 16-byte multiple token stride and a 16-byte
    aligned base."""
    if x.dim() != 4 or x.shape[0] != 1 or x.element_size() not in element_sizes:
        return False
    _, T, H, D = x.shape
    return (x.stride(3) == 1 and (H == 1 or x.stride(2) == D) and (x.stride(1) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0 and (T <= 1 or x.stride(1) >= H * D))


def tma_descriptor(x: torch.Tensor, block, swizzled: bool = True):
    """The 2-D TMA descriptor of ``x [1, T, H, D]`` over ``[T, H * D]`` with box ``block``
    (``x`` :func:`tma_compatible`; bf16, fp16 or fp32): in the default NVMMA layout (what
    wgmma reads), or with ``swizzled=False`` unswizzled rows (what a thread-per-column
    register layout reads without per-row address arithmetic)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _, T, H, D = x.shape
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[x.dtype]
    if swizzled:
        layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    else:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * x.element_size(), rank=2)
    return TensorDescriptor(x, [T, H * D], [x.stride(1), 1], list(block), layout)


def _strides(x: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(x.stride()) if x is not None else (0, 0, 0, 0)


def state_launch_args(dummy, cu_seqlens, *, initial_state, final_state, state_cache, state_indices,
                      has_initial_state, checkpoint_state, checkpoint_offsets, checkpoint_state_indices):
    """``(pointers, strides, constexprs)`` of the state keywords of a launch that walks
    the state (:func:`folded_walk_launch`, the fused prefill's
    :func:`~kda_engram.kda.hopper.fused.fused_prefill_launch`): the seven state and
    checkpoint pointers (an absent one is ``dummy``, or ``cu_seqlens`` for the integer
    ones: never dereferenced where a pointer is unused, constexpr branches), the strides
    of the state read, the state written and the checkpoints, and ``LOAD_STATE``,
    ``STORE_STATE``, ``HAS_CKPT``, ``CKPT_INDEXED``, ``CKPT_BF16``."""
    load_state, store_state, s_in, s_out = state_launch_modes(initial_state, final_state, state_cache)
    ck_indexed = checkpoint_state_indices is not None
    pointers = (s_in if s_in is not None else dummy, s_out if s_out is not None else dummy,
                state_indices if state_indices is not None else cu_seqlens,
                has_initial_state if has_initial_state is not None else cu_seqlens,
                checkpoint_state if checkpoint_state is not None else dummy,
                checkpoint_offsets if checkpoint_offsets is not None else cu_seqlens,
                checkpoint_state_indices if ck_indexed else cu_seqlens)
    strides = (*_strides(s_in), *_strides(s_out), *_strides(checkpoint_state))
    constexprs = dict(LOAD_STATE=load_state, STORE_STATE=store_state, HAS_CKPT=checkpoint_state is not None,
                      CKPT_INDEXED=ck_indexed,
                      CKPT_BF16=checkpoint_state is not None and checkpoint_state.dtype == torch.bfloat16)
    return pointers, strides, constexprs


def folded_walk_launch(qg, kd, t_fold, a_fold, v, decay, out, scale, cu_seqlens, chunk_offsets, *,
                       initial_state=None, final_state=None, state_cache=None, state_indices=None,
                       has_initial_state=None, checkpoint_state=None, checkpoint_offsets=None,
                       checkpoint_state_indices=None, vb=128, use_async=True, warp_specialized=False,
                       loader_regs=WALK_LOADER_REGS, chunk_size=CHUNK_SIZE):
    """``(kernel, grid, args, kwargs)`` of one walk launch (``None`` kernel: nothing to walk).

    Arguments are assumed valid and :func:`tma_compatible` (the caller's job);
    works on CPU tensors too, for compiling on a machine without a GPU.
    ``warp_specialized``: a one-warp loader partition (``loader_regs`` registers) issues
    the TMA loads and the walk's warps only compute (the fused prefill's consumer side;
    the same arithmetic, bit for bit). ``chunk_size``: 64 (the prologues' chunk), or 32 /
    16 for operands prepared at that chunk (``a_fold [1, T, H, chunk_size]``,
    ``chunk_offsets`` and ``decay`` rows counted in such chunks)."""
    _, T, H, K = kd.shape
    V = v.shape[3]
    N = cu_seqlens.numel() - 1
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size: expected 16, 32 or 64 (the wgmma N of the walk's chunk products), "
                         f"got {chunk_size!r}")
    BT = int(chunk_size)
    descs = (tma_descriptor(qg, [BT, K]), tma_descriptor(kd, [BT, K]), tma_descriptor(t_fold, [BT, K]),
             tma_descriptor(a_fold, [BT, BT]), tma_descriptor(v, [BT, vb]), tma_descriptor(out, [BT, vb]))
    state_ptrs, state_strides, state_modes = state_launch_args(
        decay, cu_seqlens, initial_state=initial_state, final_state=final_state, state_cache=state_cache,
        state_indices=state_indices, has_initial_state=has_initial_state, checkpoint_state=checkpoint_state,
        checkpoint_offsets=checkpoint_offsets, checkpoint_state_indices=checkpoint_state_indices)
    args = (*descs, out, decay, *state_ptrs, cu_seqlens, chunk_offsets, float(scale), H,
            out.stride(1), out.stride(2), *decay.stride(), *state_strides)
    kwargs = dict(K=K, V=V, VB=vb, BT=BT, STAGES=WALK_STAGES, **state_modes,
                  ASYNC=use_async, WS=bool(warp_specialized), LOADER_REGS=int(loader_regs), num_warps=vb // 16)
    grid = (N * H * (V // vb),)
    return _folded_walk_kernel, grid, args, kwargs


def folded_walk(qg, kd, t_fold, a_fold, v, decay, out, scale, cu_seqlens, chunk_offsets, **state):
    """Launch the walk (see :func:`folded_walk_launch` for the arguments).

    ``qg, kd, t_fold [1, T, H, K]``, ``a_fold [1, T, H, C]`` (``C = chunk_size``, 64 by
    default), ``v, out [1, T, H, V]``
    (one 16-bit dtype), ``decay [chunks, H, K]`` fp32, ``cu_seqlens [N+1]``,
    ``chunk_offsets [N+1]`` int32; the state keywords as the module docstring says.
    Writes ``out``'s rows inside the sequences, the state rows it was given, and
    nothing else."""
    N = cu_seqlens.numel() - 1
    H = kd.shape[2]
    if N == 0 or H == 0:
        return
    kernel, grid, args, kwargs = folded_walk_launch(qg, kd, t_fold, a_fold, v, decay, out, scale, cu_seqlens,
                                                    chunk_offsets, **state)
    kernel[grid](*args, **kwargs)
