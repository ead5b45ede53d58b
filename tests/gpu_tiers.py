"""The GPU tier's shape: the smoke selection, the memory budgets and how
``scripts/gpu-check`` splits the tier into passes that fit the card.

* **Smoke.** :data:`SMOKE_TESTS` names existing GPU tests (bf16, K = V = 128,
  serving shapes) that between them launch every kernel of the package once
  against its reference; ``tests/conftest.py`` marks them ``smoke``. Run with
  ``--kernel-coverage DIR``, every launch is logged and the run fails when a
  kernel the package defines was never launched (a new kernel needs a smoke case).
* **Budgets.** A GPU test states the GPU memory it needs (PyTorch's peak
  reserved bytes, in GiB) with ``@pytest.mark.gpu_mem(gib)``; unmarked GPU tests
  get :data:`DEFAULT_GPU_MEM_GIB`. A card whose memory is smaller skips the test
  with the reason printed.
* **Plan.** :func:`plan` picks the worker counts of two passes from the card's
  free memory and the budgets: a pass over the tests up to a budget cap, then the
  tests above it, each with as many workers (up to the cores) as its largest
  budgets side by side allow.

``python3 tests/gpu_tiers.py plan BUDGETS.json`` prints the plan as shell
variables (``scripts/gpu-check`` evaluates it); ``... summary WALL_SECONDS
JUNIT.xml...`` prints the run's counts, wall time and slowest tests; ``... outcomes
LOG`` the same from the ``--outcome-log`` that a run writes as each test ends
(a killed run's partial log too), with each failure's text.
"""

from __future__ import annotations

import json
import os
import sys

#: Budget (GiB) of a GPU test without a ``gpu_mem`` marker: inputs of a few
#: hundred MB at most, references included.
DEFAULT_GPU_MEM_GIB = 2.0
#: What one pytest worker holds besides its tests' tensors (CUDA context, loaded
#: kernels, cuBLAS workspace), in GiB.
WORKER_OVERHEAD_GIB = 1.0
#: Share of the free memory a plan may fill (the rest absorbs fragmentation).
USABLE_SHARE = 0.92
#: A second pass's start-up (workers importing torch, collecting), in tests.
PASS_COST = 2.0

SMOKE_TESTS = (
    # KDA prefill: metadata, index rules, prologue (intra + solve), chunk walk with
    # state cache and checkpoints; the conv prefill through the prologue; the
    # grouped walk (pass one, scan).
    "tests/kda/test_prefill.py::test_gpu_small_cache_checkpoints_out_is_v",
    # The Hopper path (sm_90): folded prologue (intra + fold) and the Gluon walk.
    "tests/kda/test_hopper.py::test_gpu_hopper_cache_checkpoints_out_is_v[ckpt_rows-bf16]",
    # The Gluon folded prologue (sm_90) on a ragged batch.
    "tests/kda/test_hopper_prologue.py::test_gpu_gluon_prologue_ragged_matches_triton_fp64_and_model[-5.0]",
    # The fused Hopper prefill (sm_90) with the state cache and checkpoints.
    "tests/kda/test_hopper_fused.py::test_gpu_fused_state_cache_and_checkpoints",
    "tests/kda/test_prologue.py::test_gpu_small_bf16_strided",
    "tests/kda/test_prologue.py::test_gpu_small_bf16_conv",
    "tests/kda/test_groups.py::test_gpu_small_groups_cache_checkpoints",
    "tests/kda/test_metadata.py::test_gpu_metadata_kernel_matches_torch",
    # KDA decode: one token, multi-token, bf16 state rows, the fused layer step,
    # the conv decode and the conv checkpoint.
    "tests/kda/test_decode.py::test_gpu_decode_bf16[random-bounded-mid]",
    "tests/kda/test_decode.py::test_gpu_multi_bf16[bounded-small]",
    "tests/kda/test_state_dtype.py::test_gpu_bf16_store_is_rtne_at_real_shapes",
    "tests/kda/test_fused_decode.py::test_gpu_kimi_linear_shapes_and_cuda_graph[one-bf16]",
    "tests/kda/test_conv.py::test_gpu_bf16_decode_and_checkpoint",
    # The guarded launches (index and cu_seqlens rules) on a side stream: decode,
    # prefill, the layer's mixed step (one test each, compiled side by side).
    "tests/validation/test_caches_untouched.py::test_guarded_decode_on_the_gpu",
    "tests/validation/test_caches_untouched.py::test_guarded_prefill_on_the_gpu[state_indices]",
    "tests/validation/test_caches_untouched.py::test_guarded_layer_step_on_the_gpu[duplicate]",
    # Engram: n-gram hash, history kernels, table gather (bf16 and fp8), the gate
    # (grid and persistent passes), the dim-sharded gate.
    "tests/engram/test_hashing.py::test_gpu_hash_prefill_size",
    "tests/engram/test_history.py::test_gpu_history_kernels_match_python",
    "tests/layers/test_engram_layer.py::test_gpu_bf16_layer_matches_reference",
    "tests/engram/test_table.py::test_gpu_lookup_prefill[bf16]",
    "tests/engram/test_table.py::test_gpu_lookup_prefill[fp8]",
    "tests/engram/test_gate.py::test_gpu_bf16_matches_reference[4-5120]",
    "tests/engram/test_gate.py::test_gpu_persistent_rows[2048-5120]",
    "tests/engram/test_sharded_gate.py::test_gpu_bf16_matches_reference[5120-4-4]",
    # vLLM's DeepSeek-V4.1 n-gram rows (integrations/vllm_engram_history.py), then the hash.
    "tests/integrations/test_vllm_engram_history.py::test_gpu_rows_and_hash_at_a_serving_batch",
)


