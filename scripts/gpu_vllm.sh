#!/usr/bin/env bash
# kvtier inside real vLLM 0.26 on the GPU machine, from the offline bundle
# (../shared/gpu-vllm copied to .gpu-vllm and carried; BUNDLE=.gpu-vllm-core for a copy without
# LMCache's add-on, when a setup without LMCache needs room beside it, e.g. .tools/' py-spy wheel):
#   device run:  bash scripts/gpu_vllm.sh                 (results in $OUT, or results/gpu-vllm)
#   STEPS="tests bench" SETUPS="plain kvtier" LENGTHS="16384" PAIRS=7 bash scripts/gpu_vllm.sh
#   TAG=b STEPS=bench SETUPS=lmcache bash scripts/gpu_vllm.sh    (a second archive in the same call)
# Steps: tests (GPU tests; GPU_TESTS= a subset), hma (a sliding-window model with vLLM's hybrid allocator: its test, and
# cold/warm TTFT at 16k of an 8B-sized Gemma-3-style model, or HMA_FAMILY=gptoss_dense), mamba (the same for a Mamba hybrid,
# Nemotron-H-style, and a mutant of the state load the test must catch), guides (the guides' server workflows through real vLLM on the GPU:
# the InfiniStore guide's `vllm bench serve` twice, two instances sharing a store, 1P1D over
# cuda_ipc through `kvtier proxy`), bench (query twice per setup: kvtier_tools.bench.vllm), serving (the
# multi-turn chat workload against vLLM's OpenAI server per offloader: kvtier_tools.bench.serving; about
# 2 minutes a setup, so at most 4 setups a call: SETUPS="plain kvtier" then "kvtier-kernel lmcache native";
# with the 8B shape ~135 s a setup and ~90 s to make the model once a machine; SERVING_ARGS="--rounds 2"
# runs the setups twice over in turn, paired by round; "--rounds 8 --resident" starts each setup's server
# once, all up together, and sends each round new conversations: ~10 s a run after the starts, so many
# paired rounds a call; GPU_UTIL then small enough that each start finds its share free, e.g. 0.3 for
# three setups at 8B on an H200; "--alone" the same rounds, one setup's server at a time), hosttime (the
# host time of kvtier's per-request calls, a store, a lookup, a load, at the 8B shape: kvtier_tools.bench.host_time),
# benchserve (`vllm bench serve` twice per offloader, prefix-sharing prompts: kvtier_tools.bench.serving
# --bench-serve), sharedstore (two vLLM instances one after
# the other sharing KV through each project's own store server on this host: `kvtier server` and LMCache's
# lm:// server, kvtier_tools.bench.stores_vllm; STORES= which), mla (an MLA model, DeepSeek-V2-Lite's attention, query
# twice at 16k: plain, native, kvtier), fleet (kvtier bench fleet on the GPUs: FLEET_ARGS), quality (the
# lossy KV codecs against vLLM's fp8 KV cache: kvtier_tools.bench.profiles.kv_codec).
set -uo pipefail
cd "$(dirname "$0")/.."
# Everything is written to $work and comes back as one archive in $OUT (the device returns at most 8 files).
out=${OUT:-results/gpu-vllm}
tag=${TAG:-a}
work=/tmp/gpu-vllm-results-$tag
steps=${STEPS:-tests guides bench}
rm -rf "$work"; mkdir -p "$out" "$work"
servers='^[^ ]*python[0-9.]* -m (vllm\.entrypoints\.openai\.api_server|kvtier\.server|kvtier\.cli proxy)'
pkill -f "$servers"  # an earlier call's, cut short
trap 'tar czf "$out/gpu-vllm-$tag.tgz" -C "$work" .' EXIT
if ls .tools/py_spy-*.whl >/dev/null 2>&1 && [ ! -x /tmp/pyspy/bin/py-spy ]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/pyspy .tools/py_spy-*.whl
fi
export PATH=$PATH:/tmp/pyspy/bin
if [ ! -d /tmp/site/vllm ]; then
    bash "${BUNDLE:-.gpu-vllm}/install.sh" "${BUNDLE:-.gpu-vllm}" /tmp/site >/dev/null || exit 1
