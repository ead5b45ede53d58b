"""The fused KDA prologue alone, at the anchor shapes, against its own HBM floor.

    python -m kda_engram.tools.benchmarks.bench_kda_prologue                  # all anchor cases, with the fla peer
    python -m kda_engram.tools.benchmarks.bench_kda_prologue --cases 1x32k_H32 --sweep
    python -m kda_engram.tools.benchmarks.bench_kda_prologue --no-peer --json out.json
    python -m kda_engram.tools.benchmarks.bench_kda_prologue --conv state     # the serving layer's path

Inputs (the anchor setting): bf16 q, k, v, raw gate ``[1, T, H, 128]`` and raw
beta ``[1, T, H]``; fp32 ``A_log [H]``, ``dt_bias [H*128]``; ``lower_bound = -5``;
``cu_seqlens`` (int32) given. Ours runs with ``check_inputs=False`` (as inside a
CUDA graph), chunk metadata prepared once outside the timed region (the engine
builds it once per batch for both launches). Times are ``triton.testing.do_bench``
medians under ``torch.inference_mode()``.

HBM floor = bytes the prologue must move / copy bandwidth: it reads q, k, v, raw_g,
raw_beta and writes qg, w, u, aqk (``[1, T, H, 64]``), kg_t (one ``[128, 64]`` slab
per real chunk and head) and decay (fp32). The copy bandwidth is measured here with
a 1 GiB device-to-device copy (read + write counted).

The peer is fla-core's equivalent of the same work, which it spreads over several
launches: ``l2norm_fwd`` of q and k, the beta sigmoid, ``kda_gate_chunk_cumsum`` and
``chunk_kda_fwd_intra`` (A_qk, A_kk, the inverse, w, u, qg, kg). Those are internal
functions whose signatures move between fla versions, so they are called with the
keyword arguments each one accepts; when that fails the row says why
(``peer_note``) and carries no peer time. It is not exactly the same contract
(fla's A_qk carries ``scale``, its kg is token-major), so no values are compared;
``max_abs_diff`` is ours against the fp32 reference on the first 1024 tokens.

``--conv weight`` runs the depthwise conv + SiLU on the q/k/v bands first, and
``--conv state`` also starts every sequence from a conv-state row and writes it
back, as ``KimiDeltaAttention`` prefills. These rows have no peer (fla's pieces
do not include the conv) and no reference diff; their floor adds the
conv weight and the conv-state rows read and written.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys

import torch

from ...constants import CHUNK_SIZE
from ...kda.metadata import prepare_chunk_indices
from ...kda.prologue import kda_prefill_prologue
from ...kda.reference import naive_chunk_operands
from .common import bench_ms as bench
from .common import copy_bandwidth, no_gpu_exit, random_kda_inputs, write_json

K = V = 128
LOWER_BOUND = -5.0
RCP_LN2 = 1.0 / math.log(2.0)
# name -> (sequences, tokens per sequence, heads), as in the anchor measurement
CASES = {
    "1x8k_H32": (1, 8192, 32),
    "1x32k_H32": (1, 32768, 32),
    "1x32k_H4": (1, 32768, 4),
    "1x128k_H4": (1, 131072, 4),
    "16x2k_H32": (16, 2048, 32),
    "64x512_H32": (64, 512, 32),
    "1x8k_H96": (1, 8192, 96),
}
QUICK_CASES = ["1x8k_H32", "1x32k_H32", "16x2k_H32"]
SWEEP_WARPS = ((4, 4), (8, 4), (8, 8), (8, 2), (16, 4))  # (intra, solve)


def make_case(num_seqs, length, H, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    T = num_seqs * length
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = random_kda_inputs(rnd, (1, T), H, K, V, torch.bfloat16)
    cu = torch.arange(0, T + 1, length, dtype=torch.int32, device=device)
    return x, cu


def conv_inputs(x, num_seqs, H, conv, device, seed=1):
    """The conv arguments of ``kda_prefill_prologue`` for ``conv`` in (None, "weight",
    "state"): a ``[2HK + HV, 4]`` weight, and with "state" one bf16 conv-state row
    per sequence, every sequence starting from its row."""
    if conv is None:
        return {}
    gen = torch.Generator(device=device).manual_seed(seed)
    channels = H * (2 * K + V)
    args = dict(conv_weight=(0.5 * torch.randn(channels, 4, generator=gen, device=device)).to(x["q"].dtype))
    if conv == "state":
        args.update(
            conv_state=torch.randn(num_seqs, channels, 3, generator=gen, device=device).to(x["q"].dtype),
            conv_state_indices=torch.arange(num_seqs, dtype=torch.int32, device=device),
            conv_has_initial_state=torch.ones(num_seqs, dtype=torch.bool, device=device),
        )
    return args


def hbm_bytes(num_seqs, length, H, itemsize=2, conv=None):
    T = num_seqs * length
    chunks = num_seqs * (-(-length // CHUNK_SIZE))
    read = T * H * (2 * K + V + K + 1) * itemsize  # q, k, v, raw_g, raw_beta
    write = T * H * (2 * K + V + CHUNK_SIZE) * itemsize  # qg, w, u, aqk
    write += chunks * H * K * (CHUNK_SIZE * itemsize + 4)  # kg_t, decay
    channels = H * (2 * K + V)
    if conv is not None:
        read += channels * 4 * itemsize  # conv weight
    if conv == "state":
        read += num_seqs * channels * 3 * itemsize  # conv-state rows, read and written back
        write += num_seqs * channels * 3 * itemsize
    return read + write


# ----------------------------------------------------------------------- peer


def _call(fn, **kwargs):
    """Call ``fn`` with the keyword arguments its signature accepts."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{n: v for n, v in kwargs.items() if n in params})


