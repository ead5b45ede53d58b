#!/usr/bin/env bash
# One device call for step 3 of the fused Hopper prefill (issue 52): the peers' set-up, a
# 60 s probe of the fused kernel on a small batch (a hang here is an mbarrier phase bug:
# the rest of the fused steps are skipped), its GPU tests, the walk's GPU tests (the ring
# decay refactor), the timing beside the Hopper path and the peers, then the vLLM plugin's
# bf16 run where .vllm_files was carried. Logs under $OUT.
set -u
source experiments/fused_prefill/device_setup.sh
nvidia-smi -L
timeout -s KILL 60 python3 experiments/fused_prefill/probe_fused.py 2>&1 | tee "$out/probe.txt"
if grep -q "probe warps .*: finite" "$out/probe.txt"; then
  timeout -s KILL 130 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kda/test_hopper_fused.py 2>&1 \
    | tail -60 > "$out/tests_fused.txt"; tail -15 "$out/tests_fused.txt"
  timeout -s KILL 160 python3 experiments/fused_prefill/step3_fused.py --cases "${CASES:-16x2k_H32,64x512_H32}" \
    --json "$out/step3.json" 2>&1 | tail -20
fi
timeout -s KILL 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kda/test_hopper_walk.py 2>&1 | tail -3
# The vLLM plugin in bf16 (issue 53), where its prepared folder was carried.
if [ -d .vllm_files ]; then
  timeout -s KILL "${VLLM_S:-110}" python3 -m kda_engram.tools.benchmarks.bench_vllm_plugin --vllm-files .vllm_files \
    --json "$out/vllm_plugin.json" 2>&1 | tail -25
fi
