#!/usr/bin/env bash
# kvtier inside real vLLM 0.26 on the GPU machine, from the offline bundle
# (../shared/gpu-vllm copied to .gpu-vllm and carried):
#   device run:  bash scripts/gpu_vllm.sh                 (results in $OUT, or results/gpu-vllm)
#   STEPS="tests bench" SETUPS="plain kvtier" LENGTHS="16384" PAIRS=7 bash scripts/gpu_vllm.sh
# Steps: tests (GPU tests), bench (query twice per setup: kvtier.bench.vllm).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-vllm}
steps=${STEPS:-tests bench}
mkdir -p "$out"
if [ ! -d /tmp/site/vllm ]; then
    bash .gpu-vllm/install.sh .gpu-vllm /tmp/site >/dev/null || exit 1
fi
# kvtier installed (a wheel of this tree) for vLLM's plugin entry point; the tree itself comes first.
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kvtier-dist . 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site:/tmp/kvtier-dist PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__)"
} 2>&1 | tee "$out/machine.txt"
case " $steps " in *" tests "*)
python3 -m pytest -q -p no:cacheprovider tests/test_transfer_cuda.py tests/test_vllm_layout.py 2>&1 \
    | tail -5 | tee "$out/pytest.txt" ;;
esac
case " $steps " in *" bench "*)
python3 -m kvtier.bench.vllm --setups ${SETUPS:-plain kvtier kvtier-layerwise} --lengths ${LENGTHS:-4096 16384 32768} \
    --pairs ${PAIRS:-7} --out "$out" ${BENCH_ARGS:-} > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -E "^\[|tokens|Traceback|Error" "$out/bench.log" | tail -40 ;;
esac
