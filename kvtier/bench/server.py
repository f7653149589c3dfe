"""`kvtier bench server`: the store server against raw loopback TCP and redis-server.

One run measures, on this machine:

- put and get throughput of 2, 4 and 8 MiB values with 1, 2 and 8
  connections (one client process per connection), for
    raw   a plain request/ack TCP server (thread per connection, recv_into
          a buffer): the limit of loopback TCP with that many streams;
    kvtier  `kvtier server` through KVClient over TCP (no shared memory);
    redis   redis-server through kvtier's Redis store (redis-py + hiredis);
  reported as kvtier/raw and kvtier/redis;
- p50/p99 latency of exists and match-prefix over 64 keys;
- the same-host shared-memory path (put and get of 4 MiB) against memcpy;
- the remote serdes (naive, lz4): ratio and encode/decode GB/s.

Throughput cells are medians over `repeats` runs of `duration` seconds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MiB = 1 << 20
_LEN = struct.Struct("<q")


# -- the raw TCP limit --------------------------------------------------------------------


def raw_server(port: int) -> None:
    """Request/ack over plain sockets: +n = client sends n bytes, -n = server sends n bytes."""
    listener = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_raw_serve, args=(conn,), daemon=True).start()


def _raw_serve(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(16 * MiB))
    head = memoryview(bytearray(8))
    while _recv_exactly(conn, head):
        (n,) = _LEN.unpack(head)
        if n >= 0:
            if not _recv_exactly(conn, buf[:n]):
                return
            conn.sendall(b"k")
        else:
            conn.sendall(buf[:-n])


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


class _RawClient:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(16 * MiB))
        self.ack = memoryview(bytearray(1))

    def put(self, key: bytes, value: memoryview) -> None:
        self.sock.sendall(_LEN.pack(len(value)))
        self.sock.sendall(value)
        _recv_exactly(self.sock, self.ack)

    def get(self, key: bytes, size: int) -> None:
        self.sock.sendall(_LEN.pack(-size))
        _recv_exactly(self.sock, self.buf[:size])


class _StoreClient:
    def __init__(self, store) -> None:
        self.store = store

    def put(self, key: bytes, value: memoryview) -> None:
        self.store.put([key], [value])

    def get(self, key: bytes, size: int) -> None:
        (value,) = self.store.get([key])
        assert value is not None and len(value) == size


def _client(target: str, address: str):
    if target == "raw":
        return _RawClient(int(address))
    if target in ("kvtier", "kvtier-shm"):
        from kvtier.server.client import KVClient

        host, port = address.rsplit(":", 1)
        return _StoreClient(KVClient(host, int(port), shm=target == "kvtier-shm"))
    from kvtier.remote import open_store

    return _StoreClient(open_store(address, 30))


# -- client processes -----------------------------------------------------------------------


def _worker(conn, index: int) -> None:
    clients: dict[tuple[str, str], object] = {}
    value = memoryview(np.random.default_rng(index).integers(0, 255, 16 * MiB, dtype=np.uint8))
    while (cmd := conn.recv()) is not None:
        key_of = (cmd["target"], cmd["address"])
        if key_of not in clients:
            clients[key_of] = _client(*key_of)
        client, size = clients[key_of], cmd["size"]
        keys = [b"bench-%d-%d-%d" % (index, size, i) for i in range(4)]
        if cmd["op"] == "get":
            for key in keys:
                client.put(key, value[:size])
        while time.time() < cmd["start"]:
            time.sleep(0.001)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < cmd["duration"]:
            if cmd["op"] == "put":
                client.put(keys[n % 4], value[:size])
            else:
                client.get(keys[n % 4], size)
            n += 1
        conn.send((n * size, time.perf_counter() - t0))


class _Clients:
    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, i), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def run(self, conns: int, **cmd) -> float:
        """GB/s of `conns` clients running `cmd` at the same time."""
        start = time.time() + 0.5
        for pipe in self.pipes[:conns]:
            pipe.send({**cmd, "start": start})
        results = [pipe.recv() for pipe in self.pipes[:conns]]
        return sum(b for b, _ in results) / max(s for _, s in results) / 1e9

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(10)


# -- the run ----------------------------------------------------------------------------------


@dataclass
class ServerBenchConfig:
    sizes_mib: tuple[int, ...] = (2, 4, 8)
    conns: tuple[int, ...] = (1, 2, 8)
    duration: float = 1.0
    repeats: int = 3
    latency_iters: int = 2000


def run_server_bench(cfg: ServerBenchConfig, progress=print) -> dict:
    from kvtier.localservers import free_port, kvtier_server, redis_server, wait_for_port

    raw_port = free_port()
    raw = mp.get_context("spawn").Process(target=raw_server, args=(raw_port,), daemon=True)
    raw.start()
    wait_for_port(raw_port)
    clients = _Clients(max(cfg.conns))
    result: dict = {"machine": _machine(), "date": time.strftime("%Y-%m-%d"), "config": cfg.__dict__,
                    "throughput": [], "latency": {}, "shm": {}, "serde": {}}
    try:
        with kvtier_server(1.0) as kv, redis_server() as rd:
            kv_addr = f"127.0.0.1:{kv.ports[0]}"
            targets = {"raw": str(raw_port), "kvtier": kv_addr, "redis": rd.url}
            for size in cfg.sizes_mib:
                for conns in cfg.conns:
                    for op in ("put", "get"):
                        cell = {"size_mib": size, "conns": conns, "op": op}
                        runs: dict[str, list[float]] = {t: [] for t in targets}
                        for _ in range(cfg.repeats):  # interleaved, so that a noisy second hits all alike
                            for target, address in targets.items():
                                runs[target].append(clients.run(conns, target=target, address=address, op=op,
                                                                size=size * MiB, duration=cfg.duration))
                        for target, gbps in runs.items():
                            cell[f"{target}_GBps"] = round(statistics.median(gbps), 3)
                            cell[f"{target}_runs"] = [round(x, 3) for x in gbps]
                        cell["vs_raw"] = round(cell["kvtier_GBps"] / cell["raw_GBps"], 3)
                        cell["vs_redis"] = round(cell["kvtier_GBps"] / cell["redis_GBps"], 3)
                        result["throughput"].append(cell)
                        progress(f"{op} {size} MiB x{conns}: raw {cell['raw_GBps']:.2f} kvtier "
                                 f"{cell['kvtier_GBps']:.2f} redis {cell['redis_GBps']:.2f} GB/s "
                                 f"(kvtier/raw {cell['vs_raw']:.2f}, kvtier/redis {cell['vs_redis']:.2f})")
            result["latency"] = _latency(kv_addr, rd.url, cfg.latency_iters)
            progress(f"latency over 64 keys: {result['latency']}")
            result["shm"] = _shm(clients, kv_addr, cfg)
            progress(f"shared memory: {result['shm']}")
    finally:
        clients.close()
        raw.terminate()
    result["serde"] = _serde()
    progress(f"serde: {result['serde']}")
    return result


def _latency(kv_addr: str, redis_url: str, iters: int) -> dict:
    from kvtier.remote import open_store
    from kvtier.server.client import KVClient

    host, port = kv_addr.rsplit(":", 1)
    out = {}
    for name, store in [("kvtier", KVClient(host, int(port))), ("redis", open_store(redis_url, 30))]:
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


def _shm(clients: _Clients, kv_addr: str, cfg: ServerBenchConfig) -> dict:
    size = 4 * MiB
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    memcpy = []
    for _ in range(cfg.repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < cfg.duration:
            dst[:] = src
            n += 1
        memcpy.append(n * size / (time.perf_counter() - t0) / 1e9)
    out = {"memcpy_GBps": round(statistics.median(memcpy), 3)}
    for op in ("put", "get"):
        clients.run(1, target="kvtier-shm", address=kv_addr, op=op, size=size, duration=0.2)  # maps the pool
        runs = [clients.run(1, target="kvtier-shm", address=kv_addr, op=op, size=size, duration=cfg.duration)
                for _ in range(cfg.repeats)]
        out[f"{op}_GBps"] = round(statistics.median(runs), 3)
        out[f"{op}_vs_memcpy"] = round(out[f"{op}_GBps"] / out["memcpy_GBps"], 3)
    return out


def _serde() -> dict:
    import torch

    from kvtier.codec import Codec

    raw = torch.randn(8 * MiB).to(torch.bfloat16).view(torch.uint8).numpy()  # 16 MiB of bf16 N(0,1)
    out = {"data": "16 MiB of bf16 N(0,1)"}
    for serde in ("naive", "lz4"):
        codec = Codec(serde, itemsize=2)
        t0 = time.perf_counter()
        parts = codec.encode(memoryview(raw), 256)
        t_enc = time.perf_counter() - t0
        value = b"".join(bytes(p) for p in parts)
        t0 = time.perf_counter()
        _, back = codec.decode(value, len(raw))
        t_dec = time.perf_counter() - t0
        assert bytes(back) == raw.tobytes()
        out[serde] = {"ratio": round(len(value) / len(raw), 3), "encode_GBps": round(len(raw) / t_enc / 1e9, 2),
                      "decode_GBps": round(len(raw) / t_dec / 1e9, 2)}
    return out


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}"


def write_result(result: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
