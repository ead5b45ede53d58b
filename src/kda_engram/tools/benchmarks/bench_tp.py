"""Tensor-parallel layers over torch.distributed, each checked against the same layer on one process.

    torchrun --nproc-per-node 4 -m kda_engram.tools.benchmarks.bench_tp              # NCCL on 4 GPUs, the full cases
    torchrun --nproc-per-node 2 -m kda_engram.tools.benchmarks.bench_tp --json tp2.json
    python -m kda_engram.tools.benchmarks.bench_tp --spawn 2 --backend gloo --small  # CPU ranks (it sets TRITON_INTERPRET=1)

Every rank builds the layers from the same seeded full checkpoint, so each also runs
the unsharded layer (P = 1) locally as the reference. Two parts:

1. The Engram layer (``kda_engram.layers.engram_gate.Engram``: ``wkv`` projection, then the gate)
   at dim 5120, hc 4, T in {64, 2048, 16384}, in both tensor-parallel layouts: the
   column-parallel projection followed by an all-gather of the whole ``kv`` ("gather",
   the baseline) and the dim-sharded gate ("sharded", which all-gathers a value slice
   and two partial sums per stream). Checked: each layout's output equals the P = 1
   layer's within the bf16 tolerance, and every rank holds bit-identical outputs.
2. ``KimiDeltaAttention`` with its heads sharded over the ranks (Kimi-Linear shapes:
   hidden 2304, 32 heads of 128, low-rank gates, ``lower_bound = -5``), on a ragged
   prefill batch and on a decode step; checked against the P = 1 layer and for
   bit-identical ranks.

Times: per call, median over repeats of the slowest rank's time (every rank runs the
same number of calls between barriers; do_bench would pick a count per process and
desynchronise the collectives). Bytes exchanged per token are what each layout's
all-gather (Engram) or all-reduce (KDA, the ``[T, hidden]`` output) moves.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` unless the caller set it). The
process exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from ...layers.engram_gate import Engram
from ...engram.sharded_gate import send_width
from ...layers.kda import KDABatch, KimiDeltaAttention
from ...parallel import TensorParallelGroup
from .bench_engram_gate import block_times_ms

EPS = 1e-6
HC = 4
# (T, dim, in_dim) of the Engram part and the KDA layer shape, full and --small.
ENGRAM_CASES = [(64, 5120, 1024), (2048, 5120, 1024), (16384, 5120, 1024)]
ENGRAM_CASES_SMALL = [(5, 96, 32)]
KDA_SHAPE = dict(hidden_size=2304, num_heads=32, head_dim=128)
KDA_SHAPE_SMALL = dict(hidden_size=32, num_heads=4, head_dim=16)
# name -> (query lengths, decode rows first)
KDA_CASES = {"prefill 1x8192": ([8192], 0), "prefill 8x1024": ([1024] * 8, 0), "decode 256": ([1] * 256, 256)}
KDA_CASES_SMALL = {"prefill 2 ragged": ([3, 66], 0), "decode 3": ([1] * 3, 3)}
# max |ours - P=1| / max |P=1| allowed: bf16 (GPU) outputs round differently when the
# reduction order changes; fp32 (CPU) only by the summation order.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _init(backend: str | None) -> tuple[TensorParallelGroup, torch.device]:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    return TensorParallelGroup(), device


def slowest_rank_median_ms(samples: list[float], device: torch.device) -> float:
    """Median over repeats of the per-repeat maximum over ranks (every rank passes
    its own ``samples``, one per repeat)."""
    mine = torch.tensor(samples, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return statistics.median(torch.stack(every).max(0).values.tolist())


def time_calls(fn, device: torch.device, iters: int, repeats: int) -> float:
    """ms per call, the slowest rank's, median over ``repeats`` blocks of ``iters`` calls
    (after ``repeats`` warm-up calls)."""
    return slowest_rank_median_ms(block_times_ms(fn, iters, device, repeats, warmup=repeats), device)


def ranks_identical(tp: TensorParallelGroup, x: torch.Tensor) -> bool:
    """Whether every rank holds the same bits of ``x`` (the same verdict on every rank)."""
    everyone = tp.all_gather(x.contiguous()[None], dim=0)
    same = all(torch.equal(everyone[r], everyone[0]) for r in range(tp.world_size))
    flag = torch.tensor([int(same)], dtype=torch.int32, device=x.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def run_engram(tp, device, dtype, cases, iters, repeats, tol) -> list[dict]:
    P = tp.world_size
    rows = []
    for T, dim, in_dim in cases:
        gen = torch.Generator().manual_seed(T * 7 + dim)
        wkv = (torch.randn((HC + 1) * dim, in_dim, generator=gen) * in_dim**-0.5).to(dtype).to(device)
        q = (1 + 0.5 * torch.randn(HC, dim, generator=gen)).to(dtype).to(device)
        k = (1 + 0.5 * torch.randn(HC, dim, generator=gen)).to(dtype).to(device)
        hidden = torch.randn(T, HC, dim, generator=gen).to(dtype).to(device)
        emb = torch.randn(T, in_dim, generator=gen).to(dtype).to(device)
        single = Engram(dim, HC, in_dim, eps=EPS, dtype=dtype, device=device)
        single.load_checkpoint(wkv, q, k)
        want = single(hidden, emb)
        row = dict(part="engram", case=f"Engram P={P} T={T} d={dim}", P=P, T=T, dim=dim,
                   gather_bytes_per_token=(HC + 1) * dim * hidden.element_size(),
                   sharded_bytes_per_token=P * send_width(dim, HC, P, dtype) * hidden.element_size())
        ok = True
        for name, shard in (("gather", False), ("sharded", True)):
            layer = Engram(dim, HC, in_dim, eps=EPS, tp=tp, shard_gate=shard, dtype=dtype, device=device)
            layer.load_checkpoint(wkv, q, k)
            out = layer(hidden, emb)
            diff = rel_diff(out, want)
            same = ranks_identical(tp, out)
            row[f"{name}_rel_diff_vs_p1"] = diff
            row[f"{name}_ranks_bit_identical"] = same
            ok &= same and diff <= tol
            row[f"{name}_ms"] = time_calls(lambda: layer(hidden, emb, check_inputs=False), device, iters, repeats)
            del layer
        row["p1_ms"] = time_calls(lambda: single(hidden, emb, check_inputs=False), device, iters, repeats)
        row["sharded_speedup"] = row["gather_ms"] / row["sharded_ms"]
        row["ok"] = ok
        rows.append(row)
    return rows


def _kda_layer(shape, tp, dtype, device) -> KimiDeltaAttention:
    K = shape["head_dim"]
    return KimiDeltaAttention(**shape, gate_low_rank_dim=K, output_gate_low_rank_dim=K, lower_bound=-5.0,
                              tp=tp, dtype=dtype, device=device)


def run_kda(tp, device, dtype, shape, cases, iters, repeats, tol) -> list[dict]:
    P = tp.world_size
    full = _kda_layer(shape, None, dtype, device)
    weights = full.reset_parameters(torch.Generator().manual_seed(11))
    layer = _kda_layer(shape, tp, dtype, device)
    layer.load_weights(weights)
    rows = []
    for name, (lens, num_decode) in cases.items():
        N = len(lens)
        gen = torch.Generator().manual_seed(N + sum(lens))
        x = torch.randn(sum(lens), shape["hidden_size"], generator=gen).to(dtype).to(device)
        batch = KDABatch.from_query_lens(torch.tensor(lens, device=device), torch.arange(N, device=device),
                                         num_decode=num_decode)
        # Decode rows read their state rows: start every row from zeros (a prefill
        # without initial state never reads it).
        caches = {}
        for tag, lay in (("p1", full), ("tp", layer)):
            state, conv = lay.allocate_cache(N, device=device)
            caches[tag] = (state.zero_(), conv.zero_())
        fresh = {tag: (s.clone(), c.clone()) for tag, (s, c) in caches.items()}
        want = full(x, batch, *fresh["p1"])
        got = layer(x, batch, *fresh["tp"])
        diff = rel_diff(got, want)
        same = ranks_identical(tp, got)
        row = dict(part="kda", case=f"KDA P={P} {name}", P=P, tokens=sum(lens), heads_per_rank=layer.local_heads,
                   rel_diff_vs_p1=diff, ranks_bit_identical=same, ok=same and diff <= tol,
                   allreduce_bytes_per_token=shape["hidden_size"] * x.element_size())
        # Timed calls update the caches in place; a decode step then continues from
        # its own last state, which keeps every call the same work.
        row["tp_ms"] = time_calls(lambda: layer(x, batch, *caches["tp"], check_inputs=False), device, iters, repeats)
        row["p1_ms"] = time_calls(lambda: full(x, batch, *caches["p1"], check_inputs=False), device, iters, repeats)
        row["speedup_vs_p1"] = row["p1_ms"] / row["tp_ms"]
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'case':<34} {'P=1 ms':>8} {'gather ms':>10} {'sharded ms':>11} {'speed-up':>9} "
          f"{'bytes/token':>15} {'rel diff':>9} {'ranks equal':>11} {'ok':>3}")
    for r in rows:
        if r["part"] == "engram":
            diff = max(r["gather_rel_diff_vs_p1"], r["sharded_rel_diff_vs_p1"])
            same = r["gather_ranks_bit_identical"] and r["sharded_ranks_bit_identical"]
            print(f"{r['case']:<34} {r['p1_ms']:>8.4f} {r['gather_ms']:>10.4f} {r['sharded_ms']:>11.4f} "
                  f"{r['sharded_speedup']:>8.2f}x {r['gather_bytes_per_token']:>7}->{r['sharded_bytes_per_token']:<7} "
                  f"{diff:>9.2e} {str(same):>11} {'yes' if r['ok'] else 'NO':>3}")
        else:
            print(f"{r['case']:<34} {r['p1_ms']:>8.4f} {'':>10} {r['tp_ms']:>11.4f} {r['speedup_vs_p1']:>8.2f}x "
                  f"{r['allreduce_bytes_per_token']:>15} {r['rel_diff_vs_p1']:>9.2e} "
                  f"{str(r['ranks_bit_identical']):>11} {'yes' if r['ok'] else 'NO':>3}")


def worker(args) -> int:
    tp, device = _init(args.backend)
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        iters, repeats = (1, 1) if args.small else (20, 5)
        tol = TOLERANCE[dtype] if args.tolerance is None else args.tolerance
        rows = []
        if args.part in ("all", "engram"):
            rows += run_engram(tp, device, dtype, ENGRAM_CASES_SMALL if args.small else ENGRAM_CASES, iters, repeats,
                               tol)
        if args.part in ("all", "kda"):
            rows += run_kda(tp, device, dtype, KDA_SHAPE_SMALL if args.small else KDA_SHAPE,
                            KDA_CASES_SMALL if args.small else KDA_CASES, iters, repeats, tol)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(f"P = {tp.world_size} ranks | {dist.get_backend()} | {name} | torch {torch.__version__}")
            print_rows(rows)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(rows, fh, indent=2)
        # Every rank past its last collective before any tears down: a rank that
        # destroyed its gloo group while a peer was still sending aborted once
        # ("terminate called without an active exception", a loaded CPU host).
        dist.barrier()
        return 0 if all(r["ok"] for r in rows) else 1
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if worker(args):
        raise SystemExit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "engram", "kda"), default="all")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU ranks, CI)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl with GPUs, else gloo")
    parser.add_argument("--spawn", type=int, metavar="P", help="start P local ranks here instead of under torchrun")
    parser.add_argument("--json", help="rank 0 writes the rows here")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max relative difference to the P = 1 layer (default: 2e-2 bf16, 1e-4 fp32)")
    args = parser.parse_args(argv)
    if args.spawn is None:
        if "RANK" not in os.environ:
            parser.error("run under torchrun (or pass --spawn P)")
        return worker(args)
    import socket

    import torch.multiprocessing as mp

    if args.backend == "gloo" or (args.backend is None and not torch.cuda.is_available()):
        # CPU ranks: the kernels run under the Triton interpreter, which must be on
        # before a process imports them; each spawned rank is a fresh interpreter that
        # inherits this (an explicit TRITON_INTERPRET=0 is kept, and refused by the kernels).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawned, args=(args.spawn, port, args), nprocs=args.spawn, join=True)
    except mp.ProcessRaisedException as exc:
        print(exc, file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
