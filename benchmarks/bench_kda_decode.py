"""KDA decode, ours vs fla-core's ``fused_recurrent_kda``, side by side in one process.

    python benchmarks/bench_kda_decode.py                 # the issue's cases + one multi-token case
    python benchmarks/bench_kda_decode.py --sweep         # also time every (BLOCK_V, num_warps)
    python benchmarks/bench_kda_decode.py --cases 256x32 --no-peer
    python -m kda_engram.cli bench kda-decode             # the same rows through the CLI

Inputs (the anchor setting): bf16 q, k, v, raw gate, raw beta, ``[B, H, 128]``;
fp32 ``A_log [H]``, ``dt_bias [H*128]``; ``lower_bound = -5``; in-kernel L2 norm,
gate and beta sigmoid; fp32 state, 64 KiB per head. Times are
``triton.testing.do_bench`` medians (it flushes L2 between runs), under
``torch.inference_mode()``.

The peer is timed two ways and the faster one counts (``peer_ms``):

* ``fla_api`` -- the public ``fused_recurrent_kda(..., initial_state=h0,
  output_final_state=True)`` with a K-first ``[B, H, K, V]`` ``h0``; it reads h0 and
  writes a new final-state tensor (the same bytes as in place). This is how
  the anchor measurement gave fla (0.389 ms at B = 256, H = 32).
* ``fla_inplace`` -- fla's continuous-batching path (``fused_recurrent_kda_fwd``
  with ``ssm_state_indices``, ``inplace_final_state=True``, ``state_v_first=True``):
  the same V-first paged cache, the same indices and the same in-place update as
  ours, so it is the exact like-for-like comparison; its outputs and states are
  also checked against ours (``max_abs_diff``, ``max_abs_diff_state``).

Ours runs with ``check_inputs=False`` (as an engine does inside a CUDA graph).
HBM floor = (state read + state write(s) in fp32 + inputs + outputs) / copy
bandwidth, the bandwidth measured here with a 1 GiB device-to-device copy
(read + write counted).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from common import bench_ms as bench  # first: the path setup (src/ when not installed)
from common import copy_bandwidth

from kda_engram.kda.decode import _launch, decode_tiling, kda_decode, kda_decode_multi

K = V = 128
LOWER_BOUND = -5.0
# (B, H, S): S = None is the one-token decode; S > 1 the speculative multi-token variant.
CASES = [(64, 32, None), (256, 32, None), (1024, 8, None), (256, 32, 4)]
QUICK_CASES = CASES[:3]
SWEEP = [(bv, nw) for bv in (16, 32, 64) for nw in (2, 4, 8)]


def case_name(B, H, S=None):
    return f"B{B}_H{H}" + (f"_S{S}" if S else "")


def parse_case(text: str):
    parts = text.lower().replace("x", " ").replace("s", " ").split()
    B, H = int(parts[0]), int(parts[1])
    return B, H, (int(parts[2]) if len(parts) > 2 else None)


# ----------------------------------------------------------------------- peers


def load_peer():
    """``(api_fn, inplace_fn, note)``; functions are None when fla is missing."""
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception as exc:  # ImportError, or fla failing at import on this machine
        return None, None, f"fla-core not importable ({type(exc).__name__}: {exc})"
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as exc:
        return fused_recurrent_kda, None, f"fla in-place path not importable ({type(exc).__name__}: {exc})"
    import fla

    return fused_recurrent_kda, fused_recurrent_kda_fwd, f"fla-core {getattr(fla, '__version__', '?')}"


def make_case(B, H, S, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    lead = (B,) if S is None else (B, S)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    bf = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = dict(
        q=rnd(*lead, H, K).to(bf),
        k=rnd(*lead, H, K).to(bf),
        v=rnd(*lead, H, V).to(bf),
        raw_g=rnd(*lead, H, K).to(bf),
        raw_beta=rnd(*lead, H).to(bf),
        A_log=0.5 * rnd(H),
        dt_bias=rnd(H * K),
    )
    steps = S or 1
    slots = B * steps
    perm = torch.randperm(slots, generator=gen, device=device).to(torch.int32)
    idx = perm[:B].contiguous() if S is None else perm.view(B, S).contiguous()
    cache = 0.5 * rnd(slots, H, V, K)  # V-first, fp32
    return x, idx, cache


def hbm_bytes(B, H, S):
    steps = S or 1
    state = B * H * V * K * 4 * (1 + steps)  # read once, write after each token
    inputs = B * steps * H * (3 * K + V + 1) * 2  # q, k, raw_g, v, raw_beta in bf16
    outputs = B * steps * H * V * 2
    return state + inputs + outputs + B * steps * 4 + H * (K + 1) * 4


def _as_fla(x, S):
    """fla's shapes: [B, T, H, *] contiguous (T = 1 for one-token decode)."""
    t = (lambda a: a[:, None].contiguous()) if S is None else (lambda a: a.contiguous())
    return t(x["q"]), t(x["k"]), t(x["v"]), t(x["raw_g"]), t(x["raw_beta"])


