"""The GPU tier's machinery on the CPU: the worker plan, the smoke selection,
the launch log behind the smoke's kernel coverage, and the first-fit autotuning
the peer comparison uses (tests/gpu_tiers.py, tests/helpers.py)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from .gpu_tiers import (
    DEFAULT_GPU_MEM_GIB,
    SMOKE_TESTS,
    WORKER_OVERHEAD_GIB,
    defined_kernels,
    log_launches,
    outcomes_summary,
    plan,
    read_outcomes,
    summary,
)
from .helpers import first_fit_autotune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def side_by_side(budgets, p, workers):
    """GiB the ``workers`` largest of ``budgets`` need at once, overheads included."""
    return sum(sorted(budgets, reverse=True)[:workers]) + workers * WORKER_OVERHEAD_GIB


@pytest.mark.parametrize("free", [20.0, 78.5, 139.0])
def test_plan_fits_the_card(free):
    # The tier's shape today: many 2 GiB tests, a few of 4-10, the big decode cases.
    budgets = [2.0] * 100 + [4.0] * 12 + [6.0] * 4 + [8.0, 10.0] + [18.0] * 2 + [24.0] * 3
    p = plan(budgets, free, max_workers=16)
    small = [b for b in budgets if b <= p["cap"]]
    big = [b for b in budgets if b > p["cap"]]
    assert 1 <= p["workers"] <= 16
    assert side_by_side(small, p, p["workers"]) <= p["usable"] or p["workers"] == 1
    if big:
        runnable = [b for b in big if b + WORKER_OVERHEAD_GIB <= p["usable"]]
        assert p["big_workers"] >= 1
        assert not runnable or p["big_workers"] == 1 or side_by_side(runnable, p, p["big_workers"]) <= p["usable"]
    else:
        assert p["big_workers"] == 0
    if free > 70:  # an 80 GB card runs all but the few largest side by side, 8 or more at once
        assert p["workers"] >= 8 and p["cap"] >= 4.0 and len(big) <= 16
    if free > 130:  # an H200 runs the big ones all at once
        assert p["big_workers"] == len(big)


def test_plan_splits_off_what_would_narrow_the_pass():
    p = plan([2.0] * 10 + [30.0], 40.0, max_workers=8)
    # 8 workers fit with the 2 GiB tests (8 * 3 = 24 <= 36.8); with the 30 GiB one only 2 would.
    assert (p["workers"], p["cap"], p["big_workers"]) == (8, 2.0, 1)
    assert plan([], 80.0, 16) == dict(cap=0.0, workers=1, big_workers=0, usable=80.0 * 0.92)
    # A card too small for everything still runs one worker (the conftest skips what cannot fit).
    tiny = plan([DEFAULT_GPU_MEM_GIB] * 4 + [24.0], 3.0, max_workers=16)
    assert tiny["workers"] == 1 and tiny["big_workers"] <= 1


def test_smoke_selection_names_collected_tests():
    """Every smoke node id exists (a renamed test or parameter would drop it silently)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")) if p)
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "smoke", *SMOKE_TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    collected = {line.strip() for line in run.stdout.splitlines() if "::" in line}
    assert collected == set(SMOKE_TESTS), set(SMOKE_TESTS) ^ collected


def test_launch_log_passes_launches_through():
    from kda_engram.kda.conv import kda_conv_decode
    from kda_engram.kda.reference import naive_conv_decode

    assert {"_kda_decode_kernel", "_conv_decode_kernel", "_engram_post_wkv_kernel"} <= defined_kernels()
    launched = set()
    restore = log_launches(launched)
    try:
        x, w, state = torch.randn(2, 8), torch.randn(8, 4), torch.randn(3, 8, 3)
        want, want_state = naive_conv_decode(x, w, state, torch.tensor([2, 0]))
        out = kda_conv_decode(x, w, state, torch.tensor([2, 0]), out_dtype=torch.float32)
    finally:
        restore()
    assert launched == {"_conv_decode_kernel"}
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, want_state)
    import kda_engram.kda.conv as conv

    assert isinstance(conv._conv_decode_kernel, triton.runtime.jit.KernelInterface)


@triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"])
@triton.jit
def _add_one_kernel(x, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)


