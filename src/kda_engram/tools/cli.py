"""The ``kda-engram`` command line: ``demo``, ``bench`` and ``check``."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from .bench import BENCHMARKS, BENCHMARKS_PACKAGE, benchmark_scripts
from .reporting import MAX_SEED


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``kda-engram demo: error: ...``) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_in(low: int, what: str, high: int | None = None, too_big: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected {too_big}, got {value}")
        return value

    return parse


_seed = _int_in(0, "a non-negative integer", MAX_SEED, f"at most {MAX_SEED} (a signed 64-bit seed)")
_examples = _int_in(1, "at least 1 case per kernel")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .reporting import pick_device

    return run_demo(device=pick_device(args.device), seed=args.seed, small=args.small)


def _bench(args: argparse.Namespace) -> int:
    from .bench import require_gpu, run_bench

    require_gpu()  # before any benchmark is imported
    return run_bench(args.what, vs=args.vs, json_path=args.json, plot_path=args.plot, quick=args.quick)


def _check(args: argparse.Namespace) -> int:
    from .check import run_check
    from .reporting import pick_device

    return run_check(device=pick_device(args.device), examples=args.examples, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kda-engram",
        description="Triton kernels for Kimi Delta Attention and DeepSeek Engram: "
        "run the demo, the benchmarks against the peers, or a correctness sweep.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the weights and inputs, >= 0 (default: 0)")
    demo.add_argument("--small", action="store_true",
                      help="use the small CPU configuration on a GPU too (the CPU always uses it)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser(
        "bench", help="time our kernels against the peers (needs a GPU)",
        description="Time the kernels against their peers (fla-core for KDA, torch for the Engram gate and "
        "table) in this process and print one table: eager and CUDA-graph times, the ratio, and the fraction "
        "of the HBM floor. Needs a GPU (CUDA or ROCm); without one it exits 2. The benchmarks ship with the "
        "package; each is also a script with more options (cases, sweeps, profiles): "
        f"python -m {BENCHMARKS_PACKAGE}.MODULE --help, MODULE one of {', '.join(benchmark_scripts())} "
        "(bench_tp: tensor parallel, also under torchrun -m).",
    )
    bench.add_argument("what", nargs="?", default="all", choices=[*BENCHMARKS, "all"])
    bench.add_argument("--vs", default="fla", choices=["fla", "none"], help="peer to compare with (default: fla)")
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also write a PNG plot of the ratios")
    bench.add_argument("--quick", action="store_true", help="fewer cases, for a smoke run")
    bench.set_defaults(func=_bench)

    check = sub.add_parser(
        "check", help="correctness sweep over random shapes against the references",
        description="Draw random cases (ragged lengths, head counts, dims, gate forms, masks) for the KDA "
        "prefill, the KDA decode and the Engram gate (fused and dim-sharded), run each kernel and its "
        "plain-PyTorch reference, and print every error against its bound; exits 1 if any case is out of "
        "bounds. On a GPU in bf16; on the CPU in fp32 with the kernels under the Triton interpreter.",
    )
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    check.add_argument("--examples", type=_examples, default=20, help="random cases per kernel, >= 1 (default: 20)")
    check.add_argument("--seed", type=_seed, default=0, help="random seed, >= 0 (default: 0)")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit status. Bad options, a device that is
    not there and ``bench`` without a GPU end in one line on stderr and 2."""
    from .bench import NeedsGPU
    from .reporting import DeviceError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # blamed on the subcommand that was given them (argparse blames the top level)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except (DeviceError, NeedsGPU) as exc:
        print(f"kda-engram {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
