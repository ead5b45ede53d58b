"""KDA chunk walk over the folded operand contract, Hopper (sm_90a), Gluon (triton 3.6.0).

Implements, per (sequence n, head h) and per 64-token chunk, exactly
``reference.folded_chunk_step``::

    R      = v - kd S^T                       [L, V]
    o      = scale (qg S^T + a_fold R)        [L, V]
    S_next = S diag(decay) + R^T t_fold       [V, K]   (S is V-first, fp32)

in the transposed orientation of ``kda_chunk_step_gluon.py`` (LEAN form): S [VB, K]
stays in registers as an fp32 wgmma accumulator for the whole sequence and is the
register A operand of every product that reads it; qg, kd, t_fold, a_fold and v
arrive by TMA into a 2-stage shared-memory ring::

    S_op = bf16(-S)
    R^T  = wgmma(S_op, kd^T, v^T)            = v^T - S kd^T          [VB, BT]
    -Oq  = wgmma(S_op, qg^T, 0)              = -S qg^T
    R^T  = where(token < L, R^T, 0)          (tail chunk only)
    o^T  = wgmma(bf16(R^T), a_fold^T, Oq)    = S qg^T + R^T a_fold^T
    S    = wgmma(bf16(R^T), t_fold, S * decay)

Precision recipe (PRECISION.md, `fold-bf16`): operands in the input dtype (bf16), fp32
accumulation, S and R rounded to the operand dtype only where they are wgmma A operands.

CTA shape: one CTA per (sequence, head, V-block of VB rows). With VB = V = 128 and
num_warps = 8 the CTA has two compute warpgroups, each owning a V half (the wgmma
M = 128 splits into two m64 warpgroup instructions); the shared operand tiles are loaded
once per head. VB = 64 with num_warps = 4 is the V-half-CTA variant (grid x 2).

Partial chunks (the masking choice; see FOLDED_WALK.md):
  TMA tiles are [BT, *] boxes over the token axis of the whole batch, so the rows past
  a sequence's end inside the batch hold the NEXT sequence's tokens (only past the
  tensor end does TMA zero-fill). The last chunk of a sequence (L = len % BT > 0) is
  peeled out of the main loop (constexpr TAIL, so full chunks pay nothing) and:
    * R^T columns >= L are set to 0 in registers after the first product. This is the
      same as zeroing the rows >= L of v and kd (R = v - kd S^T row by row), and
      stronger: a non-finite value in those rows cannot get through either.
      With R_j = 0 for j >= L, a_fold's columns >= L and t_fold's rows >= L multiply
      zeros: o rows < L and S_next are exact for finite inputs.
    * GUARD_PAD (default on): t_fold rows >= L and a_fold columns >= L are also zeroed
      in shared memory (load, select, store, fence, CTA barrier) so that 0 * inf/nan
      from a neighbouring sequence's t_fold rows, or from a non-zero-filled a_fold pad,
      cannot reach S_next or o. Costs one extra smem pass per sequence.
    * qg rows >= L need no mask: they only reach o rows >= L, which are never stored.
    * o rows >= L are not stored: the tail's o tile goes register -> smem -> masked
      gl.store (16-byte vectors); full chunks leave by TMA store.
  Zero-length sequences: no chunk, no o row; the final state is the initial state.

Operand memory contract (no copies): qg, kd, t_fold [1, T, H, K], a_fold [1, T, H, BT],
v [1, T, H, V] are read through 2-D TMA descriptors over [T, H * D] (D = last dim), which
need stride(-1) == 1, stride(-2) == D (heads packed), stride(1) * itemsize % 16 == 0
and a 16-byte aligned base. The token stride itself is free. A tensor that breaks this
is copied with .contiguous() by the wrapper (the only copy it ever makes). decay, the
initial state, o and the final state use explicit strides (last stride 1 expected, not
required). Nothing here has been run (no GPU in the session that wrote it).
"""

from __future__ import annotations

import torch
from triton.runtime.jit import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

CHUNK = 64


