"""`kvtier bench disk`: the disk tier against plain file I/O, and what a disk hit costs an engine
step.

Tier against file, for N tokens of a model's KV shape (Llama-3.1-8B by default):
    write  DiskTier.put of every chunk (header and checksum, temporary file,
           rename), then sync() so the bytes are on the device
    read   DiskTier.get_into of every chunk, 16 at a time into 16 chunk-sized
           buffers, as a fetch through a pool reads (length and checksum checked)
    limit  one file of the same bytes, written with the same write size, then
           sync(); read back sequentially
Reads come from the device, not the page cache: every file is fsynced and
its pages dropped (posix_fadvise DONTNEED) before it is read. One pass of
each is run first and not counted. The order of tier and file alternates
between repeats; figures are medians, and ratios are paired (median of
per-repeat ratios).

Engine step, a CacheEngine on a CPU paged cache of the same shape with a
CPU pool of a few chunks and the disk tier holding the prompt:
    sync   retrieve(): what vLLM's step waits for a synchronous load
    async  what the step waits when the load is queued in the background, as
           the vLLM connector does for hits below CPU RAM; and the request's
           own time from its lookup (lease + prefetch) to loaded
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.codec import Codec
from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat, chunk_spans
from kvtier.tiers.disk import DiskTier
from kvtier.transfer import PagedKV
from kvtier_tools.bench.offload import OffloadShape, machine_name

READ_BATCH = 16  # chunks per read call, as a fetch through a pool of 16 blocks


@dataclass
class DiskResult:
    shape: OffloadShape
    directory: str
    machine: str
    date: str
    kv_bytes: int
    tier_write_gbps: list[float] = field(default_factory=list)
    tier_read_gbps: list[float] = field(default_factory=list)
    file_write_gbps: list[float] = field(default_factory=list)
    file_read_gbps: list[float] = field(default_factory=list)
    step_wait_sync_ms: list[float] = field(default_factory=list)
    step_wait_async_ms: list[float] = field(default_factory=list)
    request_load_async_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        med = statistics.median
        return {
            "tier_write_GBps": round(med(self.tier_write_gbps), 3),
            "tier_read_GBps": round(med(self.tier_read_gbps), 3),
            "file_write_GBps": round(med(self.file_write_gbps), 3),
            "file_read_GBps": round(med(self.file_read_gbps), 3),
            "write_ratio_paired": round(
                med(t / f for t, f in zip(self.tier_write_gbps, self.file_write_gbps)), 3
            ),
            "read_ratio_paired": round(
                med(t / f for t, f in zip(self.tier_read_gbps, self.file_read_gbps)), 3
            ),
            "step_wait_sync_ms": round(med(self.step_wait_sync_ms), 2),
            "step_wait_async_ms": round(med(self.step_wait_async_ms), 3),
            "request_load_async_ms": round(med(self.request_load_async_ms), 2),
        }


def drop_cache(path: Path) -> None:
    """Write the file's pages out and drop them, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _chunks(shape: OffloadShape, bytes_per_token: int) -> list[memoryview]:
    rng = np.random.default_rng(0)
    size = shape.chunk_size * bytes_per_token
    return [
        memoryview(rng.integers(0, 255, size, dtype=np.uint8))
        for _ in range(shape.tokens // shape.chunk_size)
    ]


def file_read_bandwidth(root: Path, nbytes: int, block: int = 32 << 20) -> float:
    """GB/s of a sequential read of a fresh `nbytes` file in `root`, from the device."""
    data = memoryview(np.random.default_rng(1).integers(0, 255, block, dtype=np.uint8))
    return _file_pass(root, [data] * -(-nbytes // block))[1]


def _file_pass(root: Path, chunks: list[memoryview]) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one sequential file of the chunks' bytes."""
    path = root / "sequential.bin"
    total = sum(len(c) for c in chunks)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for chunk in chunks:
            f.write(chunk)
    os.sync()  # as the tier pass: every dirty page on the device
    write = total / (time.perf_counter() - t0) / 1e9
    drop_cache(path)
    out = memoryview(bytearray(len(chunks[0])))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(out):
            pass
    read = total / (time.perf_counter() - t0) / 1e9
    path.unlink()
    return write, read


def _tier_pass(
    root: Path, shape: OffloadShape, chunks: list[memoryview], itemsize: int
) -> tuple[float, float]:
    """(write GB/s, read GB/s) of the disk tier over the same bytes, chunk by chunk."""
    tier_dir = root / "tier"
    shutil.rmtree(tier_dir, ignore_errors=True)
    tier = DiskTier(tier_dir, 2 * sum(len(c) for c in chunks), Codec("naive", itemsize=itemsize))
    fmt = KVFormat("bench", "flash_attn", shape.dtype)
    keys = [s.key for s in chunk_spans(np.arange(shape.tokens), fmt, shape.chunk_size, False)]
    total = sum(len(c) for c in chunks)
    t0 = time.perf_counter()
    tier.put(keys, [(c, shape.chunk_size) for c in chunks])
    # the tier does not fsync each file (a torn file fails its checks); the device must have them
    os.sync()
    write = total / (time.perf_counter() - t0) / 1e9
    for path in tier_dir.glob("*.kvc"):
        drop_cache(path)
    outs = [memoryview(bytearray(len(chunks[0]))) for _ in range(READ_BATCH)]
    t0 = time.perf_counter()
    for i in range(0, len(keys), READ_BATCH):  # as a fetch reads: a pool's batch at a time
        batch = keys[i : i + READ_BATCH]
        if tier.get_into(batch, outs[: len(batch)]) != [shape.chunk_size] * len(batch):
            raise AssertionError("the disk tier lost a chunk")
    read = total / (time.perf_counter() - t0) / 1e9
    if bytes(outs[(len(keys) - 1) % READ_BATCH]) != bytes(chunks[-1]):
        raise AssertionError("the disk tier read back other bytes")
    tier.close()
    shutil.rmtree(tier_dir)
    return write, read


def _step_pass(
    root: Path,
    shape: OffloadShape,
    engine: CacheEngine,
    tokens: torch.Tensor,
    load_slots: torch.Tensor,
    loader: ThreadPoolExecutor,
) -> tuple[float, float, float]:
    """(sync step wait, async step wait, async request latency), ms, for a prompt whose chunks are
    on disk."""

    def cold() -> None:
        engine.tiers.cpu.clear()
        for path in (root / "engine").glob("*.kvc"):
            drop_cache(path)

    cold()
    t0 = time.perf_counter()
    loaded = int(engine.retrieve(tokens, load_slots).sum())
    sync = time.perf_counter() - t0
    if loaded != shape.tokens:
        raise AssertionError(f"sync load got {loaded} of {shape.tokens} tokens")
    cold()
    t0 = time.perf_counter()
    engine.find(tokens, hold_for="bench")  # the scheduler's lookup: lease, and prefetch starts
    engine.start_prefetch(tokens, "bench")
    t1 = time.perf_counter()
    # what start_load_kv does
    future = loader.submit(engine.retrieve, tokens, load_slots, request_id="bench")
    step = time.perf_counter() - t1
    loaded = int(future.result().sum())
    request = time.perf_counter() - t0
    if loaded != shape.tokens:
        raise AssertionError(f"async load got {loaded} of {shape.tokens} tokens")
    return sync * 1e3, step * 1e3, request * 1e3


def run_disk(
    shape: OffloadShape,
    directory: Path,
    repeats: int = 3,
    pool_chunks: int = 8,
    progress: bool = True,
) -> DiskResult:
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    n_blocks = -(-shape.tokens // shape.block_size)
    layers = [
        torch.randn(shape.layer_shape(2 * n_blocks), generator=gen).to(shape.torch_dtype)
        for _ in range(shape.layers)
    ]
    kv = PagedKV.wrap(layers, shape.layout)
    result = DiskResult(
        shape,
        str(directory),
        machine_name(torch.device("cpu")),
        dt.date.today().isoformat(),
        shape.tokens * kv.bytes_per_token(),
    )
    _bandwidths(result, directory, kv, repeats, progress)
    _step_waits(result, directory, kv, gen, repeats, pool_chunks, progress)
    return result


def _bandwidths(
    result: DiskResult, directory: Path, kv: PagedKV, repeats: int, progress: bool
) -> None:
    """The tier's write and read GB/s against plain sequential files, in alternating order."""
    shape = result.shape
    chunks = _chunks(shape, kv.bytes_per_token())
    # warm-up, no figures: the first pass of a
    _tier_pass(directory, shape, chunks, kv.dtype.itemsize)
    _file_pass(directory, chunks)  # process is the slowest (0.3 GB/s where later ones reach 1 GB/s)
    for i in range(repeats):
        passes = [
            ("tier", lambda: _tier_pass(directory, shape, chunks, kv.dtype.itemsize)),
            ("file", lambda: _file_pass(directory, chunks)),
        ]
        for name, run in passes if i % 2 == 0 else passes[::-1]:
            write, read = run()
            getattr(result, f"{name}_write_gbps").append(write)
            getattr(result, f"{name}_read_gbps").append(read)
            if progress:
                print(
                    f"repeat {i}: {name} write {write:.2f} GB/s, read {read:.2f} GB/s", flush=True
                )


def _step_waits(
    result: DiskResult,
    directory: Path,
    kv: PagedKV,
    gen: torch.Generator,
    repeats: int,
    pool_chunks: int,
    progress: bool,
) -> None:
    """What an engine step waits for a disk hit, loaded in the step or in the background;
    and that what was loaded is what was stored."""
    shape, bpt = result.shape, kv.bytes_per_token()
    n_blocks = -(-shape.tokens // shape.block_size)
    engine_dir = directory / "engine"
    shutil.rmtree(engine_dir, ignore_errors=True)
    config = KvtierConfig(
        chunk_size=shape.chunk_size,
        local_disk=str(engine_dir),
        max_local_cpu_size=pool_chunks * shape.chunk_size * bpt * 1.001 / 1024**3,
        max_local_disk_size=2 * result.kv_bytes / 1024**3,
    )
    engine = CacheEngine(config, kv, KVFormat("bench", shape.layout, shape.dtype))
    perm = torch.randperm(2 * n_blocks, generator=gen)
    slots = (perm[:, None] * shape.block_size + torch.arange(shape.block_size)).flatten()
    store_slots = slots[: shape.tokens]
    load_slots = slots[n_blocks * shape.block_size :][: shape.tokens]
    tokens = torch.randint(0, 32000, (shape.tokens,), generator=gen)
    if engine.store(tokens, store_slots) != shape.tokens or not engine.flush(timeout=600):
        raise AssertionError("the store did not reach the disk tier")
    with ThreadPoolExecutor(1) as loader:
        for i in range(repeats):
            sync, step, request = _step_pass(directory, shape, engine, tokens, load_slots, loader)
            result.step_wait_sync_ms.append(sync)
            result.step_wait_async_ms.append(step)
            result.request_load_async_ms.append(request)
            if progress:
                print(
                    f"repeat {i}: step waits {sync:.1f} ms (sync load) vs {step:.3f} ms (async); "
                    f"the request's async load took {request:.1f} ms",
                    flush=True,
                )
    for layer in kv.layers:  # what was loaded is what was stored
        if not torch.equal(
            layer[:, store_slots // shape.block_size, store_slots % shape.block_size],
            layer[:, load_slots // shape.block_size, load_slots % shape.block_size],
        ):
            raise AssertionError("KV loaded from disk differs from the KV stored")
    engine.close()
    shutil.rmtree(engine_dir)
