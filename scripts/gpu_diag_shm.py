"""Diagnostics: is memory of a shared memfd mapping slower to copy than private memory, on this host?"""
import mmap, os, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import torch

N = 2 << 30
print("THP enabled:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
      "| shmem_enabled:", open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip(), flush=True)
fd = os.memfd_create("diag", os.MFD_CLOEXEC)
os.ftruncate(fd, N)
t0 = time.perf_counter()
shm = mmap.mmap(fd, N, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
print(f"memfd map+populate {N / (time.perf_counter() - t0) / 1e9:.1f} GB/s", flush=True)
src = np.frombuffer(shm, np.uint8)
priv = np.ones(N, np.uint8)
pinned = torch.empty(N, dtype=torch.uint8, pin_memory=True).numpy()
pinned[:] = 1
fd2 = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR)
shm2 = mmap.mmap(fd2, N, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
src2 = np.frombuffer(shm2, np.uint8)


def copy(dst, s, threads):
    piece = 8 << 20
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(lambda i: dst.__setitem__(slice(i, i + piece), s[i : i + piece]), range(0, N, piece)))
        return N / (time.perf_counter() - t0) / 1e9


for name, d, s in [("private->pinned", pinned, priv), ("shm->pinned", pinned, src), ("pinned->shm", src, pinned),
                   ("second map shm->pinned", pinned, src2)]:
    print(name, " ".join(f"{t}t {copy(d, s, t):.1f}" for t in (1, 1, 4, 8, 8)), "GB/s", flush=True)
