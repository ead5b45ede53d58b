"""The package's layering, read from the source with ``ast``: no import cycles
between modules, and no module imports from a layer above its own.

Layers, top to bottom (a module may import from its own layer and any below):

1. the tools: ``tools`` (the command line, demo, check, bench, the benchmark
   scripts and their reporting) and the package root;
2. ``layers`` (the serving ``nn.Module``s) and ``integrations`` (the fla / vLLM adapters);
3. ``ops`` (the ``torch.ops`` wrappers);
4. the kernel families: ``kda``, ``engram``;
5. the base: ``parallel``, ``platform``, ``validation``, ``bundles`` (the argument
   bundles the validation and the kernels take), ``constants``, ``launch_config``.

The plain-PyTorch references (``kda/reference.py``, ``engram/reference.py``,
``layers/reference.py``) sit beside what they check but are not used by it: only the tools,
the layers, the other references and a family's ``__init__`` (which re-exports
them as public API) may import a reference. Tests may import anything.

Every import counts: at module level, inside functions (the lazy imports that
used to hide the cycles), under ``if TYPE_CHECKING``; relative imports are
resolved against the importing module's package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "kda_engram"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: Top to bottom. An entry names a module or a package (and everything under it);
#: the bare package name matches only the root ``__init__``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("tools", (PACKAGE, f"{PACKAGE}.tools")),
    ("layers", (f"{PACKAGE}.layers", f"{PACKAGE}.integrations")),
    ("ops", (f"{PACKAGE}.ops",)),
    ("kernels", (f"{PACKAGE}.kda", f"{PACKAGE}.engram")),
    ("base", (f"{PACKAGE}.parallel", f"{PACKAGE}.platform", f"{PACKAGE}.validation", f"{PACKAGE}.bundles",
              f"{PACKAGE}.constants", f"{PACKAGE}.launch_config")),
]

#: Public names of a kernel family that moved up to ``layers``, kept at their old
#: import path: the family's ``__init__`` imports them lazily (a module ``__getattr__``,
#: so importing the family imports no layer). The only upward imports allowed.
MOVED_UP = {f"{PACKAGE}.engram": {f"{PACKAGE}.layers.engram_gate"}}

#: The plain-PyTorch references, and the torch models of the Gluon kernels (their CPU
#: proof: nothing on a kernel path may import them either).
REFERENCES = {f"{PACKAGE}.kda.reference", f"{PACKAGE}.engram.reference", f"{PACKAGE}.layers.reference",
              f"{PACKAGE}.kda.hopper.prologue_model", f"{PACKAGE}.kda.hopper.fused_model"}

# ----------------------------------------------------------------------- the graph


def find_modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def imports_of(name: str, source: str, is_package: bool, modules) -> set[str]:
    """The package's modules that ``source`` (module ``name``) imports, anywhere in it.

    ``from X import Y`` counts as an import of ``X.Y`` when that is a module, else
    of ``X``; relative imports resolve against the importing module's package."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                # `import kda_engram.kda.chunk.x` of a non-module: its longest module prefix
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target != name:
                    found.add(target)
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = find_modules(src)
    return {name: imports_of(name, path.read_text(), is_package, modules)
            for name, (path, is_package) in modules.items()}


# ----------------------------------------------------------------------- the rules


def layer_of(module: str, layers=LAYERS) -> int | None:
    for depth, (_, entries) in enumerate(layers):
        for entry in entries:
            if module == entry or (entry != PACKAGE and module.startswith(entry + ".")):
                return depth
    return None


def unplaced_modules(graph, layers=LAYERS) -> list[str]:
    return sorted(m for m in graph if layer_of(m, layers) is None)


def upward_imports(graph, layers=LAYERS, moved_up=MOVED_UP) -> list[str]:
    """``a -> b`` where ``b``'s layer is above ``a``'s (but for ``moved_up``)."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets - moved_up.get(a, set())):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb < la:
                bad.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return bad


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a
    sorted list."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = iter(range(10**9))

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def reference_imports(graph, references=REFERENCES, layers=LAYERS) -> list[str]:
    """Imports of a reference module by anything but the tools, the layers, another
    reference or a kernel family's ``__init__``."""
    families = {entry for entry in dict(layers)["kernels"]}
    bad = []
    for a, targets in sorted(graph.items()):
        allowed = (a in references or a in families or layer_of(a, layers) is not None
                   and layer_of(a, layers) <= layer_of(f"{PACKAGE}.layers", layers))
        if allowed:
            continue
        bad.extend(f"{a} imports the reference {b}" for b in sorted(targets & references))
    return bad


# ----------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_every_module_and_its_lazy_imports(graph):
    # A sanity floor: the walk found the package and reads function-level imports
    # (cli imports demo and check only inside functions).
    assert {f"{PACKAGE}.ops", f"{PACKAGE}.kda.chunk", f"{PACKAGE}.layers.engram"} <= graph.keys()
    assert {f"{PACKAGE}.tools.demo", f"{PACKAGE}.tools.check"} <= graph[f"{PACKAGE}.tools.cli"]
    assert f"{PACKAGE}.ops" in graph[f"{PACKAGE}.layers.engram"]  # `from .. import ops`


def test_every_module_has_a_layer(graph):
    assert unplaced_modules(graph) == [], "add the module to a layer in LAYERS"


def test_no_import_cycles(graph):
    assert import_cycles(graph) == []


