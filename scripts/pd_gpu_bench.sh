#!/usr/bin/env bash
# Disaggregated-prefill figures on the GPU machine, in one call:
#   one GPU:  sender and receiver processes both on cuda:0 (ratio to a device-to-device copy)
#   two GPUs: sender on cuda:0, receiver on cuda:1 (ratio to a plain GPU0->GPU1 torch copy)
# Channels: cuda_ipc (built in), nixl (when .wheels-pd carries it), tcp (reference).
# PIECES="default 4,16 step": cuda_ipc's reservation of a step, each way in the same run.
# The machine reaches no package index: scripts/gpu_wheels.sh pd puts xxhash, nixl and
# nixl-cu13 into .wheels-pd/ for the device tool to carry.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-pd}
mkdir -p "$out"
# NVLink multicast stays off, also in the receiver processes (they inherit this environment).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .wheels-pd ]; then
    python3 -m pip install -q --no-index --no-deps --target .pydeps .wheels-pd/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:$PWD/.pydeps${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/machine.txt"
channels="cuda_ipc tcp"
if python3 -c "import nixl._api" 2>/dev/null; then channels="cuda_ipc nixl tcp"; fi
echo "channels: $channels" | tee -a "$out/machine.txt"
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/test_pd.py tests/test_transfer_cuda.py tests/test_transfer.py 2>&1 | tail -3 | tee "$out/pytest.txt"
[ -n "${SKIP_1GPU:-}" ] || timeout 280 python3 -m kvtier.cli bench pd --tokens 4096 16384 32768 --channels $channels \
    --sender-device cuda:0 --receiver-device cuda:0 --repeats 5 --output "$out/pd-1gpu.json" 2>&1 \
    | grep -v " INFO " | tee "$out/pd-1gpu.txt"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 280 python3 -m kvtier.cli bench pd --tokens 4096 16384 32768 --channels ${CHANNELS_2GPU:-$channels} \
        --sender-device cuda:0 --receiver-device cuda:1 --repeats ${REPEATS:-5} --pieces ${PIECES:-default} \
        --output "$out/pd-2gpu.json" 2>&1 \
        | grep -v " INFO " | tee "$out/pd-2gpu.txt"
fi
# Where a cuda_ipc send's time goes: the gather kernel into local and peer memory, kvtier's
# ring (kernel, then the copy engine), and the plain copy, each alone.
python3 -m kvtier_tools.bench.profiles.pd_write 2>&1 | tee "$out/pd-profile.txt"
