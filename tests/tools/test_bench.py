"""``kda-engram bench``'s table (CPU: formatting only; the timings need a GPU)."""

import re
from pathlib import Path

import pytest
import torch

from kda_engram.tools.bench import print_table


def test_table_adds_the_cuda_graph_columns_where_a_row_has_them(capsys):
    rows = [
        # The sharded gate at T = 2048: slower than one post_wkv eagerly (two launches
        # timed apart), faster replayed from a graph. The table must show both.
        dict(benchmark="engram", case="sharded P=4 T=2048 d=5120", ours_ms=0.1012, peer_ms=0.0746,
             peer="post_wkv", ratio=0.7372, hbm_floor_ms=0.0568, floor_fraction=0.5613,
             graph_ms=0.0686, peer_graph_ms=0.0710),
        dict(benchmark="kda-decode", case="64 x H32", ours_ms=0.1, peer_ms=0.187, peer="fla",
             ratio=1.87, hbm_floor_ms=0.063, floor_fraction=0.63),
    ]
    print_table(rows)
    header, _, gate, decode = capsys.readouterr().out.splitlines()
    assert header.split()[-3:] == ["ms", "graph", "ratio"] and "graph ms" in header
    assert gate.split()[-2:] == ["0.0686", "1.03"]  # 0.0710 / 0.0686
    assert gate.split()[-5] == "0.74"  # the eager ratio is kept beside it
    assert decode.split()[-2:] == ["-", "-"]


def test_every_benchmark_loads_and_takes_the_runner_arguments():
    import inspect

    from kda_engram.tools.bench import BENCHMARKS, load_benchmark

    assert "kda-prologue" in BENCHMARKS
    for name in BENCHMARKS:
        params = inspect.signature(load_benchmark(name).run).parameters
        assert "peers" in params and "quick" in params, name


def test_every_benchmark_script_imports_and_has_a_main():
    # The scripts run as `python -m kda_engram.tools.benchmarks.NAME`: each must
    # import against the package and parse its own flags (--help exits 0).
    import importlib

    from kda_engram.tools.bench import BENCHMARKS, BENCHMARKS_PACKAGE, benchmark_scripts

    scripts = benchmark_scripts()
    assert set(BENCHMARKS.values()) | {"bench_tp", "sweep_kda_groups", "sweep_engram_gate"} <= set(scripts)
    for name in scripts:
        module = importlib.import_module(f"{BENCHMARKS_PACKAGE}.{name}")
        with pytest.raises(SystemExit) as exc:
            module.main(["--help"])
        assert exc.value.code == 0, name


#: The scripts that time on a GPU only; bench_tp (gloo ranks) and
#: profile_default_checks (--counts) also run on a CPU.
CPU_SCRIPTS = {"bench_tp", "profile_default_checks"}


def test_every_gpu_only_script_says_so_in_one_line_and_exits_2_on_a_cpu(monkeypatch, capsys):
    # Issue 54: bench_kda_prefill and bench_engram_table printed a traceback and exited
    # 1, sweep_engram_gate exited 1, four others printed one line and exited 2.
    import importlib

    from kda_engram.tools.bench import BENCHMARKS_PACKAGE, benchmark_scripts
    from kda_engram.tools.benchmarks.common import NEEDS_GPU_EXIT

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_only = [n for n in benchmark_scripts() if n not in CPU_SCRIPTS]
    assert {"bench_kda_prefill", "bench_engram_table", "sweep_engram_gate", "sweep_kda_groups"} <= set(gpu_only)
    for name in gpu_only:
        module = importlib.import_module(f"{BENCHMARKS_PACKAGE}.{name}")
        assert module.main([]) == NEEDS_GPU_EXIT == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(f"{name} needs a GPU"), (name, out, err)


