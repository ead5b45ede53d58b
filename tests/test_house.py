"""House rules read from the source (CPU, no kernels run).

* Measurements and dated records live in ``docs/design/*.md``, not in ``src/``:
  no line of the package carries a date (``YYYY-MM-DD``), in code, comment or
  docstring.
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kda_engram"

DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")


def dated_lines(src: Path = SRC) -> list[str]:
    """``path:line: text`` of every line under ``src`` that holds a date."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DATE.search(line):
                found.append(f"{path.relative_to(src.parent)}:{number}: {line.strip()}")
    return found


def test_no_dated_line_in_src():
    assert dated_lines() == [], "move dated records to docs/design/<family>.md"


def test_the_date_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text('"""Measured on an H200 (2026-12-04)."""\nx = 1\n')
    assert dated_lines(tmp_path) == ['m.py:1: """Measured on an H200 (2026-12-04)."""'.replace(
        "m.py", f"{tmp_path.name}/m.py")]
