"""Sweep of the experimental single-launch chunk-16 KDA prefill
(:func:`kda_engram.kda.fused_prefill.fused_kda_prefill_c16`) against the
two-stage ``chunk_kda_prefill`` on one GPU.

Per case (the anchor run's inputs from ``bench_kda_prefill.make_inputs``: bf16,
K = V = 128, ``lower_bound = -5``, slow-channel gates, zero initial state, final
state returned): ``chunk_kda_prefill(check_inputs=False)`` and the fused kernel
over every launch configuration of ``BENCH_CONFIGS`` (those that compile for
sm_90a without spills, see ``tests/kda/test_fused_prefill_compile.py``), each
timed with ``triton.testing.do_bench`` (median, warmup 10 ms, rep 40 ms). Printed:
ms, the ratio two-stage ms / fused ms (> 1: fused is faster), the max abs
difference of the output and of the final state to the two-stage result, and the
relative RMS of the fused output and final state against it. The anchor run's
best peer and the issue's target are printed beside each case.

    python benchmarks/sweep_kda_fused.py [--cases 16x2k_H32,ragged_H32] [--configs '[{"BV": 64}]'] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CASES = {
    "16x2k_H32": ((2048,) * 16, 32),
    "64x512_H32": ((512,) * 64, 32),
    "256x128_H32": ((128,) * 256, 32),
    "1x8k_H96": ((8192,), 96),
    "ragged_H32": ((37, 4000, 1, 900, 2048, 129, 6000, 63, 64, 65), 32),
    "1x8k_H32": ((8192,), 32),
    "1x32k_H4": ((32768,), 4),
}


def _rel_rmse(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def run(cases, configs, json_path=None) -> list[dict]:
    """Baselines of every case first, then every config over every case (configs
    outer, in ``BENCH_CONFIGS`` order, the least tried last): a config that faults
    the device loses only its own rows and the ones after it; the rows so far are
    rewritten to ``json_path`` after each config."""
    import torch
    import triton.testing

    from bench_kda_prefill import ANCHOR_BEST_PEER_MS, LOWER_BOUND, TARGET_MS, make_inputs
    from kda_engram.kda.fused_prefill import fused_config, fused_kda_prefill_c16
    from kda_engram.kda.prefill import chunk_kda_prefill

    def bench(fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))

    device = torch.device("cuda")
    state, rows = {}, []
    for name in cases:
        lengths, heads = CASES[name]
        x = make_inputs(lengths, heads, device)
        args = (x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"])
        kw = dict(lower_bound=LOWER_BOUND, cu_seqlens=x["cu"], initial_state=x["h0"], output_final_state=True)
        out = torch.empty_like(x["v"])

        def two_stage(args=args, kw=kw, out=out):
            return chunk_kda_prefill(*args, **kw, out=out, check_inputs=False)

        o_ref, f_ref = two_stage()
        o_ref, f_ref = o_ref.clone(), f_ref.clone()
        ms_ref = bench(two_stage)
        default = fused_config(len(lengths), heads, 128, device)
        print(f"{name:<12} two-stage {ms_ref:.3f} ms (anchor best peer {ANCHOR_BEST_PEER_MS.get(name, '-')} ms, "
              f"target {TARGET_MS.get(name, '-')} ms); fused default config {default}", flush=True)
        state[name] = (args, kw, o_ref, f_ref, out)
        rows.append(dict(case=name, two_stage_ms=ms_ref, anchor_best_peer_ms=ANCHOR_BEST_PEER_MS.get(name),
                         target_ms=TARGET_MS.get(name), default_config=default, fused=[]))
    for cfg in configs:
        print(f"== config {json.dumps(cfg)}", flush=True)
        for row in rows:
            name = row["case"]
            args, kw, o_ref, f_ref, fo = state[name]

            def fused(args=args, kw=kw, fo=fo, cfg=cfg):
                return fused_kda_prefill_c16(*args, **kw, out=fo, config=cfg)

            try:
                o, f = fused()
                torch.cuda.synchronize()
                ms = bench(fused)
            except Exception as exc:  # a config failing (compile, launch): report, keep the others
                torch.cuda.synchronize()
                print(f"  {name:<12} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                row["fused"].append(dict(config=cfg, error=f"{type(exc).__name__}: {exc}"))
                continue
            d_o = (o.float() - o_ref.float()).abs().max().item()
            d_f = (f - f_ref).abs().max().item()
            r_o, r_f = _rel_rmse(o, o_ref), _rel_rmse(f, f_ref)
            finite = bool(torch.isfinite(o.float()).all() and torch.isfinite(f).all())
            ms_ref = row["two_stage_ms"]
            print(f"  {name:<12} {ms:7.3f} ms  x{ms_ref / ms:5.2f} vs two-stage {ms_ref:.3f}  max|do| {d_o:.2e}  "
                  f"max|df| {d_f:.2e}  relrms o {r_o:.2e} f {r_f:.2e}{'' if finite else '  NON-FINITE'}", flush=True)
            row["fused"].append(dict(config=cfg, ms=ms, ratio=ms_ref / ms, max_abs_out=d_o, max_abs_state=d_f,
                                     rel_rmse_out=r_o, rel_rmse_state=r_f, finite=finite))
        if json_path:
            with open(json_path, "w") as fh:
                json.dump(rows, fh, indent=1)
    print("== best per case (ms; ratio two-stage / fused)")
    for row in rows:
        ok = [r for r in row["fused"] if "ms" in r and r["finite"]]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            print(f"  {row['case']:<12} two-stage {row['two_stage_ms']:.3f}  fused {best['ms']:.3f} "
                  f"x{best['ratio']:.2f}  {json.dumps(best['config'])}  (target {row['target_ms']}, "
                  f"anchor best peer {row['anchor_best_peer_ms']})")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--configs", default=None,
                        help="JSON list of config dicts (BV, num_warps, num_stages, maxnreg); default BENCH_CONFIGS")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import torch

    if not torch.cuda.is_available():
        print("sweep_kda_fused: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kda_engram.kda.fused_prefill import BENCH_CONFIGS

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    configs = json.loads(args.configs) if args.configs else [dict(c) for c in BENCH_CONFIGS]
    run(cases, configs, args.json)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
