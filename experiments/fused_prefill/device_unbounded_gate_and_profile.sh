#!/usr/bin/env bash
# One device call, most needed first: the prologue's per-sub-chunk
# diagonal form on the GPU in bf16 and vLLM's Kimi-Linear prefill row (issue 53), then
# the fused prefill's ncu profile and its timing beside the peers (issue 52). Logs
# under $OUT.
set -u
source experiments/fused_prefill/device_setup.sh
nvidia-smi -L
timeout -s KILL 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kda/test_prologue.py \
  -k "small_bf16_matches" > "$out/prologue_gpu.txt" 2>&1; tail -4 "$out/prologue_gpu.txt"
if [ -d .vllm_files ]; then
  timeout -s KILL 110 python3 -m kda_engram.tools.benchmarks.bench_vllm_plugin --vllm-files .vllm_files --quick \
    --only "Kimi-Linear prefill" --no-graph --json "$out/vllm_kimi_linear.json" 2>&1 | tail -8
fi
PHASES_LIST="4" NCU_S=${NCU_S:-170} OUT=$out/prof timeout -s KILL 200 bash experiments/fused_prefill/device_profile.sh
timeout -s KILL 150 python3 experiments/fused_prefill/step3_fused.py --cases 16x2k_H32 --json "$out/step3.json" \
  2>&1 | tail -2