def test_no_upward_imports(graph):
    assert upward_imports(graph) == []


def test_a_moved_name_is_imported_lazily():
    """The one allowed upward import (``MOVED_UP``) happens only when the name is asked
    for: importing the Engram family imports no layer, and the old path gives the
    layer's object."""
    code = ("import sys, kda_engram.engram as e; "
            "assert not [m for m in sys.modules if m.startswith('kda_engram.layers')]; "
            "from kda_engram.layers import engram_gate as g; "
            "assert e.Engram is g.Engram and e.shards_engram_gate is g.shards_engram_gate")
    env = {**os.environ, "PYTHONPATH": str(SRC.parent), "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_kernels_do_not_import_the_references(graph):
    assert reference_imports(graph) == []


def test_what_every_op_module_shares_is_generic(graph):
    """ops/common.py defines the ops of every family and imports none: the kinds of
    object that cross as a handle come from the op modules' ``EntryOp(handles=)``."""
    families = dict(LAYERS)["kernels"]
    assert [m for m in sorted(graph[f"{PACKAGE}.ops.common"]) if layer_of(m) == layer_of(families[0])] == []


def test_the_checker_reports_a_cycle_an_upward_import_and_a_kernel_importing_a_reference():
    synthetic = {
        f"{PACKAGE}.tools.cli": {f"{PACKAGE}.tools.demo"},
        f"{PACKAGE}.tools.demo": {f"{PACKAGE}.tools.reporting", f"{PACKAGE}.kda.reference"},
        f"{PACKAGE}.tools.reporting": {f"{PACKAGE}.tools.cli"},  # cycle cli -> demo -> reporting -> cli
        f"{PACKAGE}.ops": {f"{PACKAGE}.layers.engram"},  # upward: ops -> layers
        f"{PACKAGE}.layers.engram": {f"{PACKAGE}.ops", f"{PACKAGE}.engram.reference"},  # and a cycle back
        f"{PACKAGE}.kda.chunk": {f"{PACKAGE}.kda.reference", f"{PACKAGE}.platform"},  # kernel -> reference
        f"{PACKAGE}.kda.reference": {f"{PACKAGE}.kda.metadata"},
        f"{PACKAGE}.kda.metadata": set(),
        f"{PACKAGE}.platform": {f"{PACKAGE}.tools.bench"},  # upward: the base -> the tools
        f"{PACKAGE}.engram.reference": set(),
        f"{PACKAGE}.mystery": set(),
    }
    assert import_cycles(synthetic) == [
        [f"{PACKAGE}.layers.engram", f"{PACKAGE}.ops"],
        [f"{PACKAGE}.tools.cli", f"{PACKAGE}.tools.demo", f"{PACKAGE}.tools.reporting"],
    ]
    assert upward_imports(synthetic) == [f"{PACKAGE}.ops (ops) imports {PACKAGE}.layers.engram (layers)",
                                         f"{PACKAGE}.platform (base) imports {PACKAGE}.tools.bench (tools)"]
    assert reference_imports(synthetic) == [f"{PACKAGE}.kda.chunk imports the reference {PACKAGE}.kda.reference"]
    assert unplaced_modules(synthetic) == [f"{PACKAGE}.mystery"]


def test_imports_are_resolved_relative_to_the_importing_module():
    modules = {f"{PACKAGE}": 0, f"{PACKAGE}.ops": 0, f"{PACKAGE}.layers": 0, f"{PACKAGE}.layers.kda": 0,
               f"{PACKAGE}.kda": 0, f"{PACKAGE}.kda.reference": 0, f"{PACKAGE}.kda.chunk": 0}
    source = (
        "from .. import ops\n"
        "from ..kda.reference import naive_recurrent_kda\n"
        "def later():\n"
        "    from ..kda import chunk\n"
        "    import kda_engram.kda\n"
        "import torch\n"
    )
    assert imports_of(f"{PACKAGE}.layers.kda", source, False, modules) == {
        f"{PACKAGE}.ops", f"{PACKAGE}.kda.reference", f"{PACKAGE}.kda.chunk", f"{PACKAGE}.kda"}
    # In a package's __init__, "." is the package itself.
    assert imports_of(f"{PACKAGE}.kda", "from .reference import x\nfrom . import chunk\n", True, modules) == {
        f"{PACKAGE}.kda.reference", f"{PACKAGE}.kda.chunk"}


def test_no_references_to_files_outside_the_repository():
    """Comments and docstrings point only at files in the repository (the design
    notes the package grew from are not shipped: their records are in docs/design/)."""
    root = SRC.parents[1]
    outside = ["DESIGN" + ".md", "ANCHORS" + ".md", ".dbg" + "/", "../" + "shared", "PREFILL_NOTES" + ".md"]
    found = []
    for folder in ("src", "tests", "scripts"):
        for path in sorted((root / folder).rglob("*")):
            generated = "__pycache__" in path.parts or any(p.endswith(".egg-info") for p in path.parts)
            if path.is_file() and path.suffix in (".py", "") and not generated:
                text = path.read_text(errors="replace")
                found += [f"{path.relative_to(root)}: {name}" for name in outside if name in text]
    assert found == []


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py; a test module imports no other."""
    tests = SRC.parents[1] / "tests"
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + ([a.name for a in node.names] if not node.module else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [f"{path.relative_to(tests)} imports {n}" for n in names if n.rpartition(".")[2].startswith("test_")]
    assert found == []
