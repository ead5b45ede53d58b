"""Where the default call's extra time goes: host time per call, verdict waits,
implicit syncs and a host profile, for ``check_inputs=True`` beside ``False``.

    python -m kda_engram.tools.benchmarks.profile_default_checks                 # B=256, H=32 on the GPU
    python -m kda_engram.tools.benchmarks.profile_default_checks --batch 4 --heads 2 --json out.json

The benches' ``checked`` columns say *whether* the default call meets its bound
(no-check + max(0.02 ms, 3%)); this says *why not*. For each call (``kda_decode``,
``kda_layer_decode_step``, the ``KimiDeltaAttention`` forward of a decode batch) it
measures, in one process:

* ``host_us``: the median host time of one call, calls issued back to back
  without a sync (what the host spends, including any wait for a verdict);
* ``per_call_us``: wall time of ``--iters`` calls then one sync, per call (the
  throughput an engine's loop sees: the larger of host and GPU time when they
  overlap, their sum when a wait serialises them);
* ``wait_us``: the median time a call spent waiting for an earlier call's verdict
  (:meth:`kda_engram.validation.entry._Pending.resolve`);
* ``syncs``: the implicit host syncs PyTorch reports in one call
  (``torch.cuda.set_sync_debug_mode("warn")``; CUDA only);
* the top of a ``cProfile`` of the default call by own and by cumulative time,
  in the JSON;
* ``ops`` / ``launches``: the PyTorch (``aten``) ops dispatched and the Triton
  kernels launched by one steady-state call of each mode
  (:func:`count_ops_and_launches`; also the layer forward of a mixed decode +
  prefill batch and of one with prefix checkpoints). Counts need no GPU:

    TRITON_INTERPRET=1 python -m kda_engram.tools.benchmarks.profile_default_checks --counts --device cpu \\
        --batch 4 --heads 2 --head-dim 16

Run it on the GPU before changing the checks' design, and again after.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings

import torch
import triton.runtime.jit
from torch.utils._python_dispatch import TorchDispatchMode

from ...kda.decode import kda_decode
from ...kda.fused_decode import kda_layer_decode_step
from ...layers.kda import KDABatch, KimiDeltaAttention
from ...platform import interpreting
from ...validation import entry
from .common import NEEDS_GPU_EXIT, random_kda_inputs, write_json

LOWER_BOUND = -5.0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _calls(device, B: int, H: int, K: int):
    """``{name: fn(check_inputs)}``: the three default-path calls of a decode step."""
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = random_kda_inputs(rnd, (B,), H, K, K, dt)
    idx = torch.randperm(B, generator=gen, device=device).to(torch.int32)
    cache = 0.5 * rnd(B, H, K, K)
    out = torch.empty(B, H, K, dtype=dt, device=device)

    layer = KimiDeltaAttention(H * K, H, K, gate_low_rank_dim=K, output_gate_low_rank_dim=K,
                               lower_bound=LOWER_BOUND, dtype=dt, device=device)
    layer.reset_parameters(torch.Generator().manual_seed(0))
    sc, cs = layer.allocate_cache(B)  # torch.empty: filled below
    sc.copy_(0.3 * rnd(*sc.shape))
    cs.copy_(rnd(*cs.shape))
    hs = rnd(B, H * K).to(dt)
    lidx = torch.randperm(B, generator=gen, device=device)
    batch = KDABatch.from_query_lens(torch.ones(B, dtype=torch.int64, device=device), lidx, num_decode=B)
    b, C = layer.bands, layer.conv_channels
    with torch.no_grad():
        proj = layer.in_proj(hs)
        raw_g = layer.f_b_proj(proj[:, b["gate"][0]: b["gate"][1]])
        raw_beta = proj[:, b["beta"][0]: b["beta"][1]]
        g_out = layer.g_b_proj(proj[:, b["g_out"][0]: b["g_out"][1]])
    step_out = torch.empty(B, H * K, dtype=dt, device=device)
    return {
        "kda_decode": lambda check: kda_decode(**x, state_cache=cache, state_indices=idx, lower_bound=LOWER_BOUND,
                                               out=out, check_inputs=check),
        "kda_layer_decode_step": lambda check: kda_layer_decode_step(
            proj[:, :C], raw_g, raw_beta, g_out, layer.conv_weight, cs, lidx, layer.A_log, layer.dt_bias,
            layer.o_norm_weight, sc, lidx, scale=layer.scale, lower_bound=LOWER_BOUND, norm_eps=layer.norm_eps,
            out=step_out, check_inputs=check),
        "layer_forward": lambda check: layer(hs, batch, sc, cs, check_inputs=check),
    }


def _host_and_throughput(fn, device, iters: int) -> tuple[float, float]:
    host = []
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    _sync(device)
    per_call = (time.perf_counter() - start) / iters
    return statistics.median(host) * 1e6, per_call * 1e6


def _waits(fn, device, iters: int) -> float:
    """The median wait for a verdict per call (0 when nothing waited)."""
    waits = []
    real = entry._Pending.resolve

    def timed(self):
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            waits.append(time.perf_counter() - t0)

    entry._Pending.resolve = timed
    try:
        for _ in range(iters):
            fn()
        entry.raise_pending_errors()
        _sync(device)
    finally:
        entry._Pending.resolve = real
    return statistics.median(waits) * 1e6 if waits else 0.0


def sync_warnings(fn) -> list[str]:
    """The first line of each warning PyTorch's CUDA sync debug mode gives for a
    synchronizing operation in ``fn()`` (CUDA only). Its one-off notice that the mode
    is a prototype is not one of them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0] for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)]


