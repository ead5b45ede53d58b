"""Step 3 of the fused Hopper prefill (issue 52): the whole prefill in one launch
(``kda/hopper/fused.py``), timed beside the Hopper path (folded prologue + walk) and the
peers in one process, on one GPU.

Per case: the fused kernel's output and final state against the Hopper path's (relative
RMS and max |delta|), then the times (ms, median) of the fused kernel, the fused kernel
stopped after each producer phase (1 gate and walk operands, 2 strips, 3 inverse; the
consumers still walk every chunk), the Hopper path, and fla / FlashKDA / cuDNN where
they import; the ratio of the best peer to the fastest fused form. ``--producer-warps 4,8``
times each producer width (one warpgroup, or two splitting the chunk's rows) in turn.

``python3 experiments/fused_prefill/step3_fused.py [--cases 16x2k_H32,...] [--json FILE]``
(from the repository root, ``PYTHONPATH=src``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kda_engram.kda.hopper.fused import FUSED_PRODUCER_WARPS, fused_prefill
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.tools.benchmarks.bench_kda_prefill import LOWER_BOUND, load_peers, make_inputs
from kda_engram.tools.benchmarks.common import bench_ms

CASES = {"16x2k_H32": ([2048] * 16, 32), "64x512_H32": ([512] * 64, 32), "1x8k_H96": ([8192], 96),
         "ragged_H32": ([3000, 17, 1, 900, 64, 4000, 333, 2048], 32), "1x8k_H32": ([8192], 32)}


def _rel(x, ref):
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm()).item(), (x - ref).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="16x2k_H32,64x512_H32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--producer-warps", default=str(FUSED_PRODUCER_WARPS),
                    type=lambda t: [int(w) for w in t.split(",")], help="e.g. 4,8: each producer width in turn")
    ap.add_argument("--phases", default="1,2,3", type=lambda t: [int(p) for p in t.split(",") if p],
                    help="the producer phases to time on their own (empty: none)")
    ns = ap.parse_args()
    peers = load_peers(not ns.no_peers)
    rows = []
    for name in ns.cases.split(","):
        t0 = time.time()
        lengths, H = CASES[name]
        x = make_inputs(lengths, H, torch.device("cuda"))
        N, K = len(lengths), 128
        cu32 = x["cu"].to(torch.int32)
        scale = K ** -0.5

        def hopper():
            return chunk_kda_prefill(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
                                     lower_bound=LOWER_BOUND, cu_seqlens=x["cu"], initial_state=x["h0"],
                                     output_final_state=True, check_inputs=False, path="hopper")

        o_f = torch.empty_like(x["v"])
        s_f = torch.empty(N, H, K, K, device="cuda")

        def fused(phases=4, warps=FUSED_PRODUCER_WARPS):
            fused_prefill(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], o_f, scale,
                          cu32, lower_bound=LOWER_BOUND, initial_state=x["h0"], final_state=s_f, phases=phases,
                          producer_warps=warps)
            return o_f

        o_h, s_h = hopper()
        row = dict(case=name, device=torch.cuda.get_device_name())
        for w in ns.producer_warps:
            tag = "" if w == FUSED_PRODUCER_WARPS else f"_pw{w}"
            o_f.fill_(float("nan"))
            fused(warps=w)
            torch.cuda.synchronize()
            row.update({f"o_rel_rms_max{tag}": _rel(o_f, o_h), f"state_rel_rms_max{tag}": _rel(s_f, s_h),
                        f"finite{tag}": bool(torch.isfinite(o_f.float()).all())})
            row[f"fused{tag}_ms"] = bench_ms(lambda: fused(warps=w))
            for p in ns.phases:
                row[f"fused{tag}_phases{p}_ms"] = bench_ms(lambda: fused(p, w))
        row["hopper_path_ms"] = bench_ms(hopper)
        best = None
        for peer, (make, desc) in peers.items():
            if make is None:
                row[f"{peer}_ms"] = None
                continue
            try:
                row[f"{peer}_ms"] = bench_ms(make(x))
                best = row[f"{peer}_ms"] if best is None else min(best, row[f"{peer}_ms"])
            except Exception as exc:  # noqa: BLE001 - a peer failing is reported, not fatal
                row[f"{peer}_ms"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        fastest = min(v for key, v in row.items() if key.startswith("fused") and key.endswith("_ms")
                      and "phases" not in key)
        row["best_peer_over_fused"] = best / fastest if best else None
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if ns.json:
            with open(ns.json, "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
