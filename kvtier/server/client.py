"""Blocking client of `kvtier server`, for cache engines and tools.

    client = KVClient("127.0.0.1", 12345, timeout=10)
    client.put([b"k1", b"k2"], [v1, v2])     # batched; a value may be a list of buffers
    client.get([b"k1", b"k3"])               # [memoryview, None]
    client.match_prefix([b"k1", b"k2", b"k3"])  # 2

Transport faults (refused, reset, no answer within `timeout`) raise
RemoteUnavailable and drop the connection; the next call reconnects. The
server's refusals raise ValueTooLarge (a value larger than its pool),
RemoteAuthFailed (no token or a wrong one: auth.py) or RemoteRefused.
`tls=True` speaks TLS (certificate checked against `tls_ca`, or the
system's CAs, and the host name). A connection left idle for half the
server's idle timeout is replaced before it is used.

Same host: when the server's HELLO reply says it runs on this kernel boot,
the client maps the server's pool (a memfd, through /proc/<pid>/fd) and
moves values with memcpy: PUT_ALLOC → copy → PUT_COMMIT, and GET_SHM →
copy → RELEASE. Only keys and page extents go over TCP then. The server
drops a lease after its lease timeout and a reservation after its put
deadline (both in the HELLO reply): a copy that is not done within half
of it is thrown away as a fault, so a slow copy never returns, or commits,
bytes the server may have handed to someone else.

Over TCP a large `get_into` is spread over up to READERS connections
(each a contiguous share of the keys, received on its own thread): one
loopback TCP stream moves less than several do, and the server
serves them on its I/O threads. The extra connections open on the first
such get and are left alone if the server refuses them (a bound).

`borrow(keys)` (same host only) hands out the values themselves: where they
lie in the mapped pool, leased until `ShmLease.release()`, so a reader can
copy them where it wants them (a GPU, by DMA from the pool once it is
registered with CUDA: `on_map`/`on_unmap` are called with each mapping).
The lease also says how many keys, from the first, the server holds: a
reader needs no EXISTS round trip before it.
"""

from __future__ import annotations

import itertools
import mmap
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np

from kvtier.buffers import Value, as_parts, from_extents, into_extents, run_copy
from kvtier.errors import RemoteAuthFailed, RemoteRefused, RemoteUnavailable, ValueTooLarge
from kvtier.logs import get_logger
from kvtier.server import auth
from kvtier.server import protocol as p
from kvtier.server.link import (
    Link,
    PoolMap,
    ShmLease,
    dial,
    map_server_pool,
    pool_inode,
    scratch_parts,
)

log = get_logger(__name__)
T = TypeVar("T")

READERS = 4  # connections one large TCP get_into is spread over
READER_BYTES = 32 << 20  # at least this much for each connection beyond the first


