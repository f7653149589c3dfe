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
        t.gather(slots, views); torch.cuda.synchronize(); print(name, "ok", flush=True)
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
try_gather(remote, "ipc-opened cuda:1 buffer")
p.stdin.write("\n"); p.stdin.flush(); print("child sum", p.stdout.readline().strip())
