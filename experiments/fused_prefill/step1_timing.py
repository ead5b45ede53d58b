"""Step 1 of the fused Hopper prefill (issue 52, FUSED_PREFILL.md's build order), on one GPU.

* The consumer bound: the Gluon walk fed by its own prefetch (today's walk) against the
  same walk with a one-warp warp-specialised TMA loader (``warp_specialized=True``: the
  fused kernel's consumer side), on the folded operands of the Triton folded prologue;
  the two must agree bit for bit.
* The walk at 32- and 16-token chunks (plain and warp-specialised), the granularities a
  producer that fits its registers would feed it.
* Where the producer's time goes: the one-launch Gluon prologue stopped after each of
  its phases (1 gate and norms, 2 strips, 3 inverse, 4 fold), beside the Triton folded
  prologue.

``python3 experiments/fused_prefill/step1_timing.py [--json FILE]`` (from the repository
root, ``PYTHONPATH=src``); prints one line per case and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from kda_engram.bundles import KDAInputs
from kda_engram.kda.hopper.folded_prologue import prepare_folded_prologue
from kda_engram.kda.hopper.prologue import gluon_folded_prologue
from kda_engram.kda.hopper.walk import folded_walk
from kda_engram.kda.metadata import prepare_chunk_metadata, prepare_chunk_offsets

CASES = {"16x2k_H32": (16, 2048, 32), "64x512_H32": (64, 512, 32), "1x8k_H96": (1, 8192, 96),
         "1x32k_H32": (1, 32768, 32)}


def case(seqs, seqlen, heads, K=128, lower_bound=-5.0):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    T = seqs * seqlen
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = {n: rnd(1, T, heads, K).to(torch.bfloat16) for n in ("q", "k", "v", "raw_g")}
    cu = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * seqlen
    offsets, indices = prepare_chunk_metadata(cu, T)
    inp = KDAInputs(**x, raw_beta=rnd(1, T, heads).to(torch.bfloat16), A_log=rnd(heads) * 0.5,
                    dt_bias=rnd(heads * K), lower_bound=lower_bound, scale=K ** -0.5)
    return inp, cu, offsets, indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    rows = []
    for name in ns.cases.split(","):
        seqs, seqlen, heads = CASES[name]
        inp, cu, offsets, indices = case(seqs, seqlen, heads)
        N, H, K = seqs, heads, 128
        ops = prepare_folded_prologue(inp, cu, indices)()
        init = torch.randn(N, H, K, K, device="cuda") * 0.1
        outs = {}

        def walk(ws):
            o = torch.empty_like(inp.v)
            fin = torch.empty(N, H, K, K, device="cuda")
            outs[ws] = (o, fin)
            return lambda: folded_walk(ops["qg"], ops["kd"], ops["t_fold"], ops["a_fold"], ops["v"], ops["decay"], o,
                                       inp.scale, cu, offsets, initial_state=init, final_state=fin,
                                       warp_specialized=ws)

        fns = {"walk": walk(False), "walk_ws": walk(True), "prologue_triton": prepare_folded_prologue(inp, cu, indices)}
        for chunk in (32, 16):  # the walk at smaller chunks, on operands of that shape (values: timing only)
            offs = prepare_chunk_offsets(cu, chunk)
            af = torch.randn(1, inp.q.shape[1], H, chunk, device="cuda").to(torch.bfloat16) * 0.1
            dec = torch.rand(int(offs[-1]), H, K, device="cuda") * 0.5 + 0.5
            for ws in (False, True):
                o_c = torch.empty_like(inp.v)
                fns[f"walk_c{chunk}" + ("_ws" if ws else "")] = (
                    lambda o_c=o_c, af=af, dec=dec, offs=offs, ws=ws, chunk=chunk: folded_walk(
                        ops["qg"], ops["kd"], ops["t_fold"], af, ops["v"], dec, o_c, inp.scale, cu, offs,
                        initial_state=init, final_state=torch.empty(N, H, K, K, device="cuda"),
                        warp_specialized=ws, chunk_size=chunk))
        if name == "16x2k_H32":
            for p in (1, 2, 3, 4):
                fns[f"prologue_gluon_p{p}"] = gluon_folded_prologue(inp, cu, indices, phases=p)
        for key, fn in list(fns.items()):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 (a variant that fails to build is reported, the rest timed)
                print(f"{name} {key}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                del fns[key]
        torch.cuda.synchronize()
        same = torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1])
        ms = {k: float(triton.testing.do_bench(fn, warmup=50, rep=300)) for k, fn in fns.items()}
        row = dict(case=name, device=torch.cuda.get_device_name(0), ws_bitwise_equal=same, ms=ms)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
