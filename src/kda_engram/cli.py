"""The ``kda-engram`` command line: ``demo``, ``bench`` and ``check``."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kda_engram.bench import BENCHMARKS


class Checks:
    """Collects (name, error, bound) rows, prints them as they come, and fails the run
    if any error is past its bound."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def error(self, name: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> float:
        err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        ok = err <= bound and got.shape == want.shape
        print(f"  {'ok ' if ok else 'FAIL'} {name:<58} max|err| {err:.2e}  (bound {bound:.0e})", flush=True)
        if not ok:
            self.failed.append(name)
        return err


class Stage:
    """``with Stage("prefill"):`` prints the stage's name, then its wall time."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self):
        print(f"[{self.name}]", flush=True)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        print(f"  ({time.perf_counter() - self.start:.2f} s)", flush=True)
        return False


def _demo(args: argparse.Namespace) -> int:
    from kda_engram.demo import run_demo

    return run_demo(device=args.device, seed=args.seed, small=args.small)


def _bench(args: argparse.Namespace) -> int:
    from kda_engram.bench import run_bench

    return run_bench(args.what, vs=args.vs, json_path=args.json, plot_path=args.plot, quick=args.quick)


def _check(args: argparse.Namespace) -> int:
    from kda_engram.check import run_check

    return run_check(device=args.device, examples=args.examples, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kda-engram",
        description="Triton kernels for Kimi Delta Attention and DeepSeek Engram: "
        "run the demo, the benchmarks against the peers, or a correctness sweep.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo", help="run the whole system on an embedded configuration and check it",
        description="Build a hybrid block (an Engram layer feeding a KDA layer) with random weights, prefill a "
        "batch of ragged prompts with prefix-cache checkpoints, resume one prompt from its checkpoint, decode a "
        "few tokens, and check every result against the plain-PyTorch references. Prints one line per stage "
        "with its time and every check with its error and bound; exits non-zero if any check fails. On a GPU: "
        "real sizes (K = V = 128, 32 heads, Engram dim 5120, hc 4) in bf16. On the CPU: small sizes in fp32, "
        "kernels under the Triton interpreter (about half a minute). Nothing is downloaded.",
    )
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default: 0)")
    demo.add_argument("--small", action="store_true",
                      help="use the small CPU configuration on a GPU too (the CPU always uses it)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="time our kernels against the peers (GPU)")
    bench.add_argument("what", nargs="?", default="all", choices=[*BENCHMARKS, "all"])
    bench.add_argument("--vs", default="fla", choices=["fla", "none"], help="peer to compare with (default: fla)")
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also write a PNG plot of the ratios")
    bench.add_argument("--quick", action="store_true", help="fewer cases, for a smoke run")
    bench.set_defaults(func=_bench)

    check = sub.add_parser("check", help="correctness sweep over random shapes against the references")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    check.add_argument("--examples", type=int, default=20, help="random cases per kernel (default: 20)")
    check.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
