"""`kvtier bench ttft`: time to first token, cold vs warm from the CPU tier.

A Llama-3.1-8B-shaped model (random weights, bf16, transformers SDPA) on a
GPU; for each prompt length:
    cold   prefill of the whole prompt, nothing cached, kvtier off
    cold + store  the same miss with kvtier on: the prompt's chunks are
           stored after the forward (whole), or layer by layer during it
           (layerwise); reported as a ratio to cold (the cost of storing)
    warm   kvtier loads all but the last token from CPU RAM, the model runs one
    warm layerwise  the same, layer i+1 loading while layer i computes
    warm server  the same prefix from `kvtier server` on this host (local_cpu
           off: the chunks are lent in place from the server's pool, which the
           client registered with CUDA, and DMA'd to the GPU), when a server
           URL is given; also as a ratio to warm (from local CPU RAM)
    warm server layerwise  the same, layer by layer (all chunks lent in one
           lease, checked while they move): compared with max(load floor, forward)
    warm server tcp  the same over TCP (`?shm=0`: as from another host): its
           floor is KV bytes / raw loopback TCP (one connection, measured right
           after those runs, from a 256 MiB ring into a 256 MiB ring as from a
           store's pool into a cache's pool) + the forward; also given against
           the faster cache-resident figure (one 16 MiB buffer at each end), and
           against raw TCP over as many connections as a large get uses
           (KVClient spreads it over READERS connections)
    warm server tcp int8 / fp8  the same with the lossy KV codec (`--codecs`):
           against the lossless TCP run, and as an effective bandwidth (bytes
           of bf16 KV delivered per second of load, i.e. TTFT less the
           forward), which can exceed raw TCP
    warm disk  the same prefix from the disk tier (`--disk DIR`): the CPU tier
           emptied and the files' pages dropped before each run, a CPU pool of
           16 chunks as staging; its floor is KV bytes / the sequential read
           bandwidth of a file in DIR (measured in the same run) + the forward
    floor  KV bytes / pinned H2D copy bandwidth + a one-token forward over the
           same context, both measured in the same run (layerwise: compared
           with max of the two instead of their sum)
    forward beside a copy  the one-token forward while the same bytes cross
           PCIe on another stream, as they do beside a layerwise load's
           forward: on some hosts the DMA slows the host-bound forward (not
           part of any floor; it says how much of a layerwise ratio is that)
Medians over repeats; warm is also given as a ratio to its floor, both as
medians of each and paired (the median of per-repeat ratios, each warm run
against the forward timed right after it). Writes a JSON record and a PNG
plot of TTFT against prompt length.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.config import KvtierConfig
from kvtier.integrations.hf import HFSession, KvtierCache
from kvtier.server.client import READERS
from kvtier_tools.bench.offload import copy_bandwidth, machine_name
from kvtier_tools.bench.ttft_sources import (
    BesideACopy,
    ServerSession,
    cuda_timed,
    kv_bytes_per_token,
    warm_from_disk,
    warm_from_server,
)

CUDA = torch.device("cuda")
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)


@dataclass
class TTFTPoint:
    tokens: int
    hit_tokens: int
    cold_s: float
    warm_s: float
    warm_layerwise_s: float
    load_floor_s: float
    forward_1_s: float
    cold_store_s: float
    cold_store_layerwise_s: float
    samples: dict[str, list[float]]  # every repeat, seconds
    warm_server_s: float | None = None
    warm_server_tcp_s: float | None = None
    warm_server_layerwise_s: float | None = None
    tcp_floor_s: float | None = None  # KV bytes / raw loopback TCP (pool to pool) + forward
    tcp_cached_floor_s: float | None = None  # the same with the cache-resident TCP figure
    # raw loopback TCP: pool to pool, and cache-resident
    tcp_gbps: tuple[float, float] | None = None
    # raw loopback TCP pool to pool over as many connections as KVClient uses
    tcp_multi_gbps: float | None = None
    warm_disk_s: float | None = None
    disk_floor_s: float | None = None  # KV bytes / file read bandwidth + forward
    kv_bytes: int = 0  # bf16 KV of the hit tokens

    @property
    def floor_s(self) -> float:
        return self.load_floor_s + self.forward_1_s

    def paired(self, ratio, warm: str) -> float:
        """Median over repeats of ratio(warm_i, forward_i): each warm run against the
        one-token forward timed right after it, so that slow drifts cancel."""
        return statistics.median(
            ratio(w, f) for w, f in zip(self.samples[warm], self.samples["forward_1"])
        )

    def tcp_codecs(self) -> list[str]:
        return [
            k.removeprefix("warm_server_tcp_")
            for k in self.samples
            if k.startswith("warm_server_tcp_")
        ]

    def _codec_row(self, name: str) -> dict:
        times = self.samples[f"warm_server_tcp_{name}"]
        t = statistics.median(times)
        load = t - self.forward_1_s
        return {
            f"warm_server_tcp_{name}_s": round(t, 4),
            f"tcp_{name}_over_lossless": round(t / self.warm_server_tcp_s, 3),
            f"tcp_{name}_effective_GBps": round(self.kv_bytes / load / 1e9, 3),
            f"tcp_{name}_effective_over_raw_tcp": round(
                self.kv_bytes / load / 1e9 / self.tcp_gbps[0], 3
            ),
        }

    def row(self) -> dict:
        return {
            "tokens": self.tokens,
            "hit_tokens": self.hit_tokens,
            "cold_s": round(self.cold_s, 4),
            "warm_s": round(self.warm_s, 4),
            "floor_s": round(self.floor_s, 4),
            "warm_over_floor": round(self.warm_s / self.floor_s, 3),
            "speedup": round(self.cold_s / self.warm_s, 1),
            "warm_over_floor_paired": round(
                self.paired(lambda w, f: w / (self.load_floor_s + f), "warm"), 3
            ),
            "warm_layerwise_s": round(self.warm_layerwise_s, 4),
            "layerwise_over_max_load_forward": round(
                self.warm_layerwise_s / max(self.load_floor_s, self.forward_1_s), 3
            ),
            "layerwise_over_max_paired": round(
                self.paired(lambda w, f: w / max(self.load_floor_s, f), "warm_layerwise"), 3
            ),
            "load_floor_s": round(self.load_floor_s, 4),
            "forward_1_s": round(self.forward_1_s, 4),
            "forward_1_beside_a_copy_over_forward_1": round(
                statistics.median(
                    c / f
                    for c, f in zip(
                        self.samples["forward_1_beside_a_copy"], self.samples["forward_1"]
                    )
                ),
                3,
            ),
            "cold_store_s": round(self.cold_store_s, 4),
            "cold_store_over_cold": round(self.cold_store_s / self.cold_s, 3),
            "cold_store_layerwise_s": round(self.cold_store_layerwise_s, 4),
            "cold_store_layerwise_over_cold": round(self.cold_store_layerwise_s / self.cold_s, 3),
            **(
                {}
                if self.warm_server_s is None
                else {
                    "warm_server_s": round(self.warm_server_s, 4),
                    "warm_server_over_floor": round(self.warm_server_s / self.floor_s, 3),
                    "warm_server_over_warm": round(self.warm_server_s / self.warm_s, 3),
                    "warm_server_over_warm_paired": round(
                        statistics.median(
                            s / w for s, w in zip(self.samples["warm_server"], self.samples["warm"])
                        ),
                        3,
                    ),
                    "speedup_server": round(self.cold_s / self.warm_server_s, 1),
                }
            ),
            **(
                {}
                if self.warm_server_layerwise_s is None
                else {
                    "warm_server_layerwise_s": round(self.warm_server_layerwise_s, 4),
                    "server_layerwise_over_max_load_forward": round(
                        self.warm_server_layerwise_s / max(self.load_floor_s, self.forward_1_s), 3
                    ),
                    "server_layerwise_over_max_paired": round(
                        self.paired(
                            lambda w, f: w / max(self.load_floor_s, f), "warm_server_layerwise"
                        ),
                        3,
                    ),
                }
            ),
            **(
                {}
                if self.warm_server_tcp_s is None
                else {
                    "warm_server_tcp_s": round(self.warm_server_tcp_s, 4),
                    "tcp_floor_s": round(self.tcp_floor_s, 4),
                    "warm_server_tcp_over_tcp_floor": round(
                        self.warm_server_tcp_s / self.tcp_floor_s, 3
                    ),
                    "raw_tcp_pool_to_pool_GBps": round(self.tcp_gbps[0], 3),
                    "raw_tcp_cache_resident_GBps": round(self.tcp_gbps[1], 3),
                    "raw_tcp_pool_to_pool_multi_GBps": round(self.tcp_multi_gbps, 3),
                    "warm_server_tcp_over_multi_floor": round(
                        self.warm_server_tcp_s
                        / (self.kv_bytes / (self.tcp_multi_gbps * 1e9) + self.forward_1_s),
                        3,
                    ),
                    "warm_server_tcp_over_cache_resident_floor": round(
                        self.warm_server_tcp_s / self.tcp_cached_floor_s, 3
                    ),
                }
            ),
            **{k: v for name in self.tcp_codecs() for k, v in self._codec_row(name).items()},
            **(
                {}
                if self.warm_disk_s is None
                else {
                    "warm_disk_s": round(self.warm_disk_s, 4),
                    "disk_floor_s": round(self.disk_floor_s, 4),
                    "warm_disk_over_disk_floor": round(self.warm_disk_s / self.disk_floor_s, 3),
                    "speedup_disk": round(self.cold_s / self.warm_disk_s, 1),
                }
            ),
            "samples_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in self.samples.items()},
        }


def build_model(layers: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA_8B, **({"num_hidden_layers": layers} if layers else {})})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def measure(
    model,
    tokens: int,
    repeats: int,
    chunk_size: int = 256,
    transfer: str = "auto",
    server_url: str | None = None,
    disk_dir: Path | None = None,
    server_tcp: bool = False,
    codecs: tuple[str, ...] = (),
) -> TTFTPoint:
    ids = torch.randint(
        0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens)
    )
    kv_per_token = kv_bytes_per_token(model)
    pool_gib = (tokens + chunk_size) * kv_per_token * 1.05 / 1024**3
    session = HFSession(
        model,
        KvtierConfig(chunk_size=chunk_size, max_local_cpu_size=pool_gib),
        max_len=tokens,
        transfer=transfer,
    )
    samples = _cold(session, ids, repeats)
    # stored, for the warm runs
    assert session.engine.lookup(ids[0]) == tokens - tokens % chunk_size
    hit = session.prefill(ids).hit_tokens
    remote = (
        ServerSession(model, ids, chunk_size, pool_gib, server_url, transfer)
        if server_url
        else None
    )
    setup = _Setup(model, ids, chunk_size, pool_gib, repeats, transfer)
    samples.update(_warm(setup, session, hit, kv_per_token, remote))
    _, h2d = copy_bandwidth(hit * kv_per_token, torch.device("cuda"))
    med = statistics.median
    point = TTFTPoint(
        tokens,
        hit,
        med(samples["cold"]),
        med(samples["warm"]),
        med(samples["warm_layerwise"]),
        hit * kv_per_token / (h2d * 1e9),
        med(samples["forward_1"]),
        med(samples["cold_store"]),
        med(samples["cold_store_layerwise"]),
        samples,
        kv_bytes=hit * kv_per_token,
    )
    del session
    if remote is not None:
        remote.close()
        point.warm_server_s = med(samples["warm_server"])
        point.warm_server_layerwise_s = med(samples["warm_server_layerwise"])
    torch.cuda.empty_cache()
    if server_url and server_tcp:
        _over_tcp(point, setup, server_url, codecs)
    if disk_dir is not None:
        point.samples["warm_disk"], read_gbps = warm_from_disk(
            model, ids, chunk_size, disk_dir, repeats, transfer
        )
        point.warm_disk_s = med(point.samples["warm_disk"])
        point.disk_floor_s = point.kv_bytes / (read_gbps * 1e9) + point.forward_1_s
    return point


@dataclass(frozen=True)
class _Setup:
    """One prompt length's measurement: the model, its prompt, and how to run it."""

    model: Any
    ids: torch.Tensor
    chunk_size: int
    pool_gib: float
    repeats: int
    transfer: str


