"""Sweep of the grouped KDA chunk walk on one GPU: the group scan's launch and
precision, then the group count. The constants of the cost model in
``kda_engram/kda/groups.py`` (``_SCAN_STEP_NVIDIA``, ``_OVERLAP_*``) and the scan's
default precision in ``kda_engram/kda/chunk.py`` came from this script.

``--part scan``: at 1 x 131072 H4 (G = 32) and 1 x 32768 H4 (G = 16), the chunk
kernel (``kda_prefill_walk`` on the prologue's operands) with every scan launch
(``scan_precision`` ieee / tf32x3, ``BJ_scan`` 32 / 64, 4 / 8 warps, 1 / 2
stages), its time and its difference from the serial walk (G = 1), then the
per-kernel split (torch.profiler) of the ieee scan and of the fastest tf32x3 one.
``--part groups``: forced G = 1, 8, 16, 24, 32, 48, 64 against the heuristic's
pick over long few-head shapes, with the fastest tf32x3 scan of ``--part scan``
(or ``--config``). The benchmark inputs decay fast (unit-scale gates), so their
differences against G = 1 say little about the scan's accuracy; the GPU tests
(``tests/kda/test_groups.py``, weak decay) bound that.

    python -m kda_engram.tools.benchmarks.sweep_kda_groups [--part all|scan|groups] [--config '{"BJ_scan": 64}']
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from ...kda import kda_prefill_walk, kda_prefill_prologue
from ...kda.groups import chunk_groups
from ...constants import CHUNK_SIZE
from ...kda.metadata import prepare_chunk_indices, prepare_chunk_offsets
from .bench_kda_prefill import HEAD_DIM, LOWER_BOUND, kernel_times, make_inputs
from .common import bench_ms as _bench
from .common import no_gpu_exit

SCAN_CASES = ((1, 131072, 4, 32), (1, 32768, 4, 16))  # (sequences, length, heads, forced G)
GROUP_CASES = ((1, 32768, 4), (1, 131072, 4), (1, 32768, 8), (1, 65536, 8), (2, 32768, 4), (1, 16384, 4),
               (1, 8192, 4), (1, 32768, 32), (4, 8192, 8), (1, 262144, 2))
GROUP_COUNTS = (1, 8, 16, 24, 32, 48, 64)


def chunk_walk_of(N: int, L: int, H: int, device):
    """``walk(groups=, config=)`` over fixed prologue operands, and its G = 1 result."""
    x = make_inputs((L,) * N, H, device)
    scale = HEAD_DIM**-0.5
    offs = prepare_chunk_offsets(x["cu"], CHUNK_SIZE)
    idx = prepare_chunk_indices(x["cu"], CHUNK_SIZE, total_tokens=N * L, chunk_offsets=offs)
    ops = kda_prefill_prologue(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
                             scale, LOWER_BOUND, x["cu"], chunk_indices=idx, check_inputs=False)
    out = torch.empty_like(x["v"])

    def walk(groups=None, config=None):
        return kda_prefill_walk(ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"], out,
                               scale, x["cu"], x["h0"], True, chunk_offsets=offs, check_inputs=False,
                               config=config, groups=groups)

    o1, f1 = walk(groups=1)
    return walk, (o1.float().clone(), f1.clone())


def difference(walk, serial, **kw) -> tuple[float, float]:
    """Max abs difference of the outputs and of the final state from the serial walk."""
    o, f = walk(**kw)
    return (o.float() - serial[0]).abs().max().item(), (f - serial[1]).abs().max().item()


def sweep_scan(device) -> dict | None:
    best = None
    for N, L, H, G in SCAN_CASES:
        walk, serial = chunk_walk_of(N, L, H, device)
        print(f"== {N} x {L} H{H}, G = {G} (serial walk {_bench(lambda: walk(groups=1), True):.3f} ms)")
        fastest = None
        for prec, bj, nw, ns in itertools.product(("ieee", "tf32x3"), (32, 64), (4, 8), (1, 2)):
            cfg = {"scan_precision": prec, "BJ_scan": bj, "num_warps_scan": nw, "num_stages_scan": ns}
            d_out, d_state = difference(walk, serial, groups=G, config=cfg)
            ms = _bench(lambda: walk(groups=G, config=cfg), True)  # noqa: B023
            print(f"{prec:7s} BJ {bj:3d} warps {nw} stages {ns}: {ms:.3f} ms  vs G=1: out {d_out:.2e} "
                  f"state {d_state:.2e}")
            if prec != "ieee" and (fastest is None or ms < fastest[0]):
                fastest = (ms, cfg)
        for cfg in ({"scan_precision": "ieee"}, fastest[1]):
            split = kernel_times(lambda: walk(groups=G, config=cfg), calls=5, warmup=3)  # noqa: B023
            print("  kernels", cfg, {k: round(v, 4) for k, v in split.items()})
        best = best or fastest  # the first (longest) case's choice feeds --part groups
        del walk, serial
        torch.cuda.empty_cache()
    return best[1] if best else None


def sweep_groups(device, config: dict | None) -> None:
    print("group sweep, scan config:", config)
    for N, L, H in GROUP_CASES:
        walk, _ = chunk_walk_of(N, L, H, device)
        picked = chunk_groups(L // CHUNK_SIZE, N, H, device)
        row = [f"G{G}={_bench(lambda: walk(groups=G, config=config), True):.3f}"  # noqa: B023
               for G in GROUP_COUNTS if G <= L // CHUNK_SIZE // 4]
        print(f"{N} x {L} H{H} (heuristic {picked}): " + " ".join(row) + " ms")
        del walk
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "scan", "groups"), default="all")
    parser.add_argument("--config", type=json.loads, default=None, help="chunk config for --part groups (JSON)")
    args = parser.parse_args(argv)
    if (code := no_gpu_exit("sweep_kda_groups")) is not None:
        return code
    device = torch.device("cuda")
    with torch.inference_mode():
        config = args.config
        if args.part in ("all", "scan"):
            found = sweep_scan(device)
            config = config if config is not None else found
        if args.part in ("all", "groups"):
            sweep_groups(device, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
