#!/usr/bin/env bash
# Issue 52 item 6: the full prefill bench with every peer, in as many device calls as it
# takes on one warm machine. Each call resumes the rows kept on the device in the
# ignored .bench_out/ (kept between calls while the machine stays warm), starts no case
# that would end past the budget, and copies the rows and the plot to $OUT; rerun until
# it prints "0 to run". Then commit $OUT/bench_kda_prefill.json as
# docs/bench_kda_prefill.json and $OUT/bench.png as docs/bench.png.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out" .bench_out
python3 -m pip install -q --no-index --no-deps --target /tmp/kda-site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/kda-peers && cp -r .peers/flash_kda /tmp/kda-peers/ \
  && gunzip -c .peers/flash_kda_C.so.gz > /tmp/kda-peers/flash_kda_C.cpython-312-x86_64-linux-gnu.so
export PYTHONPATH="$PWD/src:/tmp/kda-site:/tmp/kda-peers"
timeout -s KILL 570 python3 -m kda_engram.tools.benchmarks.bench_kda_prefill --quick \
  --json .bench_out/bench_kda_prefill.json --resume --budget-s ${BUDGET_S:-480} 2>&1 | tail -40
cp .bench_out/bench_kda_prefill.json "$out/" 2>/dev/null
python3 -c "import matplotlib" 2>/dev/null && python3 -m kda_engram.tools.benchmarks.bench_kda_prefill \
  --json .bench_out/bench_kda_prefill.json --plot "$out/bench.png" --plot-only
