"""KDA fused prologue: two launches from raw ``q, k, v, raw_g, raw_beta`` to the
operands of the chunk kernel (a third, before them, applies the short conv when
``conv_weight`` is given: :func:`~kda_engram.kda.conv.conv_prefill_bands`).

The first launch (``_kda_prologue_intra_kernel``, one program per (chunk row,
head)) takes the L2 norms of ``q`` and ``k``, the gate (:func:`kda_engram.kda.reference.kda_gate`)
and its chunk-local cumsum in log2 units, ``beta = sigmoid(raw_beta)``, and builds
``A_qk`` and ``A_kk`` from 16-row sub-chunk blocks, writing ``qg``, ``kg_t``, ``decay``,
the right-hand sides ``beta k̂ 2^g`` / ``beta v`` into ``w`` / ``u`` and ``A_kk`` into an
fp32 workspace. The second (``_kda_prologue_solve_kernel``, same grid) solves
``w = T (beta k̂ 2^g)``, ``u = T (beta v)`` with ``T = (I + A_kk)^-1`` in place, by
block forward substitution over 16x16 fp32 diagonal inverses. Why two launches:
one program would need far more than the 255 registers a thread may hold.
The kernels are in :mod:`kda_engram.kda.prologue_kernels`; this module launches them.

Operand contract (identical to :func:`kda_engram.kda.reference.naive_chunk_operands`),
with ``g`` the chunk-local inclusive cumsum of ``a * log2(e)``:

====== ============================ ====================================================
key    shape, dtype                 contents
====== ============================ ====================================================
qg     ``[1, T, H, K]``, input      ``q̂_i 2^g_i``; ``scale`` is *not* folded in
w      ``[1, T, H, K]``, input      ``T (beta k̂ 2^g)``
u      ``[1, T, H, V]``, input      ``T (beta v)`` (``v`` after conv + SiLU when on)
kg_t   ``[chunks, H, K, 64]``, in.  ``k̂_i 2^(g_last - g_i)`` transposed, zero past
                                    the chunk's last token
aqk    ``[1, T, H, 64]``, input     ``sum_c q̂_ic k̂_jc 2^(g_ic - g_jc)`` for ``j <= i``
decay  ``[chunks, H, K]``, fp32     ``2^g_last``
====== ============================ ====================================================

Row ``chunk_offsets[n] + c`` of ``kg_t`` / ``decay`` is sequence ``n``'s chunk ``c``;
padding rows and tokens outside every sequence are never written. Numerics
(sub-chunk anchors, so no ``2^(+-g)`` of a whole chunk is formed), precision (bf16
tensor-core operands with fp32 accumulation for bf16 inputs, fp32 IEEE otherwise),
the conv path's state contract and memory ownership: docs/design/kda_prefill.md
("Prologue contract details"). All outputs are new ``torch.empty`` tensors; inputs
are read through their strides and never copied.
"""

from __future__ import annotations

import numbers

import torch
import triton.language as tl

from ..bundles import ConvArgs, KDAInputs
from ..constants import CHUNK_SIZE, SUB_CHUNK
from ..launch_config import prologue_warps_for
from ..platform import arch, interpreting, is_gpu
from ..validation.entry import EntryChecks
from ..validation.kda_inputs import check_input_forms, check_log_decay_values, check_lower_bound
from ..validation.kda_prefill import check_prologue_arguments
from .conv import conv_prefill_bands
from .gate import gate_form, gate_pointers, needs_exact_diagonal, subchunk_span_bound
from .metadata import trusted_chunk_metadata
from .prologue_kernels import _kda_prologue_intra_kernel, _kda_prologue_solve_kernel


def launch_warps(num_warps, dev, K: int, V: int) -> tuple[int, int]:
    """``(intra, solve)`` warps per program from the ``num_warps`` override: None
    for the defaults, one int for both launches, or a pair.

    The defaults are :func:`kda_engram.launch_config.prologue_warps_for`; the sweep
    behind them: docs/design/kda_prefill.md ("Prologue warps").
    """
    if num_warps is None:
        warps = prologue_warps_for(arch(dev) if is_gpu(dev) else "cpu", K, V)  # the per-architecture rule
        return warps.intra, warps.solve
    pair = (num_warps, num_warps) if isinstance(num_warps, numbers.Integral) else num_warps
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in pair)):
        raise TypeError(f"num_warps: expected None, an int or a pair of ints (intra, solve), got {num_warps!r}")
    if any(int(w) not in (1, 2, 4, 8, 16) for w in pair):
        raise ValueError(f"num_warps: expected powers of two in [1, 16], got {num_warps!r}")
    return int(pair[0]), int(pair[1])


def prologue_dot_dtype(q: torch.Tensor):
    """The operand dtype of the prologues' products: bf16 tensor-core operands when
    compiled; fp32 under the interpreter, whose tl.dot is wrong on bf16 operands (the
    CPU path then computes what the GPU does up to the operand rounding)."""
    return tl.bfloat16 if q.dtype == torch.bfloat16 and not interpreting() else tl.float32