@constexpr_function
def _row_tile_layout(cols, num_warps):
    """Blocked layout for a [rows, cols] 16-bit tile: 8 contiguous elements (16 B) per thread."""
    cols = int(cols)
    tpw1 = min(cols // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tpw1, tpw1], [int(num_warps), 1], [1, 0])


@gluon.jit
def _issue_loads(c, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s, bars,
                 K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of chunk c into stage c % STAGES (predicated off when c >= NT)."""
    NBYTES: gl.constexpr = (qg_desc.block_type.nbytes + kd_desc.block_type.nbytes + tf_desc.block_type.nbytes +
                            af_desc.block_type.nbytes + v_desc.block_type.nbytes)
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
def _walk_chunk(c, Lc, S, NT, bos, h, v0, scale,  #
                qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc,  #
                qg_s, kd_s, tf_s, af_s, v_s, o_s, bars,  #
                o_ptr, s_ot, s_oh, dec_ptr,  #
                K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                TAIL: gl.constexpr, GUARD_PAD: gl.constexpr, ASYNC: gl.constexpr, num_warps: gl.constexpr):
    """One chunk: returns S_next. ``Lc`` is the number of valid rows (== BT unless TAIL)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, K, 16])
    C_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    A_FOR_C: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=C_L, k_width=2)
    A_FOR_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    op_dt: gl.constexpr = kd_desc.dtype

    st = c % STAGES
    bar = bars.index(st)
    mbarrier.wait(bar, (c // STAGES) & 1)
    qs = qg_s.index(st)
    ks = kd_s.index(st)
    ts = tf_s.index(st)
    as_ = af_s.index(st)
    vs = v_s.index(st)

    if TAIL:
        if GUARD_PAD:
            # Zero t_fold rows >= Lc and a_fold columns >= Lc in shared memory (see module doc).
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
    ck = gl.arange(0, K, gl.SliceLayout(0, S_L))
    d = gl.load(dec_ptr + ck).to(gl.float32)
    S = S * d[None, :]
    S = warpgroup_mma(gl.convert_layout(r16, A_FOR_S), ts, S, is_async=ASYNC)
    if ASYNC:
        oT, S = warpgroup_mma_wait(0, deps=(oT, S))

    # Stage st is free (both warpgroups' wgmmas on it are complete: the TMA issue below
    # is preceded by a CTA barrier in the lowering): prefetch chunk c + STAGES into it.
    _issue_loads(c + STAGES, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s,
                 bars, K, V, BT, STAGES)

    # o out: the previous TMA store must have finished reading o_s.
    tma.store_wait(0)
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
def folded_walk_kernel(qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc,  #
                       o_ptr, decay_ptr, h0_ptr, ht_ptr, cu_ptr, coff_ptr, scale, H,  #
                       s_ot, s_oh,  #
                       s_dc, s_dh, s_dk,  #
                       s_h0n, s_h0h, s_h0v, s_h0k,  #
                       s_htn, s_hth, s_htv, s_htk,  #
                       K: gl.constexpr, V: gl.constexpr, VB: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                       HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr, GUARD_PAD: gl.constexpr,
                       ASYNC: gl.constexpr, num_warps: gl.constexpr):
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

    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, K, 16])

    qg_s = gl.allocate_shared_memory(qg_desc.dtype, [STAGES, BT, K], qg_desc.layout)
    kd_s = gl.allocate_shared_memory(kd_desc.dtype, [STAGES, BT, K], kd_desc.layout)
    tf_s = gl.allocate_shared_memory(tf_desc.dtype, [STAGES, BT, K], tf_desc.layout)
    af_s = gl.allocate_shared_memory(af_desc.dtype, [STAGES, BT, BT], af_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BT, VB], v_desc.layout)
    o_s = gl.allocate_shared_memory(o_desc.dtype, [BT, VB], o_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()

    for s in gl.static_range(STAGES):
        _issue_loads(s, NT, bos, h, v0, qg_desc, kd_desc, tf_desc, af_desc, v_desc, qg_s, kd_s, tf_s, af_s, v_s,
                     bars, K, V, BT, STAGES)

    rv = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck = gl.arange(0, K, gl.SliceLayout(0, S_L))
    if HAS_H0:
        h0_base = h0_ptr + n.to(gl.int64) * s_h0n + h.to(gl.int64) * s_h0h
        S = gl.load(h0_base + (v0 + rv)[:, None] * s_h0v + ck[None, :] * s_h0k).to(gl.float32)
    else:
        S = gl.zeros([VB, K], gl.float32, S_L)

    dec_base = decay_ptr + h.to(gl.int64) * s_dh
    for c in range(NF):
        dec_ptr = dec_base + (crow0 + c) * s_dc + ck * s_dk
        S = _walk_chunk(c, BT, S, NT, bos, h, v0, scale, qg_desc, kd_desc, tf_desc, af_desc, v_desc, o_desc,
                        qg_s, kd_s, tf_s, af_s, v_s, o_s, bars, o_ptr, s_ot, s_oh, dec_ptr,
                        K, V, VB, BT, STAGES, False, GUARD_PAD, ASYNC, num_warps)
    if NF < NT:
        dec_ptr = dec_base + (crow0 + NF) * s_dc + ck * s_dk
        S = _walk_chunk(NF, seqlen - NF * BT, S, NT, bos, h, v0, scale, qg_desc, kd_desc, tf_desc, af_desc, v_desc,
                        o_desc, qg_s, kd_s, tf_s, af_s, v_s, o_s, bars, o_ptr, s_ot, s_oh, dec_ptr,
                        K, V, VB, BT, STAGES, True, GUARD_PAD, ASYNC, num_warps)

    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    if STORE_FINAL:
        rv2 = gl.arange(0, VB, gl.SliceLayout(1, S_L))
        ck2 = gl.arange(0, K, gl.SliceLayout(0, S_L))
        ht_base = ht_ptr + n.to(gl.int64) * s_htn + h.to(gl.int64) * s_hth
        gl.store(ht_base + (v0 + rv2)[:, None] * s_htv + ck2[None, :] * s_htk, S)


# --------------------------------------------------------------------------- host side


def _tma_view(x: torch.Tensor, block, name: str):
    """2-D TMA descriptor over [T, H * D] of ``x [1, T, H, D]`` without copying when the
    layout allows it (see the module docstring); returns (descriptor, tensor kept alive)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"{name}: expected [1, T, H, D], got {tuple(x.shape)}")
    _, T, H, D = x.shape
    es = x.element_size()
    ok = (x.stride(3) == 1 and (H == 1 or x.stride(2) == D) and (x.stride(1) * es) % 16 == 0
          and x.data_ptr() % 16 == 0 and x.stride(1) >= H * D)
    if not ok:
        x = x.contiguous()
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[x.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    desc = TensorDescriptor(x, [T, H * D], [x.stride(1), 1], list(block), layout)
    return desc, x


def folded_walk_launch(qg, kd, t_fold, a_fold, v, decay, cu_seqlens, chunk_offsets, scale, initial_state=None,
                       output_final_state=True, *, VB=None, BT=CHUNK, STAGES=2, guard_pad=True, use_async=False,
                       o=None, final_state=None):
    """Validate, allocate outputs and build (kernel, grid, args, kwargs, o, final_state).

    Needs no GPU (CPU tensors give a compile-only launch description)."""
    dt = v.dtype
    if dt not in (torch.bfloat16, torch.float16):
        raise TypeError(f"v: expected bfloat16 or float16, got {dt}")
    for name, x in (("qg", qg), ("kd", kd), ("t_fold", t_fold), ("a_fold", a_fold)):
        if x.dtype != dt:
            raise TypeError(f"{name}: dtype {x.dtype} differs from v's {dt}")
    _, T, H, K = kd.shape
    V = v.shape[3]
    for name, x, last in (("qg", qg, K), ("t_fold", t_fold, K), ("a_fold", a_fold, BT), ("v", v, V)):
        if tuple(x.shape) != (1, T, H, last):
            raise ValueError(f"{name}: expected {(1, T, H, last)}, got {tuple(x.shape)}")
    if K not in (64, 128):  # the two head dims compiled (FOLDED_WALK.md); others untried
        raise ValueError(f"K = {K}: need 64 or 128")
    if VB is None:
        VB = 128 if V % 128 == 0 else 64
    if VB not in (64, 128) or V % VB:
        raise ValueError(f"VB = {VB}: need 64 or 128 dividing V = {V}")
    num_warps = VB // 16
    N = cu_seqlens.numel() - 1
    if decay.dim() != 3 or decay.shape[1:] != (H, K):
        raise ValueError(f"decay: expected [chunks, {H}, {K}], got {tuple(decay.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (N, H, V, K):
        raise ValueError(f"initial_state: expected {(N, H, V, K)}, got {tuple(initial_state.shape)}")
    dev = v.device
    if o is None:
        o = torch.empty(1, T, H, V, dtype=dt, device=dev)
    if final_state is None and output_final_state:
        final_state = torch.empty(N, H, V, K, dtype=torch.float32, device=dev)
    if N == 0 or T == 0:
        return None, None, None, None, o, final_state

    qg_d, qg = _tma_view(qg, [BT, K], "qg")
    kd_d, kd = _tma_view(kd, [BT, K], "kd")
    tf_d, t_fold = _tma_view(t_fold, [BT, K], "t_fold")
    af_d, a_fold = _tma_view(a_fold, [BT, BT], "a_fold")
    v_d, v = _tma_view(v, [BT, VB], "v")
    o_d, o_t = _tma_view(o, [BT, VB], "o")
    if o_t is not o:
        raise ValueError("o: must satisfy the TMA layout contract (it is written in place)")
    h0 = initial_state if initial_state is not None else final_state if final_state is not None else o
    ht = final_state if final_state is not None else o
    h0s = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    hts = final_state.stride() if final_state is not None else (0, 0, 0, 0)
    args = (qg_d, kd_d, tf_d, af_d, v_d, o_d, o, decay, h0, ht, cu_seqlens, chunk_offsets, float(scale), H,
            o.stride(1), o.stride(2), decay.stride(0), decay.stride(1), decay.stride(2), *h0s, *hts)
    kwargs = dict(K=K, V=V, VB=VB, BT=BT, STAGES=STAGES, HAS_H0=initial_state is not None,
                  STORE_FINAL=final_state is not None, GUARD_PAD=guard_pad, ASYNC=use_async, num_warps=num_warps)
    grid = (N * H * (V // VB),)
    keep = (qg, kd, t_fold, a_fold, v)  # possibly-copied operands, alive until launch
    return folded_walk_kernel, grid, (args, keep), kwargs, o, final_state


def folded_walk(qg, kd, t_fold, a_fold, v, decay, cu_seqlens, chunk_offsets, scale, initial_state=None,
                output_final_state=True, **opts):
    """Run the walk: returns ``(o [1, T, H, V] in v's dtype, final_state [N, H, V, K] fp32 or None)``.

    qg, kd, t_fold [1, T, H, K]; a_fold [1, T, H, 64]; v [1, T, H, V] (all bf16 or all fp16);
    decay [chunks, H, K] (fp32 expected; any float is read as fp32); cu_seqlens [N+1] (int32/int64);
    chunk_offsets [N+1] int32 (``metadata.prepare_chunk_offsets``); initial_state [N, H, V, K] or None.
    o rows outside every sequence (cu_seqlens[-1] < T) are left unwritten (torch.empty).
    """
    kern, grid, packed, kwargs, o, final = folded_walk_launch(qg, kd, t_fold, a_fold, v, decay, cu_seqlens,
                                                              chunk_offsets, scale, initial_state,
                                                              output_final_state, **opts)
    N = cu_seqlens.numel() - 1
    if kern is None:  # empty batch or T == 0: every sequence is empty, state passes through
        if final is not None and N > 0:
            if initial_state is None:
                final.zero_()
            else:
                final.copy_(initial_state)
        return o, final
    args, _keep = packed
    kern[grid](*args, **kwargs)
    return o, (final if output_final_state else None)


def compile_folded_walk(K=128, V=128, VB=128, H=4, lengths=(0, 1, 63, 64, 65, 1000), has_h0=True,
                        output_final_state=True, **opts):
    """Compile for sm_90a on the CPU (nothing runs); returns the CompiledKernel."""
    from gluon_compile import compile_sm90

    bf = torch.bfloat16
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    counts = [(x + CHUNK - 1) // CHUNK for x in lengths]
    coff = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    N = len(lengths)
    z = lambda *s, dt=bf: torch.zeros(*s, dtype=dt)  # noqa: E731
    h0 = z(N, H, V, K, dt=torch.float32) if has_h0 else None
    kern, grid, packed, kwargs, _, _ = folded_walk_launch(z(1, T, H, K), z(1, T, H, K), z(1, T, H, K),
                                                          z(1, T, H, CHUNK), z(1, T, H, V),
                                                          z(int(coff[-1]), H, K, dt=torch.float32), cu, coff,
                                                          K ** -0.5, h0, output_final_state, VB=VB, **opts)
    return compile_sm90(kern, packed[0], kwargs)