def _cold(session: HFSession, ids: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Prefills with nothing stored: without kvtier, and a miss with kvtier on (the
    forward, and every chunk stored), whole and layer by layer."""
    out: dict[str, list[float]] = {
        "cold": [cuda_timed(lambda: session.prefill(ids, use_cache=False)) for _ in range(repeats)],
        "cold_store": [],
        "cold_store_layerwise": [],
    }
    for _ in range(repeats):
        for name, layerwise in (("cold_store", False), ("cold_store_layerwise", True)):
            session.engine.clear()
            out[name].append(cuda_timed(lambda: session.prefill(ids, layerwise=layerwise)))
    return out


def _warm(
    setup: _Setup, session: HFSession, hit: int, kv_per_token: int, remote: ServerSession | None
) -> dict[str, list[float]]:
    """Warm prefills, interleaved with the one-token forward alone and beside a copy, so that
    the host-bound forward (it varies by several ms from one minute to the next) is timed in
    the same conditions; so are the loads from the store server of this host (a second session)."""
    model, ids, repeats = setup.model, setup.ids, setup.repeats
    last = ids[:, -1:].cuda()

    def forward_one() -> None:
        with torch.inference_mode():
            model(
                input_ids=last,
                past_key_values=KvtierCache(session.buffers, hit),
                use_cache=True,
                logits_to_keep=1,
            )

    beside_a_copy = BesideACopy(hit * kv_per_token)
    names = ["warm", "warm_layerwise", "forward_1", "forward_1_beside_a_copy"]
    out: dict[str, list[float]] = {
        n: [] for n in names + (["warm_server", "warm_server_layerwise"] if remote else [])
    }
    for _ in range(repeats):
        out["warm"].append(cuda_timed(lambda: session.prefill(ids, layerwise=False)))
        out["warm_layerwise"].append(cuda_timed(lambda: session.prefill(ids, layerwise=True)))
        out["forward_1"].append(cuda_timed(forward_one))
        out["forward_1_beside_a_copy"].append(beside_a_copy.timed(forward_one))
        if remote is not None:
            out["warm_server"].append(remote.timed(layerwise=False))
            out["warm_server_layerwise"].append(remote.timed(layerwise=True))
    return out


def _over_tcp(point: TTFTPoint, setup: _Setup, server_url: str, codecs: tuple[str, ...]) -> None:
    """Warm from the store server over TCP (and with lossy codecs), against loopback TCP measured
    now."""
    from kvtier_tools.bench.server_clients import tcp_bandwidth

    url = server_url + "/?shm=0"
    s = setup
    point.samples["warm_server_tcp"] = warm_from_server(
        s.model, s.ids, s.chunk_size, s.pool_gib, url, s.repeats, s.transfer
    )
    point.warm_server_tcp_s = statistics.median(point.samples["warm_server_tcp"])
    for name in codecs:  # the lossy KV codecs: about half the bytes on the wire
        point.samples[f"warm_server_tcp_{name}"] = warm_from_server(
            s.model, s.ids, s.chunk_size, s.pool_gib, url, s.repeats, s.transfer, serde=name
        )
    # Measured now, beside the runs it bounds: values out of and into 256 MiB rings (a store's
    # pool, a cache's pool), and the cache-resident figure of one 16 MiB buffer at each end.
    point.tcp_gbps = (tcp_bandwidth(ring=256 << 20), tcp_bandwidth())
    point.tcp_multi_gbps = tcp_bandwidth(ring=256 << 20, connections=READERS)
    point.tcp_floor_s, point.tcp_cached_floor_s = (
        point.kv_bytes / (gbps * 1e9) + point.forward_1_s for gbps in point.tcp_gbps
    )


def run_ttft(
    lengths: list[int],
    repeats: int,
    out_dir: Path,
    layers: int | None = None,
    transfer: str = "auto",
    server: bool = False,
    disk_dir: Path | None = None,
    server_tcp: bool = False,
    codecs: tuple[str, ...] = (),
) -> list[TTFTPoint]:
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(layers)
    measure(model, 512, 1)  # warm-up: kernels, allocator
    points = []
    with contextlib.ExitStack() as stack:
        url = None
        if server:
            from kvtier_tools.dev.localservers import kvtier_server

            kv_bytes = max(lengths) * kv_bytes_per_token(model)
            url = stack.enter_context(kvtier_server(2.5 * kv_bytes / 1024**3)).url
        for n in lengths:
            p = measure(
                model,
                n,
                repeats,
                transfer=transfer,
                server_url=url,
                disk_dir=disk_dir,
                server_tcp=server and server_tcp,
                codecs=codecs,
            )
            print(json.dumps({k: v for k, v in p.row().items() if k != "samples_ms"}), flush=True)
            points.append(p)
    record = {
        "machine": machine_name(torch.device("cuda")),
        "date": dt.date.today().isoformat(),
        "model": {**LLAMA_8B, **({"num_hidden_layers": layers} if layers else {})},
        "dtype": "bfloat16",
        "attention": "sdpa",
        "repeats": repeats,
        "transfer": transfer,
        "points": [p.row() for p in points],
    }
    suffix = "" if transfer == "auto" else f"-{transfer}"
    (out_dir / f"ttft{suffix}.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(points, out_dir / f"ttft{suffix}.png", record["machine"])
    return points


def _plot(points: list[TTFTPoint], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p.tokens for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [p.cold_s for p in points], "o-", label="cold (full prefill)")
    ax.plot(
        x,
        [p.cold_store_layerwise_s for p in points],
        "x:",
        label="cold, kvtier storing layer by layer",
    )
    ax.plot(x, [p.warm_s for p in points], "o-", label="warm (kvtier, CPU RAM)")
    ax.plot(x, [p.warm_layerwise_s for p in points], "o-", label="warm, layerwise")
    if points and points[0].warm_server_s is not None:
        ax.plot(x, [p.warm_server_s for p in points], "o-", label="warm (kvtier server, same host)")
    if points and points[0].warm_server_layerwise_s is not None:
        ax.plot(
            x,
            [p.warm_server_layerwise_s for p in points],
            "o-",
            label="warm (kvtier server, layerwise)",
        )
    if points and points[0].warm_server_tcp_s is not None:
        ax.plot(
            x, [p.warm_server_tcp_s for p in points], "o-", label="warm (kvtier server over TCP)"
        )
    for name in points[0].tcp_codecs() if points else ():
        ax.plot(
            x,
            [statistics.median(p.samples[f"warm_server_tcp_{name}"]) for p in points],
            "o:",
            label=f"warm (kvtier server over TCP, {name} codec)",
        )
    if points and points[0].warm_disk_s is not None:
        ax.plot(x, [p.warm_disk_s for p in points], "o-", label="warm (disk tier)")
    ax.plot(x, [p.floor_s for p in points], "--", label="floor (KV bytes / H2D + 1-token forward)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(f"Llama-3.1-8B-shaped, bf16 — {machine.split(',')[0]}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
