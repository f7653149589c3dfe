#!/usr/bin/env bash
# Before/after on one GPU machine: `kvtier bench offload` and `kvtier bench ttft --server`
# of two source trees, in the order A B B A by default (so that drift over the call falls on both),
# from the offline vLLM bundle (.gpu-vllm, carried) for the server's packages.
#   BEFORE=.before bash scripts/gpu_ab.sh      (.before: e.g. `git archive <commit> kvtier | tar -x -C .before`)
# One archive comes back in $OUT; `python3 scripts/gpu_ab.py DIR` prints the paired ratios.
set -uo pipefail
cd "$(dirname "$0")/.."
here=$PWD
before=$here/${BEFORE:-.before}
work=/tmp/gpu-ab
rm -rf "$work"; mkdir -p "$work" "${OUT:-results/gpu-ab}"
trap 'tar czf "${OUT:-$here/results/gpu-ab}/gpu-ab.tgz" -C "$work" .' EXIT
[ -d /tmp/site/vllm ] || bash .gpu-vllm/install.sh .gpu-vllm /tmp/site >/dev/null || exit 1
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "before: $(cat "$before/REVISION" 2>/dev/null), after: $(git rev-parse --short HEAD 2>/dev/null)"
} 2>&1 | tee "$work/machine.txt"
run() {  # run SIDE ROUND
    local dir=$here; [ "$1" = before ] && dir=$before
    (cd "$dir" && export PYTHONPATH=$dir:/tmp/site PYTHONUNBUFFERED=1 &&
     if [ "${OFFLOAD:-1}" = 1 ]; then python3 -m kvtier.cli bench offload --transfer triton --repeats 5 \
         --output "$work/$1-offload.json" 2>&1 | grep -v "it/s" | tee -a "$work/$1-offload.txt"; fi &&
     python3 -m kvtier.cli bench ttft --lengths ${LENGTHS:-16384 32768} --repeats ${REPEATS:-5} --server \
         --output "$work/$1-ttft-$2" 2>&1 | tail -4 | tee -a "$work/$1-ttft.txt")
    rm -f "$work/$1-ttft-$2"/*.png
}
# ORDER: the sides in turn, e.g. "before after after before" (the default) or longer.
i=0
for side in ${ORDER:-before after after before}; do i=$((i + 1)); run "$side" "$i"; done
