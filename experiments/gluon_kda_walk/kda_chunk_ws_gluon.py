"""Warp-specialised variant of the chunk-walk skeleton (compile-only, triton 3.6.0 Gluon API).

Same math and operand orientation as kda_chunk_step_gluon.py (lean form), but the
TMA loads move to a 1-warp worker partition with a small register budget, the
compute warps form the default partition. Stage handshake: ready[s] (TMA bytes
landed, expect/tx) and empty[s] (compute is done with stage s). Nothing was run.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _loader(q_desc, k_desc, w_desc, u_desc, a_desc, q_s, k_s, w_s, u_s, a_s, ready, empty, row0, v0, NT,
            BT: gl.constexpr, STAGES: gl.constexpr):
    NBYTES: gl.constexpr = (3 * q_desc.block_type.nbytes + u_desc.block_type.nbytes + a_desc.block_type.nbytes)
    for c in range(NT):
        st = c % STAGES
        # Wait until compute released this stage (first pass through the ring: no wait).
        mbarrier.wait(empty.index(st), ((c // STAGES) & 1) ^ 1, pred=c >= STAGES)
        bar = ready.index(st)
        mbarrier.expect(bar, NBYTES)
        r = row0 + c * BT
        tma.async_copy_global_to_shared(q_desc, [r, 0], bar, q_s.index(st))
        tma.async_copy_global_to_shared(k_desc, [r, 0], bar, k_s.index(st))
        tma.async_copy_global_to_shared(w_desc, [r, 0], bar, w_s.index(st))
        tma.async_copy_global_to_shared(u_desc, [r, v0], bar, u_s.index(st))
        tma.async_copy_global_to_shared(a_desc, [r, 0], bar, a_s.index(st))


@gluon.jit
def _compute(o_desc, q_s, k_s, w_s, u_s, a_s, o_s, ready, empty, decay_ptr, h0_ptr, ht_ptr, h, row0, v0, NT, scale,
             K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
             NUM_WARPS: gl.constexpr):
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, K, 16])
    C_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BT, 16])
    A_FOR_C: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=C_L, k_width=2)
    A_FOR_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    rv = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck = gl.arange(0, K, gl.SliceLayout(0, S_L))
    S = gl.load(h0_ptr + ((h * V + v0 + rv)[:, None] * K + ck[None, :]))
    for c in range(NT):
        st = c % STAGES
        mbarrier.wait(ready.index(st), (c // STAGES) & 1)
        qs = q_s.index(st)
        ws = w_s.index(st)
        uT = u_s.index(st).permute((1, 0)).load(C_L).to(gl.float32)
        S_op = gl.convert_layout((-S).to(gl.bfloat16), A_FOR_C)
        zero_c = gl.zeros([VB, BT], gl.float32, C_L)
        vT = warpgroup_mma(S_op, ws.permute((1, 0)), uT, is_async=True)
        oqn = warpgroup_mma(S_op, qs.permute((1, 0)), zero_c, use_acc=False, is_async=True)
        vT, oqn = warpgroup_mma_wait(0, deps=(vT, oqn))
        vT16 = vT.to(gl.bfloat16)
        oT = warpgroup_mma(gl.convert_layout(vT16, A_FOR_C), a_s.index(st).permute((1, 0)), -oqn, is_async=True)
        d = gl.load(decay_ptr + (h * NT + c) * K + ck)
        S = S * d[None, :]
        S = warpgroup_mma(gl.convert_layout(vT16, A_FOR_S), k_s.index(st), S, is_async=True)
        oT, S = warpgroup_mma_wait(0, deps=(oT, S))
        mbarrier.arrive(empty.index(st))
        tma.store_wait(0)
        o_s.permute((1, 0)).store((oT * scale).to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row0 + c * BT, v0], o_s)
    tma.store_wait(0)
    rv2 = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck2 = gl.arange(0, K, gl.SliceLayout(0, S_L))
    gl.store(ht_ptr + ((h * V + v0 + rv2)[:, None] * K + ck2[None, :]), S)


@gluon.jit
def kda_chunk_walk_ws_kernel(q_desc, k_desc, w_desc, u_desc, a_desc, o_desc, decay_ptr, h0_ptr, ht_ptr, T, scale,  #
                             K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr,
                             STAGES: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    pid_v = gl.program_id(0)
    h = gl.program_id(1)
    v0 = pid_v * VB
    NT = T // BT
    row0 = h * T
    q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BT, K], k_desc.layout)
    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BT, K], w_desc.layout)
    u_s = gl.allocate_shared_memory(u_desc.dtype, [STAGES, BT, VB], u_desc.layout)
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BT, BT], a_desc.layout)
    o_s = gl.allocate_shared_memory(o_desc.dtype, [BT, VB], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_compute, (o_desc, q_s, k_s, w_s, u_s, a_s, o_s, ready, empty, decay_ptr, h0_ptr, ht_ptr, h, row0, v0, NT,
                    scale, K, V, VB, BT, STAGES, num_warps)),
        (_loader, (q_desc, k_desc, w_desc, u_desc, a_desc, q_s, k_s, w_s, u_s, a_s, ready, empty, row0, v0, NT, BT,
                   STAGES)),
    ], [1], [LOAD_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def compile_ws_variant(VB, BT, num_warps, STAGES=2, LOAD_REGS=40, **opts):
    from gluon_compile import compile_sm90
    from kda_chunk_step_gluon import make_args

    grid, args = make_args(VB=VB, BT=BT)
    kw = dict(K=128, V=128, VB=VB, BT=BT, STAGES=STAGES, LOAD_REGS=LOAD_REGS, num_warps=num_warps, **opts)
    return compile_sm90(kda_chunk_walk_ws_kernel, args, kw)


if __name__ == "__main__":
    from gluon_compile import ptxas_report, resources

    for VB, BT, nw, stg in [(64, 64, 4, 2), (128, 64, 8, 2), (64, 16, 4, 4), (128, 16, 8, 4)]:
        try:
            k = compile_ws_variant(VB, BT, nw, stg)
        except Exception as e:  # noqa: BLE001
            print(f"WS VB={VB} BT={BT} warps={nw}+1 stages={stg}: FAILED {type(e).__name__}: {str(e)[:1500]}")
            continue
        r = resources(k)
        setmax = sorted(set(__import__("re").findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])))
        print(f"WS VB={VB} BT={BT} warps={nw}+1 stages={stg}: regs {r['registers']} spills {r['spill_stores']}/"
              f"{r['spill_loads']} smem {r['dyn_smem_triton']} total warps {k.metadata.num_warps} setmaxnreg {setmax} "
              f"wgmma {r['wgmma_instrs']}")
