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


@pytest.mark.parametrize("number", range(len(BLOCKS)), ids=lambda n: f"block{n}")
def test_readme_block_runs(number, tmp_path):
    script = tmp_path / f"readme_block_{number}.py"
    script.write_text(BLOCKS[number])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"README python block {number} failed:\n{BLOCKS[number]}\n{done.stderr[-4000:]}"


def test_a_failing_block_fails(tmp_path):
    # The runner must see a raise: the same subprocess call on a block that raises.
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit('boom')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
