"""KDA prefill on one GPU: ``chunk_kda_prefill`` beside every Hopper peer, in one process.

Peers, each on the same inputs right beside ours (each skipped with a printed
reason when it cannot be imported or fails): fla-core's ``chunk_kda`` (Triton),
FlashKDA (``flash_kda.fwd``, CUTLASS sm_90a; bounded gate only) and cuDNN
frontend's fused Hopper kernel ``kda_fused``
(``cudnn.linear_attention.hopper.cuda_host.launch``). Inputs follow the peers'
anchor run: bf16 q, k, v, raw gate and beta logits, K = V = 128, ``lower_bound =
-5`` with ``A_log = log U[1, 16)`` and ``dt_bias ~ N(0, 1)`` (some channels
barely decay, as in trained models); the ``_fastgate`` cases draw ``A_log,
dt_bias ~ U[0, 1)`` (every channel decays fast). Each call starts from a zero
initial state and returns the final state. ``ragged_H32`` is ten sequences of
37, 4000, 1, 900, 2048, 129, 6000, 63, 64, 65 tokens.

Per case: ours as the default call (``check_inputs=True``: what a user meets;
``default_ms`` = ``checked_ms``, with ``within_check_bound``: at most no-check +
max(0.02 ms, 3%)), the no-check call (what an engine makes) and replayed from a
CUDA graph (GPU time alone); each peer's time; the best peer and our ratio to it (best peer ms /
ours ms, > 1 is faster) for the no-check and the graph column; our fraction of
the HBM floor (q, k, v, raw gate, out in bf16, beta, initial and final state in
fp32, over the copy bandwidth measured here); the max abs difference of our
output to each peer's. Times are the mean of two interleaved
``triton.testing.do_bench`` medians (ours and the peers alternate, so clock and
thermal drift hit both).

The serving forms get rows of their own, checked beside no-check the same way
(:data:`SERVING_CASES`, or every case named with ``--cases``): ``<case>+state``
(a dense random ``initial_state`` + ``output_final_state``) and ``<case>+cache``
(``state_cache`` + ``state_indices`` + ``has_initial_state`` + 64-aligned
checkpoints into the cache). The last line counts the rows within the bound.

The long few-head cases (:data:`GROUP_CASES`) can add one row per forced chunk
group count (``--groups``), the measurement behind :mod:`kda_engram.kda.groups`.
``--profile`` lists instead the time per call of every kernel each side launches
(torch.profiler); ``--sweep`` times the chunk walk over its launch
configurations. ``run(cases=None, peers=True, quick=False)`` returns the rows for
``kda-engram bench``.

FlashKDA is not on PyPI: put its package and extension on ``PYTHONPATH``
(``import flash_kda`` must work). cuDNN's kernel comes with
``pip install nvidia-cudnn-frontend==1.32.0`` (compiled at first use by NVRTC);
it takes the raw gate and beta as fp32, converted here outside the timed call.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

import torch

# fla 0.6 routes chunk_kda to FlashKDA by itself under torch.inference_mode() when
# flash_kda imports: time fla's own kernels (FlashKDA has its own column).
os.environ.setdefault("FLA_FLASH_KDA", "0")

from ...kda.chunk import kda_prefill_walk
from ...kda.hopper.folded_prologue import prepare_folded_prologue
from ...kda.groups import chunk_groups
from ...kda.hopper.walk import folded_walk
from ...constants import CHUNK_SIZE
from ...kda.metadata import prepare_chunk_indices, prepare_chunk_offsets
from ...kda.prefill import chunk_kda_prefill, prefill_path
from ...bundles import KDAInputs
from ...launch_config import chunk_config
from ...kda.prefill_paths import PrefillCall, path_names, verify
from ...kda.prologue import kda_prefill_prologue
from .common import bench_ms as _bench
from .common import copy_bandwidth_gbs, cuda_graph_ms, default_check_bound_ms, no_gpu_exit, result_row, write_json

HEAD_DIM = 128
LOWER_BOUND = -5.0
DTYPE = torch.bfloat16
RAGGED_LENGTHS = (37, 4000, 1, 900, 2048, 129, 6000, 63, 64, 65)
# name: (sequence lengths, heads, fast-decaying gates).
CASES = {
    "1x8k_H32": ((8192,), 32, False),
    "1x32k_H32": ((32768,), 32, False),
    "1x32k_H4": ((32768,), 4, False),
    "1x128k_H4": ((131072,), 4, False),
    "16x2k_H32": ((2048,) * 16, 32, False),
    "64x512_H32": ((512,) * 64, 32, False),
    "256x128_H32": ((128,) * 256, 32, False),
    "1x8k_H96": ((8192,), 96, False),
    "ragged_H32": (RAGGED_LENGTHS, 32, False),
    "1x32k_H32_fastgate": ((32768,), 32, True),
    "1x32k_H4_fastgate": ((32768,), 4, True),
}
# The best peer per case in the H200 anchor run (docs/design/kda_prefill.md, ms), and the
# prefill targets set from it (each at least 1.2x that best peer).
ANCHOR_BEST_PEER_MS = {"1x8k_H32": 1.02, "1x32k_H32": 3.73, "1x32k_H4": 1.44, "1x128k_H4": 4.25,
                       "16x2k_H32": 1.14, "64x512_H32": 1.20, "256x128_H32": 1.48, "1x8k_H96": 1.47,
                       "ragged_H32": 1.18, "1x32k_H32_fastgate": 1.11, "1x32k_H4_fastgate": 0.15}
TARGET_MS = {"16x2k_H32": 0.95, "64x512_H32": 1.00, "256x128_H32": 1.20, "1x8k_H96": 1.20, "ragged_H32": 0.95,
             "1x8k_H32": 0.60, "1x32k_H32": 2.00, "1x32k_H4": 0.45, "1x128k_H4": 1.40}
PEERS = ("fla", "flashkda", "cudnn")
# The long few-head cases can get forced-G rows beside the heuristic's pick.
GROUP_CASES = ("1x32k_H4", "1x128k_H4", "1x32k_H32")
GROUP_COUNTS = (1, 4, 8, 16, 32)
SWEEP = {"BV": (32, 64), "num_warps": (4, 8), "num_stages": (1, 2)}
# The serving forms (:func:`_serving_calls`) get rows of their own for these cases
# by default, and for every case named with ``--cases``.
SERVING_CASES = ("1x32k_H4", "1x32k_H4_fastgate", "16x2k_H32", "ragged_H32")  # BV 16 is refused on GPUs (see chunk_config)


def _interleaved(fns: dict, quick: bool, rounds: int = 2) -> dict:
    """Mean over ``rounds`` of each callable's do_bench median, the callables
    alternating within a round; ``None`` for a callable that raised (printed)."""
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if times[name] is None:
                continue
            try:
                times[name].append(_bench(fn, quick))
            except Exception as exc:  # a peer failing at a shape: report, keep the others
                torch.cuda.synchronize()
                print(f"  {name}: timing failed: {type(exc).__name__}: {exc}")
                times[name] = None
    return {name: (sum(t) / len(t) if t else None) for name, t in times.items()}


def floor_bytes(lengths, heads: int) -> int:
    """Bytes a prefill must move: q, k, v, raw gate, out (bf16), beta (bf16), initial + final state (fp32)."""
    T, N = sum(lengths), len(lengths)
    return T * heads * (5 * HEAD_DIM * 2 + 2) + 2 * N * heads * HEAD_DIM * HEAD_DIM * 4


def make_inputs(lengths, heads: int, device, fastgate: bool = False, seed: int = 0) -> dict:
    """The anchor run's inputs; zero initial state ``h0`` V-first ``[N, H, V, K]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    uni = lambda *s: torch.rand(*s, device=device, generator=gen)  # noqa: E731
    if fastgate:
        A_log, dt_bias = uni(heads), uni(heads * HEAD_DIM)
    else:
        A_log, dt_bias = torch.log(1 + 15 * uni(heads)), rnd(heads * HEAD_DIM)
    cu = torch.zeros(N + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(device)
    return dict(
        q=rnd(1, T, heads, HEAD_DIM).to(DTYPE),
        k=rnd(1, T, heads, HEAD_DIM).to(DTYPE),
        v=rnd(1, T, heads, HEAD_DIM).to(DTYPE),
        raw_g=rnd(1, T, heads, HEAD_DIM).to(DTYPE),
        raw_beta=rnd(1, T, heads).to(DTYPE),
        A_log=A_log.float(),
        dt_bias=dt_bias.float(),
        h0=torch.zeros(N, heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device),
        cu=cu,
    )


def _load_fla():
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or fla failing at import time: report, do not crash
        return None, f"fla-core not importable: {type(exc).__name__}: {exc}"
    try:
        import fla

        version = getattr(fla, "__version__", "?")
    except Exception:  # pragma: no cover
        version = "?"
    return chunk_kda, f"fla-core {version} chunk_kda"


def _fla_call(chunk_kda, x, h0_kv, use_graph: bool = False):
    """fla's call of the anchor run; fla keeps the state K-first [N, H, K, V].
    ``use_graph=True`` is fla's capturable mode (chunk metadata built on the
    device with a static row bound instead of read back to the host)."""
    extra = {"use_graph": True} if use_graph else {}
    return chunk_kda(
        x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], initial_state=h0_kv, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        safe_gate=True, lower_bound=LOWER_BOUND, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=x["cu"],
        **extra,
    )


