"""House rules read from the source (CPU, no kernels run).

* Measurements and dated records live in ``docs/design/*.md``, not in ``src/``:
  no line of the package carries a date (``YYYY-MM-DD``), in code, comment or
  docstring.
* One reference convention: the plain-PyTorch references live in a
  ``reference.py`` beside what they check and are named ``naive_*`` (besides the
  few building blocks they share, listed below); no other module defines one.
* One import style: inside the package, imports of the package are relative.
* No kept-for-nobody names: 0.1.0 has no users to keep old names for, so the
  package defines no deprecated alias (no ``DeprecationWarning``, no
  ``kda/deprecated.py``) and registers each ``torch.ops`` op under its Python
  function's name.
* Rooms: no module imports another module's private name (``_x``), but for the
  ``@triton.jit`` kernels and helpers a kernels module shares with its launchers;
  the Hopper path's modules live under ``kda/hopper/``; ``experiments/`` holds
  experiments, not GPU checks of the package (those are ``@pytest.mark.gpu`` tests).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kda_engram"

DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")

#: Public functions of a reference.py that are not references of a kernel but the
#: pieces the references share (and, for kda_gate, a public formula of the package).
REFERENCE_BUILDING_BLOCKS = {"compute_dtype", "gate_from_sums", "kda_gate", "l2norm", "shard_kv_by_dim", "stored_state"}
#: Names that say "reference" in the retired spellings.
RETIRED_REFERENCE_NAME = re.compile(r"(_ref|_reference)$")


def dated_lines(src: Path = SRC) -> list[str]:
    """``path:line: text`` of every line under ``src`` that holds a date."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DATE.search(line):
                found.append(f"{path.relative_to(src.parent)}:{number}: {line.strip()}")
    return found


