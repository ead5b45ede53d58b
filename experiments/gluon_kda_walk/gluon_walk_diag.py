"""Diagnostic of the Gluon walk (kda_engram.kda.hopper.walk) on a GPU: errors against the
fp32 emulation of the recipe per case (one chunk, two chunks, a partial chunk, zero and random
initial state, decay = 1), the state compared in both orientations, and the per-chunk error of o
along one 1000-token sequence. Run from the repository root:

    python3 ../shared/gpu-runs/2026-12-05/gluon_walk_diag.py
"""
import os, sys
HERE = os.path.join(os.getcwd(), "experiments", "gluon_kda_walk")
sys.path[:0] = [HERE, os.path.join(os.getcwd(), "src")]
import torch
import check_folded_walk_gpu as C

dev = "cuda"
def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

for lengths in ([64], [128], [1], [65], [192], [64, 64], [1000]):
    for gate in C.GATES[:1]:
        d = C._setup(lengths, gate, dev)
        for init_name in ("zero", "init"):
            init = torch.zeros_like(d["init"]) if init_name == "zero" else d["init"]
            o_emu, s_emu = C._emulate(d, init)
            o, s = C._run(d, False, initial_state=init)
            line = f"len={lengths} init={init_name}: o {rel(o, o_emu):.2e}  s {rel(s, s_emu):.2e}  s^T {rel(s.transpose(-1,-2), s_emu):.2e}"
            line += f"  |s|={s.float().norm().item():.3e} |s_emu|={s_emu.norm().item():.3e}"
            if lengths == [1000] and init_name == "init":
                per = [f"{rel(o[0, c:c+64], o_emu[0, c:c+64]):.1e}" for c in range(0, 1000, 64)]
                line += "\n   per-chunk o: " + " ".join(per)
            print(line, flush=True)
# decay = 1 (no forgetting), no initial state: isolates the update path
d = C._setup([128], C.GATES[0], dev)
d["kin"]["decay"].fill_(1.0); d["st"]["decay"].fill_(1.0)
z = torch.zeros_like(d["init"])
o_emu, s_emu = C._emulate(d, z); o, s = C._run(d, False, initial_state=z)
print(f"decay=1 len=128 zero init: o {rel(o, o_emu):.2e} s {rel(s, s_emu):.2e} s^T {rel(s.transpose(-1,-2), s_emu):.2e}")
print("shapes:", {k: tuple(v.shape) for k, v in d["kin"].items() if hasattr(v, "shape")}, "state", tuple(s.shape))