def _syncs(fn, device) -> list[str]:
    if device.type != "cuda":
        return []
    _sync(device)
    return sync_warnings(fn)


def _profile(fn, device, iters: int, top: int) -> str:
    prof = cProfile.Profile()
    _sync(device)
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    entry.raise_pending_errors()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)  # where the host's own time goes
    stats.sort_stats("cumulative").print_stats(top)  # which of our steps holds it (a wait shows here)
    return text.getvalue()


class _OpCounter(TorchDispatchMode):
    """The ``aten`` ops dispatched while active, by name (views included: each is
    a dispatch the host pays for). Ops a kernel launch runs inside itself (the
    interpreter's copies of the arguments) are not counted: ``paused`` > 0."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _launchers() -> list[type]:
    """The Triton classes whose ``run`` launches a ``@triton.jit`` kernel:
    ``JITFunction`` on a GPU, ``InterpretedFunction`` under ``TRITON_INTERPRET=1``
    (``kernel[grid](...)`` calls ``run(grid=..., warmup=False)`` on either; the
    autotuner and heuristics wrappers call the inner one's, so a launch counts
    once)."""
    classes = [triton.runtime.jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        return classes
    return classes + [InterpretedFunction]


@contextlib.contextmanager
def _counting():
    """Count ops (:class:`_OpCounter`) and kernel launches (by kernel name) inside
    the block; yields ``(ops, launches)``, two Counters filled as it runs."""
    counter = _OpCounter()
    launches: collections.Counter = collections.Counter()
    patched = []
    for cls in _launchers():
        real = cls.run

        def run(self, *args, grid, warmup, _real=real, **kwargs):
            if warmup:  # compiles, launches nothing
                return _real(self, *args, grid=grid, warmup=warmup, **kwargs)
            launches[getattr(self, "__name__", None) or self.fn.__name__] += 1
            counter.paused += 1
            try:
                return _real(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter.paused -= 1

        patched.append((cls, "run" in vars(cls), real))
        cls.run = run
    try:
        with counter:
            yield counter.ops, launches
    finally:
        for cls, own, real in patched:
            if own:
                cls.run = real
            else:
                del cls.run


def ops_and_launches_by_name(fn, *, warmup: int = 2) -> tuple[collections.Counter, collections.Counter]:
    """The ``aten`` ops (by op name) and Triton kernel launches (by kernel name) of
    one steady-state call of ``fn()``: ``warmup`` calls first (compiles, kept
    buffers, and a previous call's verdict pending, as in an engine's loop, which
    the counted call resolves); the counted call's own verdict is raised after.
    Deterministic: counts do not depend on timing or on the device's speed."""
    for _ in range(warmup):
        fn()
    try:
        with _counting() as (ops, launches):
            fn()
    finally:
        entry.raise_pending_errors()
    return ops, launches


