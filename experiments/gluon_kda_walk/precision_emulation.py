"""CPU emulation of the planned Gluon (sm_90a) KDA walk's rounding, against the fp64 recurrence.

Not part of the package. Run (2 CPU cores, a few minutes):

    PYTHONPATH=src python3 experiments/gluon_kda_walk/precision_emulation.py   (from the repository root)

Every walk reads the operands of ``reference.naive_chunk_operands`` computed in float64 and rounded
to bf16 (fp32 -> bf16, RTNE) as the prologue would store them; ``decay`` is stored fp32 (as
``prologue.py`` does). A product ``A @ B`` is emulated as ``round(A) @ round(B)`` in float32
(bf16 x bf16 and tf32 x bf16 products are exact in fp32, so this is an fp32-accumulating
tensor-core product up to accumulation order). The recurrent state is fp32 between chunks.

Variants (``mode`` of :func:`folded_walk` / :func:`unfolded_walk`):

* ``fold-bf16``   the Gluon recipe: S -> bf16 as the A operand of S.kd^T and S.qg^T,
                  R -> bf16 for a_fold.R and R^T.t_fold.
* ``fold-tf32``   S and R rounded to tf32 (10-bit mantissa, RTNE) instead; operands bf16.
* ``fold-Rtf32``  S bf16, R tf32 (only a_fold and t_fold would need tf32 tiles).
* ``fold-S32``    S kept fp32 in its two products, R bf16 (the ideal the kernel can't have cheaply).
* ``fold-SR32``   S and R both fp32 (isolates the bf16 operand storage alone).
* ``today-S32``   ``naive_chunk_step`` over the unfolded operands (w, u, qg, kg_t, aqk bf16, decay
                  fp32), S and v_new fp32 in the products (the stand-in the brief asked for).
* ``today-bf16``  the same, but S and v_new rounded to bf16 in the products, which is what
                  ``chunk_kernels._walk_chunk`` does on the GPU today (``sb = st.to(dt)``,
                  ``vb = v_new.to(dt)``) and what fla's walk does.

Also reported: ``fold-f64`` (the folded contract in float64, a check of the harness) and
``bf16(ref)`` (the exact result merely rounded to bf16: the floor of a bf16 output / state).
"""

from __future__ import annotations

import math
import sys
import time

import torch

from kda_engram.kda.metadata import prepare_chunk_offsets
from kda_engram.kda.reference import naive_chunk_operands, naive_folded_chunk_step, naive_recurrent_kda

CHUNK = 64
torch.set_float32_matmul_precision("highest")


def _chunk_rows(cu_seqlens: torch.Tensor, chunk_size: int):
    """Per sequence: list of (chunk row, start, end) token ranges (the rows of
    ``naive_chunk_operands``' per-chunk operands)."""
    bounds = cu_seqlens.tolist()
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size).tolist()
    out = []
    for n in range(len(bounds) - 1):
        starts = range(bounds[n], bounds[n + 1], chunk_size)
        out.append([(offsets[n] + c, s, min(s + chunk_size, bounds[n + 1])) for c, s in enumerate(starts)])
    return out


# ----------------------------------------------------------------------------- rounding helpers
def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (via fp32, RTNE), returned as float32."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> nearest tf32 (10 explicit mantissa bits, ties to even), as float32.

    Drops the low 13 mantissa bits with round-to-nearest-even on the bit pattern
    (carry into the exponent is the correct rounding); inputs are finite here."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    bits = (bits + (0x0FFF + lsb)) & ~0x1FFF
    return bits.view(torch.float32)


def fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


ROUND = {"bf16": bf16, "tf32": tf32, "fp32": fp32}


def _check_tf32():
    one = torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-10 + 2.0**-11, -(1.0 + 2.0**-11 + 2.0**-20)])
    want = torch.tensor([1.0, 1.0 + 2.0**-9, 1.0 + 2.0**-9, -(1.0 + 2.0**-10)])
    assert torch.equal(tf32(one), want), tf32(one)
    x = torch.randn(10000) * 1e3
    r = tf32(x)
    assert ((r - x).abs() <= x.abs() * 2.0**-11 * (1 + 1e-6)).all()  # half an ulp of a 10-bit mantissa


# ----------------------------------------------------------------------------- the walks
def _stored(ops, v):
    """The prologue's outputs as the walk loads them: bf16 operands, fp32 decay."""
    keys = ("qg", "kd", "t_fold", "a_fold", "w", "u", "kg_t", "aqk")
    out = {k: bf16(ops[k]) for k in keys}
    out["v"] = bf16(v)
    out["decay"] = ops["decay"].to(torch.float32)
    return out