# ----------------------------------------------------------------------- budgets


def budget_of(item) -> float:
    """The GiB a collected GPU test states (``gpu_mem``; the largest where a
    function and one of its parameters both state one), else the default."""
    stated = []
    for mark in item.iter_markers("gpu_mem"):
        if len(mark.args) != 1 or not isinstance(mark.args[0], (int, float)) or mark.args[0] <= 0:
            raise ValueError(f"{item.nodeid}: gpu_mem takes one positive number of GiB, got {mark.args}")
        stated.append(float(mark.args[0]))
    return max(stated, default=DEFAULT_GPU_MEM_GIB)


def _fits(budgets_desc: list[float], workers: int, usable: float) -> bool:
    """Whether the ``workers`` largest budgets, side by side, fit ``usable`` GiB."""
    return sum(budgets_desc[:workers]) + workers * WORKER_OVERHEAD_GIB <= usable


def _most_workers(budgets_desc: list[float], usable: float, max_workers: int) -> int:
    """The most workers (1 at least) whose largest budgets fit side by side."""
    return max(n for n in range(1, max(1, max_workers) + 1) if n == 1 or _fits(budgets_desc, n, usable))


def plan(budgets: list[float], free_gib: float, max_workers: int) -> dict:
    """Two passes over tests of ``budgets`` (GiB) on a card with ``free_gib`` free.

    Returns ``{"cap", "workers", "big_workers", "usable"}``: the first pass runs the
    tests with budget <= ``cap`` on ``workers`` workers, the second the rest on
    ``big_workers`` (0: no second pass). Any ``workers`` tests of a pass may run at
    once, so the ``workers`` largest budgets of the pass plus each worker's overhead
    must fit the usable memory (tests larger than the card skip; they need no room).
    The cap minimises ``tests / workers`` summed over the passes, a second pass
    counting as :data:`PASS_COST` tests more (its start-up); ties go to more workers.
    """
    usable = free_gib * USABLE_SHARE
    desc = sorted(budgets, reverse=True)
    if not desc:
        return dict(cap=0.0, workers=1, big_workers=0, usable=usable)
    best = None
    for cap in sorted(set(desc)):
        small = [b for b in desc if b <= cap]
        big = [b for b in desc if b > cap]
        workers = _most_workers(small, usable, max_workers)
        big_workers = 0
        if big:
            runnable = [b for b in big if b + WORKER_OVERHEAD_GIB <= usable] or big[-1:]
            big_workers = min(_most_workers(runnable, usable, max_workers), len(big))
        score = len(small) / workers + (len(big) / big_workers + PASS_COST if big else 0.0)
        if best is None or (score, -workers) < (best[0], -best[1]["workers"]):
            best = (score, dict(cap=cap, workers=workers, big_workers=big_workers, usable=usable))
    return best[1]


