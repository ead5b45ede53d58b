"""Compile every variant of kda_chunk_walk_gluon_kernel for sm_90a on the CPU; print a table, write results.json."""
import json
import sys
import traceback

from gluon_compile import resources
from kda_chunk_step_gluon import compile_variant

# (VB, BT, num_warps, STAGES, ASYNC, LEAN)
CONFIGS = [
    (64, 64, 4, 2, False, False), (64, 64, 4, 2, True, False), (64, 64, 4, 2, False, True), (64, 64, 4, 2, True, True),
    (128, 64, 8, 2, False, False), (128, 64, 8, 2, True, False), (128, 64, 8, 2, False, True), (128, 64, 8, 2, True, True),
    (128, 64, 4, 2, False, True), (128, 64, 4, 2, True, True),
    (64, 16, 4, 2, False, True), (128, 16, 8, 2, False, True), (128, 16, 4, 2, False, True),
    (64, 16, 4, 4, True, True), (128, 16, 8, 4, True, True), (128, 64, 8, 3, True, True),
]

rows = []
print(f"{'VB':>4} {'BT':>3} {'warps':>5} {'stg':>3} {'async':>5} {'lean':>4} | {'regs':>4} {'spill_st':>8} {'spill_ld':>8} "
      f"{'smem_B':>7} {'wgmma':>5} shapes")
for VB, BT, nw, stg, asy, lean in CONFIGS:
    cfg = dict(VB=VB, BT=BT, num_warps=nw, STAGES=stg, ASYNC=asy, LEAN=lean)
    try:
        r = resources(compile_variant(**cfg))
    except Exception as e:  # noqa: BLE001
        r = dict(error=f"{type(e).__name__}: {str(e)[:1500]}")
        print(f"{VB:>4} {BT:>3} {nw:>5} {stg:>3} {asy!s:>5} {lean!s:>4} | FAILED {r['error'][:300]}")
        rows.append(dict(cfg=cfg, **r))
        continue
    rows.append(dict(cfg=cfg, **r))
    print(f"{VB:>4} {BT:>3} {nw:>5} {stg:>3} {asy!s:>5} {lean!s:>4} | {r['registers']:>4} {r['spill_stores']:>8} "
          f"{r['spill_loads']:>8} {r['dyn_smem_triton']:>7} {r['wgmma_instrs']:>5} {','.join(r['wgmma_shapes'])}",
          flush=True)
json.dump(rows, open("results.json", "w"), indent=1)
