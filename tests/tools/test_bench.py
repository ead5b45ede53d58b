"""``kda-engram bench``'s table (CPU: formatting only; the timings need a GPU)."""

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
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    for name in BENCHMARKS:
        params = inspect.signature(load_benchmark(name, folder).run).parameters
        assert "peers" in params and "quick" in params, name


def test_group_sweep_imports_and_refuses_without_a_gpu(monkeypatch, capsys):
    # benchmarks/sweep_kda_groups.py (the sweep behind kda/groups.py's constants)
    # must keep importing against the package; on a CPU machine it exits 2.
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_kda_groups.py"
    spec = importlib.util.spec_from_file_location("sweep_kda_groups", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sweep.main(["--part", "groups"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