def ours_fn(x, idx, cache, S, out, block_v=None, num_warps=None):
    if block_v is not None:
        init = idx if S is None else idx[:, 0]
        strides = (idx.stride(0), 0) if S is None else idx.stride()
        return lambda: _launch(
            *x.values(), cache, init, idx, out, None, LOWER_BOUND, steps=S or 1,
            init_stride=init.stride(0), idx_strides=strides, block_v=block_v, num_warps=num_warps,
        )
    if S is None:
        return lambda: kda_decode(**x, state_cache=cache, state_indices=idx, lower_bound=LOWER_BOUND,
                                  out=out, check_inputs=False)
    return lambda: kda_decode_multi(**x, state_cache=cache, state_indices=idx, lower_bound=LOWER_BOUND,
                                    out=out, check_inputs=False)


def fla_api_fn(api, x, idx, cache, S):
    q, k, v, g, beta = _as_fla(x, S)
    rows = (idx if S is None else idx[:, 0]).long()
    h0 = cache[rows].transpose(-1, -2).contiguous()  # [B, H, K, V], fla's default layout
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=LOWER_BOUND)
    return lambda: api(q, k, v, g, beta, **kw)


def fla_inplace_fn(fwd, x, idx, cache, S, out):
    q, k, v, g, beta = _as_fla(x, S)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=cache, inplace_final_state=True,
              state_v_first=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=out)
    return lambda: fwd(q, k, v, g, beta, **kw)


def compare_with_fla(fwd, x, idx, cache, S):
    """Max |ours - fla in-place| over outputs and written state rows, one step
    from the same start state."""
    ours_cache, fla_cache = cache.clone(), cache.clone()
    out = torch.empty(x["v"].shape, dtype=x["v"].dtype, device=cache.device)
    ours_fn(x, idx, ours_cache, S, out)()
    fla_out = torch.empty(_as_fla(x, S)[2].shape, dtype=x["v"].dtype, device=cache.device)
    fla_inplace_fn(fwd, x, idx, fla_cache, S, fla_out)()
    fla_o = fla_out[:, 0] if S is None else fla_out
    rows = idx.reshape(-1).long()
    d_out = (out.float() - fla_o.float()).abs().max().item()
    d_state = (ours_cache[rows] - fla_cache[rows]).abs().max().item()
    return d_out, d_state


# --------------------------------------------------------------------- timing