def intra_launcher(x: KDAInputs, cu_seqlens, chunk_indices, conv: ConvArgs, *, num_warps):
    """The first launch of both prologues (this module's and the folded one,
    :mod:`kda_engram.kda.hopper.folded_prologue`), with the conv's launch before it when on.
    Returns ``launch(qg, w, u, kg, aqk, decay, akk, folded)``, which launches and
    returns the value band the launch read (the conv's output, or ``v``)."""
    q, k, v, raw_g, raw_beta, A_log, dt_bias = x.q, x.k, x.v, x.raw_g, x.raw_beta, x.A_log, x.dt_bias
    lower_bound, gate, qk_l2norm, beta_sigmoid = x.lower_bound, x.gate, x.qk_l2norm, x.beta_sigmoid
    H, K = q.shape[2], q.shape[3]
    V = v.shape[3]
    bounded = lower_bound is not None
    # Within MAX_ANCHOR_SPAN one shift, half the bounded gate's widest span, centres every
    # diagonal product; past it, and for the unbounded gates, each sub-chunk checks its
    # own span at run time.
    span_check = needs_exact_diagonal(gate, lower_bound)
    shift = 0.0 if span_check else subchunk_span_bound(gate, lower_bound) / 2
    dot_dtype = prologue_dot_dtype(q)

    gate_args = gate_pointers(raw_g, A_log, dt_bias, K, gate)
    grid = (chunk_indices.shape[0] * H,)

    def launch(qg, w, u, kg, aqk, decay, akk, folded):
        qb, kb, vb = q, k, v
        if conv.on:
            # The conv runs as a launch of its own (see kda/conv.py for the measured
            # reason); the rest of the prologue reads its bands like raw inputs.
            qb, kb, vb = conv_prefill_bands(q, k, v, conv.conv_weight, cu_seqlens, chunk_indices, conv.conv_state,
                                            conv.conv_state_indices, conv.conv_has_initial_state)
        _kda_prologue_intra_kernel[grid](
            qb, qb.stride(1), qb.stride(2), qb.stride(3),
            kb, kb.stride(1), kb.stride(2), kb.stride(3),
            vb, vb.stride(1), vb.stride(2), vb.stride(3),
            raw_g, raw_g.stride(1), raw_g.stride(2), raw_g.stride(3),
            raw_beta, raw_beta.stride(1), raw_beta.stride(2),
            *gate_args,
            cu_seqlens, chunk_indices, chunk_indices.stride(0), chunk_indices.stride(1),
            qg, w, u, kg, aqk, decay, akk,
            H, float(lower_bound) if bounded else 0.0, shift, 2.0 ** shift,
            K=K, V=V, BT=CHUNK_SIZE, BS=SUB_CHUNK,
            GATE=gate_form(gate, lower_bound), SPAN_CHECK=span_check,
            DOT=dot_dtype,
            QK_L2NORM=bool(qk_l2norm), BETA_SIGMOID=bool(beta_sigmoid),
            FOLDED=folded, LOAD_V=not folded,
            num_warps=num_warps, num_stages=1,
        )
        return vb

    return launch


def prepare_kda_prologue(x: KDAInputs, cu_seqlens, conv: ConvArgs = ConvArgs(), chunk_indices=None, *,
                         num_warps=None):
    """The host half of :func:`kda_prefill_prologue` (its arguments as bundles,
    assumed valid and guarded): chunk metadata, operand and workspace allocation,
    launch settings. Returns ``launch()``, which makes the launches (the conv's first,
    when on) and returns the operand dict."""
    q, v = x.q, x.v
    _, T, H, K = q.shape
    V = v.shape[3]
    dev = q.device
    if chunk_indices is None:
        chunk_indices = trusted_chunk_metadata(cu_seqlens, T, CHUNK_SIZE)[1]
    num_chunks = chunk_indices.shape[0]
    intra_warps, solve_warps = launch_warps(num_warps, dev, K, V)
    out = dict(
        qg=torch.empty(1, T, H, K, dtype=q.dtype, device=dev),
        w=torch.empty(1, T, H, K, dtype=q.dtype, device=dev),
        u=torch.empty(1, T, H, V, dtype=q.dtype, device=dev),
        kg_t=torch.empty(num_chunks, H, K, CHUNK_SIZE, dtype=q.dtype, device=dev),
        aqk=torch.empty(1, T, H, CHUNK_SIZE, dtype=q.dtype, device=dev),
        decay=torch.empty(num_chunks, H, K, dtype=torch.float32, device=dev),
    )
    if num_chunks == 0 or H == 0:
        return lambda: out

    dot_dtype = prologue_dot_dtype(q)
    launch_intra = intra_launcher(x, cu_seqlens, chunk_indices, conv, num_warps=intra_warps)
    # A_kk (beta-scaled, strictly lower, fp32: the diagonal blocks are inverted
    # in fp32) passes from the first launch to the second through this
    # workspace, [1, T, H, 64] like aqk; only row blocks J <= I are written/read.
    akk = torch.empty(1, T, H, CHUNK_SIZE, dtype=torch.float32, device=dev)
    grid = (num_chunks * H,)

    def launch():
        launch_intra(out["qg"], out["w"], out["u"], out["kg_t"], out["aqk"], out["decay"], akk, folded=False)
        _kda_prologue_solve_kernel[grid](
            cu_seqlens, chunk_indices, chunk_indices.stride(0), chunk_indices.stride(1),
            out["w"], out["u"], akk,
            H,
            K=K, V=V, BT=CHUNK_SIZE, BS=SUB_CHUNK, DOT=dot_dtype,
            num_warps=solve_warps, num_stages=1,
        )
        return out

    return launch


