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
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvtier.bench.offload import OffloadShape
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
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    print(f"=== {name}: top host work ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    if out is None:
        return
    raw = out / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def offload(tokens: int, out: Path) -> None:
    shape = OffloadShape(tokens=tokens)
    n_blocks = 2 * tokens // shape.block_size
    layers = [torch.randn(shape.layer_shape(n_blocks), device="cuda").to(torch.bfloat16) for _ in range(32)]
    kv = PagedKV.wrap(layers, "flash_attn")
    perm = torch.randperm(n_blocks)
    slots = (perm[:, None] * shape.block_size + torch.arange(shape.block_size)).flatten()
    store_slots, load_slots = slots[:tokens], slots[tokens : 2 * tokens]
    pool = tokens * kv.bytes_per_token() * 1.1 / 1024**3
    eng = CacheEngine(KvtierConfig(max_local_cpu_size=pool), kv, KVFormat("p", "flash_attn", "bfloat16"))
    toks = torch.randint(0, 32000, (tokens,))
    nbytes = tokens * kv.bytes_per_token()
    for _ in range(2):  # warm-up
        eng.clear()
        eng.store(toks, store_slots)
        eng.retrieve(toks, load_slots)
    spans = eng.spans(toks)
    print(f"host: spans {timed(lambda: eng.spans(toks)) * 1e3:.2f} ms, "
          f"missing {timed(lambda: eng.tiers.missing([s.key for s in spans])) * 1e3:.2f} ms, "
          f"check {timed(lambda: eng._check(toks, store_slots)) * 1e3:.2f} ms")
    eng.clear()
    t_store = timed(lambda: eng.store(toks, store_slots))
    t_load = timed(lambda: eng.retrieve(toks, load_slots))
    print(f"store {t_store * 1e3:.1f} ms ({nbytes / t_store / 1e9:.1f} GB/s), "
          f"retrieve {t_load * 1e3:.1f} ms ({nbytes / t_load / 1e9:.1f} GB/s)")
    eng.clear()
    trace("store", out, lambda: eng.store(toks, store_slots))
    trace("retrieve", out, lambda: eng.retrieve(toks, load_slots))
    eng.clear()
    del eng, layers
    torch.cuda.empty_cache()


def warm(tokens: int, out: Path) -> None:
    from kvtier.bench.ttft import _kv_bytes_per_token, build_model
    from kvtier.integrations.hf import HFSession

    model = build_model()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    pool = (tokens + 256) * _kv_bytes_per_token(model) * 1.05 / 1024**3
    session = HFSession(model, KvtierConfig(max_local_cpu_size=pool), max_len=tokens)
    session.prefill(ids)
    for layerwise in (False, True, False, True):
        print(f"warm{' layerwise' if layerwise else ''}: {timed(lambda: session.prefill(ids, layerwise=layerwise)) * 1e3:.1f} ms")
    trace("warm", out, lambda: session.prefill(ids, layerwise=False))
    trace("warm_layerwise", out, lambda: session.prefill(ids, layerwise=True))
    session.engine.clear()
    trace("cold_store_layerwise", out, lambda: session.prefill(ids, layerwise=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, help="write gzipped chrome traces here")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--what", nargs="+", default=["offload", "warm"])
    args = p.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    if "offload" in args.what:
        offload(args.tokens, args.out)
    if "warm" in args.what:
        warm(args.tokens, args.out)


if __name__ == "__main__":
    main()