def run(cases=None, peers=True, quick=False, sweep=False) -> list[dict]:
    """Time every case; rows ``{case, ours_ms, peer_ms, ratio, hbm_floor_ms,
    floor_fraction, max_abs_diff, ...}`` (``ratio`` = peer_ms / ours_ms, > 1 means
    ours is faster; ``floor_fraction`` = hbm_floor_ms / ours_ms)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kda_decode needs a GPU")
    device = torch.device("cuda")
    cases = (QUICK_CASES if quick else CASES) if cases is None else [c if len(c) == 3 else (*c, None) for c in cases]
    api, fwd, note = load_peer() if peers else (None, None, "peer not requested")
    if peers and api is None:
        print(f"[bench_kda_decode] {note}: peer columns left empty")
    bw = copy_bandwidth(device)
    rows = []
    with torch.inference_mode():
        for B, H, S in cases:
            x, idx, cache = make_case(B, H, S, device)
            out = torch.empty(x["v"].shape, dtype=x["v"].dtype, device=device)
            row = dict(case=case_name(B, H, S), peer=None, peer_note=note, copy_gbps=bw / 1e9,
                       tiling=decode_tiling(B, H, V, device, S))
            row["ours_ms"] = bench(ours_fn(x, idx, cache, S, out))
            timings = {}
            if api is not None:
                try:
                    timings["fla_api"] = bench(fla_api_fn(api, x, idx, cache, S))
                except Exception as exc:
                    row["peer_note"] += f"; fla_api failed: {type(exc).__name__}: {exc}"
            if fwd is not None:
                try:
                    row["max_abs_diff"], row["max_abs_diff_state"] = compare_with_fla(fwd, x, idx, cache, S)
                    fla_out = torch.empty(_as_fla(x, S)[2].shape, dtype=x["v"].dtype, device=device)
                    timings["fla_inplace"] = bench(fla_inplace_fn(fwd, x, idx, cache, S, fla_out))
                except Exception as exc:
                    row["peer_note"] += f"; fla_inplace failed: {type(exc).__name__}: {exc}"
            for name, ms in timings.items():
                row[f"{name}_ms"] = ms
            if timings:
                row["peer"] = min(timings, key=timings.get)
                row["peer_ms"] = timings[row["peer"]]
                row["ratio"] = row["peer_ms"] / row["ours_ms"]
            else:
                row["peer_ms"] = row["ratio"] = None
            row["hbm_floor_ms"] = hbm_bytes(B, H, S) / bw * 1e3
            row["floor_fraction"] = row["hbm_floor_ms"] / row["ours_ms"]
            if sweep:
                row["sweep_ms"] = {
                    f"bv{bv}_w{nw}": bench(ours_fn(x, idx, cache, S, out, bv, nw)) for bv, nw in SWEEP
                }
            rows.append(row)
            del x, idx, cache, out
            torch.cuda.empty_cache()
    return rows


def print_rows(rows):
    if rows:
        print(f"copy bandwidth (read + write): {rows[0]['copy_gbps']:.0f} GB/s; peer: {rows[0]['peer_note']}")
    fmt = lambda v, spec: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
    head = (f"{'case':<14} {'ours ms':>8} {'fla api':>8} {'fla inpl':>8} {'ratio':>6} {'floor ms':>8} "
            f"{'of floor':>8} {'tiling':>8} {'|d out|':>9} {'|d state|':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['case']:<14} {fmt(r['ours_ms'], '.4f'):>8} {fmt(r.get('fla_api_ms'), '.4f'):>8} "
            f"{fmt(r.get('fla_inplace_ms'), '.4f'):>8} {fmt(r.get('ratio'), '.2f'):>6} "
            f"{fmt(r['hbm_floor_ms'], '.4f'):>8} {fmt(r['floor_fraction'], '.0%'):>8} "
            f"{'%dx%d' % r['tiling']:>8} {fmt(r.get('max_abs_diff'), '.2e'):>9} {fmt(r.get('max_abs_diff_state'), '.2e'):>9}"
        )
        if "sweep_ms" in r:
            best = min(r["sweep_ms"], key=r["sweep_ms"].get)
            cells = "  ".join(f"{k}={v:.4f}" for k, v in r["sweep_ms"].items())
            print(f"    sweep (best {best}): {cells}")
    print("ratio = fastest fla variant / ours (> 1: ours faster); tiling = BLOCK_V x num_warps")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help="comma-separated BxH or BxHxS, e.g. 64x32,256x32x4")
    p.add_argument("--no-peer", action="store_true", help="time ours only")
    p.add_argument("--quick", action="store_true", help="the three one-token cases only")
    p.add_argument("--sweep", action="store_true", help="also time every (BLOCK_V, num_warps) of ours")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kda_decode needs a GPU")
        return 2
    cases = [parse_case(c) for c in args.cases.split(",")] if args.cases else None
    rows = run(cases, peers=not args.no_peer, quick=args.quick, sweep=args.sweep)
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
