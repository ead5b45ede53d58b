"""Test set-up: kernels run under the Triton interpreter on a machine without a GPU.

GPU-only tests carry ``@pytest.mark.gpu``; they are skipped where no CUDA/ROCm
device is visible (CI) and run through ``scripts/gpu-check`` on the device machine.
A GPU test needing more than the default GPU memory says so with
``@pytest.mark.gpu_mem(gib)`` (``tests/gpu_tiers.py``): a card with less skips it,
and each GPU test's peak is recorded (a property in ``--junitxml``) and flagged in
the summary when it passes its budget. The smoke selection (``-m smoke``) is named in
``tests/gpu_tiers.py``.
"""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any kernel module is imported (triton.jit reads it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: the references' many small CPU ops
    # spin in OpenMP barriers when every worker runs a thread per core (measured:
    # a 1367-token fp32 recurrence takes 0.5 s on one thread, 24 s on two
    # threads of a busy two-core machine).
    torch.set_num_threads(1)

from .gpu_tiers import SMOKE_TESTS, budget_of, defined_kernels, log_launches, outcome_line  # noqa: E402

_GIB = 2**30


def pytest_addoption(parser):
    group = parser.getgroup("kda-engram GPU tier")
    group.addoption("--gpu-mem-at-most", type=float, default=None, metavar="GIB",
                    help="keep only the GPU tests whose gpu_mem budget is at most GIB")
    group.addoption("--gpu-mem-above", type=float, default=None, metavar="GIB",
                    help="keep only the GPU tests whose gpu_mem budget is above GIB")
    group.addoption("--gpu-budgets-out", default=None, metavar="FILE",
                    help="write {node id: gpu_mem budget in GiB} of the selected GPU tests to FILE (JSON)")
    group.addoption("--kernel-coverage", default=None, metavar="DIR",
                    help="log every kernel launch (one file per process in DIR) and fail the run when a kernel "
                         "the package defines was never launched")
    group.addoption("--outcome-log", default=None, metavar="FILE",
                    help="append one JSON line per test phase to FILE as it finishes (id, phase, outcome, "
                         "seconds, worker; the failure text of a failed phase), so a killed run keeps its "
                         "results; tests/gpu_tiers.py outcomes FILE summarises a partial log")


#: (node id, budget, peak) of the GPU tests that passed their budget, gathered from
#: the reports (on the xdist controller, from every worker's).
_OVER_BUDGET = []


#: The ``--outcome-log`` file, opened (append, line-buffered) by the process that
#: reports: the xdist controller, or the only process.
_OUTCOME_LOG = []


def pytest_configure(config):
    path = config.getoption("--outcome-log")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # workers' reports reach the controller
        _OUTCOME_LOG.append(open(path, "a", buffering=1))
    config.kda_missing_kernels = None
    config.kda_launched = None
    if config.getoption("--kernel-coverage"):
        os.makedirs(config.getoption("--kernel-coverage"), exist_ok=True)
        config.kda_launched = set()
        log_launches(config.kda_launched)


def pytest_report_header(config):
    if not HAS_GPU:
        return None
    import importlib.util

    import triton

    props = torch.cuda.get_device_properties(0)  # no CUDA context in the process that only reports
    peer = "fla-core found" if importlib.util.find_spec("fla") else "fla-core absent"  # not imported: start-up time
    return (f"GPU: {props.name}, {props.total_memory / _GIB:.1f} GiB | torch {torch.__version__} | "
            f"triton {triton.__version__} | {peer}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    smoke = set(SMOKE_TESTS)
    for item in items:
        if item.nodeid in smoke:
            item.add_marker(pytest.mark.smoke)
    at_most, above = config.getoption("--gpu-mem-at-most"), config.getoption("--gpu-mem-above")
    if at_most is not None or above is not None:
        keep, drop = [], []
        for item in items:
            b = budget_of(item) if "gpu" in item.keywords else None
            inside = b is not None and (at_most is None or b <= at_most) and (above is None or b > above)
            (keep if inside else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if config.getoption("--gpu-budgets-out"):
        with open(config.getoption("--gpu-budgets-out"), "w") as fh:
            json.dump({i.nodeid: budget_of(i) for i in items if "gpu" in i.keywords}, fh, indent=0)
    if not HAS_GPU:
        skip = pytest.mark.skip(reason="needs a GPU (run scripts/gpu-check on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    props = torch.cuda.get_device_properties(0)
    capacity = props.total_memory / _GIB
    for item in items:
        if "gpu" in item.keywords and budget_of(item) > capacity - 1.0:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {budget_of(item):g} GiB of GPU memory (gpu_mem budget); {props.name} has "
                       f"{capacity:.1f} GiB in all"))


@pytest.fixture(autouse=True)
def _no_pending_error_left():
    """A checked call's broken verdict is raised by the next kda_engram call (see
    kda_engram.validation.entry): a test must not leave one behind for the next
    test to raise."""
    yield
    from kda_engram.validation.entry import raise_pending_errors

    raise_pending_errors()


@pytest.fixture(autouse=True)
def _gpu_memory_budget(request):
    """Around a GPU test: its peak reserved GPU memory against its budget; the
    cached blocks go back to the driver after it, for the other workers."""
    if not HAS_GPU or "gpu" not in request.node.keywords:
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    try:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_reserved() / _GIB
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - the test's own failure (a fault) is already reported
        return
    budget = budget_of(request.node)
    request.node.user_properties.append(("gpu_mem_peak_gib", round(peak, 2)))
    request.node.user_properties.append(("gpu_mem_budget_gib", budget))


def pytest_runtest_logreport(report):
    """Log the outcome (``--outcome-log``) and collect the tests over their budget,
    on the controller too (xdist hands every worker's reports to it)."""
    for log in _OUTCOME_LOG:
        log.write(outcome_line(report) + "\n")
    if report.when != "teardown":
        return
    props = dict(report.user_properties)
    if "gpu_mem_peak_gib" in props and props["gpu_mem_peak_gib"] > props["gpu_mem_budget_gib"]:
        _OVER_BUDGET.append((report.nodeid, props["gpu_mem_budget_gib"], props["gpu_mem_peak_gib"]))


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    folder = config.getoption("--kernel-coverage")
    if not folder:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"launched-{worker}.txt"), "w") as fh:
        fh.write("".join(f"{name}\n" for name in sorted(config.kda_launched)))
    if worker != "main":
        return  # a worker's share; the controller (or the only process) judges the whole run
    launched = set()
    for name in os.listdir(folder):
        if name.startswith("launched-"):
            with open(os.path.join(folder, name)) as fh:
                launched |= {line.strip() for line in fh if line.strip()}
    config.kda_missing_kernels = sorted(defined_kernels() - launched)
    if config.kda_missing_kernels:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if _OVER_BUDGET:
        terminalreporter.section("GPU tests over their gpu_mem budget", sep="=", yellow=True, bold=True)
        for nodeid, budget, peak in _OVER_BUDGET:
            terminalreporter.write_line(f"{nodeid}: peak {peak:.2f} GiB reserved > budget {budget:g} GiB")
    if config.kda_missing_kernels is not None:
        if config.kda_missing_kernels:
            terminalreporter.section("KERNEL COVERAGE FAILED", sep="=", red=True, bold=True)
            terminalreporter.write_line("kernels the package defines that no test of this run launched: "
                                        + ", ".join(config.kda_missing_kernels), red=True, bold=True)
        else:
            terminalreporter.write_line("kernel coverage: every kernel the package defines was launched")


@pytest.fixture
def gpu():
    """The CUDA device for ``@pytest.mark.gpu`` tests."""
    return torch.device("cuda")
