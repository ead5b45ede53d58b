"""A quick check of the fused prefill on a small ragged batch (empty, 1-token and
chunk-edge sequences) against the Hopper path, for each producer width given: one line
``probe warps W: finite ... o rel ... state rel ...`` per width. Run under a timeout: a
hang is a barrier-phase bug.

``python3 experiments/fused_prefill/probe_fused.py [--producer-warps 4,8]`` (from the
repository root, ``PYTHONPATH=src``).
"""

from __future__ import annotations

import argparse

import torch

from kda_engram.kda.hopper.fused import FUSED_PRODUCER_WARPS, fused_prefill
from kda_engram.kda.prefill import chunk_kda_prefill


def _rel(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producer-warps", default=str(FUSED_PRODUCER_WARPS),
                    type=lambda t: [int(w) for w in t.split(",")])
    ns = ap.parse_args()
    torch.manual_seed(0)
    lengths, H, K, dev = [100, 32, 1, 0, 64], 2, 128, "cuda"
    T = sum(lengths)
    q, k, v, g = (torch.randn(1, T, H, K, device=dev).to(torch.bfloat16) for _ in range(4))
    b = torch.randn(1, T, H, device=dev).to(torch.bfloat16)
    A_log, dt_bias = torch.rand(H, device=dev), torch.randn(H * K, device=dev)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=dev, dtype=torch.int32)
    o_ref, s_ref = chunk_kda_prefill(q, k, v, g, b, A_log, dt_bias, lower_bound=-5.0, cu_seqlens=cu,
                                     output_final_state=True, path="hopper")
    for w in ns.producer_warps:
        o = torch.full_like(v, float("nan"))
        s = torch.empty(len(lengths), H, K, K, device=dev)
        fused_prefill(q, k, v, g, b, A_log, dt_bias, o, K ** -0.5, cu, lower_bound=-5.0, final_state=s,
                      producer_warps=w)
        torch.cuda.synchronize()
        print(f"probe warps {w}: finite", bool(torch.isfinite(o.float()).all()), "o rel", _rel(o, o_ref),
              "state rel", _rel(s, s_ref), flush=True)


if __name__ == "__main__":
    main()
