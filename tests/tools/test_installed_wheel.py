"""``kda-engram bench`` from a plain, non-editable install, away from the repository.

The package's sources (``pyproject.toml``, ``README.md``, ``src/``) are copied out of
the checkout, built into a wheel, and the wheel installed with ``--no-deps`` into a
fresh venv that sees the system's torch and triton (``--system-site-packages``;
nothing is downloaded). Then, from a folder outside the repository and without
``PYTHONPATH``, the venv's ``kda-engram bench --help`` and one tiny CPU benchmark
(``bench_tp --small --part engram`` on two gloo ranks, kernels under the Triton
interpreter) must run from the installed copy. About 30 s on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, *, cwd, env, timeout=300):
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed ({done.returncode}):\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(venv python, the folder the commands run in, their environment, the wheel)."""
    tmp = tmp_path_factory.mktemp("installed")
    sources = tmp / "sources"  # the package without the rest of the repository
    sources.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, sources / name)
    shutil.copytree(ROOT / "src", sources / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    wheels = tmp / "wheels"
    # --no-build-isolation: the build backend (setuptools) comes from this
    # interpreter, --no-index: nothing is fetched.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheels, sources], cwd=tmp, env=env)
    (wheel,) = wheels.glob("kda_engram-*.whl")

    # --without-pip: the system's pip, seen through --system-site-packages, installs
    # into the venv (its sys.prefix) and saves the seconds ensurepip takes.
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", tmp / "venv"], cwd=tmp, env=env)
    python = tmp / "venv" / "bin" / "python"
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp, env=env)
    work = tmp / "elsewhere"
    work.mkdir()
    return python, work, env, wheel


def test_the_wheel_ships_the_tools_and_the_benchmarks(venv):
    *_, wheel = venv
    names = set(zipfile.ZipFile(wheel).namelist())
    scripts = {p.name for p in (ROOT / "src" / "kda_engram" / "tools" / "benchmarks").glob("*.py")}
    assert {"common.py", "bench_kda_prefill.py", "bench_tp.py"} <= scripts
    missing = [s for s in sorted(scripts) if f"kda_engram/tools/benchmarks/{s}" not in names]
    assert missing == []
    assert "kda_engram/tools/cli.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kda-engram = kda_engram.tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_package_is_the_venvs(venv):
    python, work, env, _ = venv
    done = _run([python, "-c", "import kda_engram; print(kda_engram.__file__)"], cwd=work, env=env)
    location = Path(done.stdout.strip())
    assert location.is_relative_to(python.parents[1]), location  # the venv's copy...
    assert not location.is_relative_to(ROOT), location  # ...not the checkout's


def test_kda_engram_bench_help_from_the_installed_package(venv):
    python, work, env, _ = venv
    done = _run([python.parent / "kda-engram", "bench", "--help"], cwd=work, env=env)
    text = " ".join(done.stdout.split())  # argparse wraps the description
    assert text.startswith("usage: kda-engram bench")
    assert "python -m kda_engram.tools.benchmarks.MODULE" in text and "bench_tp" in text


def test_one_tiny_cpu_benchmark_from_the_installed_package(venv):
    python, work, env, _ = venv
    rows = work / "rows.json"
    env = dict(env, TRITON_INTERPRET="1")
    _run([python, "-m", "kda_engram.tools.benchmarks.bench_tp", "--spawn", "2", "--backend", "gloo", "--small",
          "--part", "engram", "--json", rows], cwd=work, env=env)
    got = json.loads(rows.read_text())
    assert got and all(r["part"] == "engram" and r["P"] == 2 and r["ok"] for r in got)


def test_kda_engram_check_from_the_installed_package(venv):
    # Issue 46: `kda-engram check` crashed on every call (NameError), from the wheel too.
    python, work, env, _ = venv
    env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}  # as a user types it on a CPU machine
    done = _run([python.parent / "kda-engram", "check", "--examples", "1"], cwd=work, env=env)
    assert "check passed: every case within its bound" in done.stdout
