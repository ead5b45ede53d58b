"""Compile folded_walk_kernel for sm_90a on the CPU (no GPU needed); print resources.

Run: cd experiments/gluon_kda_walk && python3 compile_folded_walk.py  (output: folded_walk_compile_out.txt)
"""
import re
import sys

from folded_walk_gluon import compile_folded_walk
from gluon_compile import ptxas_report, resources

SMEM_OPT_IN_MAX = 232_448

VARIANTS = [
    ("VB=128 8 warps (default)", dict(VB=128)),
    ("VB=128 8 warps ASYNC", dict(VB=128, use_async=True)),
    ("VB=128 8 warps no GUARD_PAD", dict(VB=128, guard_pad=False)),
    ("VB=128 8 warps no h0, no final", dict(VB=128, has_h0=False, output_final_state=False)),
    ("VB=64 4 warps (V-half CTA)", dict(VB=64)),
    ("VB=64 4 warps ASYNC", dict(VB=64, use_async=True)),
]


def main():
    lines = []
    for name, kw in VARIANTS:
        try:
            k = compile_folded_walk(**kw)
        except Exception as e:  # noqa: BLE001
            lines.append(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
            print(lines[-1], flush=True)
            continue
        r = resources(k)
        warn = [w for w in ptxas_report(k.asm["ptx"])["log"].splitlines() if "arning" in w]
        ptx = k.asm["ptx"]
        lines.append(
            f"{name}: regs {r['registers']} spill st/ld {r['spill_stores']}/{r['spill_loads']} B "
            f"stack {r['stack_frame']} dyn smem {r['dyn_smem_triton']} B "
            f"({'OK' if r['dyn_smem_triton'] <= SMEM_OPT_IN_MAX else 'OVER'} vs {SMEM_OPT_IN_MAX}) "
            f"warps {r['num_warps']} wgmma {r['wgmma_instrs']} {','.join(r['wgmma_shapes'])} "
            f"tma {r['tma_loads']} bar.sync {len(re.findall(r'bar.sync', ptx))} ptxas warnings {warn or 'none'}")
        print(lines[-1], flush=True)
    with open("folded_walk_compile_out.txt", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0 if all("FAILED" not in ln for ln in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
