"""``kda-engram bench`` from a plain, non-editable install, away from the repository.

The package's sources (``pyproject.toml``, ``README.md``, ``src/``) are copied out of
the checkout, built into a wheel, and the wheel installed with ``--no-deps`` into a
fresh venv that sees the running interpreter's packages, torch and triton among them
(``venv_seeing``: a ``.pth`` file adds its site directories; nothing is downloaded).
That works whether the tests run from a system interpreter or from a venv. Then, from a folder outside the repository and without
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


SITE_DIRS = ("import json, site, sys; print(json.dumps(site.getsitepackages()"
             " + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))")


def venv_seeing(python, dest, *, env=None) -> Path:
    """A venv at ``dest`` that sees ``python``'s packages; returns its interpreter.

    Not ``--system-site-packages``: from an interpreter that is itself a venv, that
    flag shows the base interpreter's site-packages, not the venv's (where a new user's
    torch is). Instead a ``.pth`` file in the new venv adds ``python``'s own site
    directories (their ``.pth`` files processed, after the venv's own packages).
    ``--without-pip``: ``python``'s pip, seen so, installs into the new venv (its
    ``sys.prefix``) and saves the seconds ensurepip takes.
    """
    dest = Path(dest)
    cwd = dest.parent
    dirs = json.loads(_run([python, "-c", SITE_DIRS], cwd=cwd, env=env).stdout)
    _run([python, "-m", "venv", "--without-pip", dest], cwd=cwd, env=env)
    new = Path(dest) / "bin" / "python"
    (own,) = json.loads(_run([new, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
                             cwd=cwd, env=env).stdout)
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs if Path(d).is_dir()]
    (Path(own) / "zz_kda_engram_parent_site.pth").write_text("\n".join(lines) + "\n")
    return new


def test_a_venv_made_from_a_venv_sees_that_venvs_packages(tmp_path):
    # Issue 54: made with --system-site-packages from inside a fresh venv, the wheel's
    # venv saw the base interpreter's site-packages (no torch there) instead of the
    # venv's. A bare venv holding a marker package stands for the user's venv.
    outer = tmp_path / "outer"
    _run([sys.executable, "-m", "venv", "--without-pip", outer], cwd=tmp_path, env=None)
    outer_python = outer / "bin" / "python"
    (site_dir,) = json.loads(_run([outer_python, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
                                  cwd=tmp_path, env=None).stdout)
    (Path(site_dir) / "kda_engram_issue54_marker").mkdir()
    (Path(site_dir) / "kda_engram_issue54_marker" / "__init__.py").write_text("WHERE = 'outer venv'\n")
    inner = venv_seeing(outer_python, tmp_path / "inner")
    done = _run([inner, "-c", "import kda_engram_issue54_marker as m; print(m.WHERE)"], cwd=tmp_path, env=None)
    assert done.stdout.strip() == "outer venv"


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

    python = venv_seeing(sys.executable, tmp / "venv", env=env)
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
