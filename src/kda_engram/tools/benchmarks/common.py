"""What the benchmark scripts share: timing, copy bandwidth, CUDA-graph timing, the
default checks' budget and random KDA inputs (which ``kda-engram check`` draws too).

The scripts are modules of the installed package: each runs as ``python -m
kda_engram.tools.benchmarks.NAME`` (``bench_tp`` under ``torchrun -m`` too), and
the ``bench_*`` ones behind ``kda-engram bench`` through their ``run``.
"""

from __future__ import annotations

import statistics
import sys



#: The exit status of a GPU-only benchmark script where torch sees no GPU.
NEEDS_GPU_EXIT = 2


def no_gpu_exit(name: str) -> int | None:
    """Where torch sees no GPU: one line on stderr saying ``name`` needs one, and
    :data:`NEEDS_GPU_EXIT` for the script's ``main`` to return (no traceback);
    ``None`` where it sees one. Every GPU-only script checks this first."""
    import torch

    if torch.cuda.is_available():
        return None
    print(f"{name} needs a GPU (CUDA or ROCm) and this torch sees none: its timings are only meaningful on one",
          file=sys.stderr)
    return NEEDS_GPU_EXIT


def bench_ms(fn, quick: bool = False, *, return_mode: str = "median") -> float:
    """``triton.testing.do_bench`` of ``fn`` in ms (it flushes L2 between calls):
    warm-up 25 ms and 100 ms of repetitions, or 10 and 40 when ``quick``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                         return_mode=return_mode))


def default_check_bound_ms(nocheck_ms: float) -> float:
    """The most the default call (``check_inputs=True``) may add to the no-check call
    (issue 35): max(0.02 ms, 3%), both timed the same way in one process (the benches'
    ``checked`` columns)."""
    return max(0.02, 0.03 * nocheck_ms)


_COPY_BW: dict = {}


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of an ``nbytes`` device-to-device copy, the read and the write counted
    (median of :func:`bench_ms`); measured once per (device, size)."""
    import torch

    key = (str(device), nbytes)
    if key not in _COPY_BW:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = bench_ms(lambda: dst.copy_(src))
        _COPY_BW[key] = 2 * nbytes / (ms * 1e-3)
        del src, dst
    return _COPY_BW[key]


def copy_bandwidth_gbs(device, nbytes: int = 1 << 30) -> float:
    """:func:`copy_bandwidth` in GB/s."""
    return copy_bandwidth(device, nbytes) / 1e9


def cuda_graph_ms(fn, iters: int = 200, repeats: int = 5) -> float:
    """ms per call of ``fn`` replayed from a CUDA graph, as an engine runs it: one
    graph of ``iters`` x (L2 flush, ``fn``) minus one of ``iters`` flushes alone,
    median over ``repeats`` replays.

    Why beside ``do_bench``: its eager loop records the timing events around a
    host call, so when a kernel takes less than the host needs to launch it (a few
    tens of microseconds: the Engram gate at T = 64, a 64-token table lookup),
    argument handling and launch time fall between the events. In a replayed graph
    no host work lies between them. ``fn`` must be capturable (no host syncs);
    it runs once outside the capture to compile and warm up.
    """
    import torch

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    per = []
    for g in graphs:
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
        per.append(statistics.median(times))
    return max(per[0] - per[1], 0.0)


def result_row(case, ours_ms, peer_ms, peer, floor_ms, **extra) -> dict:
    """One row of a bench's results: ``case``, ``ours_ms``, ``peer_ms`` and ``peer`` (what
    the peer is), ``ratio = peer_ms / ours_ms`` (above 1: ours is faster),
    ``hbm_floor_ms`` and ``floor_fraction = hbm_floor_ms / ours_ms`` (``None`` where a
    time is missing), then ``extra``."""
    return {
        "case": case,
        "ours_ms": ours_ms,
        "peer_ms": peer_ms,
        "peer": peer,
        "ratio": (peer_ms / ours_ms) if (peer_ms and ours_ms) else None,
        "hbm_floor_ms": floor_ms,
        "floor_fraction": (floor_ms / ours_ms) if (floor_ms and ours_ms) else None,
        **extra,
    }


def random_kda_inputs(rnd, lead, H: int, K: int, V: int, dtype, dt_bias_scale: float | None = None) -> dict:
    """Random raw inputs of a KDA call, drawn by ``rnd(*shape)`` (the caller's seeded
    ``randn``) in this order: ``q``, ``k`` ``[*lead, H, K]``, ``v`` ``[*lead, H, V]``,
    ``raw_g`` ``[*lead, H, K]`` and ``raw_beta`` ``[*lead, H]``, cast to ``dtype``;
    ``A_log = 0.5 * rnd(H)`` and ``dt_bias = rnd(H * K)`` (times ``dt_bias_scale`` where
    given) in ``rnd``'s dtype. ``lead``: ``(1, T)`` for a prefill, ``(B,)`` or ``(B, S)``
    for decode. The KDA benches and ``kda-engram check`` draw their inputs here, alike."""
    x = dict(
        q=rnd(*lead, H, K).to(dtype),
        k=rnd(*lead, H, K).to(dtype),
        v=rnd(*lead, H, V).to(dtype),
        raw_g=rnd(*lead, H, K).to(dtype),
        raw_beta=rnd(*lead, H).to(dtype),
        A_log=0.5 * rnd(H),
        dt_bias=rnd(H * K),
    )
    if dt_bias_scale is not None:
        x["dt_bias"] = x["dt_bias"] * dt_bias_scale
    return x


def write_json(rows, path) -> None:
    """The rows as indented JSON at ``path`` (values JSON cannot hold as text), and a line saying so."""
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps(rows, indent=2, default=str))
    print(f"wrote {path}")
