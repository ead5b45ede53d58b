#!/usr/bin/env bash
# Issue 52, the producer split: one device call that checks the fused kernel with one
# producer warpgroup and with two (the chunk's rows split), a 90 s probe of both widths
# first (a hang is a barrier bug: the rest is skipped), then the fused GPU tests (both
# widths), then both widths timed beside the Hopper path and the peers. Logs under $OUT.
set -u
source experiments/fused_prefill/device_setup.sh
nvidia-smi -L
timeout -s KILL 90 python3 experiments/fused_prefill/probe_fused.py --producer-warps "${WIDTHS:-4,8}" 2>&1 \
  | tee "$out/probe.txt"
if grep -q "probe warps .*: finite" "$out/probe.txt"; then
  timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kda/test_hopper_fused.py -k "${TESTS_K:-gpu}" 2>&1 \
    | tail -60 > "$out/tests_fused.txt"; tail -15 "$out/tests_fused.txt"
  timeout -s KILL ${STEP_S:-240} python3 experiments/fused_prefill/step3_fused.py --producer-warps ${WIDTHS:-4,8} \
    --cases "${CASES:-16x2k_H32,64x512_H32}" --phases "${PHASES:-1,2,3}" --json "$out/step3.json" 2>&1 | tail -20
fi
