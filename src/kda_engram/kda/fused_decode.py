"""One launch for the KDA layer's decode rows: projection bands in, ``o_proj`` input out.

Per token of each decode sequence, per head ``h`` (what the layer's multi-launch
decode step does with the conv step, :func:`~kda_engram.kda.decode.kda_decode`
and the PyTorch output gate)::

    q, k, v = SiLU(conv4(window, x))            depthwise width-4 causal conv
    q̂, k̂ = L2 norms;  β = sigmoid(raw_beta);  a = gate(raw_g + dt_bias)
    S' = S·diag(exp a);  δ = β (v − S' k̂);  S = S' + δ k̂ᵀ;  o = scale · S q̂
    y = RMSNorm(o) · o_norm_weight · sigmoid(g_out)           (per head, over V)

Machine fit. One program owns one (sequence, head): all of its conv channels
(``q``/``k``/``v`` bands of head ``h``), its state (walked in ``BLOCK_V``-row
tiles, each loaded once, stepped through the ``S`` tokens in registers and
stored after every token) and its output row. Owning the whole head is what
makes the conv window update and the RMSNorm over ``V`` race-free inside one
launch: no other program reads those channels or that row. The 128-wide
``q``/``k`` conv + norms are recomputed per tile from L1/L2 (cheap next to the
state's bytes). The output is first written un-normalised in ``out``'s dtype
(exactly the rounding the unfused path applies before its RMSNorm), read back
after a CTA barrier and normalised in place.

Speculative decoding: ``S`` tokens per sequence; the state after token ``s`` is
written to row ``state_indices[b, s]`` and the conv window after token ``s`` to
conv row ``conv_state_indices[b, s]``; the walk starts from
``initial_state_indices[b]`` / ``initial_conv_indices[b]``. A negative initial
state row is a padding sequence: nothing of the state is read or written and
its outputs are zero. A negative conv row is a zero window (not written).

State cache fp32 or bf16 (:mod:`kda_engram.kda.state_dtype`): fp32 on chip,
rounded to bf16 with RTNE once per store. Inputs are strided views (the bands of
the fused projection, or the low-rank up projections' outputs); nothing is
copied; nothing is allocated except ``out`` when not given. With
``check_inputs=False`` there is no host synchronisation (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import CONV_WIDTH, L2NORM_EPS
from ..launch_config import check_block_override, check_warps_override, device_arch, fused_decode_tiling_for
from ..platform import interpreting
from ..validation.entry import EntryChecks
from ..validation.kda_decode import check_fused_decode_arguments
from .decode import _l2_normalize
from .gate import dt_bias_strides, gate_form, gate_operands, log_decay
from .state_dtype import round_state

__all__ = ["kda_layer_decode_step", "CONV_WIDTH"]


@triton.jit
def _raw(x_ptr, cs_ptr, b, crow, clive, chans, t: tl.constexpr, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w):
    """Raw conv input of ``chans`` at launch-relative time ``t`` (fp32): token ``t``
    of the projection, or slot ``t + 3`` of the initial window when ``t < 0``."""
    if t < 0:
        v = tl.load(cs_ptr + crow * scs_n + chans * scs_c + (t + 3) * scs_w, mask=(chans >= 0) & clive, other=0.0)
    else:
        v = tl.load(x_ptr + b * sx_b + t * sx_s + chans * sx_c)
    return v.to(tl.float32)


@triton.jit
def _conv_silu(x_ptr, cs_ptr, cw_ptr, b, crow, clive, chans, s: tl.constexpr,
               sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w):
    """SiLU(sum_j w[c, j] x[c, s - 3 + j]) for token ``s`` (tap 3 is the token itself)."""
    acc = tl.load(cw_ptr + chans * scw_c).to(tl.float32) * _raw(
        x_ptr, cs_ptr, b, crow, clive, chans, s - 3, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w)
    for j in tl.static_range(1, 4):
        acc += tl.load(cw_ptr + chans * scw_c + j * scw_w).to(tl.float32) * _raw(
            x_ptr, cs_ptr, b, crow, clive, chans, s - 3 + j, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w)
    return acc * tl.sigmoid(acc)


@triton.jit
def _window_value(x_ptr, b, chans, t: tl.constexpr, old0, old1, old2, sx_b, sx_s, sx_c):
    """Raw input at launch-relative time ``t``: a held slot of the initial window
    (``t`` in -3..-1) or token ``t`` of the projection."""
    if t == -3:
        return old0
    elif t == -2:
        return old1
    elif t == -1:
        return old2
    else:
        return tl.load(x_ptr + b * sx_b + t * sx_s + chans * sx_c)


@triton.jit
def _store_window(x_ptr, cs_ptr, b, crow_new, chans, s: tl.constexpr, old0, old1, old2,
                  sx_b, sx_s, sx_c, scs_n, scs_c, scs_w):
    """Write the window after token ``s`` (raw inputs of times s-2, s-1, s, oldest
    first) to conv row ``crow_new``; times before the launch come from the
    initial window held in registers (``old0..2`` = its slots 0..2)."""
    base = cs_ptr + crow_new * scs_n + chans * scs_c
    for j in tl.static_range(3):
        val = _window_value(x_ptr, b, chans, s - 2 + j, old0, old1, old2, sx_b, sx_s, sx_c)
        tl.store(base + j * scs_w, val.to(cs_ptr.dtype.element_ty))


@triton.jit
def _token_qk(x_ptr, cs_ptr, cw_ptr, g_ptr, beta_ptr, b, h, crow, clive, q_ch, k_ch, offs_k, bias, a_scale,
              lower_bound, s: tl.constexpr, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w, sg_b, sg_s, sg_c,
              sb_b, sb_s, sb_h, K: tl.constexpr, GATE: tl.constexpr, EPS: tl.constexpr):
    """Token ``s`` of a head: L2-normed q and k after the conv, the per-channel
    decay exp(a), beta and q·k (all fp32)."""
    q = _conv_silu(x_ptr, cs_ptr, cw_ptr, b, crow, clive, q_ch, s,
                   sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w)
    k = _conv_silu(x_ptr, cs_ptr, cw_ptr, b, crow, clive, k_ch, s,
                   sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w)
    q = _l2_normalize(q, EPS)
    k = _l2_normalize(k, EPS)
    g = tl.load(g_ptr + b * sg_b + s * sg_s + (h * K + offs_k) * sg_c).to(tl.float32)
    beta = tl.sigmoid(tl.load(beta_ptr + b * sb_b + s * sb_s + h * sb_h).to(tl.float32))
    a = log_decay(g, bias, a_scale, lower_bound, GATE)
    return q, k, tl.exp(a), beta, tl.sum(k * q, axis=0)


@triton.jit
def _fused_kda_decode_kernel(
    x_ptr, cw_ptr, cs_ptr, cinit_ptr, cidx_ptr,
    g_ptr, beta_ptr, gout_ptr, alog_ptr, dtb_ptr, nw_ptr,
    state_ptr, init_ptr, idx_ptr, out_ptr,
    scale, lower_bound, norm_eps,
    sx_b, sx_s, sx_c,
    scw_c, scw_w,
    scs_n, scs_c, scs_w,
    sci_b, scx_b, scx_s,
    sg_b, sg_s, sg_c,
    sb_b, sb_s, sb_h,
    sgo_b, sgo_s, sgo_c,
    sa_h, sd_h, sd_k, snw,
    ss_n, ss_h, ss_v, ss_k,
    si_b, sw_b, sw_s,
    so_b, so_s, so_c,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GATE: tl.constexpr,
    EPS: tl.constexpr,
    STATE_BF16: tl.constexpr,
    NATIVE_ROUND: tl.constexpr,
):
    """Grid ``(B · H,)``, head fastest: program ``b·H + h`` runs head ``h`` of sequence ``b``."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // H).to(tl.int64)
    offs_k = tl.arange(0, K)
    q_ch = h * K + offs_k
    k_ch = H * K + h * K + offs_k

    init_row = tl.load(init_ptr + b * si_b).to(tl.int64)
    live = init_row >= 0
    srow = tl.where(live, init_row, 0)
    crow0 = tl.load(cinit_ptr + b * sci_b).to(tl.int64)
    clive = crow0 >= 0
    crow = tl.where(clive, crow0, 0)

    a_scale, bias = gate_operands(alog_ptr, sa_h, dtb_ptr, sd_h, sd_k, h, offs_k, GATE)
    state_h = state_ptr + h * ss_h

    NUM_TILES: tl.constexpr = V // BLOCK_V
    # A one-token step's q, k, decay and beta do not depend on the tile: once here.
    if S == 1:
        q1, k1, decay1, beta1, qk1 = _token_qk(
            x_ptr, cs_ptr, cw_ptr, g_ptr, beta_ptr, b, h, crow, clive, q_ch, k_ch, offs_k, bias, a_scale,
            lower_bound, 0, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w, sg_b, sg_s, sg_c, sb_b, sb_s, sb_h,
            K, GATE, EPS)
    # The state tiles stream through one register double buffer: tile t + 1's load
    # is in flight while tile t is stepped (one program walks all V rows).
    rows = tl.arange(0, BLOCK_V)
    tile_offs = rows[:, None] * ss_v + offs_k[None, :] * ss_k
    tile_in = (rows[:, None] < BLOCK_V) & (offs_k[None, :] < K)  # all true; gives the mask its shape
    state_row = state_h + srow * ss_n
    st_next = tl.load(state_row + tile_offs, mask=tile_in & live, other=0.0)
    for tile in range(NUM_TILES):
        st = st_next.to(tl.float32)
        st_next = tl.load(state_row + (tile + 1) * BLOCK_V * ss_v + tile_offs,
                          mask=tile_in & live & (tile + 1 < NUM_TILES), other=0.0)
        offs_v = tile * BLOCK_V + rows
        v_ch = 2 * H * K + h * V + offs_v
        for s in tl.static_range(S):
            if S == 1:
                q, k, decay, beta, qk = q1, k1, decay1, beta1, qk1
            else:
                q, k, decay, beta, qk = _token_qk(
                    x_ptr, cs_ptr, cw_ptr, g_ptr, beta_ptr, b, h, crow, clive, q_ch, k_ch, offs_k, bias, a_scale,
                    lower_bound, s, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w, sg_b, sg_s, sg_c,
                    sb_b, sb_s, sb_h, K, GATE, EPS)
            vv = _conv_silu(x_ptr, cs_ptr, cw_ptr, b, crow, clive, v_ch, s,
                            sx_b, sx_s, sx_c, scs_n, scs_c, scs_w, scw_c, scw_w)
            st = st * decay[None, :]  # fp32 decay before any rounding
            pred = tl.sum(st * k[None, :], axis=1)
            sq = tl.sum(st * q[None, :], axis=1)
            delta = beta * (vv - pred)
            st = st + delta[:, None] * k[None, :]
            st = round_state(st, STATE_BF16, NATIVE_ROUND)
            o = scale * (sq + delta * qk)
            o = tl.where(live, o, 0.0)
            # Un-normalised, in out's dtype (the unfused path's rounding before its norm).
            tl.store(out_ptr + b * so_b + s * so_s + (h * V + offs_v) * so_c, o.to(out_ptr.dtype.element_ty))
            out_row = tl.load(idx_ptr + b * sw_b + s * sw_s).to(tl.int64)
            write = live & (out_row >= 0)
            tl.store(state_h + tl.where(write, out_row, 0) * ss_n + tile * BLOCK_V * ss_v + tile_offs,
                     st.to(state_ptr.dtype.element_ty), mask=tile_in & write)

    # The initial conv window of this head's channels, held before any write.
    offs_vf = tl.arange(0, V)
    v_chf = 2 * H * K + h * V + offs_vf
    oq0 = tl.load(cs_ptr + crow * scs_n + q_ch * scs_c, mask=(q_ch >= 0) & clive, other=0.0)
    oq1 = tl.load(cs_ptr + crow * scs_n + q_ch * scs_c + scs_w, mask=(q_ch >= 0) & clive, other=0.0)
    oq2 = tl.load(cs_ptr + crow * scs_n + q_ch * scs_c + 2 * scs_w, mask=(q_ch >= 0) & clive, other=0.0)
    ok0 = tl.load(cs_ptr + crow * scs_n + k_ch * scs_c, mask=(k_ch >= 0) & clive, other=0.0)
    ok1 = tl.load(cs_ptr + crow * scs_n + k_ch * scs_c + scs_w, mask=(k_ch >= 0) & clive, other=0.0)
    ok2 = tl.load(cs_ptr + crow * scs_n + k_ch * scs_c + 2 * scs_w, mask=(k_ch >= 0) & clive, other=0.0)
    ov0 = tl.load(cs_ptr + crow * scs_n + v_chf * scs_c, mask=(v_chf >= 0) & clive, other=0.0)
    ov1 = tl.load(cs_ptr + crow * scs_n + v_chf * scs_c + scs_w, mask=(v_chf >= 0) & clive, other=0.0)
    ov2 = tl.load(cs_ptr + crow * scs_n + v_chf * scs_c + 2 * scs_w, mask=(v_chf >= 0) & clive, other=0.0)
    # Every thread's output stores and window reads complete before the read-back
    # of the output row and the window writes below (other threads' elements).
    tl.debug_barrier()

    nw = tl.load(nw_ptr + offs_vf * snw).to(tl.float32)
    for s in tl.static_range(S):
        p_o = out_ptr + b * so_b + s * so_s + (h * V + offs_vf) * so_c
        o = tl.load(p_o).to(tl.float32)
        go = tl.load(gout_ptr + b * sgo_b + s * sgo_s + (h * V + offs_vf) * sgo_c).to(tl.float32)
        y = o / tl.sqrt(tl.sum(o * o, axis=0) / V + norm_eps)
        y = y * nw * tl.sigmoid(go)
        tl.store(p_o, y.to(out_ptr.dtype.element_ty))

        crow_new = tl.load(cidx_ptr + b * scx_b + s * scx_s).to(tl.int64)
        if crow_new >= 0:
            _store_window(x_ptr, cs_ptr, b, crow_new, q_ch, s, oq0, oq1, oq2, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w)
            _store_window(x_ptr, cs_ptr, b, crow_new, k_ch, s, ok0, ok1, ok2, sx_b, sx_s, sx_c, scs_n, scs_c, scs_w)
            _store_window(x_ptr, cs_ptr, b, crow_new, v_chf, s, ov0, ov1, ov2, sx_b, sx_s, sx_c, scs_n, scs_c,
                          scs_w)


