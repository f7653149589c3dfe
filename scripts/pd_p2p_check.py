"""Can a Triton kernel on cuda:0 write another process's buffer on cuda:1 (CUDA IPC)?
torch's own sharing maps it for cuda:1's context only (a kernel on cuda:0 dies of an
illegal address); a cudaMalloc'd buffer whose legacy IPC handle is opened in cuda:0's
context is the route checked here. Run on the two-GPU machine."""

import subprocess
import sys
import time

import torch

from kvtier.transfer import cudart

if len(sys.argv) > 1:  # child: a cudaMalloc'd buffer on cuda:<argv[2]>, its handle on stdout
    torch.cuda.set_device(int(sys.argv[2]))
    ptr = cudart.malloc(1 << 30)
    buf = torch.as_tensor(cudart.DeviceBytes(ptr, 1 << 30))
    buf.zero_()
    torch.cuda.synchronize()
    print(cudart.ipc_handle(ptr).hex(), flush=True)
    sys.stdin.readline()
    print(int(buf[: 1 << 20].to(torch.int64).sum()), flush=True)
    sys.exit()
from kvtier.bench.offload import OffloadShape
from kvtier.bench.pd import _paged, _slots, per_token
from kvtier.transfer.factory import make_transfer

torch.cuda.set_device(0)
shape, n = OffloadShape(), 4096
kv, _ = _paged(shape, n, "cuda:0", fill=True)
slots = _slots(kv.num_blocks, shape.block_size, n, 7)
t = make_transfer(kv, "triton")
cs = shape.chunk_size * per_token(shape)
for dev in (0, 1):
    child = subprocess.Popen(
        [sys.executable, __file__, "child", str(dev)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ptr = cudart.open_ipc_handle(bytes.fromhex(child.stdout.readline().strip()))
    remote = torch.as_tensor(cudart.DeviceBytes(ptr, 1 << 30))
    views = [
        remote[i * cs : (i + 1) * cs].view(kv.dtype).view(kv.chunk_shape(shape.chunk_size))
        for i in range(n // shape.chunk_size)
    ]
    try:
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.gather(slots, views)
            torch.cuda.synchronize()
        gbps = n * per_token(shape) / (time.perf_counter() - t0) / 1e9
        child.stdin.write("\n")
        child.stdin.flush()
        print(
            f"receiver on cuda:{dev} (tensor says {remote.device}): "
            f"gather kernel ok, {gbps:.0f} GB/s; "
            f"receiver sees sum {child.stdout.readline().strip()}",
            flush=True,
        )
    except Exception as e:
        print(f"receiver on cuda:{dev}: FAILED {str(e)[:150]}", flush=True)
        break
