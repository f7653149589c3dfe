#!/usr/bin/env bash
# Two GPUs of one host (device kind nvidia-h100-x2 / nvidia-h200-x2), from the offline
# bundle (../shared/gpu-vllm copied to .gpu-vllm and carried), in one or two calls:
#   STEPS="tests pd pdvllm" bash scripts/gpu2_bench.sh     (about 9 minutes)
#   STEPS="tp" bash scripts/gpu2_bench.sh                  (about 6 minutes)
#   STEPS="tpttft" bash scripts/gpu2_bench.sh              (about 5 minutes)
#   STEPS="lmpd" bash scripts/gpu2_bench.sh                (about 4 minutes; LMCache's PD needs NIXL,
#       whose wheels (bash scripts/gpu_wheels.sh pd: .wheels-pd/, 57 MiB) do not fit the device's
#       64 MiB beside the vLLM bundle: run any step carrying .gpu-vllm first, then this one
#       within 30 s carrying .wheels-pd only; the bundle stays installed in /tmp/site)
# Steps: tests (the GPU tests of the transfers and of PD, cuda_ipc across the two GPUs),
# pd (kvtier bench pd GPU0 -> GPU1 against a plain copy, and each part of a cuda_ipc
# write timed alone: scripts/pd_gpu_bench.sh; PIECES="default forward=20" also times the send behind a
# forward, as vLLM makes it), pdprof (the sender's host time per function:
# kvtier_tools.bench.profiles.pd_send, and an Alloc's round trip in parts: kvtier_tools.bench.profiles.pd_rtt), pdvllm (1P1D inside real vLLM, prefiller on
# GPU 0, decoder on GPU 1: kvtier_tools.bench.pd_vllm), lmpd (the same with LMCache 0.5.6's PD over NIXL in
# both servers: kvtier_tools.bench.pd_vllm --engine lmcache), tp (tests/test_vllm_tp.py with one rank
# per GPU: every rank its shard, hits only where both ranks hold them, TP=2 <-> TP=1 reuse,
# PD with TP=2 on both sides, the store server's path at TP=2), tpttft (warm TTFT at 16k
# tokens, kvtier inside vLLM at TP=1 and at TP=2: kvtier_tools.bench.vllm --tp). Results come back as one archive in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu2}
work=/tmp/gpu2-results
steps=${STEPS:-tests pd pdvllm}
rm -rf "$work"; mkdir -p "$out" "$work"
servers='^[^ ]*python[0-9.]* -m (vllm\.entrypoints\.openai\.api_server|kvtier\.server|kvtier\.cli proxy)'
pkill -f "$servers"
trap 'tar czf "$out/gpu2-$(echo $steps | tr " " -).tgz" -C "$work" .' EXIT
# NVLink multicast stays off (KINDS.md), in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -d /tmp/site/vllm ]; then
    bash .gpu-vllm/install.sh .gpu-vllm /tmp/site >/dev/null || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kvtier-dist . 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site:/tmp/kvtier-dist PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__)"
} 2>&1 | tee "$work/machine.txt"
case " $steps " in *" tests "*)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_pd.py tests/test_pd_ring.py tests/test_transfer_cuda.py \
    > "$work/pytest.txt" 2>&1; tail -4 "$work/pytest.txt" ;;
esac
case " $steps " in *" pd "*)
SKIP_TESTS=1 SKIP_1GPU=1 CHANNELS_2GPU="${CHANNELS:-cuda_ipc}" OUT="$work/pd" timeout 200 bash scripts/pd_gpu_bench.sh 2>&1 | grep -v "^ *$" \
    | tail -12 ;;
esac
case " $steps " in *" pdprof "*)  # the sender's host time per function (cProfile), 16k tokens
timeout 200 python3 -m kvtier_tools.bench.profiles.pd_send > "$work/pd-send-profile.txt" 2>&1
echo "pdprof exit $?"; grep -E "^send |^-- by" "$work/pd-send-profile.txt" | head -14
timeout 100 python3 -m kvtier_tools.bench.profiles.pd_rtt > "$work/pd-rtt.txt" 2>&1; grep -v INFO "$work/pd-rtt.txt" ;;
esac
case " $steps " in *" pdvllm "*)
timeout ${PDVLLM_TIMEOUT:-330} python3 -m kvtier_tools.bench.pd_vllm --lengths ${LENGTHS:-4096 16384 32768} \
    --pairs ${PAIRS:-5} --out "$work/pd-vllm" > "$work/pd-vllm.log" 2>&1
echo "pd_vllm exit $?"; pkill -f "$servers"
grep -E "tokens:|Traceback|Error" "$work/pd-vllm.log" | tail -12
cp "$work"/pd-vllm/cluster/*/vllm-*.log "$work/pd-vllm/" 2>/dev/null ;;
esac
case " $steps " in *" lmpd "*)
if [ -d .wheels-pd ] && [ ! -d /tmp/nixl-site/nixl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/nixl-site .wheels-pd/*.whl 2>&1 | tail -2
fi
PYTHONPATH=$PYTHONPATH:/tmp/nixl-site python3 -c "import nixl._api, lmcache; print('nixl and lmcache import')" \
    2>&1 | tail -1 | tee -a "$work/machine.txt"
PYTHONPATH=$PYTHONPATH:/tmp/nixl-site timeout ${PDVLLM_TIMEOUT:-330} python3 -m kvtier_tools.bench.pd_vllm --engine lmcache \
    --lengths ${LENGTHS:-4096 16384 32768} --pairs ${PAIRS:-5} --out "$work/pd-vllm-lmcache" > "$work/pd-vllm-lmcache.log" 2>&1
echo "pd_vllm lmcache exit $?"; pkill -f "$servers"
grep -E "tokens:|Traceback|Error" "$work/pd-vllm-lmcache.log" | tail -12
cp "$work"/pd-vllm-lmcache/cluster/*/vllm-*.log "$work/pd-vllm-lmcache/" 2>/dev/null ;;
esac
case " $steps " in *" tpttft "*)
for tp in 1 2; do  # warm TTFT at 16k, kvtier's CPU tier: one GPU, then one rank on each
    timeout ${TPTTFT_TIMEOUT:-280} python3 -m kvtier_tools.bench.vllm --setups kvtier --lengths ${TTFT_LENGTHS:-16384} \
        --pairs ${PAIRS:-7} --tp $tp --cpu-gb 40 --setup-timeout 270 --out "$work/ttft-tp$tp" \
        > "$work/ttft-tp$tp.log" 2>&1
    echo "ttft tp=$tp exit $?"; pkill -f "$servers"; grep -E "^\[kvtier\] [0-9]+: |tokens (OK|DIFFER)" "$work/ttft-tp$tp.log"
done ;;
esac
case " $steps " in *" tp "*)
timeout ${TP_TIMEOUT:-560} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_vllm_tp.py \
    > "$work/tp.txt" 2>&1; echo "tp exit $?"; pkill -f "$servers"; tail -15 "$work/tp.txt" ;;
esac
