"""The Gluon folded prologue (:mod:`kda_engram.kda.hopper.prologue`) against the Triton
folded prologue (:mod:`kda_engram.kda.hopper.folded_prologue`), on one Hopper GPU.

    python -m kda_engram.tools.benchmarks.bench_gluon_prologue                      # 16x2k_H32
    python -m kda_engram.tools.benchmarks.bench_gluon_prologue --seqs 1 --seqlen 32768 --heads 4

Inputs: bf16 ``q, k, v, raw_g [1, T, H, 128]`` and ``raw_beta [1, T, H]``, fp32
``A_log [H]`` and ``dt_bias [H*128]``, the bounded gate (``--lower-bound``, -5 by
default), ``seqs`` sequences of ``seqlen`` tokens. The Gluon prologue runs uncapped
and at each ``--maxnregs`` register cap (the sweep of docs/design/kda_fused_prefill.md);
times are ``triton.testing.do_bench`` medians in ms, the chunk metadata built once
outside the timed region.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ...bundles import KDAInputs
from ...kda.hopper.folded_prologue import prepare_folded_prologue
from ...kda.hopper.prologue import gluon_folded_prologue
from ...kda.metadata import prepare_chunk_metadata
from .common import bench_ms, no_gpu_exit

HEAD_DIM = 128
MAXNREGS = (None, 168, 128)  # None: uncapped (255 registers, one CTA per SM)


def run(seqs: int = 16, seqlen: int = 2048, heads: int = 32, lower_bound: float = -5.0,
        maxnregs=MAXNREGS) -> dict[str, float]:
    """Time the Gluon prologue (uncapped and at each ``maxnregs`` cap) against the Triton
    folded prologue on ``cuda``; prints one line and returns ``{name: ms}`` (names
    ``"triton"``, ``"gluon"``, ``"gluon_maxnreg<N>"``)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    T, K = seqs * seqlen, HEAD_DIM
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = {n: rnd(1, T, heads, K).to(torch.bfloat16) for n in ("q", "k", "v", "raw_g")}
    raw_beta = rnd(1, T, heads).to(torch.bfloat16)
    A_log, dt_bias = rnd(heads) * 0.5, rnd(heads * K)
    cu = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * seqlen
    _, indices = prepare_chunk_metadata(cu, T)
    args = (KDAInputs(**x, raw_beta=raw_beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound), cu, indices)
    launches = {"triton": prepare_folded_prologue(*args)}
    for mr in maxnregs:
        launches["gluon" if mr is None else f"gluon_maxnreg{mr}"] = gluon_folded_prologue(*args, maxnreg=mr)
    ms = {name: bench_ms(fn) for name, fn in launches.items()}
    print(f"{seqs}x{seqlen}_H{heads} ({torch.cuda.get_device_name(dev)}): "
          + ", ".join(f"{name} {t:.3f} ms" for name, t in ms.items())
          + f"; triton / gluon {ms['triton'] / ms['gluon']:.2f}x", flush=True)
    return ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--lower-bound", type=float, default=-5.0)
    parser.add_argument("--maxnregs", type=int, nargs="*", default=[168, 128],
                        help="register caps timed beside the uncapped build")
    args = parser.parse_args(argv)
    code = no_gpu_exit("bench_gluon_prologue")
    if code is not None:
        return code
    run(args.seqs, args.seqlen, args.heads, args.lower_bound, (None, *args.maxnregs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
