"""Engram table lookup throughput: device tables vs copy bandwidth, host-resident
tables vs host->device bandwidth, side by side with PyTorch eager.

V4.1's shape: 24 hash columns of 256 values per token, at decode (64 tokens) and
prefill (16384 tokens). Rows are uniform in each column's table (what hashed
n-grams look like), the tables far larger than the L2 cache.

* ``device_*``: the table in HBM. Floor = bytes that must move (the rows read,
  the output written, the row indices) / the measured device copy bandwidth
  (a large device-to-device copy, read + write counted).
* ``host_*``: the table in pinned host memory, read by the GPU kernel through
  unified addressing (zero-copy). Floor = the row bytes that must cross the
  link / the measured pinned host->device copy bandwidth. ``host_staged_*`` is
  the fallback path (host gather + one async copy). Beside it each host row
  times one pinned copy of exactly the bytes the lookup moves (eager and graph:
  ``copy_ms``, ``copy_graph_ms``): at 64 tokens (a few hundred KB) the link's
  latency, not its bandwidth, sets that copy's time, so the floor measured on
  1 GiB is out of reach for any transfer of that size, and ``copy_graph_ms /
  graph_ms`` says how the gather compares with the cheapest way to move those
  bytes at all (above 1: faster than the copy).
* ``hash_*``: :func:`ngram_hash` for V4.1's two Engram layers.

Each of our rows is timed twice: ``do_bench``'s eager loop (``ours_ms``,
``floor_fraction``, the GB/s columns) and replayed from a CUDA graph
(``graph_ms``, ``graph_floor_fraction``; see :func:`common.cuda_graph_ms`),
as an engine runs a decode step. At 64 tokens a lookup takes about as long as
the host needs to launch it, so the eager loop may measure the host there. The
staged path syncs on the rows and has no graph time.

Peers (PyTorch eager, in this process): ``F.embedding`` on the device table
(the Engram reference's ``MultiHeadEmbedding``), an eager gather + dequantise
for fp8, and ``index_select`` on the host + a blocking copy for host tables.

    python -m kda_engram.tools.benchmarks.bench_engram_table [--quick] [--cases device_bf16_T16384 ...] [--no-peers] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy

import torch

from ...engram.hashing import ngram_hash
from ...engram.layout import EngramLayout
from ...engram.table import SCALE_BLOCK, EngramTable
from .common import bench_ms, cuda_graph_ms, no_gpu_exit, write_json

N_COLS, HEAD_DIM = 24, 256
TOKENS = {"T64": 64, "T16384": 16384}
CASES = [
    f"{where}_{storage}_{t}" for where in ("device", "host") for storage in ("bf16", "fp8") for t in TOKENS
] + ["host_staged_bf16_T64", "host_staged_bf16_T16384", "hash_T64", "hash_T16384"]
QUICK_CASES = [
    "device_bf16_T16384", "device_fp8_T16384", "host_bf16_T16384", "host_bf16_T64",
    "host_fp8_T16384", "host_fp8_T64", "hash_T64", "hash_T16384",
]

V41 = {
    "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_vocab_size": 16_000_000,
    "engram_compressed_vocab_size": 99_092, "engram_pad_token_id": 2,
}


def _bench(fn) -> float:
    return bench_ms(fn, return_mode="mean")


def measure_copy_bandwidth(device, nbytes=2 << 30) -> float:
    """Device-to-device copy, bytes/s counting read + write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def measure_h2d_bandwidth(device, nbytes=1 << 30) -> float:
    """Pinned host -> device copy, bytes/s (each byte crosses the link once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = _bench(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / (ms * 1e-3)


def same_bytes_copy_ms(nbytes, device) -> tuple[float, float]:
    """(eager ms, graph ms) of one pinned host -> device copy of ``nbytes``: the
    cheapest way to move a lookup's bytes across the link, at the lookup's size."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy_fn = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
    return _bench(copy_fn), cuda_graph_ms(copy_fn)


def _sizes(rows_per_col):
    return [rows_per_col + 2 * c for c in range(N_COLS)]