fi
# kvtier installed (a wheel of this tree) for vLLM's plugin entry point; the tree itself comes first.
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kvtier-dist . 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site:/tmp/kvtier-dist PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  # the host's CPU and the GPU's clocks: calls on different hosts differ (vLLM's engine thread is
  # host-bound in the chat), and the same code has run 15 % apart from one call to the next
  lscpu | grep -E "^(Model name|CPU\(s\)|CPU max MHz)"
  nvidia-smi --format=csv \
      --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,pstate
  python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__)"
} 2>&1 | tee "$work/machine.txt"
# The workloads' defaults (JSON; WORKLOAD, BENCH_SERVE and SHARED_WORKLOAD replace them). Kept out
# of the ${VAR:-default} expansions: a '}' inside a default ends the expansion early.
# The chat's rate: at 4 req/s (the runs up to 2026-11-28) a request ended before the next was sent
# (0.9 in flight at the 8B shape: 0.227 s a request of 32 tokens, 35 ms TTFT and ~6.2 ms a token).
# At 24 req/s and 48 tokens a request (predicted ~8 in flight by Little's law) an H200 ran 10.3-11.4
# in flight, at most the cap of 12 (2026-11-28; the harness's table says how many were, and notes
# a run that served them one at a time). Output lengths 24-72 tokens (mean 48) since 2026-11-29: with
# every request 48 tokens, rounds fell into lockstep at random and a round's mean TTFT followed
# that (58 to 215 ms, whichever offloader; results/gpu-h200-vllm-2026-11-29/README.md).
chat_workload='{"conversations": 32, "system_tokens": 4096, "turns": 6, "user_tokens": 256, "answer_tokens": 128,
    "max_tokens": 48, "output_spread": 0.5, "rate": 24.0, "concurrency": 12}'
bench_serve='{"num_prompts": 64, "input_len": 8192, "prefix_len": 6144, "num_prefixes": 8, "output_len": 16,
    "max_concurrency": 16}'
shared_workload='{"num_prompts": 32, "input_len": 8192, "output_len": 16, "max_concurrency": 8}'
case " $steps " in *" tests "*)
timeout 240 python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_transfer_cuda.py tests/test_vllm_layout.py tests/test_engine.py \
    tests/test_digest.py tests/test_hf_integration.py tests/test_vllm_worker.py \
    "tests/test_remote_tier.py::test_on_a_gpu_lent_chunks_go_from_the_registered_server_pool_to_the_kv"} 2>&1 \
    > "$work/pytest.txt"; tail -5 "$work/pytest.txt" ;;
esac
case " $steps " in *" hma "*)
# Hybrid models through vLLM's hybrid allocator: a tiny Gemma-3-style model's hit gives plain
# vLLM's tokens; then an 8B-sized Gemma-3-style model (Llama-3.1-8B's KV a token) cold and warm.
timeout ${HMA_TIMEOUT:-450} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_vllm_hma.py \
    > "$work/hma-test.txt" 2>&1; echo "hma test exit $?"; tail -4 "$work/hma-test.txt"
timeout ${HMA_BENCH_TIMEOUT:-300} python3 -m kvtier_tools.bench.vllm --family ${HMA_FAMILY:-gemma3} --setups ${SETUPS:-plain kvtier} \
    --lengths ${LENGTHS:-16384} --pairs ${PAIRS:-5} --out "$work/hma-bench" --setup-timeout 280 > "$work/hma-bench.log" 2>&1
echo "hma bench exit $?"; grep -E "^\[|tokens|hybrid KV cache|Traceback|Error" "$work/hma-bench.log" | tail -20 ;;
esac
case " $steps " in *" mamba "*)
# A Mamba hybrid (vLLM's --mamba-cache-mode align): a tiny Nemotron-H's hits, with the Mamba state
# kvtier stored, give plain vLLM's tokens; the same test on a copy of the tree whose state load
# writes zeros must fail (the test sees a wrong state); then an 8B-sized Nemotron-H cold and warm.
timeout ${MAMBA_TIMEOUT:-240} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_vllm_mamba.py \
    tests/test_vllm_groups.py tests/test_states.py > "$work/mamba-test.txt" 2>&1; echo "mamba test exit $?"
tail -4 "$work/mamba-test.txt"
rm -rf /tmp/mutant && mkdir /tmp/mutant && cp -r kvtier tests /tmp/mutant/
sed -i 's/        _copy(self._runs, src, dst, into_pieces=False)/        [d.zero_() for d in dst]/' /tmp/mutant/kvtier/engine/states.py
(cd /tmp/mutant && PYTHONPATH=/tmp/mutant:/tmp/site:/tmp/kvtier-dist timeout ${MAMBA_TIMEOUT:-240} python3 -m pytest -q \
    --tb=line -p no:cacheprovider tests/test_vllm_mamba.py > "$work/mamba-mutant.txt" 2>&1
 echo "mamba mutant exit $? (1: the test caught it)"); tail -3 "$work/mamba-mutant.txt"
[ "${MAMBA_BENCH:-1}" = 1 ] && timeout ${MAMBA_BENCH_TIMEOUT:-300} python3 -m kvtier_tools.bench.vllm --family nemotron_h --setups ${SETUPS:-plain kvtier} \
    --lengths ${LENGTHS:-16384} --pairs ${PAIRS:-5} --out "$work/mamba-bench" --setup-timeout 280 > "$work/mamba-bench.log" 2>&1