def load_peer():
    """``(make_fn, note)``: ``make_fn(x, cu)`` returns a callable running fla's
    prologue pieces, or None with the reason in ``note``."""
    try:
        import fla
        from fla.modules.l2norm import l2norm_fwd
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
        from fla.ops.kda.gate import kda_gate_chunk_cumsum
    except Exception as exc:  # ImportError, or fla failing at import on this machine
        return None, f"fla-core not importable ({type(exc).__name__}: {exc})"
    try:
        from fla.ops.utils.index import prepare_chunk_indices as fla_chunk_indices
    except Exception:
        fla_chunk_indices = None

    def make_fn(x, cu):
        cu64 = cu.to(torch.int64)
        ci = fla_chunk_indices(cu64, CHUNK_SIZE) if fla_chunk_indices is not None else None

        def first(r):
            return r[0] if isinstance(r, tuple) else r

        def fn():
            q = first(l2norm_fwd(x["q"]))
            k = first(l2norm_fwd(x["k"]))
            beta = torch.sigmoid(x["raw_beta"].float()).to(x["raw_beta"].dtype)
            g = _call(kda_gate_chunk_cumsum, g=x["raw_g"], A_log=x["A_log"], chunk_size=CHUNK_SIZE, scale=RCP_LN2,
                      dt_bias=x["dt_bias"], cu_seqlens=cu64, chunk_indices=ci, lower_bound=LOWER_BOUND)
            return _call(chunk_kda_fwd_intra, q=q, k=k, v=x["v"], gk=g, beta=beta, scale=K ** -0.5,
                         cu_seqlens=cu64, chunk_size=CHUNK_SIZE, chunk_indices=ci, safe_gate=True)

        return fn

    return make_fn, f"fla-core {getattr(fla, '__version__', '?')} (l2norm x2, sigmoid, gate cumsum, intra)"


# --------------------------------------------------------------------- timing