def top_level_functions(path: Path) -> list[str]:
    return [n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def reference_naming_problems(src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        where = path.relative_to(src.parent)
        for name in top_level_functions(path):
            if name.startswith("_"):
                continue
            if path.name == "reference.py":
                if not name.startswith("naive_") and name not in REFERENCE_BUILDING_BLOCKS:
                    bad.append(f"{where}: {name} (a reference is named naive_*)")
            elif name.startswith("naive_") or RETIRED_REFERENCE_NAME.search(name):
                bad.append(f"{where}: {name} (references live in a reference.py)")
    return bad


def absolute_package_imports(src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{path.relative_to(src.parent)}:{node.lineno}: {n}" for n in names
                    if n == src.name or n.startswith(src.name + ".")]
    return bad


def test_no_dated_line_in_src():
    assert dated_lines() == [], "move dated records to docs/design/<family>.md"


def test_the_date_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text('"""Measured on an H200 (2026-12-04)."""\nx = 1\n')
    assert dated_lines(tmp_path) == [f'{tmp_path.name}/m.py:1: """Measured on an H200 (2026-12-04)."""']


def test_references_are_naive_and_live_in_reference_py():
    assert reference_naming_problems() == []


def test_the_reference_check_can_fail(tmp_path):
    (tmp_path / "reference.py").write_text("def gate_ref():\n    pass\ndef naive_gate():\n    pass\n")
    (tmp_path / "gate.py").write_text("def naive_gate():\n    pass\ndef gate_reference():\n    pass\n")
    assert reference_naming_problems(tmp_path) == [
        f"{tmp_path.name}/gate.py: naive_gate (references live in a reference.py)",
        f"{tmp_path.name}/gate.py: gate_reference (references live in a reference.py)",
        f"{tmp_path.name}/reference.py: gate_ref (a reference is named naive_*)",
    ]


def test_package_imports_itself_relatively():
    assert absolute_package_imports() == []


def test_the_import_check_can_fail(tmp_path):
    pkg = tmp_path / "kda_engram"
    pkg.mkdir()
    (pkg / "gate.py").write_text("from kda_engram.platform import arch\nfrom .platform import arch\n"
                                 "def f():\n    import kda_engram.kda\n")
    assert absolute_package_imports(pkg) == ["kda_engram/gate.py:1: kda_engram.platform",
                                             "kda_engram/gate.py:4: kda_engram.kda"]


def deprecation_warnings(src: Path = SRC) -> list[str]:
    """``path:line`` of every ``DeprecationWarning`` the package would raise."""
    return [f"{path.relative_to(src.parent)}:{number}" for path in sorted(src.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if "DeprecationWarning" in line]


def test_no_deprecated_alias():
    assert not (SRC / "kda" / "deprecated.py").exists()
    assert deprecation_warnings() == []


def test_the_deprecation_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text("import warnings\nwarnings.warn('old', DeprecationWarning)\n")
    assert deprecation_warnings(tmp_path) == [f"{tmp_path.name}/m.py:2"]


def test_ops_are_named_as_their_functions():
    import torch

    import kda_engram.ops as ops

    for name in ops.__all__:
        if callable(getattr(ops, name)) and name not in ("handle", "resolve"):
            assert hasattr(torch.ops.kda_engram, name), name
    for old in ("fused_kda_prologue", "fused_kda_chunk", "fused_kda_decode_step"):
        assert not hasattr(ops, old) and not hasattr(torch.ops.kda_engram, old), old


def private_imports(src: Path = SRC) -> list[str]:
    """``path:line: module.name`` of every private name (``_x``) a module imports from
    another module of the package, but for ``@triton.jit`` / ``@gluon.jit`` functions
    (kernels and their helpers live in a kernels module and are launched or called
    from beside it)."""
    def jitted(module_path: Path) -> set[str]:
        names = set()
        for node in ast.parse(module_path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    (d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")) == "jit"
                    for d in (dec.func if isinstance(dec, ast.Call) else dec for dec in node.decorator_list)):
                names.add(node.name)
        return names

    bad = []
    for path in sorted(src.rglob("*.py")):
        package = path.parent if path.name != "__init__.py" else path.parent
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split(".")) if node.module else base
            file = target.with_suffix(".py") if target.with_suffix(".py").exists() else target / "__init__.py"
            if not file.exists():
                continue
            allowed = jitted(file)
            bad += [f"{path.relative_to(src.parent)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and a.name not in allowed]
    return bad


def test_no_private_name_imported_across_modules():
    assert private_imports() == []


def test_the_private_import_check_can_fail(tmp_path):
    pkg = tmp_path / "kda_engram"
    pkg.mkdir()
    (pkg / "a.py").write_text("import triton\n@triton.jit\ndef _k():\n    pass\ndef _helper():\n    pass\n")
    (pkg / "b.py").write_text("from .a import _helper, _k\n")
    assert private_imports(pkg) == ["kda_engram/b.py:1: a._helper"]


def test_rooms():
    assert not (SRC / "kda" / "folded_prologue.py").exists()
    assert (SRC / "kda" / "hopper" / "folded_prologue.py").exists()
    experiments = SRC.parents[1] / "experiments"
    assert sorted(p.name for p in experiments.rglob("check_*gpu*.py")) == []


def host_checked_flags(src: Path = SRC) -> list[str]:
    """``path:line`` of every line that names a ``host_checked`` flag (the old way of
    not running a rule twice: issue 45 runs each rule once instead)."""
    return [f"{path.relative_to(src.parent)}:{number}" for path in sorted(src.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if "host_checked" in line]


def test_no_host_checked_flag():
    assert host_checked_flags() == []


def test_the_host_checked_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text("def f(x, host_checked=False):\n    pass\n")
    assert host_checked_flags(tmp_path) == [f"{tmp_path.name}/m.py:1"]


def custom_op_sites(src: Path = SRC) -> list[str]:
    """``path: function`` (the innermost enclosing one) of every place that registers
    a custom op: ``torch.library.custom_op`` / ``torch.library.define``, called or as a
    decorator."""

    class Sites(ast.NodeVisitor):
        def __init__(self, where):
            self.where, self.names, self.found = where, ["<module>"], set()

        def scope(self, node):
            for dec in getattr(node, "decorator_list", []):
                self.visit(dec)
            self.names.append(node.name)
            for child in node.body:
                self.visit(child)
            self.names.pop()

        visit_FunctionDef = visit_ClassDef = scope

        def visit_Attribute(self, node):
            if (node.attr in ("custom_op", "define") and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "library"):
                self.found.add(f"{self.where}: {self.names[-1]}")
            self.generic_visit(node)

    sites = set()
    for path in sorted(src.rglob("*.py")):
        visitor = Sites(path.relative_to(src.parent))
        visitor.visit(ast.parse(path.read_text()))
        sites |= visitor.found
    return sorted(sites)


def test_every_op_from_one_definition():
    """Issue 45: every op comes from one definition, ``EntryOp`` (schema, fake, eager
    body and the public wrapper from the entry point's signature): it is the only
    place that registers an op, and every public op function is its wrapper."""
    import kda_engram.ops as ops

    assert custom_op_sites() == ["kda_engram/ops/common.py: __init__"]
    for name in ops.__all__:
        fn = getattr(ops, name)
        if callable(fn) and name not in ("handle", "resolve"):
            assert all(hasattr(fn, a) for a in ("op", "bind", "unchecked")), name


def test_the_op_site_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text("import torch\n@torch.library.custom_op('a::b', mutates_args=())\n"
                                   "def b(x: torch.Tensor) -> torch.Tensor:\n    return x\n")
    assert custom_op_sites(tmp_path) == [f"{tmp_path.name}/m.py: <module>"]