echo "mamba bench exit $?"; grep -E "^\[|tokens|hybrid KV cache|chunk_size|Traceback|Error" "$work/mamba-bench.log" | tail -20 ;;
esac
case " $steps " in *" guides "*)
timeout ${GUIDES_TIMEOUT:-540} python3 -m pytest -q -s -rfE --tb=short --timeout 300 -p no:cacheprovider \
    tests/test_vllm_pd.py tests/test_vllm_remote.py ${GUIDES_K:+-k "$GUIDES_K"} \
    > "$work/guides.txt" 2>&1; echo "guides exit $?"
# A step cut by its time limit leaves its servers (their own sessions) holding GPU memory.
pkill -f "$servers"; sleep 3
grep -E "passed|failed|error|bench serve twice|Median TTFT" "$work/guides.txt" | tail -12 ;;
esac
case " $steps " in *" hosttime "*)
# The host time of kvtier's per-request calls (a store, a lookup, a load beside) at the chat's
# sizes and the 8B shape, with their profiles: kvtier_tools.bench.host_time (~1 min). With HOSTTIME_BASE=DIR
# (a git-ignored tree of an earlier commit's kvtier/, carried, e.g. .hosttime-base: `mkdir -p DIR &&
# git archive REV kvtier | tar -x -C DIR`), the same bench against it first: before and after in one call.
if [ -n "${HOSTTIME_BASE:-}" ]; then
    PYTHONPATH=$HOSTTIME_BASE:/tmp/site timeout ${HOSTTIME_TIMEOUT:-240} python3 kvtier_tools/bench/host_time.py \
        --out "$work/host_time-base.json" ${HOSTTIME_ARGS:-} > "$work/host_time-base.txt" 2>&1
    echo "hosttime base exit $?"; grep -E "^(kvtier from|store|lookup|load)" "$work/host_time-base.txt"
fi
timeout ${HOSTTIME_TIMEOUT:-240} python3 -m kvtier_tools.bench.host_time --out "$work/host_time.json" ${HOSTTIME_ARGS:-} \
    > "$work/host_time.txt" 2>&1; echo "hosttime exit $?"; grep -v " INFO " "$work/host_time.txt" | head -60 ;;
esac
# The serving steps' model (TinyLlama fields; SERVING_ARGS="--model {...}" replaces it): 16 Llama layers.
serving_model='{"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768}'
case " $steps " in *" serving "*)
# A 16-layer Llama shape (64 KB of KV a token), seeded weights; vLLM's own KV cache a quarter of
# the live conversations at their last turn (GPU_KV_SHARE; --kv-cache-memory-bytes, so the same on
# an H100 and an H200; --gpu-util only bounds the rest), every offloader the same CPU memory.
timeout ${SERVING_TIMEOUT:-540} python3 -m kvtier_tools.bench.serving --setups ${SETUPS:-plain kvtier} --out "$work/serving" \
    --gpu-util ${GPU_UTIL:-0.5} --gpu-kv-share ${GPU_KV_SHARE:-0.25} --cpu-gb 20 --model "$serving_model" \
    --workload "${WORKLOAD:-$chat_workload}" ${SERVING_ARGS:-} > "$work/serving.log" 2>&1