def count_ops_and_launches(fn, *, warmup: int = 2) -> tuple[int, int]:
    """``(ops, launches)``: the ``aten`` ops dispatched and the Triton kernels
    launched by one steady-state call of ``fn()`` (:func:`ops_and_launches_by_name`).
    Works on the GPU and on the CPU under ``TRITON_INTERPRET=1``."""
    ops, launches = ops_and_launches_by_name(fn, warmup=warmup)
    return sum(ops.values()), sum(launches.values())


def _layer_batches(device, B: int, H: int, K: int):
    """``{name: fn(check_inputs)}``: the layer forward of a mixed batch (``B``
    decode rows, then prefill sequences of 3 and 5 tokens, the first continuing
    from its rows) and of one whose 64-token prefill exports a prefix checkpoint
    into the caches themselves (the serving form)."""
    gen = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = KimiDeltaAttention(H * K, H, K, gate_low_rank_dim=K, output_gate_low_rank_dim=K,
                               lower_bound=LOWER_BOUND, dtype=dt, device=device)
    layer.reset_parameters(torch.Generator().manual_seed(1))
    slots = B + 3
    sc, cs = layer.allocate_cache(slots)
    sc.copy_(0.3 * torch.randn(sc.shape, generator=gen, device=device))
    cs.copy_(torch.randn(cs.shape, generator=gen, device=device))
    dev_i64 = dict(dtype=torch.int64, device=device)
    rows = torch.randperm(B + 2, generator=gen, device=device)
    has = torch.tensor([False] * B + [True, False], device=device)
    calls = {}
    for name, prefill, ckpt in (("layer_forward_mixed", [3, 5], None), ("layer_forward_checkpoints", [3, 64], 64)):
        lens = torch.tensor([1] * B + prefill, **dev_i64)
        extra = {}
        if ckpt is not None:  # the second prefill sequence exports its state after 64 tokens to the spare row
            extra = dict(checkpoint_offsets=torch.tensor([0] * (B + 1) + [ckpt], **dev_i64),
                         checkpoint_indices=torch.tensor([-1] * (B + 1) + [slots - 1], **dev_i64))
        batch = KDABatch.from_query_lens(lens, rows, has, num_decode=B, **extra)
        hs = torch.randn(B + sum(prefill), H * K, generator=gen, device=device).to(dt)
        calls[name] = lambda check, hs=hs, batch=batch: layer(hs, batch, sc, cs, check_inputs=check)
    return calls


def count_rows(device, B: int, H: int, K: int) -> list[dict]:
    """Per call (the three of :func:`_calls`, then the layer's mixed and checkpoint
    batches): ops and launches of one steady-state call with ``check_inputs=False``
    and ``True``, the default's extra, and the extra ops and launches by name."""
    rows = []
    with torch.inference_mode():
        calls = {**_calls(device, B, H, K), **_layer_batches(device, B, H, K)}
        for name, call in calls.items():
            row = {"call": name, "B": B, "H": H, "K": K}
            by_name = {}
            for mode, check in (("nocheck", False), ("default", True)):
                by_name[mode] = ops_and_launches_by_name(lambda check=check: call(check))
                row[f"ops_{mode}"] = sum(by_name[mode][0].values())
                row[f"launches_{mode}"] = sum(by_name[mode][1].values())
            row["extra_ops"] = row["ops_default"] - row["ops_nocheck"]
            row["extra_launches"] = row["launches_default"] - row["launches_nocheck"]
            for i, kind in enumerate(("ops", "launches")):
                extra = by_name["default"][i].copy()
                extra.subtract(by_name["nocheck"][i])
                row[f"extra_{kind}_by_name"] = {k: v for k, v in sorted(extra.items()) if v}
            rows.append(row)
    return rows


