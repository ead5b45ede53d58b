"""Device code of the KDA chunk walk (launched by :mod:`kda_engram.kda.chunk`).

Three kernels: the walk (:func:`_kda_chunk_walk_kernel`, one program per
(sequence or chunk group, head, V-tile), state tile in registers; with
``GROUPED`` it is pass two of the chunk groups), pass one of the groups
(:func:`_kda_group_pass_one_kernel`: the same chunk step with the output off,
over the V state rows and the K transfer-operator rows) and the exact scan
over groups (:func:`_kda_group_scan_kernel`). Shapes, the math and the launch
contract are in :mod:`kda_engram.kda.chunk`; every stride is explicit and every
shape a constexpr.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .state_dtype import round_state


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    # fp32 operands: "ieee" keeps fp32 accuracy (the default would be tf32 on
    # NVIDIA, and AMD does not offer tf32 on every CDNA). bf16/fp16 operands
    # take the tensor cores with fp32 accumulation either way.
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _walk_chunk(
    c, st, bos, length, row0, i_h, o_k, o_v, o_c,
    qg_ptr, w_ptr, u_ptr, kg_t_ptr, aqk_ptr, decay_ptr, out_ptr, scale,
    st_qg_t, st_qg_h, st_qg_k, st_w_t, st_w_h, st_w_k, st_u_t, st_u_h, st_u_v,
    st_kg_r, st_kg_h, st_kg_k, st_kg_c, st_a_t, st_a_h, st_a_c,
    st_d_r, st_d_h, st_d_k, st_o_t, st_o_h, st_o_v,
    p_ck, ck_on, ck_off, u_on,
    HAS_CKPT: tl.constexpr, C: tl.constexpr, IEEE: tl.constexpr, OUTPUT: tl.constexpr,
    CKPT_BF16: tl.constexpr = False,
):
    """Chunk ``c`` of one (sequence, head, V-tile): writes its output rows and
    returns the state after it (``st[k, v] = S[v, k]``, fp32).

    ``OUTPUT=False`` is pass one of the grouped walk: only the state update
    (no qg/aqk loads, no output, no checkpoint), and ``u_on=False`` reads
    ``u`` as zero, which turns the step into the transfer operator's
    ``S (diag(d) - w^T kg)`` for the operator rows.

    A checkpoint into a bf16 buffer (``CKPT_BF16``) rounds the carried state to
    bf16 (RTNE) at that boundary and walks on from the rounded value, so a prefill
    resumed from the checkpoint continues from exactly the state this walk has."""
    # 64-bit scalar bases, 32-bit tile offsets (C * token stride stays far below
    # 2^31): per-element address math in 64 bits would cost registers the dots need.
    t0 = bos + c * C
    row = row0 + c
    live = (c * C + o_c) < length  # tokens of a partial last chunk past the end
    if OUTPUT:
        qg = tl.load(qg_ptr + t0 * st_qg_t + i_h * st_qg_h + (o_c[:, None] * st_qg_t + o_k[None, :] * st_qg_k),
                     mask=live[:, None], other=0.0)
    w = tl.load(w_ptr + t0 * st_w_t + i_h * st_w_h + (o_c[:, None] * st_w_t + o_k[None, :] * st_w_k),
                mask=live[:, None], other=0.0)
    u = tl.load(u_ptr + t0 * st_u_t + i_h * st_u_h + (o_c[:, None] * st_u_t + o_v[None, :] * st_u_v),
                mask=live[:, None] & u_on, other=0.0)
    if OUTPUT:
        # Masks along the contiguous dim would break vectorised loads, so aqk is read
        # by rows and kg_t whole (both rows lie inside their buffers) and the causal /
        # end-of-chunk masks are applied in registers: whatever the workspace holds
        # above the diagonal or past the chunk's end never reaches a product.
        a = tl.load(aqk_ptr + t0 * st_a_t + i_h * st_a_h + (o_c[:, None] * st_a_t + o_c[None, :] * st_a_c),
                    mask=live[:, None], other=0.0)
        a = tl.where(o_c[None, :] <= o_c[:, None], a, 0.0)
    kg = tl.load(kg_t_ptr + row * st_kg_r + i_h * st_kg_h + (o_k[:, None] * st_kg_k + o_c[None, :] * st_kg_c))
    kg = tl.where(live[None, :], kg, 0.0)
    d = tl.load(decay_ptr + row * st_d_r + i_h * st_d_h + o_k * st_d_k).to(tl.float32)

    # Dots in the operand dtype with fp32 accumulation (bf16 on the GPU, as fla
    # and FlashKDA do); the state itself stays fp32 from chunk to chunk.
    dt = w_ptr.dtype.element_ty
    # The state's chain (sb -> v_new -> st) is the serial part of the walk; the
    # output products hang off it and are issued beside it.
    sb = st.to(dt)
    if OUTPUT:
        o = _mm(qg, sb, None, IEEE)
    v_new = u.to(tl.float32) - _mm(w, sb, None, IEEE)  # [C, BV]
    vb = v_new.to(dt)
    st = _mm(kg, vb, st * d[:, None], IEEE)  # S diag(decay) + v_new^T kg, transposed
    if OUTPUT:
        o = _mm(a, vb, o, IEEE)
        tl.store(out_ptr + t0 * st_o_t + i_h * st_o_h + (o_c[:, None] * st_o_t + o_v[None, :] * st_o_v),
                 (o * scale).to(out_ptr.dtype.element_ty), mask=live[:, None])
        if HAS_CKPT:
            if ck_on & (ck_off == (c + 1) * C):
                st = round_state(st, CKPT_BF16)
                tl.store(p_ck, st.to(p_ck.dtype.element_ty))  # exact: already rounded
    return st


@triton.jit
def _group_span(n_chunks, n_groups, min_len):
    """``(L, G_n)`` of one sequence: chunks per group ``max(ceil(n / G), min_len)``
    and its non-empty groups ``max(ceil(n / L), 1)`` (an empty sequence keeps one
    group, which passes its start state through to the final state).
    Mirrors :func:`kda_engram.kda.groups._group_span`."""
    per = tl.maximum(tl.maximum((n_chunks + n_groups - 1) // n_groups, min_len), 1)
    return per, tl.maximum((n_chunks + per - 1) // per, 1)


@triton.jit
def _sequence_span(cu_ptr, st_cu, i_n, C: tl.constexpr):
    """``(bos, length, n_chunks)`` of sequence ``i_n`` from ``cu_seqlens``: its first
    token (int64), its length (int32: one sequence stays below 2^31 tokens) and its
    chunks of ``C`` tokens. Shared by the walk, pass one and the group scan."""
    bos_raw = tl.load(cu_ptr + i_n * st_cu)
    eos_raw = tl.load(cu_ptr + (i_n + 1) * st_cu)
    bos = bos_raw.to(tl.int64)
    length = (eos_raw - bos_raw).to(tl.int32)
    n_chunks = (length + C - 1) // C
    return bos, length, n_chunks


@triton.jit
def _load_start_state(s_in_ptr, s_idx_ptr, has_init_ptr, i_n, i_h, o_k, o_v, full,
                      st_in_r, st_in_h, st_in_v, st_in_k, st_idx, st_has,
                      LOAD_STATE: tl.constexpr, K: tl.constexpr, BV: tl.constexpr):
    """The ``[K, BV]`` fp32 start tile (transposed, ``st[k, v] = S[v, k]``) of
    sequence ``i_n``, head ``i_h``: zeros (``LOAD_STATE`` 0), row ``i_n`` of
    ``initial_state`` (1) or cache row ``state_indices[i_n]`` where
    ``has_initial_state`` (2; a negative row or no initial state reads nothing,
    so garbage/NaN there is harmless). Shared by the walk and the group scan."""
    st = tl.zeros([K, BV], dtype=tl.float32)
    if LOAD_STATE == 1:
        p_in = s_in_ptr + i_n.to(tl.int64) * st_in_r + i_h * st_in_h + (o_v[None, :] * st_in_v + o_k[:, None] * st_in_k)
        st = tl.load(p_in).to(tl.float32)
    elif LOAD_STATE == 2:
        slot = tl.load(s_idx_ptr + i_n * st_idx).to(tl.int64)
        has = tl.load(has_init_ptr + i_n * st_has) != 0
        p_in = s_in_ptr + slot * st_in_r + i_h * st_in_h + (o_v[None, :] * st_in_v + o_k[:, None] * st_in_k)
        st = tl.load(p_in, mask=full & has & (slot >= 0), other=0.0).to(tl.float32)
    return st


@triton.jit
def _kda_chunk_walk_kernel(
    qg_ptr, w_ptr, u_ptr, kg_t_ptr, aqk_ptr, decay_ptr, out_ptr,
    cu_ptr, chunk_off_ptr,
    s_in_ptr, s_out_ptr, s_idx_ptr, has_init_ptr,
    ck_ptr, ck_off_ptr, ck_idx_ptr,
    scale, n_groups, min_len,
    st_qg_t, st_qg_h, st_qg_k,
    st_w_t, st_w_h, st_w_k,
    st_u_t, st_u_h, st_u_v,
    st_kg_r, st_kg_h, st_kg_k, st_kg_c,
    st_a_t, st_a_h, st_a_c,
    st_d_r, st_d_h, st_d_k,
    st_o_t, st_o_h, st_o_v,
    st_in_r, st_in_g, st_in_h, st_in_v, st_in_k,
    st_out_r, st_out_h, st_out_v, st_out_k,
    st_ck_r, st_ck_h, st_ck_v, st_ck_k,
    st_cu, st_co, st_idx, st_has, st_cko, st_cki,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    LOAD_STATE: tl.constexpr,  # 0: zeros, 1: initial_state[n], 2: cache[idx[n]] if has_init[n], 3: group start
    STORE_STATE: tl.constexpr,  # 0: none, 1: final_state[n], 2: cache[idx[n]]
    HAS_CKPT: tl.constexpr,
    CKPT_INDEXED: tl.constexpr,
    GROUPED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    CKPT_BF16: tl.constexpr = False,
    OUT_BF16: tl.constexpr = False,
):
    """The walk (``GROUPED=False``: grid ``(V/BV, H, N)``, one program walks a
    whole sequence) or pass two of the grouped walk (``GROUPED=True``: grid
    ``(V/BV, H, N*G)``, program ``n*G + g`` walks group ``g`` of sequence ``n``
    from the scan's start state ``s_in[n, g]`` (``LOAD_STATE=3``); groups past the
    sequence's last do nothing, and only its last group stores the final state).

    States load as fp32 from fp32 or bf16 storage; the final state / cache row is
    rounded to bf16 (RTNE) when ``OUT_BF16`` and a bf16 checkpoint when
    ``CKPT_BF16`` (the walk then carries the rounded state on, see
    :func:`_walk_chunk`; the grouped walk never takes bf16 checkpoints)."""
    # V-tiles of one (sequence, head) are neighbours in launch order, so the
    # operands they all read (qg, w, kg_t, aqk) are served from L2 after the first.
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)  # head strides of a permuted cache can pass 2^31 / H
    if GROUPED:
        i_n = tl.program_id(2) // n_groups
        i_g = tl.program_id(2) % n_groups
    else:
        i_n = tl.program_id(2)

    bos, length, n_chunks = _sequence_span(cu_ptr, st_cu, i_n, C)
    row0 = tl.load(chunk_off_ptr + i_n * st_co).to(tl.int64)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    full = (o_k[:, None] < K) & (o_v[None, :] < V)

    c_begin = 0
    c_end = n_chunks
    if GROUPED:
        per, n_live = _group_span(n_chunks, n_groups, min_len)
        active = i_g < n_live
        c_begin = tl.minimum(i_g * per, n_chunks)
        c_end = tl.where(active, tl.minimum(c_begin + per, n_chunks), c_begin)  # idle groups walk nothing
        is_last = i_g == n_live - 1

    # The state is held transposed, st[k, v] = S[v, k]: every product below is
    # then a plain [M, K] @ [K, N] dot, with no transpose in memory or registers.
    st = _load_start_state(s_in_ptr, s_idx_ptr, has_init_ptr, i_n, i_h, o_k, o_v, full,
                           st_in_r, st_in_h, st_in_v, st_in_k, st_idx, st_has, LOAD_STATE, K, BV)
    if LOAD_STATE == 3:
        # The scan wrote the start state of every live group of the sequence.
        p_in = (s_in_ptr + i_n.to(tl.int64) * st_in_r + i_g.to(tl.int64) * st_in_g + i_h * st_in_h
                + (o_v[None, :] * st_in_v + o_k[:, None] * st_in_k))
        st = tl.load(p_in, mask=full & active, other=0.0).to(tl.float32)

    # Placeholders when no checkpoints are taken (never dereferenced).
    p_ck = ck_ptr
    ck_on = i_n < 0
    ck_off = i_n.to(tl.int64) * 0
    if HAS_CKPT:
        ck_off = tl.load(ck_off_ptr + i_n * st_cko).to(tl.int64)
        if CKPT_INDEXED:
            ck_row = tl.load(ck_idx_ptr + i_n * st_cki).to(tl.int64)
        else:
            ck_row = i_n.to(tl.int64)
        # Only an exactly placeable snapshot is written: a positive multiple of
        # C inside the sequence, with a real destination row. In the grouped walk
        # the group whose range holds the offset's chunk writes it.
        ck_on = (ck_off > 0) & (ck_off % C == 0) & (ck_off <= length) & (ck_row >= 0)
        p_ck = ck_ptr + ck_row * st_ck_r + i_h * st_ck_h + (o_v[None, :] * st_ck_v + o_k[:, None] * st_ck_k)

    # The interpreter (CPU tests) cannot run a `for` over a loaded bound with
    # NumPy >= 2 (it converts the 1-element scalar with int()); compiled code
    # takes the `for`, which Triton software-pipelines when num_stages >= 2 (the
    # next chunk's operand loads do not depend on the state). The compiled
    # `while` gave wrong results on the H200 (Triton 3.6): never use it there.
    if INTERPRET:
        c = c_begin
        while c < c_end:
            st = _walk_chunk(c, st, bos, length, row0, i_h, o_k, o_v, o_c,
                             qg_ptr, w_ptr, u_ptr, kg_t_ptr, aqk_ptr, decay_ptr, out_ptr, scale,
                             st_qg_t, st_qg_h, st_qg_k, st_w_t, st_w_h, st_w_k, st_u_t, st_u_h, st_u_v,
                             st_kg_r, st_kg_h, st_kg_k, st_kg_c, st_a_t, st_a_h, st_a_c,
                             st_d_r, st_d_h, st_d_k, st_o_t, st_o_h, st_o_v,
                             p_ck, ck_on, ck_off, True, HAS_CKPT, C, IEEE, True, CKPT_BF16)
            c += 1
    else:
        for c in range(c_begin, c_end):
            st = _walk_chunk(c, st, bos, length, row0, i_h, o_k, o_v, o_c,
                             qg_ptr, w_ptr, u_ptr, kg_t_ptr, aqk_ptr, decay_ptr, out_ptr, scale,
                             st_qg_t, st_qg_h, st_qg_k, st_w_t, st_w_h, st_w_k, st_u_t, st_u_h, st_u_v,
                             st_kg_r, st_kg_h, st_kg_k, st_kg_c, st_a_t, st_a_h, st_a_c,
                             st_d_r, st_d_h, st_d_k, st_o_t, st_o_h, st_o_v,
                             p_ck, ck_on, ck_off, True, HAS_CKPT, C, IEEE, True, CKPT_BF16)

    if GROUPED:
        store_mask = full & is_last
    else:
        store_mask = full
    st = round_state(st, OUT_BF16)  # RTNE once; the cast below is then exact
    if STORE_STATE == 1:
        p_out = s_out_ptr + i_n.to(tl.int64) * st_out_r + i_h * st_out_h + (o_v[None, :] * st_out_v + o_k[:, None] * st_out_k)
        if GROUPED:
            tl.store(p_out, st.to(s_out_ptr.dtype.element_ty), mask=store_mask)
        else:
            tl.store(p_out, st.to(s_out_ptr.dtype.element_ty))
    elif STORE_STATE == 2:
        slot_out = tl.load(s_idx_ptr + i_n * st_idx).to(tl.int64)
        p_out = s_out_ptr + slot_out * st_out_r + i_h * st_out_h + (o_v[None, :] * st_out_v + o_k[:, None] * st_out_k)
        tl.store(p_out, st.to(s_out_ptr.dtype.element_ty), mask=store_mask & (slot_out >= 0))


@triton.jit
def _kda_group_pass_one_kernel(
    w_ptr, u_ptr, kg_t_ptr, decay_ptr,
    cu_ptr, chunk_off_ptr, h_ptr, m_ptr,
    n_groups, min_len,
    st_w_t, st_w_h, st_w_k,
    st_u_t, st_u_h, st_u_v,
    st_kg_r, st_kg_h, st_kg_k, st_kg_c,
    st_d_r, st_d_h, st_d_k,
    st_h_n, st_h_g, st_h_h, st_h_v, st_h_k,
    st_m_n, st_m_g, st_m_h, st_m_j, st_m_k,
    st_cu, st_co,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Pass one: grid ``((V + K) / BV, H, N * (G - 1))``; program ``n*(G-1) + g``
    walks group ``g`` of sequence ``n`` from a zero state. Row tiles below ``V``
    are state rows (``H_g``, the ordinary walk with ``u``); the rest are operator
    rows (``M_g``, the same step with ``u = 0`` from the identity), so both come
    out of one step function. The sequence's last live group and the groups past
    it do nothing (nothing consumes their ``H``/``M``)."""
    i_r = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.program_id(2) // (n_groups - 1)
    i_g = tl.program_id(2) % (n_groups - 1)

    bos, length, n_chunks = _sequence_span(cu_ptr, st_cu, i_n, C)
    row0 = tl.load(chunk_off_ptr + i_n * st_co).to(tl.int64)
    per, n_live = _group_span(n_chunks, n_groups, min_len)
    active = i_g < n_live - 1
    c_begin = tl.minimum(i_g * per, n_chunks)
    c_end = tl.where(active, tl.minimum(c_begin + per, n_chunks), c_begin)

    o_k = tl.arange(0, K)
    o_r = i_r * BV + tl.arange(0, BV)  # rows of the [V + K, K] stack (H_g on top of M_g)
    o_c = tl.arange(0, C)
    is_m = i_r * BV >= V  # a tile is all state rows or all operator rows (BV divides V)
    o_j = o_r - V  # operator row index (meaningful where is_m)
    # st[k, r]: zeros for the state rows, the identity (st[k, j] = [k == j]) for M.
    st = tl.where((o_k[:, None] == o_j[None, :]) & is_m, 1.0, 0.0).to(tl.float32)

    if INTERPRET:
        c = c_begin
        while c < c_end:
            st = _walk_chunk(c, st, bos, length, row0, i_h, o_k, o_r, o_c,
                             w_ptr, w_ptr, u_ptr, kg_t_ptr, w_ptr, decay_ptr, w_ptr, 1.0,
                             st_w_t, st_w_h, st_w_k, st_w_t, st_w_h, st_w_k, st_u_t, st_u_h, st_u_v,
                             st_kg_r, st_kg_h, st_kg_k, st_kg_c, st_w_t, st_w_h, st_w_k,
                             st_d_r, st_d_h, st_d_k, st_u_t, st_u_h, st_u_v,
                             w_ptr, False, 0, ~is_m, False, C, IEEE, False)
            c += 1
    else:
        for c in range(c_begin, c_end):
            st = _walk_chunk(c, st, bos, length, row0, i_h, o_k, o_r, o_c,
                             w_ptr, w_ptr, u_ptr, kg_t_ptr, w_ptr, decay_ptr, w_ptr, 1.0,
                             st_w_t, st_w_h, st_w_k, st_w_t, st_w_h, st_w_k, st_u_t, st_u_h, st_u_v,
                             st_kg_r, st_kg_h, st_kg_k, st_kg_c, st_w_t, st_w_h, st_w_k,
                             st_d_r, st_d_h, st_d_k, st_u_t, st_u_h, st_u_v,
                             w_ptr, False, 0, ~is_m, False, C, IEEE, False)

    full = (o_k[:, None] < K) & (o_r[None, :] < V + K) & active
    base_h = h_ptr + i_n.to(tl.int64) * st_h_n + i_g.to(tl.int64) * st_h_g + i_h * st_h_h
    tl.store(base_h + (o_r[None, :] * st_h_v + o_k[:, None] * st_h_k), st, mask=full & ~is_m)
    base_m = m_ptr + i_n.to(tl.int64) * st_m_n + i_g.to(tl.int64) * st_m_g + i_h * st_m_h
    tl.store(base_m + (o_j[None, :] * st_m_j + o_k[:, None] * st_m_k), st, mask=full & is_m)  # M[j, k] = st[k, j]


@triton.jit
def _scan_step(g, st, base_s, base_h, base_m, tile_s, o_k, o_v, o_b,
               st_s_g, st_s_v, st_s_k, st_h_g, st_m_g, st_m_j, st_m_k, K: tl.constexpr, BJ: tl.constexpr,
               PRECISION: tl.constexpr):
    """Store ``S_g`` (transposed tile ``st``) and return ``S_{g+1} = S_g M_g + H_g``
    (transposed: ``M_g^T st + H_g^T``), fp32 products at ``PRECISION``."""
    p_s = base_s + g * st_s_g
    tl.store(p_s + tile_s, st)
    tl.debug_barrier()  # the rows read back below were stored by other threads of this program
    acc = tl.load(base_h + g * st_h_g)
    p_m = base_m + g * st_m_g
    for jb in range(0, K // BJ):  # a loop, not unrolled: one block live at a time
        o_j = jb * BJ + o_b
        s_blk = tl.load(p_s + (o_v[None, :] * st_s_v + o_j[:, None] * st_s_k))  # [BJ, BV]: st[j, v]
        m_blk = tl.load(p_m + (o_j[None, :] * st_m_j + o_k[:, None] * st_m_k))  # [K, BJ]: M[j, k]
        acc = tl.dot(m_blk, s_blk, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _kda_group_scan_kernel(
    cu_ptr, s_in_ptr, s_idx_ptr, has_init_ptr, h_ptr, m_ptr, s_ptr,
    n_groups, min_len,
    st_in_r, st_in_h, st_in_v, st_in_k,
    st_h_n, st_h_g, st_h_h, st_h_v, st_h_k,
    st_m_n, st_m_g, st_m_h, st_m_j, st_m_k,
    st_s_n, st_s_g, st_s_h, st_s_v, st_s_k,
    st_cu, st_idx, st_has,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    BJ: tl.constexpr,
    C: tl.constexpr,
    LOAD_STATE: tl.constexpr,  # 0: zeros, 1: initial_state[n], 2: cache[idx[n]] if has_init[n]
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The scan over groups: grid ``(V / BV, H, N)``. Reads the sequence's
    initial state (the only kernel of the grouped walk that does: with the
    in-place state cache, pass two's last group writes the row this read comes
    from, and launch order puts this read first), then
    ``S_{g+1} = S_g M_g + H_g`` with an fp32 state (the scan carries it across
    the whole sequence; products at ``PRECISION``, see ``launch_config.scan_precision_for``),
    writing every live group's start state."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.program_id(2)

    bos, length, n_chunks = _sequence_span(cu_ptr, st_cu, i_n, C)
    per, n_live = _group_span(n_chunks, n_groups, min_len)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    full = (o_k[:, None] < K) & (o_v[None, :] < V)
    st = _load_start_state(s_in_ptr, s_idx_ptr, has_init_ptr, i_n, i_h, o_k, o_v, full,
                           st_in_r, st_in_h, st_in_v, st_in_k, st_idx, st_has, LOAD_STATE, K, BV)

    # The product runs in BJ-row blocks of the contraction, with both factors
    # read from memory: S_g is the tile this program has just stored (a CTA
    # barrier makes it visible to every thread) and M_g^T a [K, BJ] column block
    # (mt[k, j] = M[j, k]). A whole-tile fp32 product would hold M's 64 KiB
    # replicated across threads (the FMA dot layout) and spill to local memory.
    o_b = tl.arange(0, BJ)
    tile_s = o_v[None, :] * st_s_v + o_k[:, None] * st_s_k  # st[k, v] = S[v, k]
    base_s = s_ptr + i_n.to(tl.int64) * st_s_n + i_h * st_s_h
    base_h = h_ptr + i_n.to(tl.int64) * st_h_n + i_h * st_h_h + (o_v[None, :] * st_h_v + o_k[:, None] * st_h_k)
    base_m = m_ptr + i_n.to(tl.int64) * st_m_n + i_h * st_m_h
    if INTERPRET:
        g = 0
        while g < n_live - 1:
            st = _scan_step(g, st, base_s, base_h, base_m, tile_s, o_k, o_v, o_b,
                            st_s_g, st_s_v, st_s_k, st_h_g, st_m_g, st_m_j, st_m_k, K, BJ, PRECISION)
            g += 1
    else:
        for g in range(0, n_live - 1):
            st = _scan_step(g, st, base_s, base_h, base_m, tile_s, o_k, o_v, o_b,
                            st_s_g, st_s_v, st_s_k, st_h_g, st_m_g, st_m_j, st_m_k, K, BJ, PRECISION)
    tl.store(base_s + (n_live - 1).to(tl.int64) * st_s_g + tile_s, st)
