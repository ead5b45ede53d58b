"""Every ```python block of README.md runs as written on the CPU (kernels under the
Triton interpreter), each in a fresh interpreter: a block that raises fails."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


BLOCKS = python_blocks((ROOT / "README.md").read_text())


def test_the_readme_has_python_blocks_and_the_extractor_finds_them():
    assert len(BLOCKS) >= 2
    sample = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n\nz = 3\n```\n"
    assert python_blocks(sample) == ["x = 1\n", "y = 2\n\nz = 3\n"]


def needs_fla(block: str) -> bool:
    """A block of the fla section: it runs where the ``fla`` extra is installed (CI
    installs it: ``.ci/run``)."""
    return "from fla." in block or "import fla" in block


def test_the_fla_example_is_a_python_block():
    # Issue 46: it was a `py` block that no test ran, with q, k, ... undefined.
    fla_blocks = [b for b in BLOCKS if needs_fla(b)]
    assert len(fla_blocks) == 1
    assert "kda_fla.ROUTED" in fla_blocks[0] and "kda_fla.REFUSED" in fla_blocks[0]


@pytest.mark.parametrize("number", range(len(BLOCKS)), ids=lambda n: f"block{n}")
def test_readme_block_runs(number, tmp_path):
    if needs_fla(BLOCKS[number]):
        pytest.importorskip("fla.ops.kda", reason="the fla example needs the fla extra: pip install -e '.[fla]'")
    script = tmp_path / f"readme_block_{number}.py"
    script.write_text(BLOCKS[number])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"README python block {number} failed:\n{BLOCKS[number]}\n{done.stderr[-4000:]}"
    if needs_fla(BLOCKS[number]):  # served by kda-engram, not fla's fallback
        assert "ROUTED {'chunk_kda': 1} REFUSED {}" in done.stdout, done.stdout + done.stderr[-2000:]


def test_a_failing_block_fails(tmp_path):
    # The runner must see a raise: the same subprocess call on a block that raises.
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit('boom')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def _extras() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_readme_test_command_is_the_ci_command_and_installs_the_fla_extra():
    command = re.search(r"^python3 -m pip install -q torch.*pytest -q$", (ROOT / "README.md").read_text(), re.M)
    assert command is not None
    assert command.group(0) in (ROOT / ".ci" / "run").read_text()
    assert '".[test,fla]"' in command.group(0)  # CI runs the fla tests and the README's fla example


def test_the_extras_declare_what_their_commands_import():
    """Issue 46: fla-core imports ``packaging`` (and ``einops``) without declaring the
    first; ``scripts/gpu-check`` runs its workers with pytest-xdist."""
    extras = _extras()
    names = {extra: {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower() for req in reqs}
             for extra, reqs in extras.items()}
    assert {"fla-core", "packaging", "einops"} <= names["fla"]
    assert {"fla-core", "packaging", "einops"} <= names["peers"]
    assert "pytest-xdist" in names["test"]
    assert "import xdist" in (ROOT / "scripts" / "gpu-check").read_text()


def _test_block() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    (block,) = [b for b in blocks if "pytest -q" in b]
    return block.splitlines()


def test_the_readme_test_block_starts_a_fresh_venv_and_ci_runs_it_line_for_line():
    # Issue 54: CI installed outside a venv, so it never met what a new user meets in one.
    lines = _test_block()
    assert lines[0] == "python3 -m venv .venv && . .venv/bin/activate"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    at = [ci.index(line) for line in lines]  # each line of the block, in order
    assert at == sorted(at)
    assert ci[-1] == lines[-1]  # the tests' exit status is the script's


FAKE_PYTHON = r"""#!/bin/sh
echo "$0 $*" >> "$FAKE_LOG"
case "$1 $2" in
  "-m venv") [ -n "$FAKE_VENV_FAILS" ] && exit 3
             mkdir -p "$3/bin" && cp "$0" "$3/bin/python3"
             echo "PATH=\"$(cd "$3" && pwd)/bin:\$PATH\"" > "$3/bin/activate" ;;
  "-m pip") exit "${FAKE_PIP_RC:-0}" ;;
  "-m pytest") exit "$FAKE_PYTEST_RC" ;;
esac
exit 0
"""


@pytest.mark.parametrize("case", ["pass", "fail", "none collected", "pip fails", "venv fails"])
def test_ci_run_uses_its_venv_and_passes_on_the_exit_status(case, tmp_path):
    """``.ci/run`` with a stand-in ``python3``: the tests run from the venv's interpreter
    and their exit status (1: a failure, 5: nothing collected) is the script's; a failed
    install or venv stops it before the tests."""
    (tmp_path / ".ci").mkdir()
    run = tmp_path / ".ci" / "run"
    run.write_text((ROOT / ".ci" / "run").read_text())
    run.chmod(0o755)
    fake_bin = tmp_path / "fake_bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(FAKE_PYTHON)
    (fake_bin / "python3").chmod(0o755)
    log = tmp_path / "log"
    rc = {"pass": 0, "fail": 1, "none collected": 5}.get(case, 0)
    env = {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_PYTEST_RC": str(rc),
           "HOME": str(tmp_path)}
    if case == "pip fails":
        env["FAKE_PIP_RC"] = "7"
    if case == "venv fails":
        env["FAKE_VENV_FAILS"] = "1"
    done = subprocess.run(["bash", str(run)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines()
    if case in ("pip fails", "venv fails"):
        assert done.returncode != 0 and not any("-m pytest" in c for c in calls), (done, calls)
        return
    assert done.returncode == rc, (done.stdout, done.stderr)
    (pytest_call,) = [c for c in calls if "-m pytest" in c]
    assert pytest_call == f"{tmp_path}/.venv/bin/python3 -m pytest -q"