FOLDED = {"fold-bf16": ("bf16", "bf16"), "fold-tf32": ("tf32", "tf32"),
          "fold-Rtf32": ("bf16", "tf32"), "fold-S32": ("fp32", "bf16"), "fold-SR32": ("fp32", "fp32")}
UNFOLDED = {"today-S32": ("fp32", "fp32"), "today-bf16": ("bf16", "bf16")}


def _walk(cu_seqlens, initial_state, T, H, V, K, dtype, step):
    """Every sequence's chunks in order from its initial state: ``step(S, row, s,
    e) -> (o [L, H, V], S_next)`` is one chunk. Returns ``(o, final)``."""
    o = torch.zeros(1, T, H, V, dtype=dtype)
    final = torch.zeros(len(cu_seqlens) - 1, H, V, K, dtype=dtype)
    for n, chunks in enumerate(_chunk_rows(cu_seqlens, CHUNK)):
        S = initial_state[n].to(dtype).clone()
        for row, s, e in chunks:
            o[0, s:e], S = step(S, row, s, e)
        final[n] = S
    return o, final


def folded_walk(st, cu_seqlens, scale, initial_state, mode):
    """The folded contract chunk by chunk in the kernel's precision recipe.

    Per chunk, per head (S fp32 [V, K] carried):
        S_op = rS(S);  R = v - kd S_op^T  (fp32 acc);  R_op = rR(R)
        o = scale * (qg S_op^T + a_fold R_op)         (fp32 acc)
        S = S * decay + R_op^T t_fold                  (fp32 decay multiply, fp32 acc)
    """
    rS, rR = (ROUND[m] for m in FOLDED[mode])

    def step(S, row, s, e):
        L = e - s
        kd = st["kd"][0, s:e].transpose(0, 1)  # [H, L, K]
        qg = st["qg"][0, s:e].transpose(0, 1)
        tf = st["t_fold"][0, s:e].transpose(0, 1)
        af = st["a_fold"][0, s:e, :, :L].transpose(0, 1)  # [H, L, L]
        vv = st["v"][0, s:e].transpose(0, 1)  # [H, L, V]
        S_op = rS(S).transpose(1, 2)  # [H, K, V]
        R_op = rR(vv - kd @ S_op)
        o = (scale * (qg @ S_op + af @ R_op)).transpose(0, 1)
        return o, S * st["decay"][row][:, None, :] + R_op.transpose(1, 2) @ tf

    T, H, V = st["v"].shape[1:]
    return _walk(cu_seqlens, initial_state, T, H, V, st["kd"].shape[3], torch.float32, step)


def unfolded_walk(st, cu_seqlens, scale, initial_state, mode):
    """``naive_chunk_step`` over (w, u, qg, kg_t, aqk, decay): v_new = u - w S^T;
    o = scale (qg S^T + aqk v_new); S = S diag(decay) + v_new^T kg."""
    rS, rV = (ROUND[m] for m in UNFOLDED[mode])

    def step(S, row, s, e):
        L = e - s
        w = st["w"][0, s:e].transpose(0, 1)
        u = st["u"][0, s:e].transpose(0, 1)
        qg = st["qg"][0, s:e].transpose(0, 1)
        aqk = st["aqk"][0, s:e, :, :L].transpose(0, 1)
        kg = st["kg_t"][row, :, :, :L].transpose(1, 2)  # [H, L, K]
        S_op = rS(S).transpose(1, 2)
        vn_op = rV(u - w @ S_op)
        o = (scale * (qg @ S_op + aqk @ vn_op)).transpose(0, 1)
        return o, S * st["decay"][row][:, None, :] + vn_op.transpose(1, 2) @ kg

    T, H, V = st["u"].shape[1:]
    return _walk(cu_seqlens, initial_state, T, H, V, st["w"].shape[3], torch.float32, step)


def folded_walk_f64(ops, v, cu_seqlens, scale, initial_state):
    """reference.naive_folded_chunk_step in float64 (harness check)."""
    T, H, V = v.shape[1:]
    return _walk(cu_seqlens, initial_state, T, H, V, ops["kd"].shape[3], torch.float64,
                 lambda S, row, s, e: naive_folded_chunk_step(S, ops, v, row, s, e, scale))


# ----------------------------------------------------------------------------- the study
def rel(x, ref):
    x, ref = x.to(torch.float64), ref.to(torch.float64)
    return ((x - ref).norm() / ref.norm()).item()