def reference_diff(x, cu, out, tokens=1024):
    """Max |ours - fp32 reference| over qg, w, u, aqk on the first ``tokens`` tokens
    (those are whole chunks of the first sequence in every anchor case)."""
    n = min(tokens, int(cu[1].item()))
    sub = {k_: (t[:, :n] if t.dim() >= 3 else t) for k_, t in x.items()}
    cu_sub = torch.tensor([0, n], dtype=torch.int32, device=cu.device)
    ref = naive_chunk_operands(*(sub[m].float() for m in ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias")),
                         cu_seqlens=cu_sub, lower_bound=LOWER_BOUND)
    return max((out[m][:, :n].float() - ref[m]).abs().max().item() for m in ("qg", "w", "u", "aqk"))


def run(cases=None, peers=True, quick=False, sweep=False, conv=None) -> list[dict]:
    """Time every case; rows ``{case, ours_ms, peer_ms, ratio, hbm_floor_ms,
    floor_fraction, max_abs_diff, ...}`` (``ratio`` = peer_ms / ours_ms, > 1 means
    ours is faster; ``floor_fraction`` = hbm_floor_ms / ours_ms). ``conv``: None,
    "weight" or "state" (see the module docstring)."""
    if conv not in (None, "weight", "state"):
        raise ValueError(f"conv: expected None, 'weight' or 'state', got {conv!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kda_prologue needs a GPU")
    device = torch.device("cuda")
    names = list(cases) if cases else (QUICK_CASES if quick else list(CASES))
    bw = copy_bandwidth(device)
    make_peer, peer_note = load_peer() if (peers and conv is None) else (
        None, "peer disabled" if conv is None else "no peer for the conv path")
    rows = []
    with torch.inference_mode():
        for name in names:
            num_seqs, length, H = CASES[name]
            x, cu = make_case(num_seqs, length, H, device)
            T = num_seqs * length
            ci = prepare_chunk_indices(cu, CHUNK_SIZE, total_tokens=T)
            conv_args = conv_inputs(x, num_seqs, H, conv, device)

            def ours(num_warps=None):
                return kda_prefill_prologue(**x, scale=K ** -0.5, lower_bound=LOWER_BOUND, cu_seqlens=cu,
                                          chunk_indices=ci, check_inputs=False, num_warps=num_warps, **conv_args)

            out = ours()
            torch.cuda.synchronize()
            row = dict(case=name if conv is None else f"{name}+conv_{conv}", tokens=T, heads=H, ours_ms=bench(ours))
            if sweep:
                row["sweep_ms"] = {f"num_warps={w}": bench(lambda w=w: ours(w)) for w in SWEEP_WARPS}
            row["max_abs_diff"] = reference_diff(x, cu, out) if conv is None else None
            del out
            row["peer"], row["peer_ms"], row["peer_note"] = None, None, peer_note
            if make_peer is not None:
                try:
                    fn = make_peer(x, cu)
                    fn()
                    torch.cuda.synchronize()
                    row["peer_ms"] = bench(fn)
                    row["peer"] = "fla pieces"
                except Exception as exc:  # an fla version whose internals differ
                    row["peer_note"] = f"fla pieces failed: {type(exc).__name__}: {exc}"[:300]
            nbytes = hbm_bytes(num_seqs, length, H, conv=conv)
            row["hbm_bytes"] = nbytes
            row["hbm_floor_ms"] = nbytes / bw * 1e3
            row["floor_fraction"] = row["hbm_floor_ms"] / row["ours_ms"]
            row["ratio"] = row["peer_ms"] / row["ours_ms"] if row["peer_ms"] else None
            row["copy_gbps"] = bw / 1e9
            rows.append(row)
            del x
            torch.cuda.empty_cache()
    return rows


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", choices=list(CASES), help="default: all anchor cases")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_CASES)}")
    parser.add_argument("--no-peer", action="store_true", help="skip the fla pieces")
    parser.add_argument("--sweep", action="store_true", help=f"also time num_warps in {SWEEP_WARPS}")
    parser.add_argument("--conv", choices=("weight", "state"), help="conv (and conv state) on")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if (code := no_gpu_exit("bench_kda_prologue")) is not None:
        return code
    rows = run(args.cases, peers=not args.no_peer, quick=args.quick, sweep=args.sweep, conv=args.conv)
    if rows:
        print(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth {rows[0]['copy_gbps']:.0f} GB/s (read + write)")
    head = f"{'case':<22} {'ours ms':>9} {'peer ms':>9} {'ratio':>6} {'floor ms':>9} {'of floor':>8} {'max|d|':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['case']:<22} {r['ours_ms']:>9.3f} {_fmt(r['peer_ms'], '9.3f'):>9} {_fmt(r['ratio'], '6.2f'):>6} "
              f"{r['hbm_floor_ms']:>9.3f} {r['floor_fraction']:>8.0%} {_fmt(r['max_abs_diff'], '9.2e'):>9}")
        if "sweep_ms" in r:
            print("             sweep: " + ", ".join(f"{k}: {v:.3f}" for k, v in r["sweep_ms"].items()))
    notes = {r["peer_note"] for r in rows}
    for n in notes:
        print(f"peer: {n}")
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