def test_profile_default_checks_on_a_cpu_without_the_interpreter_says_so_in_one_line(monkeypatch, capsys):
    # Issue 54: a Triton traceback ("0 active drivers") and exit status 0.
    from kda_engram.tools.benchmarks import profile_default_checks

    monkeypatch.setattr(profile_default_checks, "interpreting", lambda: False)
    assert profile_default_checks.main(["--counts", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "TRITON_INTERPRET=1" in err


def test_a_benchmark_run_as_a_script_on_a_cpu_prints_no_traceback():
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the machine has a GPU")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(root, "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "kda_engram.tools.benchmarks.bench_kda_prefill"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("bench_kda_prefill needs a GPU") and done.stdout == ""


def test_profile_default_checks_reports_every_call(tmp_path, capsys):
    """The default-check profiler on a tiny CPU case: one row per call with host
    times of both modes, the verdict wait and a host profile."""
    import json

    from kda_engram.tools.benchmarks import profile_default_checks

    path = tmp_path / "profile.json"
    assert profile_default_checks.main(["--batch", "2", "--heads", "1", "--head-dim", "16", "--iters", "2",
                                        "--top", "40", "--device", "cpu", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["call"] for r in rows] == ["kda_decode", "kda_layer_decode_step", "layer_forward",
                                         "layer_forward_mixed", "layer_forward_checkpoints"]
    timed = rows[:3]  # the mixed and checkpoint batches are counted, not timed
    for r in timed:
        for key in ("host_us_nocheck", "host_us_default", "per_call_us_nocheck", "per_call_us_default"):
            assert r[key] > 0, (r["call"], key)
        assert r["wait_us_default"] > 0  # every default call after the first resolves a verdict
        assert r["syncs_default"] == []  # counted on CUDA only
    for r in timed:  # (on the CPU the interpreter's own functions fill the top)
        assert "function calls" in r["profile_default"] and "Ordered by: internal time" in r["profile_default"]
    for r in rows:  # every call launches a kernel; a checked call queues rules (device ops and a rule launch)
        assert r["launches_nocheck"] >= 1 and r["extra_launches"] >= 1 and r["extra_ops"] >= 1, r
        assert r["extra_ops"] == r["ops_default"] - r["ops_nocheck"]
    out = capsys.readouterr().out
    assert "layer_forward" in out and "nocheck/default/+" in out
    # Issue 54: the README said +6 ops (the H100's count) for the CPU's +4.
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    said = re.search(r"`kda_decode`'s does: \+(\d+) ops and \+(\d+) launch over its no-check call on a CPU \(the "
                     r"fused decode step's: \+(\d+) ops and \+(\d+) launches\)", readme)
    assert said is not None
    by_call = {r["call"]: r for r in rows}
    for call in ("kda_decode", "layer_forward"):
        assert (by_call[call]["extra_ops"], by_call[call]["extra_launches"]) == tuple(map(int, said.groups()[:2]))
    step = by_call["kda_layer_decode_step"]
    assert (step["extra_ops"], step["extra_launches"]) == tuple(map(int, said.groups()[2:]))


def test_count_ops_and_launches_counts_what_a_call_runs():
    """The counter sees each aten op once, each kernel launch once (not the ops the
    interpreter runs inside a launch), and a call's steady state."""
    from kda_engram.tools.benchmarks.profile_default_checks import count_ops_and_launches
    from kda_engram.validation.index_rules import cu_seqlens_rules

    x = torch.arange(5)
    assert count_ops_and_launches(lambda: (x + 1) * 2) == (2, 0)
    cu = torch.tensor([0, 2, 5])
    assert count_ops_and_launches(lambda: cu_seqlens_rules(cu, 5, covers_all=True)) == (1, 1)  # its verdict, its launch
    assert count_ops_and_launches(lambda: [cu_seqlens_rules(cu, 5, covers_all=True) for _ in range(3)]) == (3, 3)
    first = []  # a call whose first run differs: counted in its steady state
    assert count_ops_and_launches(lambda: first.append(1) if not first else x.neg()) == (1, 0)


# ------------------------------------------------- bench_kda_prefill: resume, budget, plot


def _prefill_rows():
    """Rows as bench_kda_prefill saves them: two cases, a forced-G row, a serving row."""
    return [
        dict(case="16x2k_H32", ours_ms=2.0, fla_ms=4.0, flashkda_ms=1.0, cudnn_ms=None, device="NVIDIA H100"),
        dict(case="16x2k_H32+cache", ours_ms=2.1, serving_form="cache"),
        dict(case="1x32k_H4", ours_ms=0.5, fla_ms=1.5, flashkda_ms=None, cudnn_ms=0.6),
        dict(case="1x32k_H4 G=8", ours_ms=0.4, forced_groups=8, fla_ms=1.5),
    ]


def test_prefill_bench_resume_skips_the_saved_cases_and_the_plot_has_every_peer():
    from kda_engram.tools.benchmarks.bench_kda_prefill import cases_done, peer_speedups, starts_within

    rows = _prefill_rows()
    assert cases_done(rows) == {"16x2k_H32", "1x32k_H4"}  # not the forced-G or serving rows
    assert peer_speedups(rows) == [("16x2k_H32", {"fla": 2.0, "flashkda": 0.5, "cudnn": None}),
                                   ("1x32k_H4", {"fla": 3.0, "flashkda": None, "cudnn": pytest.approx(1.2)})]
    assert starts_within(None, 1e9, 1e9)
    assert starts_within(540, 0, 0)  # the first case always starts
    assert starts_within(540, 400, 140) and not starts_within(540, 401, 140)


def test_prefill_bench_draws_from_saved_rows_without_a_gpu(tmp_path, monkeypatch, capsys):
    """``--plot-only`` draws every peer per case from a saved JSON on a CPU; ``--resume``
    without ``--json`` is refused."""
    import json

    from kda_engram.tools.benchmarks import bench_kda_prefill

    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps(_prefill_rows()))
    png = tmp_path / "bench.png"
    assert bench_kda_prefill.main(["--json", str(saved), "--plot", str(png), "--plot-only"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        bench_kda_prefill.main(["--resume"])
    assert "--resume and --plot-only need --json" in capsys.readouterr().err
