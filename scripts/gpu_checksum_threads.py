"""How fast chunk checksums run on this host, over N threads, alone and beside a DMA.

    python3 scripts/gpu_checksum_threads.py [GiB]

Hashes 32 MiB chunks of a registered (page-locked) host buffer with
codec.checksum over 1..cpu_count threads, first alone, then while the same
bytes are copied to the GPU: says how many threads keep the checksum of a
lent batch under its DMA."""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier.codec import checksum
from kvtier.transfer import cudart

CHUNK = 32 << 20


def timed(fn, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


if __name__ == "__main__":
    nbytes = int(float(sys.argv[1]) * 2**30) if len(sys.argv) > 1 else 2 << 30
    buf = mmap.mmap(-1, nbytes)
    host = np.frombuffer(buf, np.uint8)
    host[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    ptr = host.ctypes.data
    cudart.host_register(ptr, nbytes)
    chunks = [host[i : i + CHUNK] for i in range(0, nbytes, CHUNK)]
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.from_numpy(host)
    stream = torch.cuda.Stream()

    def dma() -> None:
        with torch.cuda.stream(stream):
            dev.copy_(src, non_blocking=True)

    copy_s = timed(lambda: (dma(), stream.synchronize()))
    out = {
        "bytes": nbytes,
        "dma_s": copy_s,
        "dma_gbps": nbytes / copy_s / 1e9,
        "cpus": os.cpu_count(),
        "threads": {},
    }
    for n in sorted({1, 2, 4, 8, 12, 16, os.cpu_count() or 1}):
        if n > (os.cpu_count() or 1):
            continue
        with ThreadPoolExecutor(n) as pool:
            alone = timed(lambda: list(pool.map(checksum, chunks)))

            def both() -> float:
                dma()
                t0 = time.perf_counter()
                list(pool.map(checksum, chunks))
                sums = time.perf_counter() - t0
                stream.synchronize()
                return sums

            beside = statistics.median([both() for _ in range(5)])
            together = timed(
                lambda: (dma(), list(pool.map(checksum, chunks)), stream.synchronize())
            )
        out["threads"][n] = {
            "alone_gbps": nbytes / alone / 1e9,
            "beside_dma_gbps": nbytes / beside / 1e9,
            "dma_and_sums_s": together,
            "over_dma": together / copy_s,
        }
        print(n, json.dumps(out["threads"][n]), flush=True)
    print(json.dumps(out))