# ----------------------------------------------------------------- kernel coverage


def _is_kernel(name, obj) -> bool:
    """A ``*_kernel`` that ``triton.jit`` made (compiled, or interpreted under
    ``TRITON_INTERPRET``), logged or not."""
    from triton.runtime.jit import KernelInterface

    return name.endswith("_kernel") and isinstance(obj, (KernelInterface, LoggedKernel))


def kernel_modules():
    """The package's modules that hold a ``*_kernel`` (all imported first)."""
    from tests.compile_support import _import_kernel_modules

    _import_kernel_modules()
    return [m for n, m in sorted(sys.modules.items()) if n.startswith("kda_engram") and m is not None
            and any(_is_kernel(k, o) for k, o in vars(m).items())]


def defined_kernels() -> set[str]:
    """Names of every ``*_kernel`` the package defines."""
    return {k for m in kernel_modules() for k, o in vars(m).items() if _is_kernel(k, o)}


class LoggedKernel:
    """A kernel that records its name in ``launched`` at every launch or warm-up
    and otherwise is the kernel (``kernel[grid](...)``, ``.warmup``, attributes)."""

    def __init__(self, name, fn, launched):
        self._name, self._fn, self._launched = name, fn, launched

    def __getitem__(self, grid):
        self._launched.add(self._name)
        return self._fn[grid]

    def warmup(self, *args, **kwargs):
        self._launched.add(self._name)
        return self._fn.warmup(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._fn, attr)


def log_launches(launched: set[str]):
    """Put a :class:`LoggedKernel` in place of every kernel of the package; returns
    the function that puts the kernels back."""
    replaced = []
    for module in kernel_modules():
        for name, obj in list(vars(module).items()):
            if _is_kernel(name, obj) and not isinstance(obj, LoggedKernel):
                setattr(module, name, LoggedKernel(name, obj, launched))
                replaced.append((module, name, obj))

    def restore():
        for module, name, obj in replaced:
            setattr(module, name, obj)

    return restore


# ----------------------------------------------------------------------- summary


def junit_cases(paths: list[str]) -> list[dict]:
    """Test cases of pytest ``--junitxml`` files: ``{"id", "seconds", "outcome",
    "peak", "budget"}`` (peak/budget in GiB, None where not recorded)."""
    import xml.etree.ElementTree as ET

    cases = []
    for path in paths:
        if not os.path.exists(path):
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    break
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            cases.append(dict(
                id=f"{case.get('classname', '')}::{case.get('name', '')}",
                seconds=float(case.get("time", 0.0)),
                outcome=outcome,
                peak=float(props["gpu_mem_peak_gib"]) if "gpu_mem_peak_gib" in props else None,
                budget=float(props["gpu_mem_budget_gib"]) if "gpu_mem_budget_gib" in props else None,
            ))
    return cases


def summary(paths: list[str], wall_seconds: float, slowest: int = 15) -> str:
    """What ``scripts/gpu-check`` prints at the end: the outcome counts, the wall
    time, the ``slowest`` tests (setup + call + teardown) and every test whose
    peak GPU memory passed its budget."""
    cases = junit_cases(paths)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    lines = [", ".join(f"{n} {k}" for k, n in counts.items() if n or k == "passed")
             + f" in {wall_seconds:.1f} s of wall time"]
    lines.append(f"{min(slowest, len(cases))} slowest tests (s, peak GPU GiB / budget):")
    for c in sorted(cases, key=lambda c: -c["seconds"])[:slowest]:
        mem = f"{c['peak']:.2f} / {c['budget']:g}" if c["peak"] is not None else "-"
        lines.append(f"  {c['seconds']:8.2f}  {mem:>13}  {c['id']}  {c['outcome']}")
    over = [c for c in cases if c["peak"] is not None and c["peak"] > c["budget"]]
    for c in over:
        lines.append(f"OVER BUDGET: {c['id']} peaked at {c['peak']:.2f} GiB, states {c['budget']:g} GiB "
                     f"(raise its gpu_mem)")
    return "\n".join(lines)


