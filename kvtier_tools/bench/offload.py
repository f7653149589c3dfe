"""`kvtier bench offload`: store/retrieve throughput against plain copy bandwidth.

For N tokens of a model's KV shape, in a paged cache with random block ids:
    store     CacheEngine.store: gather from pages into the CPU tier
    retrieve  CacheEngine.retrieve: scatter from the CPU tier into other pages
each as GB/s and as a ratio to a plain contiguous copy of the same bytes,
measured in the same run (device→pinned host for store, pinned host→device
for retrieve; on a CPU-only machine, memcpy both ways). Medians over repeats.
Retrieved KV is checked against what was stored before any figure counts.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import KvtierError
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV


@dataclass(frozen=True)
class OffloadShape:
    tokens: int = 16384
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    layout: str = "flash_attn"
    chunk_size: int = 256

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        nb, bs, h, d = num_blocks, self.block_size, self.kv_heads, self.head_dim
        return {
            "flash_attn": (2, nb, bs, h, d),
            "flashinfer": (nb, 2, bs, h, d),
            "mla": (nb, bs, d),
            "vllm": (nb, h, bs, 2 * d),
        }[self.layout]


@dataclass
class OffloadResult:
    shape: OffloadShape
    device: str
    transfer: str
    machine: str
    date: str
    kv_bytes: int
    store_gbps: list[float] = field(default_factory=list)
    retrieve_gbps: list[float] = field(default_factory=list)
    d2h_gbps: list[float] = field(default_factory=list)
    h2d_gbps: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        med = statistics.median
        store, ret = med(self.store_gbps), med(self.retrieve_gbps)
        d2h, h2d = med(self.d2h_gbps), med(self.h2d_gbps)
        return {
            "store_GBps": round(store, 2),
            "retrieve_GBps": round(ret, 2),
            "copy_d2h_GBps": round(d2h, 2),
            "copy_h2d_GBps": round(h2d, 2),
            "store_ratio": round(store / d2h, 3),
            "retrieve_ratio": round(ret / h2d, 3),
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn` takes, its device work included."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(nbytes: int, device: torch.device, tries: int = 3) -> tuple[float, float]:
    """GB/s of a contiguous device→host and host→device copy of `nbytes`: the fastest
    of `tries` each way (a limit; one copy alone was once a third slow on a busy host)."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)
    d2h = min(timed(lambda: host.copy_(dev, non_blocking=True), device) for _ in range(tries))
    h2d = min(timed(lambda: dev.copy_(host, non_blocking=True), device) for _ in range(tries))
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {platform.node()}"
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{platform.node()}"
    )


def bench_device(name: str, flag: str = "--device") -> torch.device:
    """A benchmark's device: "auto" is the GPU where there is one, else the CPU; a CUDA
    device on a machine without one is a named error, not torch's traceback."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        need_gpu(f"{flag} {name}", " (use cpu, or auto)")
    return dev


def need_gpu(what: str, hint: str = "") -> None:
    """A benchmark that runs on a GPU only: a named error on a machine without one."""
    if not torch.cuda.is_available():
        raise KvtierError(f"{what}: this machine has no CUDA GPU{hint}")


def run_offload(
    shape: OffloadShape,
    device: str = "auto",
    transfer: str = "auto",
    repeats: int = 5,
    progress: bool = True,
) -> OffloadResult:
    dev = bench_device(device)
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    n_blocks = 2 * -(-shape.tokens // shape.block_size)  # half for store, half for retrieve
    gen = torch.Generator().manual_seed(0)
    layers = [
        torch.randn(shape.layer_shape(n_blocks), generator=gen, dtype=torch.float32)
        .to(shape.torch_dtype)
        .to(dev)
        for _ in range(shape.layers)
    ]
    kv = PagedKV.wrap(layers, shape.layout)
    perm = torch.randperm(n_blocks, generator=gen)
    offsets = torch.arange(shape.block_size)
    slots = (perm[:, None] * shape.block_size + offsets).flatten()
    half = n_blocks // 2 * shape.block_size
    store_slots, load_slots = slots[: shape.tokens], slots[half : half + shape.tokens]
    kv_bytes = shape.tokens * kv.bytes_per_token()
    pool_gb = kv_bytes * 1.05 / 1024**3 + shape.chunk_size * kv.bytes_per_token() / 1024**3
    config = KvtierConfig(chunk_size=shape.chunk_size, max_local_cpu_size=pool_gb)
    engine = CacheEngine(
        config, kv, KVFormat("bench", shape.layout, shape.dtype), transfer=transfer
    )
    tokens = torch.randint(0, 32000, (shape.tokens,), generator=gen)
    result = OffloadResult(
        shape,
        str(dev),
        engine.transfer.name + ("-direct" if getattr(engine.transfer, "direct", False) else ""),
        machine_name(dev),
        dt.date.today().isoformat(),
        kv_bytes,
    )
    for i in tqdm(range(repeats + 1), desc=f"offload {shape.tokens} tok", disable=not progress):
        engine.clear()
        t_store = timed(lambda: engine.store(tokens, store_slots), dev)
        t_load = timed(lambda: engine.retrieve(tokens, load_slots), dev)
        d2h, h2d = copy_bandwidth(kv_bytes, dev)
        if i == 0:  # warm-up run: check correctness, keep no figures
            _check_roundtrip(kv, store_slots, load_slots, shape.block_size)
            continue
        result.store_gbps.append(kv_bytes / t_store / 1e9)
        result.retrieve_gbps.append(kv_bytes / t_load / 1e9)
        result.d2h_gbps.append(d2h)
        result.h2d_gbps.append(h2d)
    engine.clear()
    return result


def _check_roundtrip(kv: PagedKV, a: torch.Tensor, b: torch.Tensor, block_size: int) -> None:
    a, b = a.to(kv.device), b.to(kv.device)
    for layer in kv.layers:
        if not torch.equal(
            layer[:, a // block_size, a % block_size], layer[:, b // block_size, b % block_size]
        ):
            raise AssertionError("retrieved KV differs from stored KV")


def write_result(result: OffloadResult, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": command, **asdict(result), "summary": result.summary()}
    existing = json.loads(out.read_text()) if out.exists() else []
    existing.append(record)
    out.write_text(json.dumps(existing, indent=1) + "\n")