class KVClient:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = 10.0,
        shm: bool = True,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
    ) -> None:
        self.host, self.port, self.timeout, self.use_shm = host, port, timeout, shm
        self.token, self.tls, self.tls_ca = token, tls, tls_ca
        # Called with each mapping of the server's pool, and before it is unmapped
        # (e.g. to register it with CUDA); on_map returning False: no borrowing.
        self.on_map: Callable[[mmap.mmap], bool] | None = None
        self.on_unmap: Callable[[mmap.mmap], None] | None = None
        self._link: Link | None = None
        self._pool: PoolMap | None = None  # kept across connections to the same pool
        self._lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self._readers: list[KVClient] | None = None  # the extra connections of large TCP gets
        self._reader_threads: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"KVClient({self.host}:{self.port})"

    # -- operations --------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Value]) -> None:
        parts = [as_parts(v) for v in values]
        sizes = [sum(len(x) for x in ps) for ps in parts]
        self._on_link(lambda link: self._put(link, keys, parts, sizes))

    def _put(
        self,
        link: Link,
        keys: Sequence[bytes],
        parts: list[list[memoryview]],
        sizes: list[int],
    ) -> None:
        if link.shm is None:
            self._call(
                link,
                p.Op.PUT,
                p.encode_keys(keys, sizes),
                [x for ps in parts for x in ps],
                sum(sizes),
            )
            return
        t0 = time.monotonic()
        _, meta = self._call(link, p.Op.PUT_ALLOC, p.encode_keys(keys, sizes))
        ticket, entries = p.decode_extents(meta)
        # One copy for the whole batch, so that a batch of chunks is split over the copy
        # threads.
        run_copy(
            [
                pair
                for (_, extents), ps in zip(entries, parts)
                for pair in into_extents(link.shm, extents, ps)
            ]
        )
        self._in_time(link, t0, "put_deadline", "put")
        self._send(link, p.Op.PUT_COMMIT, p.encode_u32(ticket))
        # The commit has no reply; a request after it on this connection is
        # served after it, so its answer means the put is visible to every
        # client (a flushed store is then a hit on another node at once).
        self._call(link, p.Op.EXISTS, p.encode_keys(keys[:1]))

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(keys)

        def fresh(i: int, size: int) -> list[memoryview]:
            out[i] = memoryview(np.empty(size, np.uint8))
            return [out[i]]

        self._get(keys, fresh)
        return out

    def get_into(
        self, keys: Sequence[bytes], dests: Sequence[Value], *, spread: bool = True
    ) -> list[bool]:
        """Read each value straight into its destination (one buffer, or parts
        filled in order), with no copy in between. True where a value of
        exactly the destination's size was there; False for a miss or a
        value of another size (the destination is then untouched). With
        `spread`, a large get over TCP runs over several connections."""
        parts = [as_parts(d) for d in dests]
        sizes = [sum(len(x) for x in ps) for ps in parts]
        shares = _shares(sizes, READERS, READER_BYTES) if spread else []
        if len(shares) > 1 and not self.shm_active:
            readers = self._extra_readers(len(shares) - 1)
            if readers:
                return self._get_into_spread(
                    keys, parts, _shares(sizes, len(readers) + 1, READER_BYTES), readers
                )
        filled = [False] * len(keys)

        def into(i: int, size: int) -> list[memoryview] | None:
            if size != sizes[i]:
                return None
            filled[i] = True
            return parts[i]

        self._get(keys, into)
        return filled

    def _get_into_spread(
        self,
        keys: Sequence[bytes],
        parts: list[list[memoryview]],
        shares: list[tuple[int, int]],
        readers: list[KVClient],
    ) -> list[bool]:
        """`get_into` with share 0 on this connection and share k on readers[k-1], at once.
        Returns only when every share is done (their buffers are the caller's)."""
        (a0, b0), rest = shares[0], shares[1:]
        futures = [
            self._reader_threads.submit(reader.get_into, keys[a:b], parts[a:b], spread=False)
            for reader, (a, b) in zip(readers, rest)
        ]
        try:
            filled = self.get_into(keys[a0:b0], parts[a0:b0], spread=False)
        finally:
            wait(futures)
        for future in futures:
            filled += future.result()  # a share's fault is the whole call's
        return filled

    def _extra_readers(self, n: int) -> list[KVClient]:
        """Up to `n` more connections to this server (made once; none if it refuses them)."""
        with self._lock:
            if self._readers is None:
                self._readers = []
                for _ in range(READERS - 1):
                    reader = KVClient(
                        self.host,
                        self.port,
                        timeout=self.timeout,
                        shm=False,
                        token=self.token,
                        tls=self.tls,
                        tls_ca=self.tls_ca,
                    )
                    try:
                        _ = reader.shm_active  # connects (and authenticates) now
                    except (RemoteUnavailable, RemoteRefused, RemoteAuthFailed) as e:
                        log.info(
                            "kvtier server %s:%d: %d more read connections (%s); "
                            "large gets use those",
                            self.host,
                            self.port,
                            len(self._readers),
                            e,
                        )
                        reader.close()
                        break
                    self._readers.append(reader)
                if self._readers:
                    self._reader_threads = ThreadPoolExecutor(
                        len(self._readers), thread_name_prefix="kvtier-get"
                    )
            return self._readers[:n]

    def borrow(self, keys: Sequence[bytes]) -> ShmLease | None:
        """Lease `keys`' values in the shared pool, in place; None off the same host
        (or where on_map refused the mapping)."""

        def lease(link: Link) -> tuple[Link, float, memoryview] | None:
            if link.shm is None or not link.borrowable:
                return None
            t0 = time.monotonic()
            return link, t0, self._call(link, p.Op.GET_SHM, p.encode_keys(keys))[1]

        leased = self._on_link(lease)
        if leased is None:
            return None
        link, t0, meta = leased
        ticket, entries = p.decode_extents(meta)
        places = [
            (ext[0][0], size) if size != p.MISSING and len(ext) == 1 else None
            for size, ext in entries
        ]
        leading = next(
            (i for i, (size, _) in enumerate(entries) if size == p.MISSING), len(entries)
        )

        def release() -> None:
            with self._lock:
                if (
                    link is not self._link
                ):  # that connection closed: the server let go of the lease then
                    return
                try:
                    self._send(link, p.Op.RELEASE, p.encode_u32(ticket))
                except RemoteUnavailable:  # dropped now: the same
                    pass

        return ShmLease(places, leading, link.shm, release, t0 + link.bound("lease_timeout") / 2)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(b) for b in self._simple(p.Op.EXISTS, p.encode_keys(keys))]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the server holds: one round trip."""
        return p.decode_u32(self._simple(p.Op.MATCH_PREFIX, p.encode_keys(keys)))

    def delete(self, keys: Sequence[bytes]) -> int:
        return p.decode_u32(self._simple(p.Op.DELETE, p.encode_keys(keys)))

    def stats(self) -> dict:
        return p.decode_json(self._simple(p.Op.STATS, b""))

    def server_info(self) -> dict:
        with self._lock:
            return dict(self._connect().info)

    @property
    def shm_active(self) -> bool:
        with self._lock:
            return self._connect().shm is not None

    def close(self) -> None:
        with self._lock:
            self._drop()
            readers, self._readers = self._readers or [], None
            threads, self._reader_threads = self._reader_threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        for reader in readers:
            reader.close()

    # -- connection ----------------------------------------------------------------------

    def _simple(self, op: p.Op, meta: bytes) -> memoryview:
        """A request without payload, its reply's meta."""
        return self._on_link(lambda link: self._call(link, op, meta)[1])

    def _on_link(self, run: Callable[[Link], T]) -> T:
        """`run(link)` on this client's connection, under its lock. Where a kept connection
        turns out closed before any reply to `run` (the server restarted since the link's last
        use), `run` goes once more on a new connection: a restart costs no miss. Either no
        request of `run` reached a live server, or its reply was lost, and every op here may
        run twice (a put stores the same bytes again; a lease dies with its connection)."""
        with self._lock:
            kept = self._link
            link = self._connect()
            replies = link.replies
            try:
                return run(link)
            except RemoteUnavailable as e:
                stale = link is kept and link.replies == replies
                if not stale or not isinstance(e.__cause__, ConnectionError):
                    raise
            return run(self._connect())

    def _connect(self) -> Link:
        if self._link is not None:
            if time.monotonic() - self._link.used < self._link.bound("idle_timeout") / 2:
                self._link.used = time.monotonic()
                return self._link
            self._drop(keep_pool=True)  # the server may be closing it as idle: take a fresh one
        sock = dial(self.host, self.port, self.timeout, self.tls, self.tls_ca)
        link = Link(sock, {}, None, tls=self.tls)
        _, meta = self._call(
            link, p.Op.HELLO, p.encode_json({"host_id": p.host_id() if self.use_shm else ""})
        )
        link.info = p.decode_json(meta)
        if link.info.get("auth"):
            self._authenticate(link)
        if link.info.get("shm"):
            pool = self._pool_of(link.info["shm"])
            if pool is not None:
                link.shm, link.borrowable = pool.array, pool.borrowable
        self._link = link
        return link

    def _pool_of(self, shm: dict) -> PoolMap | None:
        """The server's pool, mapped (and `on_map` called) once for as long as it is the same."""
        if self._pool is not None and self._pool.inode == pool_inode(shm):
            return self._pool
        self._release_pool()
        pool = map_server_pool(shm)
        if pool is not None and self.on_map is not None:
            pool.borrowable = bool(self.on_map(pool.mapping))
            pool.on_unmap = self.on_unmap if pool.borrowable else None
        self._pool = pool
        return pool

    def _release_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _authenticate(self, link: Link) -> None:
        if link.info["auth"] != auth.SCHEME:
            link.close()
            raise RemoteAuthFailed(
                f"kvtier server {self.host}:{self.port} wants {link.info['auth']!r} "
                f"authentication; this client speaks {auth.SCHEME}"
            )
        if not self.token:
            link.close()
            raise RemoteAuthFailed(
                f"kvtier server {self.host}:{self.port} wants a token: give it by "
                "kvtier://host:port/?token_env=VAR or the config key remote_auth_token"
            )
        proof = auth.prove(self.token, bytes.fromhex(link.info["challenge"]))
        _, meta = self._call(link, p.Op.AUTH, p.encode_json({"proof": proof.hex()}))
        link.info.update(p.decode_json(meta))

    def _in_time(self, link: Link, t0: float, bound: str, what: str) -> None:
        """Fail a same-host copy that took more than half of the server's `bound`
        (after which it frees what the copy used)."""
        took = time.monotonic() - t0
        if took > link.bound(bound) / 2:
            self._fail(
                link,
                TimeoutError(
                    f"a shared-memory {what} took {took:.1f} s, more than half the "
                    f"server's {bound} ({link.bound(bound):g} s): dropped"
                ),
            )

    def _drop(self, keep_pool: bool = False) -> None:
        """Close the connection; the pool's mapping too unless `keep_pool` (a healthy
        server: the next connection finds the same pool)."""
        if self._link is not None:
            self._link.close()
            self._link = None
        if not keep_pool:
            self._release_pool()

    def _send(
        self,
        link: Link,
        op: p.Op,
        meta: bytes,
        parts: Sequence[memoryview] = (),
        payload_len: int = 0,
    ) -> int:
        req_id = next(self._req_ids) & 0xFFFFFFFF or next(self._req_ids)  # 0 is the server's own
        try:
            link.send([p.pack_header(op, req_id, len(meta), payload_len) + meta, *parts])
        except OSError as e:
            self._fail(link, e)
        return req_id

    def _call(
        self,
        link: Link,
        op: p.Op,
        meta: bytes,
        parts: Sequence[memoryview] = (),
        payload_len: int = 0,
    ) -> tuple[p.Header, memoryview]:
        """Send a request and read its reply's header and meta; the reply's
        payload (a GET's values) is left for the caller to read."""
        req_id = self._send(link, op, meta, parts, payload_len)
        try:
            head = bytearray(p.HEADER_SIZE)
            link.recv_into(memoryview(head))
            h = p.parse_header(head, replies=True)
            link.replies += 1
            parting = (
                h.req_id == 0 and h.flags != p.Status.OK
            )  # the server's last word before it closes
            if not parting and (h.op != op | p.REPLY or h.req_id != req_id):
                raise p.ProtocolError(f"reply {h.op:#x}/{h.req_id} to request {op:#x}/{req_id}")
            if h.payload_len and op != p.Op.GET:
                raise p.ProtocolError(
                    f"a {op.name} reply carries no payload, got {h.payload_len} bytes"
                )
            meta_buf = memoryview(bytearray(h.meta_len))
            link.recv_into(meta_buf)
        except (OSError, p.ProtocolError) as e:
            self._fail(link, e)
        if h.flags != p.Status.OK:
            message = (
                f"kvtier server {self.host}:{self.port}: {bytes(meta_buf).decode(errors='replace')}"
            )
            if parting or h.flags == p.Status.UNAUTHORIZED:  # the server closes this connection
                if link is self._link:
                    self._drop(keep_pool=True)
                else:
                    link.close()
            if h.flags == p.Status.UNAUTHORIZED:
                raise RemoteAuthFailed(message)
            raise (ValueTooLarge if h.flags == p.Status.TOO_LARGE else RemoteRefused)(message)
        return h, meta_buf

    def _get(
        self, keys: Sequence[bytes], dest: Callable[[int, int], list[memoryview] | None]
    ) -> None:
        """GET `keys`; for each present value of `size` bytes, `dest(i, size)`
        names the buffers it goes into (None: not wanted, skipped)."""
        self._on_link(lambda link: self._get_on(link, keys, dest))

    def _get_on(
        self,
        link: Link,
        keys: Sequence[bytes],
        dest: Callable[[int, int], list[memoryview] | None],
    ) -> None:
        if link.shm is not None:
            t0 = time.monotonic()
            _, meta = self._call(link, p.Op.GET_SHM, p.encode_keys(keys))
            ticket, entries = p.decode_extents(meta)
            try:
                copy = []
                for i, (size, extents) in enumerate(entries):
                    parts = None if size == p.MISSING else dest(i, size)
                    if parts is not None:
                        copy += from_extents(link.shm, extents, parts)
                run_copy(copy)
            finally:
                self._send(link, p.Op.RELEASE, p.encode_u32(ticket))
            self._in_time(link, t0, "lease_timeout", "get")
            return
        h, meta = self._call(link, p.Op.GET, p.encode_keys(keys))
        try:
            sizes = p.decode_sizes(meta)
            if len(sizes) != len(keys) or sum(s for s in sizes if s != p.MISSING) != h.payload_len:
                raise p.ProtocolError(
                    f"GET reply: {len(sizes)} sizes for {len(keys)} keys, "
                    f"payload {h.payload_len} bytes"
                )
            for i, size in enumerate(sizes):
                if size == p.MISSING:
                    continue
                parts = dest(i, size)
                for part in parts if parts is not None else scratch_parts(size):
                    link.recv_into(part)
        except (OSError, p.ProtocolError) as e:
            self._fail(link, e)

    def _fail(self, link: Link, e: Exception) -> None:
        if isinstance(
            e, (BlockingIOError, socket.timeout)
        ):  # SO_RCVTIMEO / SO_SNDTIMEO (or TLS's) ran out
            e = TimeoutError(f"no progress within {self.timeout} s")
        if link is self._link:
            self._drop()
        else:
            link.close()
        raise RemoteUnavailable(f"kvtier server {self.host}:{self.port}: {e}") from e


def _shares(sizes: Sequence[int], most: int, least_bytes: int) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive values, about equal in bytes, at most `most` of them
    and each at least `least_bytes` (one range when the total is smaller than two)."""
    total = sum(sizes)
    n = max(1, min(most, len(sizes), total // least_bytes))
    shares, a, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if len(shares) < n - 1 and acc >= total * (len(shares) + 1) / n:
            shares.append((a, i + 1))
            a = i + 1
    shares.append((a, len(sizes)))
    return shares