# ------------------------------------------------------------------- outcome log


def outcome_line(report) -> str:
    """One JSON line of ``--outcome-log`` for a pytest test report (one phase of a
    test): ``{"id", "phase", "outcome", "seconds", "worker"}``, and ``"text"``, the
    failure text, where the phase failed. Written as each phase ends, so a run
    killed half-way keeps every result it had."""
    node = getattr(report, "node", None)  # the xdist worker that ran it (on the controller)
    gateway = getattr(node, "gateway", None)
    entry = dict(id=report.nodeid, phase=report.when, outcome=report.outcome,
                 seconds=round(report.duration, 3), worker=getattr(gateway, "id", None))
    if report.failed:
        entry["text"] = report.longreprtext
    return json.dumps(entry)


def read_outcomes(path: str) -> dict:
    """Per test of an outcome log (partial or whole): ``{id: {"outcome", "seconds",
    "text"}}``. The outcome is the first failing phase's ("failed" in the call,
    "error" in set-up or teardown), else the call's, else "skipped" for a test
    skipped at set-up; a test whose call has not reported is "running". A torn last
    line (the run was killed while writing it) is ignored."""
    tests = {}
    with open(path) as fh:
        for raw in fh:
            try:
                e = json.loads(raw)
            except json.JSONDecodeError:
                continue
            t = tests.setdefault(e["id"], dict(outcome="running", seconds=0.0, text=None))
            t["seconds"] = round(t["seconds"] + e["seconds"], 3)
            if t["outcome"] in ("failed", "error"):
                continue
            if e["outcome"] == "failed":
                t["outcome"] = "failed" if e["phase"] == "call" else "error"
                t["text"] = e.get("text")
            elif e["phase"] == "call" or (e["phase"] == "setup" and e["outcome"] == "skipped"):
                t["outcome"] = e["outcome"]
    return tests


def outcomes_summary(path: str, slowest: int = 15) -> str:
    """What ``gpu_tiers.py outcomes LOG`` prints: the counts, every test that failed
    or never finished with its failure text's last lines, and the slowest tests."""
    tests = read_outcomes(path)
    kinds = ("passed", "failed", "error", "skipped", "running")
    counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in kinds}
    lines = [", ".join(f"{n} {k}" for k, n in counts.items() if n or k == "passed")
             + f" ({len(tests)} tests reported in {path})"]
    for tid, t in tests.items():
        if t["outcome"] in ("failed", "error", "running"):
            lines.append(f"{t['outcome'].upper()}: {tid} ({t['seconds']:.1f} s)")
            if t["text"]:
                lines += ["    " + line for line in t["text"].rstrip().splitlines()[-12:]]
    lines.append(f"{min(slowest, len(tests))} slowest tests (s, set-up + call + teardown):")
    for tid, t in sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:slowest]:
        lines.append(f"  {t['seconds']:8.2f}  {tid}  {t['outcome']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "summary":
        print(summary(argv[2:], float(argv[1])))
        return 0
    if len(argv) == 2 and argv[0] == "outcomes":
        print(outcomes_summary(argv[1]))
        return 0
    if len(argv) != 2 or argv[0] != "plan":
        print("usage: gpu_tiers.py plan BUDGETS.json | gpu_tiers.py summary WALL_SECONDS JUNIT.xml... | "
              "gpu_tiers.py outcomes OUTCOME_LOG", file=sys.stderr)
        return 2
    import torch

    with open(argv[1]) as fh:
        budgets = json.load(fh)
    free, total = (x / 2**30 for x in torch.cuda.mem_get_info())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = plan(list(budgets.values()), free, max_workers=min(cores, 16))
    n_small = sum(1 for b in budgets.values() if b <= p["cap"])
    print(f"echo 'gpu-check plan: {torch.cuda.get_device_name(0)}, {free:.1f} of {total:.1f} GiB free, "
          f"{cores} cores; pass 1: {n_small} tests with budget <= {p['cap']:g} GiB on {p['workers']} workers; "
          f"pass 2: {len(budgets) - n_small} tests on {p['big_workers']} workers'")
    print(f"cap={p['cap']:g} workers={p['workers']} big_workers={p['big_workers']}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
