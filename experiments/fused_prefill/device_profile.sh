#!/usr/bin/env bash
# One device call for the fused prefill's profile (issue 52): Nsight Compute on one launch
# of the fused kernel at 16x2k_H32 (the full section set, clocks left alone), printed as
# the details page and the SASS source page (stall samples per instruction), under $OUT.
# PWARPS=8: the kernel with two producer warpgroups.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src"
python3 -m pip install -q --no-index --no-deps --target /tmp/kda-site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PYTHONPATH:/tmp/kda-site"
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $ncu_bin"
for p in ${PHASES_LIST:-4}; do
  timeout -s KILL "${NCU_S:-200}" "$ncu_bin" --clock-control none --kernel-name regex:_fused_prefill_kernel \
    --launch-skip 1 --launch-count 1 --set full --import-source no -f -o "$out/fused_p$p" \
    python3 experiments/fused_prefill/profile_fused.py --runs 2 --phases "$p" --producer-warps "${PWARPS:-4}" > "$out/ncu_p$p.log" 2>&1
  tail -5 "$out/ncu_p$p.log"
  "$ncu_bin" -i "$out/fused_p$p.ncu-rep" --page details --print-details all > "$out/details_p$p.txt" 2>&1
  "$ncu_bin" -i "$out/fused_p$p.ncu-rep" --page source --print-source sass --csv > "$out/sass_p$p.csv" 2>&1
  grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Occupancy" \
    "$out/details_p$p.txt" | head -12
  wc -c "$out/sass_p$p.csv"
done