def _lead(t: torch.Tensor, multi: bool):
    """``[B, S, X]`` strides of a ``[B, X]`` (S = 1) or ``[B, S, X]`` tensor."""
    return tuple(t.stride()) if multi else (t.stride(0), 0, t.stride(1))


def kda_layer_decode_step(
    x: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    g_out: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    conv_state_indices: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor,
    state_cache: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    initial_state_indices: torch.Tensor | None = None,
    initial_conv_indices: torch.Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = None,
    norm_eps: float = 1e-5,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """The KDA layer's decode step for ``B`` sequences of ``S`` tokens, one launch.

    Shapes (``H`` heads, ``K = V`` head dim, ``C = 2HK + HV``); one token per
    sequence drops the ``S`` dim everywhere (``x [B, C]``, ``state_indices [B]``):

    * ``x [B, S, C]``: the raw ``q | k | v`` bands of the projection (pre-conv).
    * ``raw_g [B, S, H K]``, ``raw_beta [B, S, H]``, ``g_out [B, S, H V]``: gate,
      beta and output-gate inputs (bands of the projection or the low-rank up
      projections' outputs); any strides, never copied.
    * ``conv_weight [C, 4]``; ``conv_state [slots, C, 3]`` (raw inputs, oldest
      first), the window after token ``s`` written to row
      ``conv_state_indices[b, s]``; the walk reads ``initial_conv_indices[b]``
      (default ``conv_state_indices[:, 0]``). Negative: zero window / not written.
    * ``A_log [H]``, ``dt_bias [H K]`` or ``[H, K]``, ``o_norm_weight [V]``.
    * ``state_cache [slots, H, V, K]`` fp32 or bf16, in place; the state after token
      ``s`` goes to ``state_indices[b, s]``, the walk starts at
      ``initial_state_indices[b]`` (default ``state_indices[:, 0]``); negative
      initial row = padding sequence (outputs zero, no state row touched).
    * ``out [B, S, H V]`` (default: new, of dtype ``out_dtype``, else ``x``'s): the
      input of ``o_proj``, ``RMSNorm(o) · o_norm_weight · sigmoid(g_out)`` per head.
      ``out_dtype`` names the dtype of a new ``out`` so that the op, which cannot
      take a caller's buffer, still gives the layer its model dtype.

    * ``block_v``, ``num_warps``: the state tile walked per step (a power of two
      dividing ``V``) and the warps (a power of two in ``[1, 32]``); default
      :func:`kda_engram.launch_config.fused_decode_tiling_for`. Any accepted value
      changes only speed; another is refused (``ValueError`` naming it).

    ``check_inputs`` validates every argument with one device read-back after
    the launch, which a broken rule turns into a no-op on both caches
    (:func:`kda_engram.validation.kda_decode.check_fused_decode_arguments`); ``False``
    skips it (CUDA-graph capturable). Rows written in one call
    must be distinct, and no sequence may start from a row another one writes.
    """
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        check_fused_decode_arguments(
            checks, x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias,
            o_norm_weight, state_cache, state_indices, initial_state_indices, initial_conv_indices, scale,
            lower_bound, norm_eps, out, out_dtype=out_dtype)
    if x.shape[0] > 0 and (x.dim() == 2 or x.shape[1] > 0):  # no token launches nothing: no guard needed
        # Launch, then read back: a broken rule makes every row "none", so the launch
        # touches neither cache. The default initial rows are views of the guarded
        # ones (derived in the runner).
        state_indices, conv_state_indices, initial_state_indices, initial_conv_indices = checks.guard_many(
            (state_indices, -1), (conv_state_indices, -1), (initial_state_indices, -1), (initial_conv_indices, -1))
    out = run_kda_layer_decode_step(
        x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias, o_norm_weight,
        state_cache, state_indices, initial_state_indices=initial_state_indices,
        initial_conv_indices=initial_conv_indices, scale=scale, lower_bound=lower_bound, norm_eps=norm_eps, out=out,
        out_dtype=out_dtype, block_v=block_v, num_warps=num_warps)
    checks.run()  # the verdict, after the launch (deferred by default: validation.entry)
    return out


def run_kda_layer_decode_step(x, raw_g, raw_beta, g_out, conv_weight, conv_state, conv_state_indices, A_log, dt_bias,
                              o_norm_weight, state_cache, state_indices, *, initial_state_indices=None,
                              initial_conv_indices=None, scale=None, lower_bound=None, norm_eps=1e-5, out=None,
                              out_dtype=None, block_v=None, num_warps=None) -> torch.Tensor:
    """:func:`kda_layer_decode_step`'s launch without any rule: the caller has run
    them (and guarded the indices); the eager body of its op
    (:mod:`kda_engram.ops.kda`). No token launches nothing."""
    multi = x.dim() == 3
    _, H, V, K = state_cache.shape
    check_block_override("block_v", block_v, V, "V")  # a wider tile walked no row (issue 54)
    check_warps_override("num_warps", num_warps)
    if out is None:
        out = torch.empty(*x.shape[:-1], H * V, dtype=out_dtype or x.dtype, device=x.device)
    B = x.shape[0]
    S = x.shape[1] if multi else 1
    if B == 0 or S == 0:
        return out
    if multi:
        init = state_indices[:, 0] if initial_state_indices is None else initial_state_indices
        cinit = conv_state_indices[:, 0] if initial_conv_indices is None else initial_conv_indices
        w_strides = tuple(state_indices.stride())
        cw_strides = tuple(conv_state_indices.stride())
    else:
        init, cinit = state_indices, conv_state_indices
        w_strides = (state_indices.stride(0), 0)
        cw_strides = (conv_state_indices.stride(0), 0)
    if block_v is None or num_warps is None:
        tiling = fused_decode_tiling_for(device_arch(x.device), V, state_cache.dtype)
        block_v = tiling.block_v if block_v is None else block_v
        num_warps = tiling.num_warps if num_warps is None else num_warps
    if scale is None:
        scale = K**-0.5
    sd_h, sd_k = dt_bias_strides(dt_bias, K)
    rb = tuple(raw_beta.stride()) if multi else (raw_beta.stride(0), 0, raw_beta.stride(1))
    _fused_kda_decode_kernel[(B * H,)](
        x, conv_weight, conv_state, cinit, conv_state_indices,
        raw_g, raw_beta, g_out, A_log, dt_bias, o_norm_weight,
        state_cache, init, state_indices, out,
        float(scale), float(lower_bound) if lower_bound is not None else 0.0, float(norm_eps),
        *_lead(x, multi),
        *conv_weight.stride(),
        *conv_state.stride(),
        cinit.stride(0), *cw_strides,
        *_lead(raw_g, multi),
        *rb,
        *_lead(g_out, multi),
        A_log.stride(0), sd_h, sd_k, o_norm_weight.stride(0),
        *state_cache.stride(),
        init.stride(0), *w_strides,
        *_lead(out, multi),
        S=S, H=H, K=K, V=V, BLOCK_V=block_v,
        GATE=gate_form("raw", lower_bound), EPS=L2NORM_EPS,
        STATE_BF16=state_cache.dtype == torch.bfloat16,
        NATIVE_ROUND=not interpreting(),
        num_warps=num_warps,
    )
    return out

