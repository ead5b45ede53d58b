"""Compile-only skeleton of a Hopper (sm_90a) KDA chunk walk in Gluon (triton 3.6.0).

One CTA owns one (head, V-block of VB rows) of a single sequence of length T
(T a multiple of BT). The state block S [VB, K] (V-first, fp32) lives in registers
as a wgmma accumulator for the whole walk. The walk is written in the TRANSPOSED
orientation so that S is always the register (A) operand and every other operand
is a TMA-loaded shared-memory (B) operand; S never goes to shared memory:

    v_newT [VB, BT] = uT - S . wT            A = bf16(S) (regs), B = w_smem^T  [K, BT]
    oT     [VB, BT] = S . qgT + v_newT . AT  A = bf16(S) / bf16(v_newT) (regs),
                                             B = q_smem^T [K, BT], a_smem^T [BT, BT]
    S      [VB, K]  = S * decay + v_newT . kg   A = bf16(v_newT) (regs), B = k_smem [BT, K]

Inputs per head are rows of [H*T, *] bf16 matrices (qg, kg, w: [.., K]; u, o: [.., V];
A_qk: [.., BT] holding each chunk's BT x BT block) plus decay [H*T/BT, K] fp32 and the
fp32 state h0/ht [H, V, K]. Numerics are only shaped like KDA's (the fold of the
inverse into w/u/A happens upstream); nothing here was run: there is no GPU.
Loads are double-buffered (STAGES) with one mbarrier per stage; o goes out by TMA.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def kda_chunk_walk_gluon_kernel(q_desc, k_desc, w_desc, u_desc, a_desc, o_desc,  #
                                decay_ptr, h0_ptr, ht_ptr, T, scale,  #
                                K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr,
                                STAGES: gl.constexpr, ASYNC: gl.constexpr, O_REG_PERMUTE: gl.constexpr, LEAN: gl.constexpr,
                                ABLATE: gl.constexpr,
                                num_warps: gl.constexpr):
    pid_v = gl.program_id(0)
    h = gl.program_id(1)
    v0 = pid_v * VB
    NT = T // BT
    row0 = h * T

    # Accumulator layouts. The state [VB, K] and the per-chunk [VB, BT] products
    # share the warp tiling along M (= V rows): warps_per_cta [num_warps, 1].
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, K, 16])
    C_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    # Register A operands (bf16: k_width = 32 / 16 = 2).
    A_FOR_C: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=C_L, k_width=2)
    A_FOR_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)

    # Shared memory: STAGES ring of the chunk's input tiles, one o tile, barriers.
    q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BT, K], k_desc.layout)
    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BT, K], w_desc.layout)
    u_s = gl.allocate_shared_memory(u_desc.dtype, [STAGES, BT, VB], u_desc.layout)
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BT, BT], a_desc.layout)
    o_s = gl.allocate_shared_memory(o_desc.dtype, [BT, VB], o_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()

    NBYTES: gl.constexpr = (3 * q_desc.block_type.nbytes + u_desc.block_type.nbytes + a_desc.block_type.nbytes)
    for s in gl.static_range(STAGES):
        pred = s < NT
        bar = bars.index(s)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [row0 + s * BT, 0], bar, q_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(k_desc, [row0 + s * BT, 0], bar, k_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row0 + s * BT, 0], bar, w_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(u_desc, [row0 + s * BT, v0], bar, u_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(a_desc, [row0 + s * BT, 0], bar, a_s.index(s), pred=pred)

    # Initial state block, fp32, straight into the accumulator layout.
    rv = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck = gl.arange(0, K, gl.SliceLayout(0, S_L))
    S = gl.load(h0_ptr + ((h * V + v0 + rv)[:, None] * K + ck[None, :]))

    for c in range(NT):
        st = c % STAGES
        phase = (c // STAGES) & 1
        bar = bars.index(st)
        mbarrier.wait(bar, phase)
        qs = q_s.index(st)
        ks = k_s.index(st)
        ws = w_s.index(st)
        us = u_s.index(st)
        as_ = a_s.index(st)

        if ABLATE & 2:  # probe only: no u tile read
            uT = gl.zeros([VB, BT], gl.float32, C_L)
        else:
            uT = us.permute((1, 0)).load(C_L).to(gl.float32)  # [VB, BT]
        if LEAN:
            # One register operand bf16(-S) serves both S products; uT is the
            # accumulator of the first, so no separate S.wT tile is ever live.
            S_op = gl.convert_layout((-S).to(gl.bfloat16), A_FOR_C)
            zero_c = gl.zeros([VB, BT], gl.float32, C_L)
            vT = warpgroup_mma(S_op, ws.permute((1, 0)), uT, is_async=ASYNC)          # uT - S.wT
            oqn = warpgroup_mma(S_op, qs.permute((1, 0)), zero_c, use_acc=False, is_async=ASYNC)  # -S.qgT
            if ASYNC:
                vT, oqn = warpgroup_mma_wait(0, deps=(vT, oqn))
            vT16 = vT.to(gl.bfloat16)
            oT = warpgroup_mma(gl.convert_layout(vT16, A_FOR_C), as_.permute((1, 0)), -oqn, is_async=ASYNC)
        else:
            S_op = gl.convert_layout(S.to(gl.bfloat16), A_FOR_C)
            # v_newT = uT - S . wT
            zero_c = gl.zeros([VB, BT], gl.float32, C_L)
            if ASYNC:
                sw = warpgroup_mma(S_op, ws.permute((1, 0)), zero_c, use_acc=False, is_async=True)
                oq = warpgroup_mma(S_op, qs.permute((1, 0)), zero_c, use_acc=False, is_async=True)
                sw, oq = warpgroup_mma_wait(0, deps=(sw, oq))
            else:
                sw = warpgroup_mma(S_op, ws.permute((1, 0)), zero_c, use_acc=False)
                oq = warpgroup_mma(S_op, qs.permute((1, 0)), zero_c, use_acc=False)
            vT = uT - sw
            vT16 = vT.to(gl.bfloat16)
            # oT = S . qgT + v_newT . A_qkT
            oT = warpgroup_mma(gl.convert_layout(vT16, A_FOR_C), as_.permute((1, 0)), oq, is_async=ASYNC)
        # S = S * decay + v_newT . kg
        if ABLATE & 1:  # probe only: a scalar decay instead of the per-channel vector
            S = S * gl.load(decay_ptr + h * NT + c)
        else:
            d = gl.load(decay_ptr + (h * NT + c) * K + ck)
            S = S * d[None, :]
        S = warpgroup_mma(gl.convert_layout(vT16, A_FOR_S), ks, S, is_async=ASYNC)
        if ASYNC:
            oT, S = warpgroup_mma_wait(0, deps=(oT, S))

        # Prefetch chunk c + STAGES into the stage just consumed (its wgmmas are done).
        nxt = c + STAGES
        pred = nxt < NT
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [row0 + nxt * BT, 0], bar, qs, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [row0 + nxt * BT, 0], bar, ks, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row0 + nxt * BT, 0], bar, ws, pred=pred)
        tma.async_copy_global_to_shared(u_desc, [row0 + nxt * BT, v0], bar, us, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [row0 + nxt * BT, 0], bar, as_, pred=pred)

        # o tile out through shared memory and TMA.
        if ABLATE & 4:  # probe only: o reduced to one scalar per row block
            oT = gl.zeros([VB, BT], gl.float32, C_L) + gl.sum(gl.sum(oT, 1), 0)
        tma.store_wait(0)
        o16 = (oT * scale).to(gl.bfloat16)
        if O_REG_PERMUTE:
            o_s.store(gl.permute(o16, (1, 0)))
        else:
            o_s.permute((1, 0)).store(o16)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row0 + c * BT, v0], o_s)

    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    # Offsets rebuilt here: held across the loop they cost 64 registers per thread.
    rv2 = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck2 = gl.arange(0, K, gl.SliceLayout(0, S_L))
    gl.store(ht_ptr + ((h * V + v0 + rv2)[:, None] * K + ck2[None, :]), S)


# --------------------------------------------------------------------------- host side


def make_args(H=4, T=1024, K=128, V=128, VB=128, BT=64, dtype=None):
    """CPU stand-ins for a launch: tensors and gluon TensorDescriptors (nothing runs)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bf = torch.bfloat16
    q, k, w = (torch.zeros(H * T, K, dtype=bf) for _ in range(3))
    u, o = torch.zeros(H * T, V, dtype=bf), torch.zeros(H * T, V, dtype=bf)
    a = torch.zeros(H * T, BT, dtype=bf)
    decay = torch.ones(H * T // BT, K)
    h0, ht = torch.zeros(H, V, K), torch.zeros(H, V, K)

    def desc(x, block):
        return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    descs = (desc(q, [BT, K]), desc(k, [BT, K]), desc(w, [BT, K]), desc(u, [BT, VB]), desc(a, [BT, BT]),
             desc(o, [BT, VB]))
    grid = (V // VB, H)
    return grid, (*descs, decay, h0, ht, T, 0.088)


def compile_variant(VB, BT, num_warps, STAGES=2, ASYNC=False, O_REG_PERMUTE=False, LEAN=False, ABLATE=0, K=128, V=128, **opts):
    from gluon_compile import compile_sm90

    grid, args = make_args(K=K, V=V, VB=VB, BT=BT)
    kw = dict(K=K, V=V, VB=VB, BT=BT, STAGES=STAGES, ASYNC=ASYNC, O_REG_PERMUTE=O_REG_PERMUTE, LEAN=LEAN,
              ABLATE=ABLATE, num_warps=num_warps, **opts)
    return compile_sm90(kda_chunk_walk_gluon_kernel, args, kw)
