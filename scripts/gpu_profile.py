"""Where the time of a store, a retrieve and a warm prefill goes, on the GPU machine.

    python3 scripts/gpu_profile.py [--out DIR] [--tokens 16384] [--what offload warm]

Prints, for Llama-3.1-8B-shaped KV in a paged cache (offload) and for the
8B-shaped model through HFSession (warm prefill, whole and layerwise): the
host-side time of each step and the torch profiler's tables of the GPU and
host work; with --out, chrome traces (gzipped) too.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvtier.bench.offload import OffloadShape
from kvtier.bench.offload import timed as timed_on
from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV


def trace(name: str, out: Path | None, fn) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n=== {name}: top GPU work ===")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
    )
    print(f"=== {name}: top host work ===")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60
        )
    )
    if out is None:
        return
    raw = out / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def timed(fn) -> float:
    return timed_on(fn, torch.device("cuda"))


def offload(tokens: int, out: Path) -> None:
    shape = OffloadShape(tokens=tokens)
    n_blocks = 2 * tokens // shape.block_size
    layers = [
        torch.randn(shape.layer_shape(n_blocks), device="cuda").to(torch.bfloat16)
        for _ in range(32)
    ]
    kv = PagedKV.wrap(layers, "flash_attn")
    perm = torch.randperm(n_blocks)
    slots = (perm[:, None] * shape.block_size + torch.arange(shape.block_size)).flatten()
    store_slots, load_slots = slots[:tokens], slots[tokens : 2 * tokens]
    pool = tokens * kv.bytes_per_token() * 1.1 / 1024**3
    eng = CacheEngine(
        KvtierConfig(max_local_cpu_size=pool), kv, KVFormat("p", "flash_attn", "bfloat16")
    )
    toks = torch.randint(0, 32000, (tokens,))
    nbytes = tokens * kv.bytes_per_token()
    for _ in range(2):  # warm-up
        eng.clear()
        eng.store(toks, store_slots)
        eng.retrieve(toks, load_slots)
    spans = eng.spans(toks)
    print(
        f"host: spans {timed(lambda: eng.spans(toks)) * 1e3:.2f} ms, "
        f"missing {timed(lambda: eng.tiers.missing([s.key for s in spans])) * 1e3:.2f} ms, "
        f"check {timed(lambda: eng._check(toks, store_slots)) * 1e3:.2f} ms"
    )
    eng.clear()
    t_store = timed(lambda: eng.store(toks, store_slots))
    t_load = timed(lambda: eng.retrieve(toks, load_slots))
    print(
        f"store {t_store * 1e3:.1f} ms ({nbytes / t_store / 1e9:.1f} GB/s), "
        f"retrieve {t_load * 1e3:.1f} ms ({nbytes / t_load / 1e9:.1f} GB/s)"
    )
    eng.clear()
    trace("store", out, lambda: eng.store(toks, store_slots))
    trace("retrieve", out, lambda: eng.retrieve(toks, load_slots))
    eng.clear()
    eng = None
    del layers
    torch.cuda.empty_cache()


def warm(tokens: int, out: Path) -> None:
    from kvtier.bench.ttft import build_model
    from kvtier.bench.ttft_sources import kv_bytes_per_token as _kv_bytes_per_token
    from kvtier.integrations.hf import HFSession

    model = build_model()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    pool = (tokens + 256) * _kv_bytes_per_token(model) * 1.05 / 1024**3
    session = HFSession(model, KvtierConfig(max_local_cpu_size=pool), max_len=tokens)
    session.prefill(ids)
    for layerwise in (False, True, False, True):
        print(
            f"warm{' layerwise' if layerwise else ''}: "
            f"{timed(lambda: session.prefill(ids, layerwise=layerwise)) * 1e3:.1f} ms"
        )
    trace("warm", out, lambda: session.prefill(ids, layerwise=False))
    trace("warm_layerwise", out, lambda: session.prefill(ids, layerwise=True))
    session.engine.clear()
    trace("cold_store_layerwise", out, lambda: session.prefill(ids, layerwise=True))


def server(tokens: int) -> None:
    """The same-host path: chunks of the 8B shape through kvtier server's shared pool, by copy
    threads."""
    import numpy as np

    import kvtier.buffers as buffers
    from kvtier.dev.localservers import kvtier_server
    from kvtier.server.client import KVClient

    chunk = 256 * 32 * 2 * 8 * 128 * 2  # 33.5 MB
    n = tokens // 256
    src = torch.empty(n * chunk, dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.empty(n * chunk, dtype=torch.uint8, pin_memory=True)
    views = [memoryview(src[i * chunk : (i + 1) * chunk].numpy()) for i in range(n)]
    outs = [memoryview(dst[i * chunk : (i + 1) * chunk].numpy()) for i in range(n)]
    keys = [b"k%d" % i for i in range(n)]
    with kvtier_server(2.5 * n * chunk / 1024**3) as srv:
        client = KVClient("127.0.0.1", srv.ports[0])
        client.put(keys, views)
        for threads in (1, 2, 4, 8):
            buffers.COPY_THREADS, buffers._pool = threads, None
            t_put = timed(lambda: client.put(keys, views))
            t_get = timed(lambda: client.get_into(keys, outs))
            t_cpy = timed(
                lambda: buffers.run_copy(
                    [
                        (np.frombuffer(o, np.uint8), np.frombuffer(v, np.uint8))
                        for o, v in zip(outs, views)
                    ]
                )
            )
            print(
                f"{threads} copy threads: put {n * chunk / t_put / 1e9:.1f} GB/s, get_into "
                f"{n * chunk / t_get / 1e9:.1f} GB/s, memcpy {n * chunk / t_cpy / 1e9:.1f} GB/s"
            )
        assert bytes(outs[-1][:16]) == b"\x07" * 16
        client.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, help="write gzipped chrome traces here")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--what", nargs="+", default=["offload", "server", "warm"])
    args = p.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    if "offload" in args.what:
        offload(args.tokens, args.out)
    if "server" in args.what:
        server(args.tokens)
    if "warm" in args.what:
        warm(args.tokens, args.out)


if __name__ == "__main__":
    main()
