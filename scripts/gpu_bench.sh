#!/usr/bin/env bash
# One call on the GPU machine: checks, then the benchmarks.
#   device run:  bash scripts/gpu_bench.sh            (results land in $OUT, or results/gpu)
#   STEPS="ttft" bash scripts/gpu_bench.sh            (a subset: tests offload ttft codec disk)
# Uses the machine's own python3 (torch + triton), kvtier from the source tree.
# The GPU machine reaches no package index: the server's dependencies come
# as wheels in .wheels/ (made here with scripts/gpu_wheels.sh, carried along).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
steps=${STEPS:-tests offload ttft}
mkdir -p "$out"
if [ -d .wheels ]; then
    python3 -m pip install -q --no-index --find-links .wheels --target .pydeps uvloop aiohttp prometheus-client xxhash \
        2>&1 | tail -2
fi
export PYTHONPATH=$PWD:$PWD/.pydeps PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/machine.txt"
case " $steps " in *" tests "*)
python3 -m pytest -q -p no:cacheprovider tests/test_transfer_cuda.py tests/test_engine.py tests/test_transfer.py \
    tests/test_kv_codec.py \
    tests/test_tiered_store.py tests/test_disk_tier.py tests/test_hf_integration.py \
    tests/test_digest.py "tests/test_remote_tier.py::test_on_a_gpu_lent_chunks_go_from_the_registered_server_pool_to_the_kv" \
    "tests/test_remote_tier.py::test_on_a_gpu_lent_chunks_are_checked_by_their_digests_on_the_device" \
    2>&1 | tee "$out/pytest.txt" ;;
esac
case " $steps " in *" offload "*)
python3 -m kvtier.cli bench offload --tokens 16384 --layers 32 --kv-heads 8 --head-dim 128 \
    --dtype bfloat16 --block-size 16 --layout flash_attn --transfer ${TRANSFER:-all} --repeats 7 \
    --output "$out/offload.json" 2>&1 | grep -v "it/s" | tee "$out/offload.txt" ;;
esac
case " $steps " in *" ttft "*)
python3 -m kvtier.cli bench ttft --lengths ${LENGTHS:-4096 16384 32768} --repeats 7 --server --server-tcp \
    --codecs int8 fp8 --output "$out" 2>&1 \
    | tee "$out/ttft.txt" ;;
esac
case " $steps " in *" codec "*)
python3 -m kvtier_tools.bench.profiles.kv_codec "$out/kv-codec.json" --lengths 4096 16384 2>&1 | tee "$out/kv-codec.txt" ;;
esac
case " $steps " in *" disk "*)
python3 -m kvtier.cli bench disk --tokens 16384 --repeats 5 --dir /tmp/kvtier-bench-disk \
    --output "$out/disk.json" 2>&1 | tee "$out/disk.txt"
python3 -m kvtier.cli bench ttft --lengths 16384 --repeats 7 --disk /tmp/kvtier-ttft-disk --output "$out/disk-ttft" \
    2>&1 | tee "$out/disk-ttft.txt" ;;
esac
