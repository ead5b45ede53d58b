"""``kda-engram bench``: the benchmarks of :mod:`kda_engram.tools.benchmarks` behind one command.

Each benchmark module there exposes ``run(cases=None, peers=True[, quick=False])``
returning rows ``{case, ours_ms, peer_ms, ratio, hbm_floor_ms, floor_fraction,
...}`` measured side by side in this process. This module prints them as one
table, writes JSON and a plot of the ratios. The modules ship with the package, so
an installed copy benchmarks without the repository; each is also a script with
more options (``python -m kda_engram.tools.benchmarks.bench_kda_prefill --help``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import pkgutil
from pathlib import Path

#: ``kda-engram bench`` names -> modules of :data:`BENCHMARKS_PACKAGE`.
BENCHMARKS = {
    "kda-prefill": "bench_kda_prefill",
    "kda-prologue": "bench_kda_prologue",
    "kda-decode": "bench_kda_decode",
    "engram": "bench_engram_gate",
    "engram-table": "bench_engram_table",
}

BENCHMARKS_PACKAGE = "kda_engram.tools.benchmarks"


class NeedsGPU(RuntimeError):
    """``bench`` was run where torch sees no GPU (one line)."""


def require_gpu() -> None:
    """Raise :class:`NeedsGPU` unless torch sees a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise NeedsGPU("bench needs a GPU (CUDA or ROCm) and this torch sees none: the timings are only "
                       "meaningful on one")


def benchmark_scripts() -> list[str]:
    """The modules of :data:`BENCHMARKS_PACKAGE` that run as scripts (all but their
    shared ``common``), sorted."""
    package = importlib.import_module(BENCHMARKS_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name != "common")


def load_benchmark(name: str):
    """The module of benchmark ``name`` (a key of :data:`BENCHMARKS`)."""
    return importlib.import_module(f"{BENCHMARKS_PACKAGE}.{BENCHMARKS[name]}")


def _fmt(x, spec=".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def print_table(rows: list[dict]) -> None:
    """One line per row. Rows that carry CUDA-graph times (``graph_ms``, and
    ``peer_graph_ms`` for the peer) add them in the last two columns: eager times of
    kernels shorter than their launch measure the host (the Engram gate at T = 64,
    the sharded gate's two launches at T = 2048), and an engine replays graphs."""
    header = (
        f"{'benchmark':<12} {'case':<26} {'ours ms':>9} {'peer ms':>9} {'peer':<16} {'ratio':>6} "
        f"{'floor ms':>9} {'of floor':>8} {'graph ms':>9} {'graph ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        graph_ms, peer_graph_ms = r.get("graph_ms"), r.get("peer_graph_ms")
        graph_ratio = peer_graph_ms / graph_ms if graph_ms and peer_graph_ms else None
        print(
            f"{r.get('benchmark', ''):<12} {r['case']:<26} {_fmt(r.get('ours_ms')):>9} {_fmt(r.get('peer_ms')):>9} "
            f"{str(r.get('peer') or '-'):<16} {_fmt(r.get('ratio'), '.2f'):>6} {_fmt(r.get('hbm_floor_ms')):>9} "
            f"{_fmt(r.get('floor_fraction'), '.0%'):>8} {_fmt(graph_ms, '.4f'):>9} {_fmt(graph_ratio, '.2f'):>11}"
        )


def plot_ratios(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows) + 2), 4))
    labels = [f"{r.get('benchmark', '')}\n{r['case']}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="#3b7dd8")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speed-up over peer (peer ms / ours ms)")
    ax.set_title("kda-engram vs peers (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def run_bench(what: str = "all", *, vs: str = "fla", json_path: str | None = None, plot_path: str | None = None,
              quick: bool = False) -> int:
    """Run the benchmarks and print one table; returns the exit status (1 if a
    benchmark failed). Raises :class:`NeedsGPU` (one line) without a GPU."""
    require_gpu()
    names = list(BENCHMARKS) if what == "all" else [what]
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is optional; run without a bar
        tqdm = None
    rows: list[dict] = []
    failed = False
    progress = tqdm(names, desc="benchmarks", unit="bench") if tqdm else names
    for name in progress:
        try:
            module = load_benchmark(name)
            kwargs = {"peers": vs != "none"}
            if "quick" in inspect.signature(module.run).parameters:
                kwargs["quick"] = quick
            got = module.run(**kwargs)
        except Exception as exc:  # report and go on with the other benchmarks
            print(f"benchmark {name} failed: {type(exc).__name__}: {exc}")
            failed = True
            continue
        for row in got:
            row.setdefault("benchmark", name)
        rows.extend(got)
    print_table(rows)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2, default=str))
        print(f"wrote {json_path}")
    if plot_path and rows:
        plot_ratios(rows, plot_path)
        print(f"wrote {plot_path}")
    return 1 if failed else 0