GATES = {  # name: (A_log sampler, dt_bias sampler, lower_bound)
    "slow, L=-5": (lambda g, H: torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64)),
                   lambda g, H, K: torch.randn(H, K, generator=g, dtype=torch.float64), -5.0),
    "slow, softplus": (lambda g, H: torch.log(1 + 15 * torch.rand(H, generator=g, dtype=torch.float64)),
                       lambda g, H, K: torch.randn(H, K, generator=g, dtype=torch.float64), None),
    "fast, L=-5": (lambda g, H: torch.rand(H, generator=g, dtype=torch.float64),
                   lambda g, H, K: torch.rand(H, K, generator=g, dtype=torch.float64), -5.0),
    "fast, softplus": (lambda g, H: torch.rand(H, generator=g, dtype=torch.float64),
                       lambda g, H, K: torch.rand(H, K, generator=g, dtype=torch.float64), None),
    # Not in the brief: a long-memory stress case (per-token log decay about -2e-4 .. -0.05, so
    # the state carries thousands of tokens and S is re-rounded on every chunk it survives).
    "long mem, softplus": (lambda g, H: torch.rand(H, generator=g, dtype=torch.float64),
                           lambda g, H, K: -10 + 6 * torch.rand(H, K, generator=g, dtype=torch.float64), None),
}
CASES = {"1x8192": [8192], "ragged 9": [37, 1000, 1, 900, 2048, 129, 63, 64, 65]}
VARIANTS = ["fold-f64", "bf16(ref)", *FOLDED, *UNFOLDED]


def make_inputs(lengths, gate, H=2, K=128, V=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape):  # bf16-rounded inputs, held in float64
        return bf16(torch.randn(*shape, generator=g, dtype=torch.float64)).to(torch.float64)

    q, k, v, raw_g, raw_beta = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), r(1, T, H, K), r(1, T, H)
    a_fn, dt_fn, lb = GATES[gate]
    A_log, dt_bias = a_fn(g, H), dt_fn(g, H, K)
    init = (0.3 * torch.randn(len(lengths), H, V, K, generator=g, dtype=torch.float64)).to(torch.float32)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)
    return dict(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, A_log=A_log, dt_bias=dt_bias,
                lower_bound=lb, cu=cu, init=init.to(torch.float64))


def run_case(lengths, gate):
    x = make_inputs(lengths, gate)
    args = (x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"])
    K = x["q"].shape[-1]
    scale = K**-0.5
    o_ref, s_ref, _ = naive_recurrent_kda(*args, scale=scale, lower_bound=x["lower_bound"], cu_seqlens=x["cu"],
                                          initial_state=x["init"], output_final_state=True)
    ops = naive_chunk_operands(*args, cu_seqlens=x["cu"], lower_bound=x["lower_bound"], chunk_size=CHUNK)
    st = _stored(ops, x["v"])
    res = {}
    o, s = folded_walk_f64(ops, x["v"], x["cu"], scale, x["init"])
    res["fold-f64"] = (rel(o, o_ref), rel(s, s_ref))
    res["bf16(ref)"] = (rel(bf16(o_ref), o_ref), rel(bf16(s_ref), s_ref))
    for m in FOLDED:
        o, s = folded_walk(st, x["cu"], scale, x["init"], m)
        res[m] = (rel(o, o_ref), rel(s, s_ref))
    for m in UNFOLDED:
        o, s = unfolded_walk(st, x["cu"], scale, x["init"], m)
        res[m] = (rel(o, o_ref), rel(s, s_ref))
    # how much the gate decays: mean per-token log decay and the chunk-end decay range
    d = ops["decay"]
    info = f"median chunk decay 2^g_last {d.median().item():.2e}, min {d.min().item():.1e}"
    return res, info


def main():
    torch.set_num_threads(1)  # 2 threads were ~100x slower on these small ops here
    _check_tf32()
    t0 = time.time()
    table = []
    for case, lengths in CASES.items():
        for gate in GATES:
            t1 = time.time()
            res, info = run_case(lengths, gate)
            table.append((case, gate, res))
            print(f"# {case:9s} {gate:15s} {time.time() - t1:6.1f} s  ({info})", file=sys.stderr, flush=True)
    for which, idx in (("output o", 0), ("final state", 1)):
        print(f"\nRelative RMS error of the {which} vs the fp64 recurrence\n")
        print("| case | gate | " + " | ".join(VARIANTS) + " |")
        print("|---|---|" + "---:|" * len(VARIANTS))
        for case, gate, res in table:
            print(f"| {case} | {gate} | " + " | ".join(f"{res[v][idx]:.2e}" for v in VARIANTS) + " |")
    print(f"\n# total {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
