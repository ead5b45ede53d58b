"""GPU check of the package's Gluon walk, kda_engram.kda.hopper.walk.folded_walk, against the fp64
recurrence and the fp32 emulation of its precision recipe (needs an sm_90 GPU).

Run (from the repository root or anywhere):

    python3 experiments/gluon_kda_walk/check_folded_walk_gpu.py            # checks + timing
    python3 experiments/gluon_kda_walk/check_folded_walk_gpu.py --no-bench
    python3 experiments/gluon_kda_walk/check_folded_walk_gpu.py --emulate  # CPU: harness self-test,
                                                                           # the fp32 emulation stands in
                                                                           # for the kernel
Without a CUDA device (and without --emulate) it prints a message and exits 0.

Checks (exit status 1 if any fails):
  1. accuracy: ragged batch (lengths 1000, 0, 1, 63, 64, 65, 2048, 37, 0), H = 4, K = V = 128,
     random initial state, two gates. Operands from reference.naive_chunk_operands in float64, rounded to
     bf16 (via fp32, RTNE), decay fp32. o and the final state against naive_recurrent_kda in float64
     (relative RMS; PRECISION.md predicts 1.7-3.4e-3, limit 5e-3) and against the fp32 emulation of the
     same recipe (precision_emulation.folded_walk 'fold-bf16', o rounded to bf16 like the kernel's store;
     limit 1.5e-3: accumulation order and bf16 rounding flips only). Every o row must be written (o is pre-filled with NaN); zero-length
     sequences must pass the initial state through bit for bit.
  2. variants against the emulation: VB=64 (V-half CTAs), synchronous wgmma,
     initial_state=None, output_final_state=False.
  3. masking: one 65-token sequence in a 192-row batch; rows 65.. of qg/kd/t_fold/v and a_fold's pad
     columns of row 64 hold NaN. o rows 65.. must stay untouched (sentinel), and o / state must
     equal the clean run bit for bit.
  4. timing (do_bench): 16 x 2048 tokens, H = 32, K = V = 128, bf16: just printed.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.normpath(os.path.join(HERE, "..", "..", "src"))

LENGTHS = [1000, 0, 1, 63, 64, 65, 2048, 37, 0]
GATES = ["slow, L=-5", "long mem, softplus"]
TOL_REF = 5e-3
TOL_EMU = 1.5e-3


def _rel(x, ref):
    import torch

    x, ref = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


class Checker:
    def __init__(self):
        self.failed = []

    def __call__(self, name, ok, detail=""):
        print(f"  [{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)
        if not ok:
            self.failed.append(name)


def _setup(lengths, gate, dev, H=4, K=128, V=128, seed=0):
    """Inputs, fp64 references and the bf16 operands the kernel reads."""
    import torch
    from kda_engram.kda.metadata import prepare_chunk_offsets
    from kda_engram.kda.reference import naive_chunk_operands, naive_recurrent_kda
    from precision_emulation import _stored, make_inputs

    x = make_inputs(lengths, gate, H=H, K=K, V=V, seed=seed)  # CPU float64 (bf16-representable inputs)
    args = [x[k].to(dev) for k in ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias")]
    cu = x["cu"].to(dev)
    scale = K ** -0.5
    init = x["init"].to(dev)
    o_ref, s_ref, _ = naive_recurrent_kda(*args, scale=scale, lower_bound=x["lower_bound"], cu_seqlens=cu,
                                          initial_state=init, output_final_state=True)
    o_ref0, s_ref0, _ = naive_recurrent_kda(*args, scale=scale, lower_bound=x["lower_bound"], cu_seqlens=cu,
                                            initial_state=None, output_final_state=True)
    ops = naive_chunk_operands(*args, cu_seqlens=cu, lower_bound=x["lower_bound"], chunk_size=64)
    st = _stored({k: t.cpu() for k, t in ops.items()}, x["v"])  # float32 holding bf16 values; decay fp32
    bf = torch.bfloat16
    kin = {k: st[k].to(dev, bf).contiguous() for k in ("qg", "kd", "t_fold", "a_fold", "v")}
    kin["decay"] = st["decay"].to(dev).contiguous()
    kin["cu_seqlens"] = cu.to(torch.int32)
    kin["chunk_offsets"] = prepare_chunk_offsets(kin["cu_seqlens"], 64)
    return dict(x=x, st=st, kin=kin, scale=scale, init=init.to(torch.float32), cu_cpu=x["cu"],
                o_ref=o_ref, s_ref=s_ref, o_ref0=o_ref0, s_ref0=s_ref0)


def _emulate(d, init):
    """The fp32 emulation of the recipe; o rounded to bf16 as the kernel stores it (so a
    comparison sees accumulation order and rounding flips, not the bf16 output floor)."""
    import torch
    from precision_emulation import folded_walk as emu

    o, s = emu(d["st"], d["cu_cpu"], d["scale"], init.cpu(), "fold-bf16")
    return o.to(torch.bfloat16), s


def _run(d, emulate, initial_state="init", prefill_nan=True, **opts):
    import torch

    k = d["kin"]
    init = d["init"] if initial_state == "init" else initial_state
    if emulate:  # harness self-test on the CPU: the recipe's emulation stands in for the kernel
        z = torch.zeros_like(d["init"]) if init is None else init
        o, s = _emulate(d, z)
        return o, (s if opts.get("output_final_state", True) else None)
    from kda_engram.kda.hopper.walk import folded_walk

    v = k["v"]
    o = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device) if prefill_nan else torch.empty_like(v)
    N, H = k["cu_seqlens"].numel() - 1, v.shape[2]
    final = None
    if opts.pop("output_final_state", True):
        final = torch.empty(N, H, v.shape[3], k["kd"].shape[3], dtype=torch.float32, device=v.device)
    folded_walk(k["qg"], k["kd"], k["t_fold"], k["a_fold"], v, k["decay"], o, d["scale"], k["cu_seqlens"],
                k["chunk_offsets"], initial_state=init, final_state=final, **opts)
    torch.cuda.synchronize()
    return o, final


def check_accuracy(chk, dev, emulate):
    import torch

    for gate in GATES:
        print(f"accuracy: lengths {LENGTHS}, H=4, gate '{gate}'", flush=True)
        d = _setup(LENGTHS, gate, dev)
        o_emu, s_emu = _emulate(d, d["init"])
        o, s = _run(d, emulate)
        chk("o rows all written (finite)", bool(torch.isfinite(o.float()).all()))
        r_o, r_s = _rel(o, d["o_ref"]), _rel(s, d["s_ref"])
        chk("o vs fp64 recurrence", r_o < TOL_REF, f"rel RMS {r_o:.3e} (limit {TOL_REF:.0e})")
        chk("final state vs fp64 recurrence", r_s < TOL_REF, f"rel RMS {r_s:.3e} (limit {TOL_REF:.0e})")
        e_o, e_s = _rel(o, o_emu), _rel(s, s_emu)
        chk("o vs fp32 emulation of the recipe", e_o < TOL_EMU, f"rel RMS {e_o:.3e} (limit {TOL_EMU:.1e})")
        chk("state vs fp32 emulation", e_s < TOL_EMU, f"rel RMS {e_s:.3e} (limit {TOL_EMU:.1e})")
        # per-sequence view: a masking bug shows up in one sequence only
        cu = d["cu_cpu"].tolist()
        worst = max(((_rel(o[0, cu[n]:cu[n + 1]], d["o_ref"][0, cu[n]:cu[n + 1]]), n)
                     for n in range(len(LENGTHS)) if LENGTHS[n] > 0))
        chk("worst single sequence o", worst[0] < 2 * TOL_REF, f"rel RMS {worst[0]:.3e} (seq {worst[1]}, "
            f"length {LENGTHS[worst[1]]})")
        for n, length in enumerate(LENGTHS):
            if length == 0:
                same = torch.equal(s[n].cpu(), d["init"][n].cpu())
                chk(f"zero-length seq {n}: final state == initial state", same)
        if gate == GATES[0]:
            check_variants(chk, d, emulate, o, s, o_emu, s_emu)


def check_variants(chk, d, emulate, o_def, s_def, o_emu, s_emu):
    import torch

    print("variants (same inputs, gate 0)", flush=True)
    for name, opts in (("VB=64 (V-half CTAs, 4 warps)", dict(vb=64)), ("synchronous wgmma", dict(use_async=False))):
        o, s = _run(d, emulate, **opts)
        e_o, e_s = _rel(o, o_emu), _rel(s, s_emu)
        chk(name, e_o < TOL_EMU and e_s < TOL_EMU,
            f"o {e_o:.3e} state {e_s:.3e} vs emulation; bitwise == default: o "
            f"{torch.equal(o.cpu(), o_def.cpu())} state {torch.equal(s.cpu(), s_def.cpu())}")
    o, s = _run(d, emulate, initial_state=None)
    r_o, r_s = _rel(o, d["o_ref0"]), _rel(s, d["s_ref0"])
    chk("initial_state=None", r_o < TOL_REF and r_s < TOL_REF, f"o {r_o:.3e} state {r_s:.3e} vs fp64 (zero init)")
    o, s = _run(d, emulate, output_final_state=False)
    chk("output_final_state=False", s is None and _rel(o, o_emu) < TOL_EMU, f"final {type(s).__name__}")


def check_masking(chk, dev, emulate):
    import torch

    print("masking: one 65-token sequence in a 192-row batch, NaN past its end", flush=True)
    d = _setup([65, 127], GATES[0], dev)  # the second sequence only pads the batch to 192 rows
    k = d["kin"]
    one = dict(d)
    one["kin"] = dict(k, cu_seqlens=k["cu_seqlens"][:2].clone(), chunk_offsets=k["chunk_offsets"][:2].clone())
    one["init"] = d["init"][:1].contiguous()
    one["cu_cpu"] = d["cu_cpu"][:2]
    if emulate:
        print("  (skipped with --emulate: it tests the kernel's masks)")
        return
    o_clean, s_clean = _run(one, emulate)
    chk("rows past the only sequence untouched", bool(torch.isnan(o_clean[0, 65:].float()).all()))
    poisoned = dict(one)
    kin = {key: (t.clone() if torch.is_tensor(t) else t) for key, t in one["kin"].items()}
    for key in ("qg", "kd", "t_fold", "v", "a_fold"):
        kin[key][0, 65:] = float("nan")
    kin["a_fold"][0, 64, :, 1:] = float("nan")  # the tail row's pad columns (contract: zeros)
    poisoned["kin"] = kin
    o_p, s_p = _run(poisoned, emulate)
    chk("NaN past the sequence end: o bitwise equal", torch.equal(o_p[0, :65].cpu(), o_clean[0, :65].cpu()))
    chk("NaN past the sequence end: state bitwise equal", torch.equal(s_p.cpu(), s_clean.cpu()))


def bench():
    import torch
    import triton.testing
    from kda_engram.kda.metadata import prepare_chunk_offsets

    from kda_engram.kda.hopper.walk import folded_walk

    N, L, H, K, V = 16, 2048, 32, 128, 128
    T = N * L
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g, device=dev)).to(bf)

    qg, kd, tf = rnd(1, T, H, K, s=K ** -0.5), rnd(1, T, H, K, s=K ** -0.5), rnd(1, T, H, K, s=0.1 * K ** -0.5)
    af, v = rnd(1, T, H, 64, s=0.1), rnd(1, T, H, V)
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=dev)
    coff = prepare_chunk_offsets(cu, 64)
    decay = 0.5 + 0.5 * torch.rand(N * L // 64, H, K, generator=g, device=dev)
    h0 = 0.1 * torch.randn(N, H, V, K, generator=g, device=dev)
    nbytes = T * H * (3 * K + 64 + 2 * V) * 2 + 2 * N * H * V * K * 4 + decay.numel() * 4
    print(f"timing: {N} x {L} tokens, H={H}, K=V={K}, bf16 (do_bench, ms)", flush=True)
    o, ht = torch.empty_like(v), torch.empty_like(h0)
    for name, opts in (("VB=128 8 warps", dict(use_async=False)), ("VB=128 8 warps ASYNC", {}),
                       ("VB=64 4 warps ASYNC", dict(vb=64))):
        fn = lambda: folded_walk(qg, kd, tf, af, v, decay, o, K ** -0.5, cu, coff, initial_state=h0,  # noqa: E731
                                 final_state=ht, **opts)
        ms = triton.testing.do_bench(fn)
        print(f"  {name:22s} {ms:8.3f} ms  ({nbytes / ms / 1e6:7.1f} GB/s of compulsory traffic)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--emulate", action="store_true", help="CPU self-test of the harness (no kernel)")
    a = ap.parse_args(argv)
    import torch

    if not a.emulate:
        if not torch.cuda.is_available():
            print("check_folded_walk_gpu: no CUDA device here; nothing was run (needs an sm_90 GPU).")
            return 0
        cap = torch.cuda.get_device_capability()
        if cap[0] != 9:
            print(f"check_folded_walk_gpu: device capability {cap} is not sm_90 (Hopper); nothing was run.")
            return 0
    for p in (SRC, HERE):
        if p not in sys.path:
            sys.path.insert(0, p)
    torch.set_float32_matmul_precision("highest")
    dev = "cpu" if a.emulate else "cuda"
    chk = Checker()
    check_accuracy(chk, dev, a.emulate)
    check_masking(chk, dev, a.emulate)
    if chk.failed:
        print(f"FAIL: {len(chk.failed)} check(s): {chk.failed}")
    else:
        print("PASS: all checks")
    if not a.emulate and not a.no_bench:
        bench()
    return 1 if chk.failed else 0


if __name__ == "__main__":
    sys.exit(main())
