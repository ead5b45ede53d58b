"""The command line's errors: bad options, a device that is not there, ``bench``
without a GPU -- each one line on stderr and exit status 2, before any work is done."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kda_engram.tools import bench, check, demo
from kda_engram.tools.cli import build_parser, main

SRC = Path(__file__).resolve().parents[2] / "src"


def _refused(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _fails(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any run that gets past the option checks fails the test."""
    def ran(*args, **kwargs):
        raise AssertionError("the command ran instead of refusing its options")

    monkeypatch.setattr(demo, "run_demo", ran)
    monkeypatch.setattr(check, "run_check", ran)
    monkeypatch.setattr(bench, "run_bench", ran)


@pytest.mark.parametrize("argv, says", [
    (["demo", "--seed", "-1"], "--seed: expected a non-negative integer, got -1"),
    (["check", "--seed", "-3"], "--seed: expected a non-negative integer, got -3"),
    (["check", "--examples", "0"], "--examples: expected at least 1 case per kernel, got 0"),
    (["check", "--examples", "-2"], "--examples: expected at least 1 case per kernel, got -2"),
    (["demo", "--seed", "x"], "--seed: expected an integer, got 'x'"),
    (["bench", "nonsense"], "invalid choice: 'nonsense'"),
    # issue 36: was torch's "Overflow when unpacking long long" after the run started
    (["demo", "--seed", "99999999999999999999999"], "--seed: expected at most 9223372036854775807"),
    (["check", "--seed", "99999999999999999999999"], "--seed: expected at most 9223372036854775807"),
    (["demo", "--bogus"], "kda-engram demo: error: unrecognized arguments: --bogus"),  # names the subcommand
])
def test_bad_options_are_one_line_and_exit_2(capsys, nothing_runs, argv, says):
    assert says in _refused(capsys, argv)


@pytest.mark.parametrize("command", ["demo", "check"])
def test_unknown_device_is_one_line_and_exit_2(capsys, nothing_runs, command):
    err = _fails(capsys, [command, "--device", "tpu"])
    assert err.startswith(f"kda-engram {command}: error: --device: expected one of cpu, cuda, got 'tpu'")


@pytest.mark.parametrize("command", ["demo", "check"])
def test_cuda_without_a_gpu_is_one_line_and_exit_2(capsys, monkeypatch, nothing_runs, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _fails(capsys, [command, "--device", "cuda"])
    assert "this torch sees no GPU" in err and "--device cpu" in err


def test_bench_without_a_gpu_is_one_line_and_exit_2(capsys, monkeypatch, nothing_runs):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "bench needs a GPU" in _fails(capsys, ["bench", "--quick"])


def test_bench_loads_its_benchmarks_from_the_package_not_the_working_directory(monkeypatch, tmp_path):
    # A user who installed the package runs `kda-engram bench` from anywhere.
    monkeypatch.chdir(tmp_path)
    module = bench.load_benchmark("kda-decode")
    assert module.__name__ == f"{bench.BENCHMARKS_PACKAGE}.bench_kda_decode"
    assert Path(module.__file__).parent == Path(bench.__file__).parent / "benchmarks"


def test_the_library_calls_refuse_what_the_cli_refuses():
    with pytest.raises(ValueError, match="examples: expected a positive number"):
        check.run_check(device="cpu", examples=0)
    with pytest.raises(ValueError, match="seed: expected a non-negative integer"):
        demo.run_demo(device="cpu", seed=-1)


def test_every_subcommand_has_a_description_and_bench_says_it_needs_a_gpu():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        assert sub.description and len(sub.description) > 40, name
    helps = {a.dest: a.help for a in subparsers._choices_actions}
    assert "GPU" in helps["bench"] and "GPU" in subparsers.choices["bench"].description


def test_the_installed_entry_point_refuses_in_one_line():
    # Through a fresh interpreter, as a user runs it: nothing of the test process leaks in.
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "kda_engram.tools.cli", "demo", "--device", "tpu"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "kda-engram demo: error: --device: expected one of cpu, cuda, got 'tpu'"
    assert "Traceback" not in done.stdout + done.stderr


def test_version(capsys):
    from kda_engram import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kda-engram {__version__}"


def test_cpu_with_the_interpreter_turned_off_is_one_line_and_exit_2(capsys, monkeypatch, nothing_runs):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    err = _fails(capsys, ["demo", "--device", "cpu"])
    assert "TRITON_INTERPRET=0 is set" in err and "TRITON_INTERPRET=1" in err


def test_interpreter_set_after_import_is_one_line():
    # A fresh process: the kernels are imported with the interpreter off, then it is turned on.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    code = (
        "import os, torch\n"
        "from kda_engram.kda.decode import kda_decode\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "x = torch.zeros(1, 1, 16)\n"
        "try:\n"
        "    kda_decode(x, x, x, x, torch.zeros(1, 1), torch.zeros(1), torch.zeros(16), torch.zeros(2, 1, 16, 16),\n"
        "               torch.tensor([0]))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "TRITON_INTERPRET=1 was set after kda_engram's kernels were imported" in done.stdout


def test_check_runs_for_real_on_the_cpu():
    # issue 46: `kda-engram check` crashed on every call (NameError: check_seed); the other
    # CLI tests replace run_check with a stub, so this one runs the real command, as a user does.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    done = subprocess.run([sys.executable, "-m", "kda_engram.tools.cli", "check", "--examples", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "check passed: every case within its bound" in done.stdout
    for kernel in ("[kda-prefill]", "[kda-decode]", "[engram]"):
        assert kernel in done.stdout, kernel
