"""`kvtier bench p2p`: how fast an instance fetches chunks from a peer's CPU RAM by each of P2P
sharing's transports, against this host's limits measured in the same run.

A holder process (its own CacheEngine with enable_p2p, the index in a `kvtier server`) stores
`--mb` of KV in chunks of `--chunk-size` tokens. This process fetches them all with one request,
as an instance's PeerSource does, into blocks of its own pool: as bytes over loopback TCP, copied
out of the holder's shared pool, and read out of it by NIXL (`transfer_channel: nixl`, the way of
a peer on another host; UCX picks its transport, UCX_TLS where set). All land the same bytes
(checked). The limits: raw loopback TCP moving values of a chunk's size
(server_clients.tcp_bandwidth, ring buffers the size of the data at both ends), and a memcpy of
the data out of a shared memory mapping (a memfd's) into a buffer of its size, in as many pieces
at once as kvtier has copy threads (buffers.COPY_THREADS: the copy out of a peer's pool uses
them). NIXL's limit is the memcpy where UCX may move the bytes by shared memory, loopback TCP
where UCX_TLS leaves it TCP only (how a host without RDMA reaches another).

    python -m kvtier_tools.bench.p2p --report RECORD     the record's table, for the docs
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

LAYERS, HEADS, HEAD_DIM, BLOCK = 8, 8, 128, 16  # bf16: 32 KiB of K and V a token
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2
TRANSPORTS = ("tcp", "shared memory", "nixl")
SHARED_MEMORY_TLS = ("sm", "shm", "posix", "sysv", "cma", "knem", "xpmem")  # UCX's on one host


def limit_of(way: str, ucx_tls: str) -> str:
    """The limit a transport is put against: NIXL's is a memcpy where UCX may move the bytes
    by shared memory (UCX_TLS unset, or naming one of those), else loopback TCP."""
    if way == "nixl":
        tls = [t for t in ucx_tls.split(",") if t]
        shared = not tls or any(t.lstrip("^") in SHARED_MEMORY_TLS for t in tls)
        return "memcpy" if shared else "loopback TCP"
    return {"tcp": "loopback TCP", "shared memory": "memcpy"}[way]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=int, default=512, help="MiB of KV fetched in each request")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens a chunk")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", type=Path, help="write the record (JSON) here")


def _hold(index_url: str, tokens: int, chunk_size: int, conn: Connection) -> None:
    """The holder: stores `tokens` tokens of random KV, sends its address and the chunks'
    wire keys, and serves them until told to stop."""
    import torch

    from kvtier.config import KvtierConfig
    from kvtier.engine import CacheEngine
    from kvtier.keys import KVFormat, wire_key
    from kvtier.transfer import PagedKV

    blocks = tokens // BLOCK
    layers = [torch.randn(2, blocks, BLOCK, HEADS, HEAD_DIM).bfloat16() for _ in range(LAYERS)]
    config = KvtierConfig(
        chunk_size=chunk_size,
        max_local_cpu_size=tokens * TOKEN_BYTES * 1.25 / 2**30,
        enable_p2p=True,
        p2p_port=0,
        p2p_index_url=index_url,
        transfer_channel="nixl",  # it lends to NIXL askers too
    )
    fmt = KVFormat("bench-p2p", "flash_attn", "bfloat16")
    engine = CacheEngine(config, PagedKV.wrap(layers, "flash_attn"), fmt)
    ids = list(range(1, tokens + 1))
    engine.store(ids, torch.arange(tokens))
    assert engine.peers is not None
    conn.send((engine.peers.server.address, [wire_key(s.key) for s in engine.spans(ids)]))
    conn.recv()  # stop
    engine.close()


def _fetch_times(
    address: str, wires: list[bytes], outs: list[memoryview], way: str, reader, n: int
) -> list[float]:
    """Seconds of each of `n` fetches of every chunk (after one that connects and maps)."""
    from kvtier.codec import Codec
    from kvtier.fleet.peer_client import PeerClient

    shared, nixl = way == "shared memory", reader if way == "nixl" else None
    client = PeerClient(address, 60.0, None, Codec("naive"), shared, nixl)
    try:
        times = []
        for _ in range(n + 1):
            t0 = time.perf_counter()
            got = client.get_into(wires, outs)
            times.append(time.perf_counter() - t0)
            if any(g is None for g in got):
                raise RuntimeError(f"the holder did not give every chunk by {way}")
        took = "shared memory" if client.copied else "nixl" if reader.reads else "tcp"
        if took != way:
            raise RuntimeError(f"the fetch took {took}, not {way}")
        return times[1:]
    finally:
        client.close()


def _memcpy_gbps(nbytes: int, repeats: int, threads: int) -> float:
    """GB/s of copying `nbytes` out of a shared memory mapping (a memfd's, as a peer's pool:
    the kernel may back it with other pages than anonymous memory) into a buffer of that size,
    in `threads` pieces at once."""
    fd = os.memfd_create("kvtier-bench-p2p")
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    os.close(fd)
    src, dst = np.frombuffer(mapping, np.uint8), np.zeros(nbytes, np.uint8)
    src[:] = 1
    step = -(-nbytes // threads)
    pieces = [(dst[i : i + step], src[i : i + step]) for i in range(0, nbytes, step)]
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda pair: np.copyto(*pair), pieces))
            times.append(time.perf_counter() - t0)
    del src, pieces
    mapping.close()
    return nbytes / statistics.median(times) / 1e9


def run(mb: int, chunk_size: int, repeats: int) -> dict:
    from kvtier.buffers import COPY_THREADS
    from kvtier.fleet.peer_reads import NixlReader
    from kvtier.memory import HostPool
    from kvtier_tools.bench.server import host
    from kvtier_tools.bench.server_clients import tcp_bandwidth
    from kvtier_tools.dev.localservers import kvtier_server

    chunk_bytes = chunk_size * TOKEN_BYTES
    chunks = mb * 2**20 // chunk_bytes
    nbytes = chunks * chunk_bytes
    pool = HostPool(nbytes, chunk_bytes, pin=False)
    blocks = pool.allocate_many(chunks)
    assert blocks is not None
    outs = [b.data.numpy().data for b in blocks]
    reader = NixlReader(pool, 60.0)
    with kvtier_server(0.0625) as index:
        parent, child = mp.get_context("spawn").Pipe()
        holder = mp.get_context("spawn").Process(
            target=_hold, args=(index.url, chunks * chunk_size, chunk_size, child), daemon=True
        )
        holder.start()
        try:
            address, wires = parent.recv()
            fetch: dict[str, dict] = {}
            landed = []
            for name in TRANSPORTS:
                pool.arena.zero_()
                times = _fetch_times(address, wires, outs, name, reader, repeats)
                landed.append(pool.arena.clone())
                fetch[name] = {
                    "GBps": round(nbytes / statistics.median(times) / 1e9, 3),
                    "ms": round(statistics.median(times) * 1e3, 2),
                    "runs_ms": [round(t * 1e3, 2) for t in times],
                }
            if not all(bool((x == landed[0]).all()) for x in landed):
                raise RuntimeError("the transports landed different bytes")
        finally:
            parent.send("stop")
            holder.join(60)
    tcp = tcp_bandwidth(size=chunk_bytes, ring=nbytes)
    copy = _memcpy_gbps(nbytes, repeats, COPY_THREADS)
    limits = {"loopback TCP": tcp, "memcpy": copy}
    tls = os.environ.get("UCX_TLS", "")
    for name in TRANSPORTS:
        fetch[name]["of_limit"] = round(fetch[name]["GBps"] / limits[limit_of(name, tls)], 3)
    return {
        "machine": host(),
        "date": datetime.date.today().isoformat(),
        "bytes": nbytes,
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "copy_threads": COPY_THREADS,
        "ucx_tls": os.environ.get("UCX_TLS", ""),
        "limits_GBps": {"loopback TCP": round(tcp, 3), "memcpy": round(copy, 3)},
        "fetch": fetch,
    }


def table(record: dict) -> str:
    limits = record["limits_GBps"]
    rows = [
        "| transport | fetch (GB/s) | one request (ms) | limit (GB/s) | of the limit |",
        "|---|---|---|---|---|",
    ]
    for name, got in record["fetch"].items():
        limit = limit_of(name, record.get("ucx_tls", ""))
        rows.append(
            f"| {name} | {got['GBps']:.2f} | {got['ms']:.1f} | {limit} {limits[limit]:.2f} "
            f"| {got['of_limit']:.2f} |"
        )
    fetch = record["fetch"]
    tcp, shm = fetch["tcp"]["GBps"], fetch["shared memory"]["GBps"]
    nixl = f", NIXL {fetch['nixl']['GBps'] / tcp:.1f}x TCP" if "nixl" in fetch else ""
    tls = f" (UCX_TLS={record['ucx_tls']})" if record.get("ucx_tls") else ""
    mib = record["bytes"] / 2**20
    return (
        "\n".join(rows)
        + f"\n\nmemcpy on {record['copy_threads']} threads. "
        + f"{record['chunks']} chunks of {record['chunk_bytes'] / 2**20:.0f} MiB "
        + f"({mib:.0f} MiB) in one request; shared memory {shm / tcp:.1f}x TCP{nixl}{tls}. "
        + f"{record['machine']}, {record['date']}: `{record['command']}`"
    )


def main(args: argparse.Namespace) -> int:
    command = "kvtier " + shlex.join(sys.argv[1:])
    record = {"command": command, **run(args.mb, args.chunk_size, args.repeats)}
    print(table(record))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--report", type=Path, required=True)
    print(table(json.loads(parser.parse_args().report.read_text())))