def print_counts(rows) -> None:
    print(f"{'call':<26} {'ops':>20} {'launches':>20}")
    print(f"{'':<26} {'nocheck/default/+':>20} {'nocheck/default/+':>20}")
    for r in rows:
        ops = f"{r['ops_nocheck']}/{r['ops_default']}/{r['extra_ops']:+d}"
        launches = f"{r['launches_nocheck']}/{r['launches_default']}/{r['extra_launches']:+d}"
        print(f"{r['call']:<26} {ops:>20} {launches:>20}")
        extra = {**r["extra_ops_by_name"], **{f"launch {k}": v for k, v in r["extra_launches_by_name"].items()}}
        if extra:
            print("    extra: " + ", ".join(f"{k} {v:+d}" for k, v in extra.items()))


def run(device, B: int, H: int, K: int, iters: int, top: int) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for name, call in _calls(device, B, H, K).items():
            row = {"call": name, "B": B, "H": H, "K": K}
            for mode, check in (("nocheck", False), ("default", True)):
                fn = lambda check=check: call(check)  # noqa: E731
                for _ in range(3):  # compile and warm
                    fn()
                entry.raise_pending_errors()
                row[f"host_us_{mode}"], row[f"per_call_us_{mode}"] = _host_and_throughput(fn, device, iters)
                entry.raise_pending_errors()
            default = lambda: call(True)  # noqa: E731
            row["wait_us_default"] = _waits(default, device, iters)
            row["syncs_default"] = _syncs(default, device)
            row["profile_default"] = _profile(default, device, iters, top)
            rows.append(row)
    return rows


def print_rows(rows) -> None:
    print(f"{'call':<24} {'host us':>16} {'per call us':>18} {'wait us':>8} {'syncs':>6}")
    print(f"{'':<24} {'nocheck/default':>16} {'nocheck/default':>18}")
    for r in rows:
        print(f"{r['call']:<24} {r['host_us_nocheck']:>7.1f}/{r['host_us_default']:<8.1f} "
              f"{r['per_call_us_nocheck']:>8.1f}/{r['per_call_us_default']:<9.1f} {r['wait_us_default']:>8.1f} "
              f"{len(r['syncs_default']):>6}")
        for message in r["syncs_default"]:
            print(f"    sync: {message}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--top", type=int, default=25, help="cProfile lines kept per call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the rows (with the profiles) here")
    parser.add_argument("--counts", action="store_true",
                        help="only the op and launch counts (no timing; what a CPU run is for)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not interpreting():
        # Without it Triton finds no driver and dies with a traceback (issue 54).
        print("profile_default_checks: on a CPU the kernels run under the Triton interpreter: set "
              "TRITON_INTERPRET=1 before Python starts (and use --counts with small sizes, e.g. --batch 4 --heads 2 "
              "--head-dim 16)", file=sys.stderr)
        return NEEDS_GPU_EXIT
    rows = [] if args.counts else run(device, args.batch, args.heads, args.head_dim, args.iters, args.top)
    if rows:
        print_rows(rows)
        print()
    counts = count_rows(device, args.batch, args.heads, args.head_dim)
    print_counts(counts)
    if args.json:  # one row per call: its timings (unless --counts) and its counts
        timed = {r["call"]: r for r in rows}
        write_json([{**timed.get(c["call"], {}), **c} for c in counts], args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
