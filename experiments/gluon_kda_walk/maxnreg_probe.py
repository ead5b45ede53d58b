"""Register pressure probe: compile with a ptxas register cap (option maxnreg) and watch for spills."""
from gluon_compile import compile_sm90, resources
from kda_chunk_step_gluon import kda_chunk_walk_gluon_kernel, make_args

for VB, BT, nw, lean, asy in [(64, 64, 4, True, False), (64, 64, 4, True, True), (128, 64, 8, True, False), (64, 16, 4, True, False), (128, 16, 8, True, False)]:
    for cap in (128, 168, 192, 232):
        grid, args = make_args(VB=VB, BT=BT)
        kw = dict(K=128, V=128, VB=VB, BT=BT, STAGES=2, ASYNC=asy, O_REG_PERMUTE=False, LEAN=lean, ABLATE=0, num_warps=nw, maxnreg=cap)
        try:
            r = resources(compile_sm90(kda_chunk_walk_gluon_kernel, args, kw))
            print(f"VB={VB} BT={BT} warps={nw} async={asy} maxnreg={cap}: regs {r['registers']} spill st/ld {r['spill_stores']}/{r['spill_loads']}", flush=True)
        except Exception as e:
            print(f"VB={VB} BT={BT} warps={nw} maxnreg={cap}: FAILED {type(e).__name__}: {str(e)[:300]}")