def load_peers(peers: bool = True) -> dict:
    """``{peer: (make_call or None, description)}``: ``make_call(x)`` returns a
    zero-argument callable running that peer on the inputs ``x`` and returning its
    output ``[1, T, H, V]``; ``None`` with the reason it cannot run."""
    if not peers:
        return {p: (None, "peers off") for p in PEERS}
    found = {}
    chunk_kda, desc = _load_fla()
    if chunk_kda is None:
        found["fla"] = (None, desc)
    else:
        def fla_call(x):
            h0_kv = x["h0"].transpose(-1, -2).contiguous()
            return lambda: _fla_call(chunk_kda, x, h0_kv)[0]

        found["fla"] = (fla_call, desc)
    try:
        import flash_kda

        def flashkda_call(x):
            N, H = x["h0"].shape[:2]
            out = torch.empty_like(x["v"])
            ht = torch.empty_like(x["h0"])
            dtb = x["dt_bias"].view(H, HEAD_DIM)

            def call():
                flash_kda.fwd(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], HEAD_DIM**-0.5, out,
                              A_log=x["A_log"], dt_bias=dtb, lower_bound=LOWER_BOUND, initial_state=x["h0"],
                              final_state=ht, cu_seqlens=x["cu"])
                return out

            return call

        found["flashkda"] = (flashkda_call, "FlashKDA flash_kda.fwd (bf16 state on chip)")
    except Exception as exc:
        found["flashkda"] = (None, f"FlashKDA not importable: {type(exc).__name__}: {exc}")
    try:
        from cudnn.linear_attention.hopper import cuda_host

        def cudnn_call(x):
            N, H = x["h0"].shape[:2]
            T = x["q"].shape[1]
            g32, b32 = x["raw_g"].float().contiguous(), x["raw_beta"].float().contiguous()
            cu32 = x["cu"].to(torch.int32)
            out = torch.empty_like(x["v"])
            ht = torch.empty_like(x["h0"])
            dev = x["q"].device.index or 0

            def call():
                cuda_host.launch(dev, torch.cuda.current_stream().cuda_stream, x["q"].data_ptr(), x["k"].data_ptr(),
                                 x["v"].data_ptr(), g32.data_ptr(), b32.data_ptr(), cu32.data_ptr(),
                                 x["h0"].data_ptr(), out.data_ptr(), ht.data_ptr(), T, N, H,
                                 a_log=x["A_log"].data_ptr(), dt_bias=x["dt_bias"].data_ptr(),
                                 gate_lower_bound=LOWER_BOUND, flags=7, q_scale=HEAD_DIM**-0.5)
                return out

            return call

        found["cudnn"] = (cudnn_call, "cuDNN frontend kda_fused (sm90, fused, warm-up pieces)")
    except Exception as exc:
        found["cudnn"] = (None, f"cuDNN kda_fused not importable: {type(exc).__name__}: {exc}")
    return found


