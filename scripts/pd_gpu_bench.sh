#!/usr/bin/env bash
# Disaggregated-prefill figures on the GPU machine, in one call:
#   one GPU:  sender and receiver processes both on cuda:0 (ratio to a device-to-device copy)
#   two GPUs: sender on cuda:0, receiver on cuda:1 (ratio to a plain GPU0->GPU1 torch copy)
# Channels: cuda_ipc (built in), nixl (when .wheels-pd carries it), tcp (reference).
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
export PYTHONPATH=$PWD:$PWD/.pydeps PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/machine.txt"
channels="cuda_ipc tcp"
if python3 -c "import nixl._api" 2>/dev/null; then channels="cuda_ipc nixl tcp"; fi
echo "channels: $channels" | tee -a "$out/machine.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_pd.py tests/test_transfer_cuda.py tests/test_transfer.py 2>&1 | tail -3 | tee "$out/pytest.txt"
[ -n "${SKIP_1GPU:-}" ] || timeout 280 python3 -m kvtier.cli bench pd --tokens 4096 16384 32768 --channels $channels \
    --sender-device cuda:0 --receiver-device cuda:0 --repeats 5 --output "$out/pd-1gpu.json" 2>&1 \
    | grep -v " INFO " | tee "$out/pd-1gpu.txt"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 280 python3 -m kvtier.cli bench pd --tokens 4096 16384 32768 --channels ${CHANNELS_2GPU:-$channels} \
        --sender-device cuda:0 --receiver-device cuda:1 --repeats 5 --output "$out/pd-2gpu.json" 2>&1 \
        | grep -v " INFO " | tee "$out/pd-2gpu.txt"
fi
# Where a cuda_ipc send's time goes: the gather kernel alone, into local device chunks, 16k tokens.
python3 - <<'PY' 2>&1 | tee "$out/pd-profile.txt"
import time, torch
from kvtier.bench.offload import OffloadShape
from kvtier.bench.pd import _paged, _slots, per_token
from kvtier.keys import KVFormat, chunk_spans
from kvtier.transfer import make_transfer
shape, n = OffloadShape(), 16384
kv, _ = _paged(shape, n, "cuda:0", fill=True)
slots = _slots(kv.num_blocks, shape.block_size, n, 7)
chunks = [torch.empty(kv.chunk_shape(shape.chunk_size), dtype=kv.dtype, device="cuda:0") for _ in range(n // shape.chunk_size)]
nbytes = n * per_token(shape)
src, dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"), torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
for name in ("triton", "torch"):
    t = make_transfer(kv, name)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(); t0 = time.perf_counter(); t.gather(slots, chunks); torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms = sorted(times[1:])[2] * 1e3
    print(f"gather kernel only ({name}), 16384 tokens into device chunks: {ms:.2f} ms = {nbytes / ms / 1e6:.0f} GB/s")
times = []
for _ in range(6):
    torch.cuda.synchronize(); t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
ms = sorted(times[1:])[2] * 1e3
print(f"device-to-device copy of the same bytes: {ms:.2f} ms = {nbytes / ms / 1e6:.0f} GB/s")
PY
