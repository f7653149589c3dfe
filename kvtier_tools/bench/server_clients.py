"""The store-server benchmark's clients: the raw TCP limit (a server and a client
that only move bytes), and client processes that drive each target."""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time

import numpy as np

MiB = 1 << 20
_LEN = struct.Struct("<q")
TOKEN_ENV = "BENCH_SERVER_TOKEN"  # the kvtier-auth target's token, for the client processes


# -- the raw TCP limit --------------------------------------------------------------------


def raw_server(port: int, ring: int) -> None:
    """Request/ack over plain sockets: +n = client sends n bytes, -n = server sends n bytes.

    Each connection's bytes go to (come from) successive n-byte slots of a
    `ring`-byte buffer: ring = 0 means one slot, which stays in the CPU
    cache; a ring far larger than the cache is what a store does, whose
    values land in memory that was not just touched.
    """
    listener = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_raw_serve, args=(conn, ring), daemon=True).start()


def _raw_serve(conn: socket.socket, ring: int) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # written once: no first-touch faults later
    buf = memoryview(np.ones(max(ring, 16 * MiB), np.uint8))
    head = memoryview(bytearray(8))
    i = 0
    while _recv_exactly(conn, head):
        (n,) = _LEN.unpack(head)
        off = (i % (len(buf) // abs(n))) * abs(n) if ring and n else 0
        i += 1
        if n >= 0:
            if not _recv_exactly(conn, buf[off : off + n]):
                return
            conn.sendall(b"k")
        else:
            conn.sendall(buf[off : off - n])


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def tcp_bandwidth(
    size: int = 16 * MiB,
    seconds: float = 1.0,
    repeats: int = 3,
    ring: int = 0,
    connections: int = 1,
) -> float:
    """GB/s of raw loopback TCP gets of `size`-byte values (median of runs), over
    `connections` connections at once (a thread each, their bytes summed): the
    limit a store server's gets over TCP are held to. With `ring`, each value
    leaves from and lands in the next slot of a `ring`-byte buffer at both ends
    (per connection), as KV moves from a store's pool into a cache's pool (out of
    the CPU cache); 0: one slot each, which stays in the CPU cache."""
    from kvtier_tools.dev.localservers import free_port, wait_for_port

    port = free_port()
    proc = mp.get_context("spawn").Process(target=raw_server, args=(port, ring), daemon=True)
    proc.start()
    try:
        wait_for_port(port)
        clients = [_RawClient(port, ring) for _ in range(connections)]
        runs = []
        for _ in range(repeats):
            moved = [0] * connections
            t0 = time.perf_counter()

            def pull(k: int) -> None:
                while time.perf_counter() - t0 < seconds:
                    clients[k].get([b"k"], size)
                    moved[k] += size

            threads = [threading.Thread(target=pull, args=(k,)) for k in range(connections)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            runs.append(sum(moved) / (time.perf_counter() - t0) / 1e9)
        for client in clients:
            client.sock.close()
        return statistics.median(runs)
    finally:
        proc.terminate()


class _RawClient:
    def __init__(self, port: int, ring: int = 0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # written once: no first-touch faults
        self.buf = memoryview(np.ones(max(ring, 16 * MiB), np.uint8))
        self.ring, self.gets = ring, 0
        self.ack = memoryview(bytearray(1))

    def put(self, keys: list[bytes], value: memoryview) -> None:
        assert len(keys) == 1, "raw TCP moves one value per request"
        self.sock.sendall(_LEN.pack(len(value)))
        self.sock.sendall(value)
        _recv_exactly(self.sock, self.ack)

    def get(self, keys: list[bytes], size: int) -> None:
        assert len(keys) == 1, "raw TCP moves one value per request"
        self.sock.sendall(_LEN.pack(-size))
        off = (self.gets % (len(self.buf) // size)) * size if self.ring else 0
        self.gets += 1
        _recv_exactly(self.sock, self.buf[off : off + size])


class _StoreClient:
    """A remote store as the cache engine uses it: values read straight into
    the caller's buffer (a pool block there, a reused buffer here, registered
    with a store that moves registered memory in place, as the engine's pool is)."""

    def __init__(self, store) -> None:
        from kvtier.remote import RegisteringStore

        self.store = store
        self._buf = np.ones(64 * MiB, np.uint8)
        self.buf = memoryview(self._buf)
        if isinstance(store, RegisteringStore):
            store.register_memory(self._buf.ctypes.data, self._buf.nbytes)

    def put(self, keys: list[bytes], value: memoryview) -> None:
        self.store.put(keys, [value] * len(keys))

    def delete(self, keys: list[bytes]) -> int:
        return self.store.delete(keys)

    def get(self, keys: list[bytes], size: int) -> None:
        found = self.store.get_into(
            keys, [self.buf[i * size : (i + 1) * size] for i in range(len(keys))]
        )
        assert all(found)


class _MooncakeOwnClient:
    """Mooncake's own Python API as its docs use it: one setup, buffers registered,
    batch_put_from / batch_get_into of whole values (the limit for kvtier's store)."""

    def __init__(self, url: str, value: np.ndarray) -> None:
        from mooncake.store import MooncakeDistributedStore

        from kvtier.remote.mooncake_settings import mooncake_settings
        from kvtier_tools.dev.localservers import MOONCAKE_JOIN

        s = mooncake_settings(url, MOONCAKE_JOIN, env={})
        self.store = MooncakeDistributedStore()
        code = self.store.setup(
            s.local_hostname,
            s.metadata_server,
            s.global_segment_size,
            s.local_buffer_size,
            s.protocol,
            s.device_name,
            s.master,
        )
        assert code == 0, f"Mooncake setup returned {code}"
        self.value, self.buf = value, np.ones(64 * MiB, np.uint8)
        for array in (self.value, self.buf):
            self.store.register_buffer(array.ctypes.data, array.nbytes)

    def delete(self, keys: list[bytes]) -> int:
        return sum(c == 0 for c in self.store.batch_remove([k.decode() for k in keys], True))

    def put(self, keys: list[bytes], value: memoryview) -> None:
        codes = self.store.batch_put_from(
            [k.decode() for k in keys],
            [self.value.ctypes.data] * len(keys),
            [len(value)] * len(keys),
        )
        assert all(c == 0 for c in codes), codes

    def get(self, keys: list[bytes], size: int) -> None:
        base = self.buf.ctypes.data
        got = self.store.batch_get_into(
            [k.decode() for k in keys],
            [base + i * size for i in range(len(keys))],
            [size] * len(keys),
        )
        assert got == [size] * len(keys), got


def _client(target: str, address: str, value: np.ndarray):
    if target in ("raw", "raw-ring"):
        return _RawClient(int(address))
    if target == "mooncake-py":
        return _MooncakeOwnClient(address, value)
    if target == "mooncake":
        from kvtier.remote import open_store
        from kvtier_tools.dev.localservers import MOONCAKE_JOIN

        return _StoreClient(open_store(address, 30, extra=MOONCAKE_JOIN))
    if target.startswith("kvtier"):
        from kvtier.remote.kvserver import open_kvserver

        return _StoreClient(open_kvserver(address, 30))
    if target == "redis-unix":
        import redis

        from kvtier.remote.redis import RedisStore, _packer

        return _StoreClient(
            RedisStore(
                lambda: redis.Redis.from_url(f"unix://{address}", command_packer=_packer()),
                f"unix://{address}",
            )
        )
    from kvtier.remote import open_store

    return _StoreClient(open_store(address, 30))


# -- client processes -----------------------------------------------------------------------


def _worker(conn, index: int) -> None:
    clients: dict[tuple[str, str], object] = {}
    array = np.random.default_rng(index).integers(0, 255, 16 * MiB, dtype=np.uint8)
    value = memoryview(array)
    while (cmd := conn.recv()) is not None:
        key_of = (cmd["target"], cmd["address"])
        if key_of not in clients:
            clients[key_of] = _client(*key_of, array)
        client, size, batch = clients[key_of], cmd["size"], cmd.get("batch", 1)
        keys = [b"bench-%d-%d-%d" % (index, size, i) for i in range(4 * batch)]
        groups = [keys[i : i + batch] for i in range(0, len(keys), batch)]
        if cmd["op"] == "get":
            for group in groups:
                client.put(group, value[:size])
        while time.time() < cmd["start"]:
            time.sleep(0.001)
        fresh = cmd["op"] == "put" and cmd["target"].startswith("mooncake")
        n, t0, put = 0, time.perf_counter(), []
        while time.perf_counter() - t0 < cmd["duration"]:
            if fresh:  # Mooncake's put of a key it holds moves nothing: a new key each time
                put.append([b"%s-%d-%d" % (k, cmd["start"] * 1000, n) for k in groups[n % 4]])
                client.put(put[-1], value[:size])
            elif cmd["op"] == "put":
                client.put(groups[n % 4], value[:size])
            else:
                client.get(groups[n % 4], size)
            n += 1
        elapsed = time.perf_counter() - t0
        for keys in put:  # untimed: the pool's room back for the next run (it evicts too slowly)
            client.delete(keys)
        conn.send((n * size * batch, elapsed))


class Clients:
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
