"""Where a warm load from `kvtier server` on this host spends its time (GPU).

    python3 scripts/gpu_server_profile.py [tokens [copy threads]]

A Llama-3.1-8B-shaped KV cache (32 layers, 8 KV heads of 128, bf16) on the
GPU; one engine stores the prompt into the server, another (CPU tier off)
loads it back: the load timed against the pinned H2D copy of the same
bytes, then profiled (cProfile, cumulative)."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch

from kvtier import buffers
from kvtier.bench.offload import copy_bandwidth
from kvtier.config import KvtierConfig
from kvtier.dev.localservers import kvtier_server
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    if len(sys.argv) > 2:
        buffers.COPY_THREADS = int(sys.argv[2])
    L, H, D, BS = 32, 8, 128, 16
    nb = tokens // BS + 16
    fmt = KVFormat("llama-8b-shaped", "flash_attn", "bfloat16")
    kv_bytes = tokens * L * 2 * H * D * 2
    with kvtier_server(2.5 * kv_bytes / 2**30) as srv:

        def engine(local_cpu: bool) -> tuple[CacheEngine, list[torch.Tensor]]:
            layers = [
                torch.randn(2, nb, BS, H, D, device="cuda").to(torch.bfloat16) for _ in range(L)
            ]
            cfg = KvtierConfig(
                chunk_size=256,
                max_local_cpu_size=1.2 * kv_bytes / 2**30,
                local_cpu=local_cpu,
                remote_url=srv.url,
            )
            return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), fmt), layers

        a, _ = engine(True)
        ids = list(range(tokens))
        slots = torch.arange(tokens)
        a.store(ids, slots)
        assert a.flush(timeout=600)
        b, _ = engine(False)
        b.retrieve(ids, slots)  # connects, maps and registers the pool
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mask = b.retrieve(ids, slots)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        assert mask.all(), int(mask.sum())
        _, h2d = copy_bandwidth(kv_bytes, torch.device("cuda"))
        print(
            f"{tokens} tokens, {kv_bytes / 1e9:.2f} GB: "
            f"load {statistics.median(times) * 1e3:.1f} ms "
            f"(runs {[round(t * 1e3, 1) for t in times]}), "
            f"pinned H2D copy {kv_bytes / h2d / 1e6:.1f} ms "
            f"({h2d:.1f} GB/s); lent chunks {b.tiers.remote.stats.lent}"
        )
        prof = cProfile.Profile()
        prof.enable()
        b.retrieve(ids, slots)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        a.close(), b.close()
