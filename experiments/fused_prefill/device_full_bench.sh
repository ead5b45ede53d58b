#!/usr/bin/env bash
# Issue 52 item 6: the full prefill bench with every peer, in as many device calls as it
# takes on one warm machine. Each call resumes the rows kept on the device in the
# ignored .bench_out/ (kept between calls while the machine stays warm), starts no case
# that would end past the budget, and copies the rows and the plot to $OUT; rerun until
# it prints "0 to run". Then commit $OUT/bench_kda_prefill.json as
# docs/bench_kda_prefill.json and $OUT/bench.png as docs/bench.png.
set -u
source experiments/fused_prefill/device_setup.sh
mkdir -p .bench_out
timeout -s KILL 570 python3 -m kda_engram.tools.benchmarks.bench_kda_prefill --quick \
  --json .bench_out/bench_kda_prefill.json --resume --budget-s ${BUDGET_S:-480} 2>&1 | tail -40
cp .bench_out/bench_kda_prefill.json "$out/" 2>/dev/null
python3 -c "import matplotlib" 2>/dev/null && python3 -m kda_engram.tools.benchmarks.bench_kda_prefill \
  --json .bench_out/bench_kda_prefill.json --plot "$out/bench.png" --plot-only
