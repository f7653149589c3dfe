"""`kvtier bench server`: the store server against raw loopback TCP and redis-server.

One run measures, on this machine:

- put and get throughput of 2, 4 and 8 MiB values with 1, 2 and 8
  connections (one client process per connection), for
    raw         a plain request/ack TCP server (thread per connection,
                recv_into one buffer that stays in cache): the limit of
                loopback TCP with that many streams;
    raw-ring    the same, each value into the next slot of a 256 MiB ring,
                as a store's values land in memory not just touched;
    kvtier      `kvtier server` through KVClient over TCP;
    kvtier-shm  the same server and client on the same host, as they run by
                default there: values through the shared pool, keys over TCP;
    kvtier-auth `kvtier server --auth-token` over TCP: the handshake is per
                connection, so this should equal kvtier (auth_vs_plain);
    kvtier-tls  `kvtier server --tls-cert/--tls-key` over TLS (tls_vs_plain);
    redis       redis-server over TCP through kvtier's Redis store
                (redis-py + hiredis);
    redis-unix  the same redis-server over its unix socket (its own
                same-host fast path);
    mooncake    Mooncake Store (mooncake_master and two mooncake_client
                processes holding the segments, TCP transport) through
                kvtier's store (remote/mooncake.py);
    mooncake-py the same pool through Mooncake's own Python API
                (batch_put_from / batch_get_into, buffers registered): what
                kvtier's store must not fall short of (mooncake_vs_own);
  every get lands in the caller's buffer (as a pool block in the engine);
  reported as tcp_vs_raw (kvtier/raw), tcp_vs_raw_ring, tcp_vs_redis (kvtier/redis) and
  same_host_vs_redis (kvtier-shm / the faster of the two redis paths),
  mooncake_vs_own, and every store against raw TCP (<target>_vs_raw), each
  as a ratio of medians and as the median of per-repeat ratios (`_paired`);
- p50/p99 latency of exists and match-prefix over 64 keys;
- the same-host shared-memory path (put and get of 4 MiB values, one and
  eight per call as the engine's writer batches them) against memcpy;
- the remote serdes (naive, lz4): ratio and encode/decode GB/s.

Throughput cells are medians over `repeats` runs of `duration` seconds.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier_tools.bench.server_clients import TOKEN_ENV, Clients, MiB, raw_server

TARGETS = (
    "raw",
    "raw-ring",
    "kvtier",
    "kvtier-shm",
    "kvtier-auth",
    "kvtier-tls",
    "redis",
    "redis-unix",
    "mooncake",
    "mooncake-py",
)


# each of the pool's two segments: small enough to touch all of it before measuring
MOONCAKE_SEGMENT_MB = 384


@dataclass
class ServerBenchConfig:
    sizes_mib: tuple[int, ...] = (2, 4, 8)
    conns: tuple[int, ...] = (1, 2, 8)
    duration: float = 1.0
    repeats: int = 3
    latency_iters: int = 2000
    targets: tuple[str, ...] = TARGETS
    extras: bool = True  # latency, shared memory vs memcpy, serdes

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(TARGETS)
        if unknown:
            raise ValueError(
                f"unknown targets {sorted(unknown)}: expected some of {', '.join(TARGETS)}"
            )
        if self.extras and not {"kvtier", "redis"} <= set(self.targets):
            raise ValueError("latency and shared-memory figures need the kvtier and redis targets")


def run_server_bench(cfg: ServerBenchConfig, progress=print) -> dict:
    from kvtier_tools.dev.localservers import free_ports, wait_for_port

    raw_port, ring_port = free_ports(2)
    raws = [
        mp.get_context("spawn").Process(target=raw_server, args=(port, ring), daemon=True)
        for port, ring in ((raw_port, 0), (ring_port, 256 * MiB))
    ]
    for proc, port in zip(raws, (raw_port, ring_port)):
        proc.start()
        wait_for_port(port)
    os.environ.setdefault(TOKEN_ENV, secrets.token_hex(32))  # before the client processes start
    clients = Clients(max(cfg.conns))
    result: dict = {
        "machine": host(),
        "date": time.strftime("%Y-%m-%d"),
        "config": cfg.__dict__,
        "throughput": [],
        "latency": {},
        "shm": {},
        "serde": {},
    }
    try:
        # One kvtier server per kvtier target, as a node reaches its server by one
        # path: the client processes keep a connection to every target, and a
        # server balances connections, not the bytes each will move.
        with _servers(cfg.targets) as addresses:
            targets = {"raw": str(raw_port), "raw-ring": str(ring_port), **addresses}
            targets = {t: a for t, a in targets.items() if t in cfg.targets}
            kv_addr = targets.get("kvtier")
            # the segments' first touch, so that no target's puts pay it
            if "mooncake-py" in addresses:
                filled = clients.run(
                    1,
                    target="mooncake-py",
                    address=addresses["mooncake-py"],
                    op="put",
                    size=8 * MiB,
                    duration=2 * 2 * MOONCAKE_SEGMENT_MB * MiB / 1e9 / 0.3,
                )
                progress(f"Mooncake pool touched: {filled:.2f} GB/s of puts")
            for size in cfg.sizes_mib:
                for conns in cfg.conns:
                    for op in ("put", "get"):
                        cell = _cell(clients, targets, cfg, size, conns, op)
                        result["throughput"].append(cell)
                        progress(
                            f"{op} {size} MiB x{conns}: "
                            + " ".join(f"{t} {cell[t + '_GBps']:.2f}" for t in targets)
                            + " GB/s | "
                            + " ".join(f"{k} {v:.2f}" for k, v in cell.items() if "_vs_" in k)
                        )
            if cfg.extras:
                result["latency"] = _latency(kv_addr, targets["redis"], cfg.latency_iters)
                progress(f"latency over 64 keys: {result['latency']}")
                result["shm"] = _shm(
                    clients, targets.get("kvtier-shm", kv_addr.split("/?")[0]), cfg
                )
                progress(f"shared memory: {result['shm']}")
    finally:
        clients.close()
        for proc in raws:
            proc.terminate()
    if cfg.extras:
        result["serde"] = _serde()
        progress(f"serde: {result['serde']}")
    return result


@contextlib.contextmanager
def _servers(targets: tuple[str, ...]):
    """The servers `targets` need, each on its own ports: target -> address for the clients."""
    from kvtier_tools.dev.localservers import (
        kvtier_server,
        mooncake_store,
        redis_server,
        self_signed_cert,
    )

    with contextlib.ExitStack() as stack:
        out = {}
        if "kvtier" in targets:  # shm=0: the same server could give this client the same-host path
            out["kvtier"] = stack.enter_context(kvtier_server(1.0)).url + "/?shm=0"
        if "kvtier-shm" in targets:
            out["kvtier-shm"] = stack.enter_context(kvtier_server(1.0)).url
        if "kvtier-auth" in targets:
            srv = stack.enter_context(kvtier_server(1.0, "--auth-token", os.environ[TOKEN_ENV]))
            out["kvtier-auth"] = f"{srv.url}/?shm=0&token_env={TOKEN_ENV}"
        if "kvtier-tls" in targets:
            cert, key = self_signed_cert(Path(stack.enter_context(tempfile.TemporaryDirectory())))
            srv = stack.enter_context(
                kvtier_server(1.0, "--tls-cert", str(cert), "--tls-key", str(key))
            )
            out["kvtier-tls"] = f"kvtiers://127.0.0.1:{srv.ports[0]}/?shm=0&tls_ca={cert}"
        if {"redis", "redis-unix"} & set(targets):
            rd = stack.enter_context(redis_server())
            out.update({"redis": rd.url, "redis-unix": rd.unix_socket})
        if {"mooncake", "mooncake-py"} & set(targets):  # one pool for both: the same segments
            # evicts at 90 %
            url = stack.enter_context(
                mooncake_store(segments=2, segment_mb=MOONCAKE_SEGMENT_MB)
            ).url
            out.update({"mooncake": url, "mooncake-py": url})
        yield out


def _cell(
    clients: Clients,
    targets: dict[str, str],
    cfg: ServerBenchConfig,
    size: int,
    conns: int,
    op: str,
) -> dict:
    """One (size, connections, op) cell: every target, repeats interleaved so
    that a noisy second hits all of them alike, the order rotated each repeat
    so that no target always runs first (or right after another); medians."""
    cell: dict = {"size_mib": size, "conns": conns, "op": op}
    runs: dict[str, list[float]] = {t: [] for t in targets}
    order = list(targets.items())
    for r in range(cfg.repeats):
        for target, address in order[r % len(order) :] + order[: r % len(order)]:
            runs[target].append(
                clients.run(
                    conns,
                    target=target,
                    address=address,
                    op=op,
                    size=size * MiB,
                    duration=cfg.duration,
                )
            )
    for target, gbps in runs.items():
        cell[f"{target}_GBps"] = round(statistics.median(gbps), 3)
        cell[f"{target}_runs"] = [round(x, 3) for x in gbps]
    ratios = {
        "tcp_vs_raw": ("kvtier", "raw"),
        "tcp_vs_raw_ring": ("kvtier", "raw-ring"),
        "tcp_vs_redis": ("kvtier", "redis"),
        "same_host_vs_redis": ("kvtier-shm", "redis*"),
        "auth_vs_plain": ("kvtier-auth", "kvtier"),
        "tls_vs_plain": ("kvtier-tls", "kvtier"),
        "mooncake_vs_own": ("mooncake", "mooncake-py"),
        "kvtier_vs_mooncake": ("kvtier", "mooncake"),
        **{f"{t}_vs_raw": (t, "raw") for t in ("kvtier-shm", "redis", "mooncake", "mooncake-py")},
    }
    for name, (a, b) in ratios.items():
        if b == "redis*":  # the faster of redis-server's two paths
            b_runs = [
                max(pair)
                for pair in zip(*(runs[t] for t in ("redis", "redis-unix") if t in targets))
            ]
        else:
            b_runs = runs.get(b, [])
        if a in targets and b_runs:
            cell[name] = round(cell[f"{a}_GBps"] / statistics.median(b_runs), 3)
            # the same ratio within each repeat (targets ran back to back), then the median:
            # a slow second on a shared machine then hits both sides of the ratio
            cell[name + "_paired"] = round(
                statistics.median(x / y for x, y in zip(runs[a], b_runs)), 3
            )
    return cell


def _latency(kv_url: str, redis_url: str, iters: int) -> dict:
    from kvtier.remote import open_store

    out = {}
    for name, store in [("kvtier", open_store(kv_url, 30)), ("redis", open_store(redis_url, 30))]:
        keys = [b"lat-%d" % i for i in range(64)]
        store.put(keys, [b"v"] * 64)
        for op in ("exists", "match_prefix"):
            call = getattr(store, op)
            for _ in range(50):
                call(keys)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                call(keys)
                times.append(time.perf_counter() - t0)
            q = np.percentile(np.array(times) * 1e3, [50, 99])
            out[f"{name}_{op}_ms"] = {"p50": round(float(q[0]), 4), "p99": round(float(q[1]), 4)}
        store.close()
    return out


def _memcpy(size: int, ring: int, cfg: ServerBenchConfig) -> float:
    """GB/s of copying `size` bytes into successive slots of a `ring`-byte buffer."""
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.ones(max(ring, size), np.uint8)
    slots = len(dst) // size
    runs = []
    for _ in range(cfg.repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < cfg.duration:
            off = (n % slots) * size
            dst[off : off + size] = src
            n += 1
        runs.append(n * size / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs)


def _shm(clients: Clients, kv_addr: str, cfg: ServerBenchConfig) -> dict:
    """The same-host path against memcpy of the same values: into one buffer
    that stays in cache (hot), and into a 256 MiB ring, as values land in a
    pool far larger than the cache (cold)."""
    size = 4 * MiB
    out: dict = {
        "value_MiB": 4,
        "memcpy_hot_GBps": round(_memcpy(size, size, cfg), 3),
        "memcpy_cold_GBps": round(_memcpy(size, 256 * MiB, cfg), 3),
    }
    for batch in (1, 8):
        for op in ("put", "get"):
            cmd = dict(target="kvtier-shm", address=kv_addr, op=op, size=size, batch=batch)
            clients.run(1, **cmd, duration=0.2)  # maps the pool
            runs = [clients.run(1, **cmd, duration=cfg.duration) for _ in range(cfg.repeats)]
            name = f"{op}_batch{batch}"
            out[f"{name}_GBps"] = round(statistics.median(runs), 3)
            out[f"{name}_vs_memcpy_hot"] = round(out[f"{name}_GBps"] / out["memcpy_hot_GBps"], 3)
            out[f"{name}_vs_memcpy_cold"] = round(out[f"{name}_GBps"] / out["memcpy_cold_GBps"], 3)
    return out


def _serde() -> dict:
    """Encode a chunk, then decode it into a block, as the remote tier does."""
    import torch

    from kvtier.codec import Codec

    raw = torch.randn(8 * MiB).to(torch.bfloat16).view(torch.uint8).numpy()  # 16 MiB of bf16 N(0,1)
    out = {"data": "16 MiB of bf16 N(0,1)"}
    block = memoryview(bytearray(len(raw)))
    for serde in ("naive", "lz4"):
        codec = Codec(serde, itemsize=2)
        t_enc, t_dec = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            parts = codec.encode(memoryview(raw), 256)
            t_enc.append(time.perf_counter() - t0)
            value = b"".join(bytes(p) for p in parts)
            t0 = time.perf_counter()
            codec.decode_into(value, block)
            t_dec.append(time.perf_counter() - t0)
        assert bytes(block) == raw.tobytes()
        out[serde] = {
            "ratio": round(len(value) / len(raw), 3),
            "encode_GBps": round(len(raw) / statistics.median(t_enc) / 1e9, 2),
            "decode_GBps": round(len(raw) / statistics.median(t_dec) / 1e9, 2),
        }
    return out


def host() -> str:
    """This machine in a record: architecture, CPUs, host name."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}"


def write_result(result: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