def test_first_fit_autotune_runs_one_config_and_forgets_it(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    benched = []
    bench = Autotuner._bench

    def spy(self, *args, config, **meta):
        benched.append(config.kwargs["BLOCK"])
        return bench(self, *args, config=config, **meta)

    monkeypatch.setattr(Autotuner, "_bench", spy)
    x = torch.zeros(8)
    with first_fit_autotune():
        _add_one_kernel[(1,)](x, 8)
        assert _add_one_kernel.best_config.kwargs["BLOCK"] == 16
    assert benched == [16]  # the first config ran; the others were neither compiled nor timed
    assert torch.equal(x, torch.full((8,), 2.0))  # the one-shot launch and the real one
    assert _add_one_kernel.cache == {} and not _add_one_kernel.cache_results
    assert Autotuner._bench is spy and not math.isnan(x.sum().item())


def test_summary_of_junit_files(tmp_path):
    xml = tmp_path / "pass1.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.kda.test_decode" name="test_a[large]" time="12.5"><properties>'
        '<property name="gpu_mem_peak_gib" value="30.1" /><property name="gpu_mem_budget_gib" value="24.0" />'
        '</properties></testcase>'
        '<testcase classname="tests.kda.test_decode" name="test_b" time="1.0"><failure message="x" /></testcase>'
        '<testcase classname="tests.kda.test_prefill" name="test_c" time="0.0"><skipped message="no fla" />'
        '</testcase></testsuite></testsuites>')
    text = summary([str(xml), str(tmp_path / "absent.xml")], 42.0, slowest=2)
    lines = text.splitlines()
    assert lines[0] == "1 passed, 1 failed, 1 skipped in 42.0 s of wall time"
    assert "12.50" in lines[2] and "30.10 / 24" in lines[2] and "tests.kda.test_decode::test_a[large]" in lines[2]
    assert "test_b" in lines[3] and "failed" in lines[3] and len(lines) == 5
    assert lines[4].startswith("OVER BUDGET: tests.kda.test_decode::test_a[large] peaked at 30.10 GiB")


_OUTCOME_CASES = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("planted set-up fault")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "planted failure"

def test_skips():
    pytest.skip("planted skip")

def test_errors(broken):
    pass
"""


def test_outcome_log_keeps_each_result_and_failure_text(tmp_path):
    """A real pytest run with the project's plugin writes a line per phase as it ends;
    the reader names the failure and the set-up error with their text."""
    (tmp_path / "test_cases.py").write_text(_OUTCOME_CASES)
    log = tmp_path / "outcomes.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "src")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "--rootdir", str(tmp_path), "--outcome-log", str(log), str(tmp_path / "test_cases.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    tests = {k.split("::")[-1]: v for k, v in read_outcomes(str(log)).items()}
    assert {k: v["outcome"] for k, v in tests.items()} == dict(
        test_passes="passed", test_fails="failed", test_skips="skipped", test_errors="error")
    assert "planted failure" in tests["test_fails"]["text"]
    assert "planted set-up fault" in tests["test_errors"]["text"]
    assert tests["test_passes"]["text"] is None


def test_outcome_log_read_while_cut_short(tmp_path):
    """A log cut by a killed run: a test whose call never reported is "running", a
    torn last line is skipped, and the summary names the failure with its text."""
    lines = [
        dict(id="t.py::a", phase="setup", outcome="passed", seconds=0.5, worker="gw0"),
        dict(id="t.py::a", phase="call", outcome="passed", seconds=2.0, worker="gw0"),
        dict(id="t.py::a", phase="teardown", outcome="passed", seconds=0.1, worker="gw0"),
        dict(id="t.py::b", phase="setup", outcome="passed", seconds=0.1, worker="gw1"),
        dict(id="t.py::b", phase="call", outcome="failed", seconds=7.0, worker="gw1",
             text="Traceback\nAssertionError: max err 3e-2 > 1e-2"),
        dict(id="t.py::b", phase="teardown", outcome="passed", seconds=0.1, worker="gw1"),
        dict(id="t.py::c", phase="setup", outcome="passed", seconds=0.2, worker="gw2"),
    ]
    log = tmp_path / "outcomes.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"id": "t.py::d", "pha')
    got = read_outcomes(str(log))
    assert {k: v["outcome"] for k, v in got.items()} == {"t.py::a": "passed", "t.py::b": "failed",
                                                         "t.py::c": "running"}
    assert got["t.py::a"]["seconds"] == 2.6
    text = outcomes_summary(str(log), slowest=2).splitlines()
    assert text[0].startswith("1 passed, 1 failed, 1 running (3 tests reported")
    assert "FAILED: t.py::b (7.2 s)" in text and "    AssertionError: max err 3e-2 > 1e-2" in text
    assert "RUNNING: t.py::c (0.2 s)" in text
    assert text[-2].endswith("t.py::b  failed") and text[-1].endswith("t.py::a  passed")