def kda_prefill_prologue(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor,
    conv_weight: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    conv_has_initial_state: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    *,
    check_inputs: bool = True,
    num_warps: int | tuple[int, int] | None = None,
    gate: str = "raw",
    qk_l2norm: bool = True,
    beta_sigmoid: bool = True,
) -> dict[str, torch.Tensor]:
    """Run the whole chunk-path prologue (two launches); returns the chunk kernel's operands.

    Args:
        q, k: ``[1, T, H, K]`` (K = 128 in production; 16/32/64 accepted for tests),
            bf16 in production, fp16/fp32 accepted; any strides (e.g. band views of
            a fused projection). Raw: the L2 norms (and the conv) happen here.
        v: ``[1, T, H, V]``, same dtype.
        raw_g: ``[1, T, H, K]`` raw gate, any float dtype, any strides (a column
            slice of the fused projection is read in place).
        raw_beta: ``[1, T, H]`` raw beta (before the sigmoid), any strides.
        A_log: ``[H]``; dt_bias: ``[H * K]`` or ``[H, K]``.
        scale: the output scale (``K ** -0.5`` usually). Validated, *not* folded
            into ``qg`` / ``aqk``: the chunk kernel applies it to its output, so the
            operands stay independent of it.
        lower_bound: ``None`` for the softplus gate, ``L <= 0`` (e.g. -5) for the
            bounded sigmoid gate ``a = L * sigmoid(exp(A_log) (raw_g + dt_bias))``.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of the varlen batch.
        conv_weight: optional ``[2 H K + H V, 4]`` depthwise conv weight (see the
            module docstring for the layout); turns the conv + SiLU on.
        conv_state: optional ``[slots, 2 H K + H V, 3]`` conv windows, updated in place.
        conv_state_indices: int ``[N]`` row of each sequence (negative: none).
        conv_has_initial_state: bool ``[N]``; None means no sequence reads its row.
        chunk_indices: ``[chunks, 2]`` (sequence id, chunk index) from
            :func:`~kda_engram.kda.metadata.prepare_chunk_indices`; built here
            (on the device, no sync) when omitted.
        check_inputs: validate shapes, dtypes and index ranges. Some checks read
            device memory (a host sync); turn off for CUDA-graph capture.
        num_warps: launch override: one int for both launches or ``(intra, solve)``
            (default: 4 and 2 for K = V = 128 on a GPU, else 4 and 4).
        gate, qk_l2norm, beta_sigmoid: the input forms, as in
            :func:`kda_engram.kda.prefill.chunk_kda_prefill`.

    Returns:
        dict with ``qg, w, u`` ``[1, T, H, K|V]``, ``kg_t [chunks, H, K, 64]``,
        ``aqk [1, T, H, 64]`` (input dtype) and ``decay [chunks, H, K]`` (fp32),
        as documented in the module docstring.
    """
    x = KDAInputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale=scale, lower_bound=lower_bound, gate=gate,
                  qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid)
    conv = ConvArgs(conv_weight, conv_state, conv_state_indices, conv_has_initial_state)
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        prologue_rules(x, cu_seqlens, conv, chunk_indices, checks)
    else:
        prologue_host_rules(x)
    # Launch, then read back: a broken rule makes every sequence empty, every
    # chunk row padding (sequence -1) and every conv row "none", so the launches
    # write no conv_state row.
    cu_seqlens, conv_rows, chunk_indices = checks.guard_many(
        (cu_seqlens, 0), (conv.conv_state_indices, -1), (chunk_indices, -1))
    operands = prepare_kda_prologue(x, cu_seqlens, conv.replace(conv_state_indices=conv_rows), chunk_indices,
                                    num_warps=num_warps)()
    checks.run()  # the verdict, after the launches (deferred by default: validation.entry)
    return operands


def prologue_host_rules(x: KDAInputs) -> None:
    """The rules :func:`kda_prefill_prologue` runs even with ``check_inputs=False``
    (host only): ``lower_bound`` and the input forms pick the kernels' branches."""
    check_lower_bound(x.lower_bound)
    check_input_forms(x.gate, x.A_log, x.dt_bias, x.lower_bound, x.qk_l2norm, x.beta_sigmoid)


def prologue_rules(x: KDAInputs, cu_seqlens, conv: ConvArgs, chunk_indices, checks) -> None:
    """Every rule of :func:`kda_prefill_prologue`: the host rules at once and, with
    ``checks``, the rules on device values queued (``None``: host rules only, what its
    op runs with ``check_inputs=False``)."""
    prologue_host_rules(x)
    check_prologue_arguments(x, cu_seqlens, conv, chunk_indices, checks)
    check_log_decay_values(x.gate, x.raw_g, checks)
