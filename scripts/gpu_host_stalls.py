"""Which host calls of kvtier's hot path make the host wait for the GPU: each runs while a
~0.2 s kernel is queued ahead of it on the current stream (vLLM's forward), and the host time
it took is reported with whether the GPU was still busy after it (if not, it waited).

Inside vLLM a host that waits there holds the scheduler (a lookup) or the next step's launch
(a store in `wait_for_save`) until the GPU's queue drains: requests' TTFTs rise together.

    python3 scripts/gpu_host_stalls.py      (a GPU; prints a table)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

CYCLES = 400_000_000  # ~0.2 s at 1.98 GHz
LAYERS, BLOCKS, BS, HEADS, HEAD = 8, 4096, 16, 8, 128


def busy() -> None:
    torch.cuda._sleep(CYCLES)


def probe(name: str, op: Callable[[], object]) -> None:
    torch.cuda.synchronize()
    busy()
    t0 = time.perf_counter()
    op()
    host = (time.perf_counter() - t0) * 1e3
    still = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    print(f"| {name} | {host:.2f} | {'yes' if still else '**no: it waited**'} |", flush=True)


def main() -> None:
    torch.cuda.init()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    busy()
    torch.cuda.synchronize()
    print(f"the busy kernel alone: {(time.perf_counter() - t0) * 1e3:.1f} ms\n")
    print(
        "| host call, with ~0.2 s of GPU work queued before it | host ms | GPU still busy after |"
    )
    print("|---|---|---|")
    keep = []

    def pinned(size: int) -> Callable[[], None]:
        return lambda: keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))

    def device(size: int) -> Callable[[], None]:
        return lambda: keep.append(torch.empty(size, dtype=torch.uint8, device="cuda"))

    for size in (8 << 10, 512 << 10, 8 << 20):
        probe(f"pinned tensor of {size >> 10} KiB, first of its size", pinned(size))
    keep.clear()
    probe("pinned tensor of 8 KiB again (cached)", pinned(8 << 10))
    probe(
        "small table .pin_memory() then .to(cuda, non_blocking)",
        lambda: keep.append(torch.arange(4096).pin_memory().to("cuda", non_blocking=True)),
    )
    probe("device tensor of 768 MiB, new segment", device(768 << 20))
    keep.clear()
    probe("device tensor of 768 MiB again (cached)", device(768 << 20))
    keep.clear()

    layers = [
        torch.randn(2, BLOCKS, BS, HEADS, HEAD, device="cuda", dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    kv = PagedKV.wrap(layers, "flash_attn")
    eng = CacheEngine(
        KvtierConfig(chunk_size=256, max_local_cpu_size=4), kv, KVFormat("m", "flash_attn", "bf16")
    )
    perm = torch.randperm(kv.num_slots)
    base = 0
    for n_chunks in (4, 4, 1, 7, 16, 16, 3, 12):
        toks = list(range(base, base + n_chunks * 256))
        probe(
            f"kvtier store of {n_chunks} chunks, not waited for",
            lambda t=toks: eng.start_store(t, perm[: len(t)]).finish(wait=False),
        )
        base += 100_000
    for known in (True, False):
        toks = list(range(base, base + 4 * 256))
        probe(
            "kvtier store of 4 chunks, then a lookup of them with "
            f"known = {len(toks) if known else 0}",
            lambda t=toks, k=known: (
                eng.start_store(t, perm[: len(t)]).finish(wait=False),
                eng.find(t, known=len(t) if k else 0),
            ),
        )
        base += 100_000
    eng.close()


if __name__ == "__main__":
    main()
