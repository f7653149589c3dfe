#!/usr/bin/env bash
# Warm TTFT inside vLLM, every case of issue 62 from one script, resumable: a device call is at
# most 10 minutes and the whole takes about 25 (three calls: 2026-11-30 on an H200, part by
# part: 90, 416, 402, 73, 245 and 266 s), so each call runs the next parts not yet in
# RESULTS (a folder of the repository, carried with the tree) while its time allows, and brings
# each part back as an archive in $OUT:
#   device run:  RESULTS=results/gpu-h200-warm-ttft-2026-11-30 bash scripts/warm_ttft.sh
#   here, after: for f in <files_at>/*.tgz; do part=$(basename "$f" .tgz | sed 's/^gpu-vllm-//')
#                mkdir -p "$RESULTS/$part" && tar xzf "$f" -C "$RESULTS/$part"; done
# then commit RESULTS and call again until it says "all parts done". PARTS= a subset, in order.
# The parts (vLLM 0.26 from the bundle, Llama-3.1-8B's shape, seeded weights; kvtier_tools.bench.vllm):
#   gpu-tests  the GPU tests of the copy and codec kernels the parts use
#   compiled   default compiled mode, multiprocess engine (as `vllm serve` runs): native offloading,
#              kvtier bf16 and int4, 16k and 32k, the store landed and back to back, 7 pairs
#   lengths    the same setups and engine from 1k to 64k (3 pairs): the plot against the copy
#   quality    the lossy codecs' logprob error beside vLLM's fp8 KV cache (profiles.kv_codec)
#   eager      as compiled, eager mode
#   fp8-kv     vLLM's own fp8 KV cache (--kv-cache-dtype fp8): native and kvtier, as compiled
#   chat       the multi-turn chat workload against vLLM's OpenAI server (kvtier_tools.bench.serving,
#              scripts/gpu_vllm.sh's `serving` step) at the 8B shape: kvtier bf16, native offloading
#              and kvtier int4 (CHAT_SETUPS= others, e.g. kvtier-in-step: every hit loaded in its
#              own step; plain-gpu-all: vLLM alone with every conversation in its GPU cache, the
#              floor of the later turns; kvtier-consumer: kvtier that never stores; kvtier-base:
#              kvtier from BENCH_BASE_TREE, an earlier commit's kvtier/ carried, beside main's),
#              servers resident, CHAT_ROUNDS (3) rounds in turn; CHAT_ARGS= more of the serving
#              bench's flags (e.g. --profile: py-spy on each server, its wheel carried in
#              .tools/; with KVTIER_TRACE_STALLS_MS=0 in the environment every kvtier call on
#              vLLM's engine thread is logged with its time: the steps' timeline)
# Tables and plots from the records: `python -m kvtier_tools.bench.vllm_report RESULTS/<part> ...`
# (docs/benchmarks/warm-ttft.md).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:?RESULTS=<a folder of results/> that holds the parts done}
out=${OUT:-/tmp/warm-ttft-out}
budget=${BUDGET_S:-570}  # this call's seconds
parts=${PARTS:-gpu-tests compiled lengths quality eager fp8-kv}
start=$(date +%s)
mkdir -p "$out"
# (chat: its rounds as many as its time allows, two of two setups in about 240 s; three setups, four
# rounds took 540)
declare -A need=([gpu-tests]=110 [compiled]=440 [lengths]=420 [quality]=120 [eager]=270 [fp8-kv]=290
    [chat]=240)
# (no spaces: gpu_vllm.sh splits SERVING_ARGS on them)
llama8b='{"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,'
llama8b+='"num_key_value_heads":8,"head_dim":128,"max_position_embeddings":32768}'
cuda=tests/test_transfer_cuda.py
engine="--multiprocess --setup-timeout 170"
bench="$engine --back-to-back"
run_part() {
    local part=$1
    case $part in
    gpu-tests) STEPS=tests GPU_TESTS="tests/test_kv_codec.py $cuda::test_the_lossy_codec_kernels_match_the_torch_codec
        $cuda::test_engine_with_the_int8_codec_through_the_store_server_on_gpu
        $cuda::test_a_whole_store_not_waited_for_reads_the_pages_after_the_forward_and_before_the_next" ;;
    compiled) STEPS=bench SETUPS="native kvtier kvtier-int4" LENGTHS="16384 32768" PAIRS=7 \
        BENCH_ARGS="--no-eager $bench" ;;
    lengths) STEPS=bench SETUPS="native kvtier kvtier-int4" LENGTHS="1024 4096 16384 65536" PAIRS=3 \
        BENCH_ARGS="--no-eager $engine" ;;
    quality) STEPS=quality LENGTHS="4096 16384" ;;
    eager) STEPS=bench SETUPS="native kvtier kvtier-int4" LENGTHS="16384 32768" PAIRS=5 \
        BENCH_ARGS="--eager $bench" ;;
    fp8-kv) STEPS=bench SETUPS="native kvtier" LENGTHS="16384 32768" PAIRS=5 \
        BENCH_ARGS="--no-eager --kv-cache-dtype fp8 $bench" ;;
    chat) STEPS=serving SETUPS=${CHAT_SETUPS:-kvtier native kvtier-int4} GPU_UTIL=0.28 \
        SERVING_ARGS="--model $llama8b --model-dir /tmp/kvtier-serving-8b --max-model-len 8192 \
        --rounds ${CHAT_ROUNDS:-3} --resident ${CHAT_ARGS:-}" ;;
    *) echo "unknown part $part"; return 2 ;;
    esac
    local left=$(( budget - ($(date +%s) - start) - 15 ))
    export STEPS SETUPS LENGTHS PAIRS BENCH_ARGS GPU_TESTS GPU_UTIL SERVING_ARGS
    OUT=$out TAG=$part BENCH_TIMEOUT=$left QUALITY_TIMEOUT=$left SERVING_TIMEOUT=$left \
        BUNDLE=${BUNDLE:-.gpu-vllm-core} bash scripts/gpu_vllm.sh
}
for part in $parts; do
    if [ -d "$results/$part" ]; then continue; fi
    used=$(( $(date +%s) - start ))
    if [ $(( used + ${need[$part]:-600} )) -gt "$budget" ]; then
        echo "next part: $part (about ${need[$part]} s; $used s of this call's $budget used)"
        exit 0
    fi
    echo "== part $part ($(date -u +%H:%M:%S))"
    unset STEPS SETUPS LENGTHS PAIRS BENCH_ARGS GPU_TESTS GPU_UTIL SERVING_ARGS
    run_part "$part"
done
echo "all parts done"
