"""What `kvtier bench ttft` times a prefill against: a copy beside the forward, the
store server (a session whose only tier it is), the disk tier."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from kvtier.config import KvtierConfig
from kvtier.integrations.hf import HFSession
from kvtier_tools.bench.offload import timed

CUDA = torch.device("cuda")


class BesideACopy:
    """Times work while `nbytes` cross PCIe host→device on another stream (as a
    layerwise load's bytes do beside its forward); owns the two buffers."""

    def __init__(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty_like(self.host, device=CUDA)
        self.side = torch.cuda.Stream(CUDA)

    def timed(self, fn) -> float:
        """Seconds of `fn` and its device work on the current stream, the copy running beside."""
        torch.cuda.synchronize(CUDA)
        with torch.cuda.stream(self.side):
            self.dev.copy_(self.host, non_blocking=True)
        t = time.perf_counter()
        fn()
        torch.cuda.current_stream(CUDA).synchronize()
        seconds = time.perf_counter() - t
        torch.cuda.synchronize(CUDA)
        return seconds


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2  # bf16


def cuda_timed(fn) -> float:
    return timed(fn, CUDA)


def warm_from_disk(
    model, ids, chunk_size: int, directory: Path, repeats: int, transfer: str
) -> tuple[list[float], float]:
    """Warm TTFTs from the disk tier, and the file read GB/s of `directory` (its limit)."""
    from kvtier_tools.bench.disk import drop_cache, file_read_bandwidth

    shutil.rmtree(directory, ignore_errors=True)
    kv_bytes = ids.shape[1] * kv_bytes_per_token(model)
    cfg = KvtierConfig(
        chunk_size=chunk_size,
        local_disk=str(directory),
        max_local_disk_size=2 * kv_bytes / 1024**3,
        max_local_cpu_size=16 * chunk_size * kv_bytes_per_token(model) * 1.001 / 1024**3,
    )
    session = HFSession(model, cfg, max_len=ids.shape[1], transfer=transfer)
    session.prefill(ids)  # stores the prompt's chunks: through the pool, onto disk
    assert session.engine.flush(timeout=600)
    times, hits = [], []
    for _ in range(repeats):
        session.engine.tiers.cpu.clear()
        for path in directory.glob("*.kvc"):
            drop_cache(path)
        times.append(cuda_timed(lambda: hits.append(session.prefill(ids).hit_tokens)))
    assert hits[-1] > 0, "nothing loaded from the disk tier"
    session.engine.close()
    session = None  # release it (rebound, not `del`: the lambda above refers to the name)
    torch.cuda.empty_cache()
    read_gbps = file_read_bandwidth(directory, kv_bytes)
    shutil.rmtree(directory, ignore_errors=True)
    return times, read_gbps


class ServerSession:
    """A session whose only tier is the store server at `url` (CPU tier off),
    with the prompt stored there."""

    def __init__(
        self,
        model,
        ids,
        chunk_size: int,
        pool_gib: float,
        url: str,
        transfer: str,
        serde: str = "naive",
    ) -> None:
        cfg = KvtierConfig(
            chunk_size=chunk_size,
            max_local_cpu_size=pool_gib,
            local_cpu=False,
            remote_url=url,
            remote_serde=serde,
        )
        self.session = HFSession(model, cfg, max_len=ids.shape[1], transfer=transfer)
        self.ids = ids
        self.session.prefill(ids)  # stores the prompt's chunks in the server
        assert self.session.engine.flush(timeout=600)

    def timed(self, layerwise: bool) -> float:
        """Seconds of one warm prefill."""
        hits = []
        seconds = cuda_timed(
            lambda: hits.append(self.session.prefill(self.ids, layerwise=layerwise).hit_tokens)
        )
        assert hits[0] > 0, "nothing loaded from the store server"
        return seconds

    def close(self) -> None:
        self.session.engine.close()
        del self.session


def warm_from_server(
    model,
    ids,
    chunk_size: int,
    pool_gib: float,
    url: str,
    repeats: int,
    transfer: str,
    serde: str = "naive",
) -> list[float]:
    """Warm TTFTs from the store server at `url`."""
    remote = ServerSession(model, ids, chunk_size, pool_gib, url, transfer, serde)
    times = [remote.timed(layerwise=False) for _ in range(repeats)]
    remote.close()
    torch.cuda.empty_cache()
    return times