echo "serving exit $?"; pkill -f "$servers"; grep -E "^\||^\[|Traceback|Error" "$work/serving.log" | tail -20
# With SERVING_ARGS=--profile (py-spy on PATH, e.g. its wheel carried in .tools/): where each
# server's threads spent the workload.
ls "$work"/serving/*-pyspy.txt >/dev/null 2>&1 && python3 -m kvtier_tools.bench.stacks "$work"/serving/*-pyspy.txt \
    --min-samples 200 > "$work/stacks.txt" 2>&1 && head -60 "$work/stacks.txt" ;;
esac
case " $steps " in *" fleet "*)
# Four vLLM instances over the GPUs behind `kvtier router`: round robin, with P2P (between
# instances of this host through shared memory), KV-aware routing with P2P; the serving model,
# prompts 8 times the CPU run's (kvtier_tools.bench.fleet; FLEET_ARGS="--setups ..." for some).
gpus=$(nvidia-smi --list-gpus | wc -l)
timeout ${FLEET_TIMEOUT:-540} python3 -m kvtier.cli bench fleet --gpus "$gpus" --gpu-util ${GPU_UTIL:-0.4} \
    --model "$serving_model" --scale 8 --cpu-gb 8 --work /tmp/fleet --output "$work/fleet.json" ${FLEET_ARGS:-} \
    > "$work/fleet.log" 2>&1
echo "fleet exit $?"; pkill -f "$servers"; grep -E "^\||Traceback|Error" "$work/fleet.log" | tail -20
grep -h "copied out of its pool" /tmp/fleet/*/vllm-*.log | head -3
for f in /tmp/fleet/*/vllm-*.log; do echo "== $f"; grep -E "Error|error|P2P" "$f" | tail -15
    grep -q EngineDead "$f" && grep -v "ulimit" "$f" | tail -60; done > "$work/fleet-servers.txt" 2>&1 ;;
esac
case " $steps " in *" benchserve "*)
# `vllm bench serve` twice per offloader with vLLM's prefix-sharing dataset (the InfiniStore
# guide's flow): the serving step's model and memory, BENCH_SERVE the workload (JSON).
timeout ${BENCHSERVE_TIMEOUT:-540} python3 -m kvtier_tools.bench.serving --setups ${SETUPS:-plain kvtier lmcache native} \
    --out "$work/bench-serve" --gpu-util ${GPU_UTIL:-0.12} --cpu-gb 20 --max-model-len 16384 --model "$serving_model" \
    --bench-serve "${BENCH_SERVE:-$bench_serve}" ${SERVING_ARGS:-} \
    > "$work/bench-serve.log" 2>&1
echo "bench serve exit $?"; pkill -f "$servers"; grep -E "^\||Traceback|Error" "$work/bench-serve.log" | tail -12
# With SERVING_ARGS=--profile: where each server's threads spent each run.
for f in "$work"/bench-serve/*-pyspy.txt; do
    [ -f "$f" ] && python3 -m kvtier_tools.bench.stacks "$f" --min-samples 100 > "${f%.txt}-stacks.txt" 2>&1 \
        && head -40 "${f%.txt}-stacks.txt"
done ;;
esac
case " $steps " in *" sharedstore "*)
# The remote path: instance A serves the prompts cold (its KV into the store), instance B, a new
# process, serves them again (hits from the store); vLLM's prefix cache and the connector's CPU tier off.
timeout ${SHAREDSTORE_TIMEOUT:-540} python3 -m kvtier_tools.bench.stores_vllm --stores ${STORES:-kvtier lmcache} \
    --model "$serving_model" --gpu-util ${GPU_UTIL:-0.2} --no-eager --cpu-gb 8 --store-gb 24 --max-model-len 16384 \
    --workload "${SHARED_WORKLOAD:-$shared_workload}" \
    --output "$work/shared-store.json" > "$work/shared-store.log" 2>&1
echo "shared store exit $?"; pkill -f "$servers"; pkill -f "lmcache.v1.server"
grep -E "^\||Traceback|Error" "$work/shared-store.log" | tail -12 ;;
esac
case " $steps " in *" mla "*)
# An MLA model (DeepSeek-V2-Lite's attention, dense MLPs): query twice at 16k beside plain vLLM and
# its native offloading; the token checks compare warm with vLLM's own GPU hit.
timeout ${MLA_TIMEOUT:-540} python3 -m kvtier_tools.bench.vllm --family deepseek_v2 --setups ${SETUPS:-plain native kvtier} \
    --lengths ${LENGTHS:-16384} --pairs ${PAIRS:-5} --out "$work/mla" --setup-timeout ${SETUP_TIMEOUT:-170} \
    ${BENCH_ARGS:-} > "$work/mla.log" 2>&1
echo "mla bench exit $?"; grep -E "^\[|tokens|MLA|backend|Traceback|Error" "$work/mla.log" | tail -30 ;;
esac
case " $steps " in *" quality "*)
# The lossy KV codecs' cost in quality beside vLLM's own fp8 KV cache, on the transformers Llama
# of the 8B shape (seeded weights): kvtier_tools.bench.profiles.kv_codec, 16 greedy tokens.
timeout ${QUALITY_TIMEOUT:-400} python3 -m kvtier_tools.bench.profiles.kv_codec "$work/kv-codec.json" \
    --lengths ${LENGTHS:-4096 16384} --new 16 > "$work/kv-codec.log" 2>&1
echo "quality exit $?"; grep -E "^\{|Traceback|Error" "$work/kv-codec.log" | cut -c1-400 | tail -20 ;;
esac
case " $steps " in *" bench "*)
timeout ${BENCH_TIMEOUT:-480} python3 -m kvtier_tools.bench.vllm --setups ${SETUPS:-plain kvtier kvtier-layerwise} --lengths ${LENGTHS:-4096 16384 32768} \
    --pairs ${PAIRS:-7} --out "$work" ${BENCH_ARGS:-} > "$work/bench.log" 2>&1
echo "bench exit $?"; grep -E "^\[|tokens|Traceback|Error" "$work/bench.log" | tail -40 ;;
esac
