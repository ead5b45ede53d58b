#!/usr/bin/env bash
# Issue 52, the producer split: one device call that checks the fused kernel with one
# producer warpgroup and with two (the chunk's rows split), a 60 s probe of each width
# first (a hang is a barrier bug: the rest is skipped), then the fused GPU tests (both
# widths), then both widths timed beside the Hopper path and the peers. Logs under $OUT.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src"
python3 -m pip install -q --no-index --no-deps --target /tmp/kda-site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/kda-peers && cp -r .peers/flash_kda /tmp/kda-peers/ \
  && gunzip -c .peers/flash_kda_C.so.gz > /tmp/kda-peers/flash_kda_C.cpython-312-x86_64-linux-gnu.so
export PYTHONPATH="$PYTHONPATH:/tmp/kda-site:/tmp/kda-peers"
nvidia-smi -L
timeout -s KILL 90 python3 - <<'PY' 2>&1 | tee "$out/probe.txt"
import torch
from kda_engram.kda.hopper.fused import fused_prefill
from kda_engram.kda.prefill import chunk_kda_prefill
torch.manual_seed(0)
L = [100, 32, 1, 0, 64]; T, H, K = sum(L), 2, 128
d = "cuda"
q, k, v, g = (torch.randn(1, T, H, K, device=d).to(torch.bfloat16) for _ in range(4))
b = torch.randn(1, T, H, device=d).to(torch.bfloat16)
A, dt = torch.rand(H, device=d), torch.randn(H * K, device=d)
cu = torch.tensor([0] + torch.tensor(L).cumsum(0).tolist(), device=d, dtype=torch.int32)
o2, s2 = chunk_kda_prefill(q, k, v, g, b, A, dt, lower_bound=-5.0, cu_seqlens=cu, output_final_state=True,
                           path="hopper")
rel = lambda a, r: ((a.float() - r.float()).norm() / r.float().norm()).item()
for w in ${WIDTHS:-4,8}:
    o = torch.full_like(v, float("nan")); s = torch.empty(len(L), H, K, K, device=d)
    fused_prefill(q, k, v, g, b, A, dt, o, K ** -0.5, cu, lower_bound=-5.0, final_state=s, producer_warps=w)
    torch.cuda.synchronize()
    print(f"probe warps {w}: finite", bool(torch.isfinite(o.float()).all()), "o rel", rel(o, o2),
          "state rel", rel(s, s2), flush=True)
PY
if grep -q "probe warps 8: finite" "$out/probe.txt"; then
  timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kda/test_hopper_fused.py -k "${TESTS_K:-gpu}" 2>&1 \
    | tail -60 > "$out/tests_fused.txt"; tail -15 "$out/tests_fused.txt"
  timeout -s KILL ${STEP_S:-240} python3 experiments/fused_prefill/step3_fused.py --producer-warps ${WIDTHS:-4,8} \
    --cases "${CASES:-16x2k_H32,64x512_H32}" --phases "${PHASES:-1,2,3}" --json "$out/step3.json" 2>&1 | tail -20
fi
