#!/usr/bin/env bash
# One device call for issue 53: the decode kernel's packed-token (varlen) mode on the GPU
# in bf16 (the gpu tests of test_decode.py include test_varlen_*_gpu_bf16), then vLLM's
# decode-size rows (decode peel, speculative verify, packed decode) timed against vLLM's
# kernels, eager and in a CUDA graph; then the one-launch Engram hash (its GPU test, its
# rows). Logs under $OUT.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src"
nvidia-smi -L
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kda/test_decode.py \
  > "$out/decode_gpu.txt" 2>&1; tail -4 "$out/decode_gpu.txt"
if [ -d .vllm_files ]; then
  timeout -s KILL 250 python3 -m kda_engram.tools.benchmarks.bench_vllm_plugin --vllm-files .vllm_files --quick \
    --only "decode peel,spec verify,packed decode" --json "$out/vllm_decode_rows.json" 2>&1 | tail -14
fi
timeout -s KILL 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/integrations/test_vllm_engram_history.py \
  > "$out/engram_hash_gpu.txt" 2>&1; tail -2 "$out/engram_hash_gpu.txt"
if [ -d .vllm_files ]; then
  timeout -s KILL 100 python3 -m kda_engram.tools.benchmarks.bench_vllm_plugin --vllm-files .vllm_files --quick \
    --only "Engram hash" --json "$out/vllm_engram_hash_rows.json" 2>&1 | tail -6
fi
