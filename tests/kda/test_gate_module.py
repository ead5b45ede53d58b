"""One gate module (issue 55): the KDA gate's forms, its floor, the kernels' copies of
``log2(e)`` and the L2 norm's eps, and the ``dt_bias`` stride rule live in
``kda/gate.py`` (the reference in ``kda/reference.py``); no other module writes them
again. Read from the source with ``ast`` (CPU, no kernels run), as ``tests/test_house.py``.

What counts as writing the gate again, in a ``@triton.jit`` / ``@gluon.jit`` function
outside ``kda/gate.py``: arithmetic on ``lower_bound`` (the bounded form), a
``log(.. exp(..) ..)`` (the softplus), the floor's ``-128`` or ``log2(e)`` as a number.
Anywhere outside ``kda/gate.py``: a ``dt_bias.stride(..)`` / ``g_bias.stride(..)`` (the
stride rule). Under ``kda/``: ``log2(e)`` or the L2 norm's ``1e-6`` as a number in code
(docstrings may say them).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import torch

from kda_engram.constants import L2NORM_EPS, LOG2E
from kda_engram.kda import gate

SRC = Path(__file__).resolve().parents[2] / "src" / "kda_engram"
GATE = Path("kda") / "gate.py"
FLOOR = -128.0
BIAS_NAMES = {"dt_bias", "g_bias"}


def _is_jit(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef):
        return False
    for dec in node.decorator_list:
        dec = dec.func if isinstance(dec, ast.Call) else dec
        if (dec.attr if isinstance(dec, ast.Attribute) else getattr(dec, "id", "")) == "jit":
            return True
    return False


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return ""


def _number(node: ast.AST) -> float | None:
    """The value of a numeric literal (``-128.0`` parses as a unary minus)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _number(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _jit_problems(fn: ast.FunctionDef) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.BinOp) and any(isinstance(s, ast.Name) and s.id == "lower_bound"
                                               for s in (node.left, node.right)):
            found.append((node.lineno, "bounded gate (arithmetic on lower_bound)"))
        if _call_name(node) == "log" and any(_call_name(n) == "exp" for a in node.args for n in ast.walk(a)):
            found.append((node.lineno, "softplus (log of exp)"))
        value = _number(node)
        if value is not None and (value == FLOOR or math.isclose(value, LOG2E, rel_tol=1e-6)):
            found.append((node.lineno, f"gate constant {value!r}"))
    return found


def gate_reimplementations(src: Path = SRC) -> list[str]:
    """``path:line: what`` of every place outside ``kda/gate.py`` that writes the gate,
    its floor, the kernels' gate constants or the ``dt_bias`` stride rule again."""
    bad = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel == GATE:
            continue
        tree = ast.parse(path.read_text())
        found = []
        for node in ast.walk(tree):
            if _is_jit(node):
                found += _jit_problems(node)
            if (_call_name(node) == "stride" and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in BIAS_NAMES):
                found.append((node.lineno, f"{node.func.value.id} stride rule"))
            value = _number(node)
            if (rel.parts[0] == "kda" and value is not None
                    and (value == L2NORM_EPS or math.isclose(value, LOG2E, rel_tol=1e-6))):
                found.append((node.lineno, f"constant {value!r} (take it from constants.py / kda.gate)"))
        bad += sorted({f"{src.name}/{rel}:{line}: {what}" for line, what in found})
    return bad


def test_no_module_but_gate_writes_the_gate():
    assert gate_reimplementations() == [], "use kda_engram.kda.gate (the reference: kda.reference.kda_gate)"


def test_the_gate_check_can_fail(tmp_path):
    pkg = tmp_path / "kda_engram"
    (pkg / "kda").mkdir(parents=True)
    (pkg / "kda" / "gate.py").write_text(  # the gate module itself may write all of it
        "import triton\n@triton.jit\ndef g(x, lower_bound):\n    return lower_bound * x * 1.4426950408889634\n")
    (pkg / "kda" / "k.py").write_text(
        "import triton\nimport triton.language as tl\n"
        "@triton.jit\n"
        "def k(x, a, lower_bound):\n"
        "    b = lower_bound * tl.sigmoid(a * x)\n"
        "    c = tl.log(1.0 + tl.exp(-tl.abs(x)))\n"
        "    c = tl.where(c < -128.0, -128.0, c)\n"
        "    return b * 1.4426950408889634 + c\n"
        "def host(dt_bias, x):\n"
        "    eps = 1e-6\n"
        "    return dt_bias.stride(0), x.stride(0)\n"
        "def not_a_kernel(lower_bound, y):\n"
        "    return lower_bound * y\n")
    assert gate_reimplementations(pkg) == [
        "kda_engram/kda/k.py:10: constant 1e-06 (take it from constants.py / kda.gate)",
        "kda_engram/kda/k.py:11: dt_bias stride rule",
        "kda_engram/kda/k.py:5: bounded gate (arithmetic on lower_bound)",
        "kda_engram/kda/k.py:6: softplus (log of exp)",
        "kda_engram/kda/k.py:7: gate constant -128.0",
        "kda_engram/kda/k.py:8: constant 1.4426950408889634 (take it from constants.py / kda.gate)",
        "kda_engram/kda/k.py:8: gate constant 1.4426950408889634",
    ]


def test_kernel_constants_are_the_constants():
    assert gate.LOG2E_JIT.value == LOG2E
    assert gate.L2NORM_EPS_JIT.value == L2NORM_EPS
    # The floor's reason: exp of it (and 2^ of it in log2 units) is exactly 0 in fp32.
    floor = torch.tensor(gate.LOG_DECAY_FLOOR.value, dtype=torch.float32)
    assert torch.exp(floor).item() == 0.0 and torch.exp2(floor * LOG2E).item() == 0.0


def test_dt_bias_strides():
    H, K = 3, 4
    assert gate.dt_bias_strides(torch.zeros(H, K), K) == (K, 1)
    assert gate.dt_bias_strides(torch.zeros(H * K), K) == (K, 1)
    strided = torch.zeros(2 * H * K)[::2]  # a strided flat view: read through its stride, not copied
    assert gate.dt_bias_strides(strided, K) == (2 * K, 2)
    transposed = torch.zeros(K, H).t()  # [H, K] with the channel stride H
    assert gate.dt_bias_strides(transposed, K) == (1, H)
    g = torch.zeros(1, 2, H, K)
    assert gate.gate_pointers(g, None, None, K, "log_decay") == (g, 0, g, 0, 0)
    A_log, bias = torch.zeros(2 * H)[::2], torch.zeros(H, K)
    assert gate.gate_pointers(g, A_log, bias, K, "raw") == (A_log, 2, bias, K, 1)


def test_gate_form():
    assert gate.gate_form("log_decay", None) == gate.GATE_LOG_DECAY.value
    assert gate.gate_form("raw", -5.0) == gate.GATE_BOUNDED.value
    assert gate.gate_form("raw", None) == gate.GATE_SOFTPLUS.value
    assert len({gate.GATE_LOG_DECAY.value, gate.GATE_BOUNDED.value, gate.GATE_SOFTPLUS.value}) == 3