def _rows(sizes, T, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    sz = torch.tensor(sizes, device=device)
    starts = torch.cumsum(sz, 0) - sz
    return (torch.randint(0, 2**31 - 1, (T, N_COLS), device=device, generator=gen) % sz + starts).to(torch.int32)


class _Tables:
    """Built once per run and shared by the cases (building a 12 GB table is the slow part)."""

    def __init__(self, device, quick):
        self.device = device
        self.dev_rows = 200_003 if quick else 1_000_003
        self.host_rows = 100_003 if quick else 400_009
        self._cache = {}

    def get(self, where, storage):
        key = (where, storage)
        if where == "host_staged" and key not in self._cache:
            # The same pinned table, gathered through the staged fallback.
            sizes, table = self.get("host", storage)
            staged = copy.copy(table)
            staged.host_mode = "staged"
            self._cache[key] = (sizes, staged)
        if key not in self._cache:
            host = where != "device"
            sizes = _sizes(self.host_rows if host else self.dev_rows)
            n = sum(sizes)
            gen = torch.Generator(device=self.device).manual_seed(1)
            table = EngramTable(sizes, HEAD_DIM, storage=storage, device=self.device, host_resident=host)
            chunk = 1 << 20
            for a in range(0, n, chunk):
                w = torch.randn(min(chunk, n - a), HEAD_DIM, device=self.device, generator=gen, dtype=torch.bfloat16)
                table.load_(w, row_start=a)
            self._cache[key] = (sizes, table)
        return self._cache[key]


def _dense_peer(table):
    w = table.weight

    def peer(rows):
        if w.is_cuda:
            return torch.nn.functional.embedding(rows.long(), w)
        return torch.index_select(w, 0, rows.reshape(-1).cpu().long()).view(*rows.shape, -1).to(rows.device)

    return peer


def _fp8_peer(table):
    q, s = table.weight, table.scale

    def peer(rows):
        idx = rows.long()
        if not q.is_cuda:
            idx_h = idx.reshape(-1).cpu()
            qq, ss = q.index_select(0, idx_h).to(rows.device), s.index_select(0, idx_h).to(rows.device)
        else:
            qq, ss = q[idx.reshape(-1)], s[idx.reshape(-1)]
        vals = qq.view(torch.float8_e4m3fn).float() * torch.exp2(ss.float() - 127).repeat_interleave(SCALE_BLOCK, -1)
        return vals.to(torch.bfloat16).view(*rows.shape, HEAD_DIM)

    return peer


def _lookup_case(case, tables, copy_bw, h2d_bw, peers):
    parts = case.split("_")
    T = TOKENS[parts[-1]]
    storage = parts[-2]
    where = "_".join(parts[:-2])
    sizes, table = tables.get(where, storage)
    device = tables.device
    rows = _rows(sizes, T, device)
    out = torch.empty(T, N_COLS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    ours = lambda: table.lookup(rows, out=out, check_inputs=False)  # noqa: E731
    ours()
    ours_ms = _bench(ours)
    # The staged path reads the rows back to the host (a sync): not capturable.
    graph_ms = cuda_graph_ms(ours) if table.host_mode != "staged" else None
    n = T * N_COLS
    row_bytes = HEAD_DIM * (1 if storage == "fp8" else 2) + (HEAD_DIM // SCALE_BLOCK if storage == "fp8" else 0)
    if where == "device":
        moved = n * (row_bytes + 4 + HEAD_DIM * 2)
        floor_ms = moved / copy_bw * 1e3
        floor_kind = "HBM copy"
    else:
        moved = n * row_bytes
        floor_ms = moved / h2d_bw * 1e3
        floor_kind = "H2D copy"
    row = {
        "case": case,
        "ours_ms": ours_ms,
        "peer_ms": None,
        "peer": "torch eager" if peers else None,
        "ratio": None,
        "hbm_floor_ms": floor_ms,
        "floor_fraction": floor_ms / ours_ms,
        "graph_ms": graph_ms,
        "graph_floor_fraction": floor_ms / graph_ms if graph_ms else None,
        "floor_kind": floor_kind,
        "rows_per_s": n / (ours_ms * 1e-3),
        "gb_per_s": moved / (ours_ms * 1e-3) / 1e9,
        "host_mode": table.host_mode,
        "max_abs_diff": None,
        "copy_ms": None,
        "copy_graph_ms": None,
    }
    if where == "host":
        row["copy_ms"], row["copy_graph_ms"] = same_bytes_copy_ms(moved, device)
    if peers:
        peer_fn = _fp8_peer(table) if storage == "fp8" else _dense_peer(table)
        global_rows = rows - int(table.row_lo)
        expect = peer_fn(global_rows)
        got = table.lookup(rows)
        torch.cuda.synchronize()
        row["max_abs_diff"] = float((got.float() - expect.float()).abs().max())
        row["peer_ms"] = _bench(lambda: peer_fn(global_rows))
        row["ratio"] = row["peer_ms"] / ours_ms
    return row


def _hash_peer(layout, tok):
    """Eager PyTorch hash of one sequence (the paper's shift-with-pad form)."""
    prim = torch.from_numpy(layout.primes.reshape(layout.n_layers, -1).copy()).to(tok.device)
    offs = torch.from_numpy(layout.row_offsets()).to(tok.device)
    mult = torch.from_numpy(layout.multipliers.copy()).to(tok.device)
    M = layout.max_ngram

    def peer():
        T = tok.shape[0]
        pad = torch.full((M - 1,), layout.hash_pad_id, dtype=torch.int64, device=tok.device)
        ext = torch.cat([pad, tok])
        lags = [ext[M - 1 - i : M - 1 - i + T] for i in range(M)]
        outs = []
        for li in range(layout.n_layers):
            mix = lags[0] * mult[li, 0]
            cols = []
            for i in range(1, M):
                mix = mix ^ (lags[i] * mult[li, i])
                cols.append(mix[:, None] % prim[li, (i - 1) * layout.n_heads : i * layout.n_heads][None])
            outs.append(torch.cat(cols, 1) + offs[li][None])
        return torch.stack(outs, 1).to(torch.int32)

    return peer


def _hash_case(case, copy_bw, peers, device):
    T = TOKENS[case.split("_")[-1]]
    layout = EngramLayout.from_config(V41)
    gen = torch.Generator(device=device).manual_seed(2)
    tok = torch.randint(0, layout.compressed_vocab_size, (T,), device=device, generator=gen)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    out = torch.empty(T, layout.n_layers, layout.n_hash_cols, dtype=torch.int32, device=device)
    ours = lambda: ngram_hash(tok, cu, layout, out=out, check_inputs=False)  # noqa: E731
    ours()
    ours_ms = _bench(ours)
    graph_ms = cuda_graph_ms(ours)
    moved = T * 8 + out.numel() * 4
    floor_ms = moved / copy_bw * 1e3
    row = {"case": case, "ours_ms": ours_ms, "peer_ms": None, "peer": "torch eager" if peers else None,
           "ratio": None, "hbm_floor_ms": floor_ms, "floor_fraction": floor_ms / ours_ms, "floor_kind": "HBM copy",
           "graph_ms": graph_ms, "graph_floor_fraction": floor_ms / graph_ms if graph_ms else None,
           "rows_per_s": out.numel() / (ours_ms * 1e-3), "gb_per_s": moved / (ours_ms * 1e-3) / 1e9,
           "max_abs_diff": None}
    if peers:
        peer = _hash_peer(layout, tok)
        row["max_abs_diff"] = float((peer().long() - out.long()).abs().max())
        row["peer_ms"] = _bench(peer)
        row["ratio"] = row["peer_ms"] / ours_ms
    return row


def run(cases=None, peers=True, quick=False) -> list[dict]:
    """Rows ``{case, ours_ms, peer_ms, ratio, hbm_floor_ms, floor_fraction, max_abs_diff,
    rows_per_s, gb_per_s, floor_kind, ...}``; ``ratio`` = peer_ms / ours_ms."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_engram_table needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    cases = list(cases) if cases else (QUICK_CASES if quick else CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"cases: unknown {unknown}; choose from {CASES}")
    copy_bw = measure_copy_bandwidth(device)
    h2d_bw = measure_h2d_bandwidth(device) if any(c.startswith("host") for c in cases) else None
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:,.0f} GB/s"
          + (f"; pinned host->device: {h2d_bw / 1e9:,.1f} GB/s" if h2d_bw else ""))
    tables = _Tables(device, quick)
    rows = []
    with torch.inference_mode():
        for case in cases:
            if case.startswith("hash"):
                rows.append(_hash_case(case, copy_bw, peers, device))
            else:
                rows.append(_lookup_case(case, tables, copy_bw, h2d_bw, peers))
            r = rows[-1]
            print(f"  {case:<26} ours {r['ours_ms']:.4f} ms  peer {r['peer_ms'] if r['peer_ms'] is None else round(r['peer_ms'], 4)} ms  "
                  f"{r['gb_per_s']:,.0f} GB/s  {r['rows_per_s'] / 1e6:,.0f} Mrows/s  "
                  f"{r['floor_fraction']:.0%} of the {r['floor_kind']} floor"
                  + (f"; graph {r['graph_ms']:.4f} ms, {r['graph_floor_fraction']:.0%}" if r["graph_ms"] else "")
                  + (f"; a copy of the same bytes {r['copy_ms']:.4f} ms, graph {r['copy_graph_ms']:.4f} ms"
                     if r.get("copy_ms") is not None else ""), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=None, help=f"any of {CASES}")
    ap.add_argument("--quick", action="store_true", help="smaller tables, fewer cases")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if (code := no_gpu_exit("bench_engram_table")) is not None:
        return code
    rows = run(args.cases, peers=not args.no_peers, quick=args.quick)
    print(f"{'case':<26} {'ours ms':>9} {'peer ms':>9} {'ratio':>6} {'floor ms':>9} {'of floor':>8} {'graph ms':>9} "
          f"{'of floor':>8} {'GB/s':>8} {'Mrows/s':>8} {'maxdiff':>8} {'copy ms':>9} {'copy graph':>10} {'vs copy':>7}")
    for r in rows:
        fmt = lambda x, s: "-" if x is None else format(x, s)  # noqa: E731
        print(f"{r['case']:<26} {r['ours_ms']:>9.4f} {fmt(r['peer_ms'], '>9.4f')} {fmt(r['ratio'], '>6.2f')} "
              f"{r['hbm_floor_ms']:>9.4f} {r['floor_fraction']:>8.0%} {fmt(r['graph_ms'], '>9.4f')} "
              f"{fmt(r['graph_floor_fraction'], '>8.0%')} {r['gb_per_s']:>8.0f} {r['rows_per_s'] / 1e6:>8.0f} "
              f"{fmt(r['max_abs_diff'], '>8.2g')} {fmt(r.get('copy_ms'), '>9.4f')} {fmt(r.get('copy_graph_ms'), '>10.4f')} "
              f"{fmt(r['copy_graph_ms'] / r['graph_ms'] if r.get('copy_graph_ms') and r['graph_ms'] else None, '>7.2f')}")
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
