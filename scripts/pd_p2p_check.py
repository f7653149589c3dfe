"""Which cross-GPU writes work here: Triton gather kernel on cuda:0 into memory of cuda:1,
(a) allocated in this process, (b) opened from another process's CUDA IPC handle."""
import json, subprocess, sys, torch
from kvtier.bench.pd import PdShape, _paged, _slots
from kvtier.transfer import make_transfer
from kvtier.transfer.cudart import enable_peer_access

if len(sys.argv) > 1:  # child: owns a buffer on cuda:1, prints its IPC handle, waits
    buf = torch.zeros(1 << 30, dtype=torch.uint8, device="cuda:1")
    print(json.dumps([f.hex() if isinstance(f, bytes) else f for f in buf.untyped_storage()._share_cuda_()]), flush=True)
    sys.stdin.readline()
    print(int(buf[:1 << 20].sum()), flush=True)
    sys.exit()
torch.cuda.set_device(0)
shape, n = PdShape(), 4096
kv, _ = _paged(shape, n, "cuda:0", fill=True)
slots = _slots(kv.num_blocks, shape.block_size, n, 7)
t = make_transfer(kv, "triton")
cs = shape.chunk_size * shape.bytes_per_token()
enable_peer_access(1)
def try_gather(buf, name):
    views = [buf[i * cs:(i + 1) * cs].view(kv.dtype).view(kv.chunk_shape(shape.chunk_size)) for i in range(n // shape.chunk_size)]
    try:
        import time
        for _ in range(3):
            torch.cuda.synchronize(); t0 = time.perf_counter(); t.gather(slots, views); torch.cuda.synchronize()
        print(name, f"ok, {n * shape.bytes_per_token() / (time.perf_counter() - t0) / 1e9:.0f} GB/s", flush=True)
    except Exception as e:
        print(name, "FAILED", str(e)[:120], flush=True)
try_gather(torch.zeros(1 << 30, dtype=torch.uint8, device="cuda:1"), "same-process cuda:1 buffer")
p = subprocess.Popen([sys.executable, __file__, "child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
fields = [bytes.fromhex(f) if isinstance(f, str) else f for f in json.loads(p.stdout.readline())]
storage = torch.UntypedStorage._new_shared_cuda(*fields)
remote = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (1 << 30,), (1,))
try:
    remote[:16].copy_(torch.ones(16, dtype=torch.uint8, device="cuda:0")); torch.cuda.synchronize(); print("ipc copy_ ok", flush=True)
except Exception as e:
    print("ipc copy_ FAILED", str(e)[:120])
# try_gather(remote, ...) dies of an illegal address (measured 2026-11-23, H200 x2), poisoning the context
import time
src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda:0")
for _ in range(2):
    torch.cuda.synchronize(0); torch.cuda.synchronize(1); t0 = time.perf_counter(); remote.copy_(src)
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
print(f"copy_ into the ipc tensor (opened by torch on cuda:1): {(1 << 30) / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
p.stdin.write("\n"); p.stdin.flush(); print("child sum", p.stdout.readline().strip())
# (c) the same handle opened in cuda:0's own context
from kvtier.transfer.cudart import DeviceBytes, open_ipc_handle
p2 = subprocess.Popen([sys.executable, __file__, "child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
fields = [bytes.fromhex(f) if isinstance(f, str) else f for f in json.loads(p2.stdout.readline())]
base = open_ipc_handle(fields[1]) + fields[3]
here = torch.as_tensor(DeviceBytes(base, 1 << 30), device="cuda:0")
print("opened-here tensor device", here.device, flush=True)
try_gather(here, "ipc opened in cuda:0's context")
p2.stdin.write("\n"); p2.stdin.flush(); print("child sum after gather (nonzero = written)", p2.stdout.readline().strip())