def _ours_call(x, out=None, check_inputs=False, groups=None, path="auto"):
    return lambda: chunk_kda_prefill(
        x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
        lower_bound=LOWER_BOUND, cu_seqlens=x["cu"], initial_state=x["h0"], output_final_state=True,
        out=out, groups=groups, check_inputs=check_inputs, path=path,
    )


def _serving_calls(x, lengths, heads: int, device) -> dict:
    """The calls users make besides the anchor row's, as ``{form: make(check_inputs)}``:

    * ``state``: a dense random ``initial_state`` and ``output_final_state``, the
      output allocated by the call (no ``out``);
    * ``cache``: the serving call: an fp32 ``state_cache`` with int32
      ``state_indices`` and ``has_initial_state`` (every other sequence resumes),
      and 64-aligned checkpoints (half way through each sequence of at least 128
      tokens) into rows of the cache itself.
    """
    N = len(lengths)
    gen = torch.Generator(device=device).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    h0 = 0.1 * rnd(N, heads, HEAD_DIM, HEAD_DIM)
    slots = 2 * N + 2
    cache = 0.1 * rnd(slots, heads, HEAD_DIM, HEAD_DIM)
    rows = torch.randperm(slots, device=device, generator=gen)[: 2 * N].to(torch.int32)
    offsets = torch.tensor([(n // 2) // CHUNK_SIZE * CHUNK_SIZE for n in lengths], dtype=torch.int32, device=device)
    has = torch.arange(N, device=device) % 2 == 0
    base = lambda: (x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"])  # noqa: E731
    return {
        "state": lambda check: (lambda: chunk_kda_prefill(
            *base(), lower_bound=LOWER_BOUND, cu_seqlens=x["cu"], initial_state=h0, output_final_state=True,
            check_inputs=check)),
        "cache": lambda check: (lambda: chunk_kda_prefill(
            *base(), lower_bound=LOWER_BOUND, cu_seqlens=x["cu"], state_cache=cache, state_indices=rows[:N],
            has_initial_state=has, checkpoint_state=cache, checkpoint_offsets=offsets,
            checkpoint_state_indices=rows[N:], check_inputs=check)),
    }


def _bound_fields(checked_ms, nocheck_ms) -> dict:
    """``checked_ms`` (the default call), its bound and whether it holds."""
    if checked_ms is None or nocheck_ms is None:
        return {"checked_ms": checked_ms, "check_bound_ms": None, "within_check_bound": None}
    bound = default_check_bound_ms(nocheck_ms)
    return {"checked_ms": checked_ms, "check_bound_ms": bound, "within_check_bound": checked_ms - nocheck_ms <= bound}


def _serving_rows(name, x, lengths, heads, device, quick) -> list[dict]:
    rows = []
    for form, make in _serving_calls(x, lengths, heads, device).items():
        make("sync")()  # validates the harness's inputs on the spot, compiles the kernels
        torch.cuda.synchronize()
        times = _interleaved({"default": make(True), "nocheck": make(False)}, quick)
        rows.append(result_row(f"{name}+{form}", times["nocheck"], None, None, None, default_ms=times["default"],
                               check_overhead_ms=(times["default"] - times["nocheck"])
                               if times["default"] and times["nocheck"] else None,
                               serving_form=form, **_bound_fields(times["default"], times["nocheck"])))
    return rows


def forced_paths() -> tuple[str, ...]:
    """The registry's paths a case is also timed on by name: all but ``"auto"`` and the
    portable path (which every row times)."""
    return tuple(p for p in path_names() if p not in ("auto", "portable"))


def _hopper_stages(x, out, offs, idx, quick):
    """``(folded prologue ms, Gluon walk ms)`` of the Hopper path on its own, or Nones
    where it cannot serve the inputs."""
    if not verify("hopper", PrefillCall(x["q"], x["v"], out, cu_seqlens=x["cu"]))[0]:
        return None, None
    pro = prepare_folded_prologue(KDAInputs.pick({**x, "lower_bound": LOWER_BOUND}), x["cu"], idx)
    ops = pro()
    ht = torch.empty_like(x["h0"])
    walk = lambda: folded_walk(ops["qg"], ops["kd"], ops["t_fold"], ops["a_fold"], ops["v"], ops["decay"],  # noqa: E731
                               out, HEAD_DIM**-0.5, x["cu"], offs, initial_state=x["h0"], final_state=ht)
    return _bench(pro, quick), _bench(walk, quick)


def run(cases=None, peers: bool = True, quick: bool = False, sweep: bool = False,
        group_counts=(), group_cases=GROUP_CASES, on_rows=None, budget_s: float | None = None) -> list[dict]:
    """Rows ``{case, ours_ms (no-check), default_ms, graph_ms, <peer>_ms, peer_ms
    (best peer), peer (its name), ratio, graph_ratio, hbm_floor_ms, floor_fraction,
    max_abs_diff_<peer>, prologue_ms, chunk_ms, groups, target_ms, case_seconds, ...}``.
    ``cases``: names of :data:`CASES` (default all). ``sweep`` adds one row per
    chunk-walk launch configuration; ``group_counts`` x ``group_cases`` add the
    forced-G rows (``forced_groups`` set, ``max_abs_diff_g1`` to our G = 1 output).
    ``on_rows(rows)`` is called with each case's rows as soon as the case is done
    (``main`` prints and saves them then, so a run cut short keeps what it had);
    ``case_seconds`` is the case's wall time, compiles and peers' autotuning included.
    ``budget_s``: no case starts once the run's time plus the longest case so far
    would pass it (:func:`starts_within`), so a device call with a time limit ends with
    every finished case saved; the cases left are named on one line."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kda_prefill needs a GPU")
    device = torch.device("cuda")
    bw = copy_bandwidth_gbs(device)
    found = load_peers(peers)
    for p, (call, desc) in found.items():
        print(f"peer {p}: {desc}" + ("" if call else " -- skipped"))
    rows: list[dict] = []
    run_start, longest = time.perf_counter(), 0.0
    names = list(cases or CASES)
    for i, name in enumerate(names):
        if not starts_within(budget_s, time.perf_counter() - run_start, longest):
            print(f"budget of {budget_s:.0f} s: stopped before {', '.join(names[i:])}")
            break
        case_start, first_row = time.perf_counter(), len(rows)
        lengths, H, fastgate = CASES[name]
        N, T = len(lengths), sum(lengths)
        x = make_inputs(lengths, H, device, fastgate=fastgate)
        floor_ms = floor_bytes(lengths, H) / (bw * 1e9) * 1e3
        out = torch.empty(1, T, H, HEAD_DIM, dtype=DTYPE, device=device)
        picked = chunk_groups(max(1, math.ceil(max(lengths) / CHUNK_SIZE)), N, H, device,
                              head_k=HEAD_DIM, head_v=HEAD_DIM)
        with torch.inference_mode():
            notes, diffs = {}, {}
            o_ours, _ = _ours_call(x, check_inputs=True)()  # validates the inputs, compiles the kernels
            fns = {"default": _ours_call(x, out, check_inputs=True), "nocheck": _ours_call(x, out),
                   "portable": _ours_call(x, out, path="portable")}
            inputs = KDAInputs.pick({**x, "lower_bound": LOWER_BOUND})
            picked_path = prefill_path(x["q"], x["v"], out, cu_seqlens=x["cu"], inputs=inputs)
            # Every forced path besides the portable one (the registry's: "hopper", "fused"),
            # with why it cannot serve the case, or its output's distance to the portable path's.
            forced_notes = {}
            for fp in forced_paths():
                forced_notes[fp] = verify(fp, PrefillCall(x["q"], x["v"], out, cu_seqlens=x["cu"], inputs=inputs))[1]
                if forced_notes[fp] is not None:
                    continue
                try:
                    o_h, _ = _ours_call(x, path=fp)()
                    o_p, _ = _ours_call(x, path="portable")()
                    torch.cuda.synchronize()
                    diffs[f"{fp}_vs_portable"] = (o_h.float() - o_p.float()).abs().max().item()
                    fns[fp] = _ours_call(x, out, path=fp)
                except Exception as exc:  # a path that fails to build: say why, time the rest
                    torch.cuda.synchronize()
                    forced_notes[fp] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
            hopper_reason = forced_notes.get("hopper")
            for p, (make, desc) in found.items():
                if make is None:
                    notes[p] = desc
                    continue
                try:
                    fn = make(x)
                    o_peer = fn()
                    torch.cuda.synchronize()
                    diffs[p] = (o_ours.float() - o_peer.float()).abs().max().item()
                    fns[p] = fn
                except Exception as exc:  # a peer that cannot run this case: say why, keep going
                    torch.cuda.synchronize()
                    notes[p] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            times = _interleaved(fns, quick)
            # Replayed from a CUDA graph: the GPU time alone, without the host's launch work.
            graph_ms = cuda_graph_ms(fns["nocheck"], iters=20, repeats=3)

            # The two stages on their own.
            scale = HEAD_DIM**-0.5
            offs = prepare_chunk_offsets(x["cu"], CHUNK_SIZE)
            idx = prepare_chunk_indices(x["cu"], CHUNK_SIZE, total_tokens=T, chunk_offsets=offs)
            pro = lambda: kda_prefill_prologue(  # noqa: E731
                x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], scale, LOWER_BOUND,
                x["cu"], chunk_indices=idx, check_inputs=False,
            )
            ops = pro()
            prologue_ms = _bench(pro, quick)

            def walk(config=None, groups=None):
                return kda_prefill_walk(ops["qg"], ops["w"], ops["u"], ops["kg_t"], ops["aqk"], ops["decay"], out,
                                       scale, x["cu"], x["h0"], True, chunk_offsets=offs, check_inputs=False,
                                       config=config, groups=groups)

            chunk_ms = _bench(walk, quick)
            folded_prologue_ms, folded_walk_ms = (None, None) if hopper_reason else _hopper_stages(x, out, offs, idx, quick)
            peer_times = {p: times.get(p) for p in PEERS}
            ran = {p: t for p, t in peer_times.items() if t is not None}
            best = min(ran, key=ran.get) if ran else None
            row = result_row(
                name, times["nocheck"], ran.get(best), best, floor_ms,
                default_ms=times["default"], graph_ms=graph_ms,
                graph_ratio=(ran[best] / graph_ms) if best else None,
                default_ratio=(ran[best] / times["default"]) if best and times["default"] else None,
                check_overhead_ms=(times["default"] - times["nocheck"]) if times["default"] else None,
                **{f"{p}_ms": peer_times[p] for p in PEERS},
                **{f"max_abs_diff_{p}": diffs.get(p) for p in PEERS},
                peer_notes=notes, prologue_ms=prologue_ms, chunk_ms=chunk_ms,
                path=picked_path, portable_ms=times.get("portable"),
                **{f"{fp}_ms": times.get(fp) for fp in forced_notes},
                **{f"{fp}_note": why for fp, why in forced_notes.items()},
                **{f"max_abs_diff_{fp}_vs_portable": diffs.get(f"{fp}_vs_portable") for fp in forced_notes},
                folded_prologue_ms=folded_prologue_ms, folded_walk_ms=folded_walk_ms,
                config=chunk_config(N, H, HEAD_DIM, device), copy_gbs=bw, groups=picked, tokens=T, heads=H,
                fastgate=fastgate, target_ms=TARGET_MS.get(name), anchor_best_peer_ms=ANCHOR_BEST_PEER_MS.get(name),
            )
            row.update(_bound_fields(times["default"], times["nocheck"]))
            if row["target_ms"] is not None:
                row["meets_target"] = min(row["ours_ms"], graph_ms) <= row["target_ms"]
            rows.append(row)
            if cases or name in SERVING_CASES:
                rows += _serving_rows(name, x, lengths, H, device, quick)

            if name in group_cases and group_counts:
                o_g1 = None
                for g in sorted(group_counts):
                    try:
                        o_g, _ = _ours_call(x, check_inputs=True, groups=g)()
                        g_ms = _bench(_ours_call(x, out, groups=g), quick)
                        g_chunk_ms = _bench(lambda: walk(groups=g), quick)
                    except Exception as exc:  # report, keep going
                        print(f"  {name} G={g}: {type(exc).__name__}: {exc}")
                        continue
                    if g == 1:
                        o_g1 = o_g
                    rows.append(result_row(
                        f"{name} G={g}", g_ms, ran.get(best), best, floor_ms, chunk_ms=g_chunk_ms,
                        forced_groups=g, groups=g, heuristic_groups=picked, copy_gbs=bw,
                        max_abs_diff_g1=None if o_g1 is None else (o_g.float() - o_g1.float()).abs().max().item(),
                    ))
                    del o_g
                del o_g1

            if sweep:
                default_cfg = chunk_config(N, H, HEAD_DIM, device)
                for bv, nw, ns in itertools.product(*SWEEP.values()):
                    conf = {"BV": bv, "num_warps": nw, "num_stages": ns}
                    try:
                        ms = _bench(lambda: walk(conf), quick)
                    except Exception as exc:  # e.g. out of shared memory for a config
                        print(f"  sweep {name} {conf}: {type(exc).__name__}: {exc}")
                        continue
                    rows.append(result_row(f"{name} chunk[BV={bv},w={nw},s={ns}]", ms, chunk_ms,
                                           f"chunk default {default_cfg}", None, sweep=True))
        del x, out, ops, o_ours
        torch.cuda.empty_cache()
        rows[first_row]["case_seconds"] = time.perf_counter() - case_start
        longest = max(longest, rows[first_row]["case_seconds"])
        if on_rows is not None:
            on_rows(rows[first_row:])
    return rows


def starts_within(budget_s: float | None, elapsed_s: float, longest_case_s: float) -> bool:
    """Whether a case may start ``elapsed_s`` into a run limited to ``budget_s`` (None:
    no limit): the longest case so far must still fit (the first case always starts)."""
    return budget_s is None or elapsed_s + longest_case_s <= budget_s


def main_rows(rows: list[dict]) -> list[dict]:
    """The rows of the cases themselves: not a forced group count, a sweep or a serving form."""
    return [r for r in rows if not (r.get("forced_groups") or r.get("sweep") or r.get("serving_form"))]


def cases_done(rows: list[dict]) -> set[str]:
    """The cases that have their row in ``rows`` (a run to resume skips them)."""
    return {r["case"] for r in main_rows(rows)}


def peer_speedups(rows: list[dict]) -> list[tuple[str, dict[str, float | None]]]:
    """Per case row: ``(case, {peer: peer_ms / ours_ms})`` for every peer of :data:`PEERS`
    (> 1: ours is faster; None: the peer did not run), ours the no-check call."""
    out = []
    for r in main_rows(rows):
        ours = r.get("ours_ms")
        out.append((r["case"], {p: (r[f"{p}_ms"] / ours) if ours and r.get(f"{p}_ms") else None for p in PEERS}))
    return out


def plot_peer_speedups(rows: list[dict], path: str, card: str = "") -> None:
    """A bar per peer per case (:func:`peer_speedups`), the 1x line and the issue's
    1.2x target, to ``path`` (PNG); needs matplotlib (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = peer_speedups(rows)
    width = 0.8 / len(PEERS)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(data) + 2), 4.2))
    for j, peer in enumerate(PEERS):
        xs = [i + (j - (len(PEERS) - 1) / 2) * width for i in range(len(data))]
        ax.bar(xs, [d.get(peer) or 0.0 for _, d in data], width, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.2, color="black", linewidth=0.6, linestyle="--", label="1.2x target")
    ax.set_xticks(range(len(data)), [case for case, _ in data], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("peer ms / ours ms (higher: ours faster)")
    ax.set_title("KDA prefill, bf16, K = V = 128" + (f", {card}" if card else "") + " (missing bar: peer did not run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_header(rows: list[dict]) -> None:
    """The device line and the column names of :func:`print_case_rows`."""
    if rows and rows[0].get("copy_gbs"):
        print(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth (read + write): {rows[0]['copy_gbs']:.0f} GB/s")
    print(f"{'case':<22} {'default':>8} {'no-check':>8} {'graph':>8} {'fla':>8} {'FlashKDA':>8} {'cuDNN':>8} "
          f"{'best':>8} {'ratio':>6} {'r graph':>7} {'target':>6} {'of floor':>8} {'prol ms':>8} {'walk ms':>8} "
          f"{'G':>3}")


def print_rows(rows: list[dict]) -> None:
    """The whole table: header, every case's rows, then the serving forms and the summaries."""
    print_header(rows)
    print_case_rows(rows)
    print_summaries(rows)


def print_case_rows(rows: list[dict]) -> None:
    """The main-table lines of ``rows`` (serving rows wait for :func:`print_summaries`)."""
    f = _f
    for r in rows:
        if r.get("serving_form"):
            continue  # their own table below
        if r.get("sweep"):
            print(f"{r['case']:<34} {f(r['ours_ms']):>8} {f(r['ratio'], '.2f'):>6}   (vs the default walk)")
            continue
        if r.get("forced_groups") is not None:
            print(f"{r['case']:<22} {'':>8} {f(r['ours_ms']):>8} {'':>8}   walk {f(r.get('chunk_ms'))} ms, "
                  f"best peer {f(r['peer_ms'])} ms, |do| to G=1 {f(r.get('max_abs_diff_g1'), '.2e')}")
            continue
        print(
            f"{r['case']:<22} {f(r.get('default_ms')):>8} {f(r['ours_ms']):>8} {f(r.get('graph_ms')):>8} "
            f"{f(r.get('fla_ms')):>8} {f(r.get('flashkda_ms')):>8} {f(r.get('cudnn_ms')):>8} "
            f"{(r['peer'] or '-'):>8} {f(r['ratio'], '.2f'):>6} {f(r.get('graph_ratio'), '.2f'):>7} "
            f"{f(r.get('target_ms'), '.2f'):>6} {f(r['floor_fraction'], '.0%'):>8} {f(r.get('prologue_ms')):>8} "
            f"{f(r.get('chunk_ms')):>8} {f(r.get('groups'), 'd'):>3}"
        )
        diffs = ", ".join(f"{p} {r[f'max_abs_diff_{p}']:.2e}" for p in PEERS
                          if r.get(f"max_abs_diff_{p}") is not None)
        skipped = "; ".join(f"{p}: {why}" for p, why in (r.get("peer_notes") or {}).items())
        print(f"{'':<22}   max|o - peer|: {diffs or '-'}; check overhead {f(r.get('check_overhead_ms'))} ms"
              + (f"; skipped {skipped}" if skipped else ""))
        print(f"{'':<22}   path {r.get('path')}: hopper {f(r.get('hopper_ms'))} ms (folded prologue "
              f"{f(r.get('folded_prologue_ms'))} + walk {f(r.get('folded_walk_ms'))}), portable "
              f"{f(r.get('portable_ms'))} ms, max|o_hopper - o_portable| "
              f"{f(r.get('max_abs_diff_hopper_vs_portable'), '.2e')}"
              + (f"; hopper cannot: {r['hopper_note']}" if r.get("hopper_note") else "")
              + (f"; fused {f(r.get('fused_ms'))} ms, max|o_fused - o_portable| "
                 f"{f(r.get('max_abs_diff_fused_vs_portable'), '.2e')}" if "fused_ms" in r else "")
              + (f" (fused cannot: {r['fused_note']})" if r.get("fused_note") else "")
              + (f"; case took {r['case_seconds']:.0f} s" if r.get("case_seconds") is not None else ""))


def print_summaries(rows: list[dict]) -> None:
    """After the main table: the serving forms' table, the check bound and the chunk-group summary."""
    f = _f
    served = [r for r in rows if r.get("serving_form")]
    if served:
        print("serving forms (+state: dense initial_state + output_final_state; +cache: state_cache + "
              "state_indices + has_initial_state + 64-aligned checkpoints)")
        print(f"{'case':<30} {'checked':>8} {'no-check':>8} {'added':>8} {'bound':>8} {'ok':>4}")
        for r in served:
            added = None if r["checked_ms"] is None or r["ours_ms"] is None else r["checked_ms"] - r["ours_ms"]
            print(f"{r['case']:<30} {f(r['checked_ms']):>8} {f(r['ours_ms']):>8} {f(added):>8} "
                  f"{f(r['check_bound_ms']):>8} {str(r['within_check_bound']):>4}")
    print_check_bound(rows)
    summary = group_summary(rows)
    if summary:
        print("chunk groups: heuristic pick vs fastest forced G (whole prefill)")
        for case, s in summary.items():
            print(f"  {case:<12} heuristic G={s['heuristic']} {f(s['heuristic_ms'])} ms; fastest forced "
                  f"G={s['best']} {f(s['best_ms'])} ms; G=1 {f(s['g1_ms'])} ms")


def group_summary(rows: list[dict]) -> dict:
    """Per case with forced-G rows: the heuristic's pick and time beside the fastest forced count."""
    main = {r["case"]: r for r in rows if not r.get("sweep") and r.get("forced_groups") is None}
    out = {}
    for r in rows:
        g = r.get("forced_groups")
        if g is None or r.get("ours_ms") is None:
            continue
        case = r["case"].split(" ")[0]
        s = out.setdefault(case, {"heuristic": main.get(case, {}).get("groups"),
                                  "heuristic_ms": main.get(case, {}).get("ours_ms"),
                                  "best": None, "best_ms": None, "g1_ms": None})
        if s["best_ms"] is None or r["ours_ms"] < s["best_ms"]:
            s["best"], s["best_ms"] = g, r["ours_ms"]
        if g == 1:
            s["g1_ms"] = r["ours_ms"]
    return out


def kernel_times(fn, calls: int = 5, warmup: int = 3) -> dict[str, float]:
    """ms per call of every GPU kernel ``fn`` launches (torch.profiler, ``calls``
    calls after ``warmup`` ones, which also let fla finish autotuning), largest
    first: where the time of a whole prefill goes."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def profile_cases(cases, peers: bool = True, min_ms: float = 0.002) -> dict:
    """``{case: {"ours"|"fla": {kernel: ms per call}}}`` for ``chunk_kda_prefill`` and
    fla's ``chunk_kda`` on the same inputs; kernels under ``min_ms`` are left out."""
    device = torch.device("cuda")
    chunk_kda, peer_name = _load_fla() if peers else (None, "peers off")
    result = {}
    for name in cases:
        lengths, H, fastgate = CASES[name]
        x = make_inputs(lengths, H, device, fastgate=fastgate)
        sides = {"ours": _ours_call(x)}
        if chunk_kda is not None:
            h0_kv = x["h0"].transpose(-1, -2).contiguous()
            sides["fla"] = lambda: _fla_call(chunk_kda, x, h0_kv)  # noqa: E731
        with torch.inference_mode():
            result[name] = {side: {k: v for k, v in kernel_times(fn).items() if v >= min_ms}
                            for side, fn in sides.items()}
        for side, kernels in result[name].items():
            print(f"{name} {side}: {sum(kernels.values()):.3f} ms in kernels of at least {min_ms} ms")
            for kernel, ms in kernels.items():
                print(f"  {ms:8.3f}  {kernel[:100]}")
    if chunk_kda is None:
        print(f"no fla rows: {peer_name}")
    return result


def print_check_bound(rows: list[dict]) -> None:
    """One line per row that has a ``checked`` column: the default call against
    no-check + max(0.02 ms, 3%)."""
    timed = [r for r in rows if "within_check_bound" in r and r["within_check_bound"] is not None]
    if not timed:
        return
    misses = [r for r in timed if not r["within_check_bound"]]
    print(f"default call (checked) within no-check + max(0.02 ms, 3%): {len(timed) - len(misses)}/{len(timed)} rows"
          + ("" if not misses else "; MISSES: " + ", ".join(
              f"{r['case']} +{r['checked_ms'] - r['ours_ms']:.3f} ms (bound {r['check_bound_ms']:.3f})"
              for r in misses)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument("--no-peers", action="store_true", help="time ours only")
    parser.add_argument("--sweep", action="store_true", help="also sweep the chunk kernel's launch configurations")
    parser.add_argument("--groups", default="",
                        help=f"forced chunk-group counts for the group cases, e.g. {','.join(map(str, GROUP_COUNTS))} "
                             "(default none)")
    parser.add_argument("--group-cases", default=",".join(GROUP_CASES),
                        help="cases that get forced-G rows ('all' = every case)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, list each kernel's time per call (ours and fla's)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--resume", action="store_true",
                        help="with --json: keep the rows already there and skip their cases")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no case that would end past this many seconds (the longest case so far)")
    parser.add_argument("--plot", default=None,
                        help="draw every peer's ratio per case (PNG; needs matplotlib) from the rows")
    parser.add_argument("--plot-only", action="store_true",
                        help="with --json and --plot: draw from the saved rows and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if (args.resume or args.plot_only) and not args.json:
        parser.error("--resume and --plot-only need --json")
    earlier: list[dict] = []
    if (args.resume or args.plot_only) and os.path.exists(args.json):
        import json

        with open(args.json) as fh:
            earlier = json.load(fh)
    if args.plot_only:
        if not args.plot:
            parser.error("--plot-only needs --plot")
        plot_peer_speedups(earlier, args.plot, card=(earlier[0].get("device") or "") if earlier else "")
        print(f"wrote {args.plot}")
        return 0
    if (code := no_gpu_exit("bench_kda_prefill")) is not None:
        return code
    cases = args.cases.split(",") if args.cases else None
    for c in cases or []:
        if c not in CASES:
            parser.error(f"unknown case {c!r}; expected one of {', '.join(CASES)}")
    if args.profile:
        kernels = profile_cases(cases or list(CASES), peers=not args.no_peers)
        if args.json:
            write_json(kernels, args.json)
        return 0
    try:
        counts = tuple(int(g) for g in args.groups.split(",") if g.strip())
    except ValueError:
        parser.error(f"--groups: expected comma-separated ints, got {args.groups!r}")
    if any(g < 1 for g in counts):
        parser.error(f"--groups: counts must be >= 1, got {args.groups!r}")
    group_cases = tuple(CASES) if args.group_cases == "all" else tuple(c for c in args.group_cases.split(",") if c)
    for c in group_cases:
        if c not in CASES:
            parser.error(f"--group-cases: unknown case {c!r}")
    done: list[dict] = list(earlier)
    if earlier:
        skipped = cases_done(earlier)
        cases = [c for c in (cases or list(CASES)) if c not in skipped]
        print(f"resuming {args.json}: {len(skipped)} cases done, {len(cases)} to run")
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else ""

    def on_rows(new):  # each case as it finishes: a run cut short keeps what it printed and saved
        if len(done) == len(earlier):
            print_header(new)
        for row in new:
            row.setdefault("device", card)
        done.extend(new)
        print_case_rows(new)
        sys.stdout.flush()
        if args.json:
            write_json(done, args.json)

    start = time.perf_counter()
    rows = run(cases, peers=not args.no_peers, quick=args.quick, sweep=args.sweep, group_counts=counts,
               group_cases=group_cases, on_rows=on_rows, budget_s=args.budget_s) if cases else []
    print_summaries(done)
    print(f"bench_kda_prefill: {len(rows)} rows in {time.perf_counter() - start:.0f} s ({len(done)} in all)")
    if args.plot and done:
        plot_peer_speedups(done, args.plot, card=card)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
