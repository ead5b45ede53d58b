"""Launch sweep of ``engram_post_wkv`` (hc 4, bf16) on one GPU: the default launch
and its alternatives, each replayed from a CUDA graph, over T and dim. The
measurements behind ``SMALL_GRID_ROWS_PER_CU`` and ``WIDE_ROW_HINTS_MAX_ROWS_PER_CU``
in ``kda_engram/engram/gate.py`` came from this script.

Variants: ``default``; ``wide`` / ``wide+hints`` (the register-resident single
pass, one token per program, without / with L2 eviction hints); ``persistent pN``
(the single pass on N programs per SM, from T = 256); ``2pass cC wW hints`` (two
passes of C-wide blocks on W warps, hinted; only up to T = 2048, where they stop
competing); ``torch.compile`` of the reference up to T = 128. Rounds run the
variants in a fresh shuffled order; each line gives the median, the fraction of
the HBM floor and every round.

    python -m kda_engram.tools.benchmarks.sweep_engram_gate [--dims 5120 2560] [--tokens 64 128 ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from ...engram.gate import engram_post_wkv, post_wkv_launch
from ...platform import num_compute_units
from . import bench_engram_gate as gate_bench
from .common import cuda_graph_ms, no_gpu_exit

HC = gate_bench.HC


def variants(T: int, device) -> dict[str, dict]:
    out = {"default": {}, "wide": dict(tokens=1), "wide+hints": dict(tokens=1, l2_hints=True)}
    if T >= 256:
        for per_cu in (4, 8):
            out[f"persistent p{per_cu}"] = dict(programs=per_cu * num_compute_units(device) // HC * HC)
    if T <= 2048:
        for chunk in (1024, 2048):
            for warps in (4, 8):
                out[f"2pass c{chunk} w{warps} hints"] = dict(chunk=chunk, num_warps=warps, l2_hints=True)
    return out


def sweep_shape(dim: int, T: int, rounds: int, copy_gbs: float, device) -> None:
    hidden, kv, q, k = gate_bench._inputs(T, dim, device)
    want = gate_bench.reference_math(hidden, kv, q, k)
    out = torch.empty_like(hidden)
    calls = {}
    for name, launch in variants(T, device).items():
        def call(launch=launch):
            return engram_post_wkv(hidden, kv, q, k, eps=gate_bench.EPS, clamp_value=gate_bench.CLAMP,
                                   out=out, check_inputs=False, **launch)
        call()
        err = (out.float() - want.float()).abs().max().item()
        if err > 0.07:  # bf16 rounding of outputs |x| < 8: a launch that is wrong is not timed
            raise AssertionError(f"dim {dim} T {T} {name}: max|err| {err:.3g} against the reference")
        calls[name] = call
    if T <= 128:
        compiled = torch.compile(gate_bench.reference_math, dynamic=False)
        compiled(hidden, kv, q, k)
        calls["torch.compile"] = lambda: compiled(hidden, kv, q, k)
    times = {name: [] for name in calls}
    order = list(calls)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            times[name].append(cuda_graph_ms(calls[name]) * 1e3)
    floor_us = gate_bench.post_wkv_bytes(T, dim) / (copy_gbs * 1e9) * 1e6
    geom, _ = post_wkv_launch(T, HC, dim, device)
    print(f"dim {dim} T {T}: floor {floor_us:.2f} us; default LOOP={geom['LOOP']} CHUNK={geom['CHUNK']} "
          f"warps={geom['num_warps']} hints={bool(geom['KEEP'])} persistent={geom['PERSISTENT']}")
    for name, us in sorted(times.items(), key=lambda item: statistics.median(item[1])):
        med = statistics.median(us)
        print(f"  {name:<22} {med:9.2f} us  {floor_us / med:5.0%}  {[round(x, 2) for x in us]}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[5120, 2560])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if (code := no_gpu_exit("sweep_engram_gate")) is not None:
        return code
    device = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = gate_bench.copy_bandwidth_gbs(device)
    print(f"copy bandwidth (read + write): {copy_gbs:,.0f} GB/s")
    for dim in args.dims:
        for T in args.tokens:
            sweep_shape(dim, T, args.rounds, copy_gbs, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
