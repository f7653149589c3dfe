"""Blocking client of `kvtier server`, for cache engines and tools.

    client = KVClient("127.0.0.1", 12345, timeout=10)
    client.put([b"k1", b"k2"], [v1, v2])     # batched; a value may be a list of buffers
    client.get([b"k1", b"k3"])               # [memoryview, None]
    client.match_prefix([b"k1", b"k2", b"k3"])  # 2

Every op runs on the client's connection (channel.py: connected, kept, made again).
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

import mmap
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from kvtier.buffers import Value, as_parts, from_extents, into_extents, run_copy
from kvtier.errors import RemoteAuthFailed, RemoteRefused, RemoteUnavailable
from kvtier.logs import get_logger
from kvtier.server import protocol as p
from kvtier.server.channel import Channel
from kvtier.server.link import Link, ShmLease, scratch_parts

log = get_logger(__name__)

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
        self._ch = Channel(host, port, timeout, shm, token, tls, tls_ca)
        self._readers: list[KVClient] | None = None  # the extra connections of large TCP gets
        self._reader_threads: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"KVClient({self._ch.host}:{self._ch.port})"

    # Called with each mapping of the server's pool, and before it is unmapped (e.g. to
    # register it with CUDA); on_map returning False: no borrowing (LendingStore).
    @property
    def on_map(self) -> Callable[[mmap.mmap], bool] | None:
        return self._ch.on_map

    @on_map.setter
    def on_map(self, hook: Callable[[mmap.mmap], bool] | None) -> None:
        self._ch.on_map = hook

    @property
    def on_unmap(self) -> Callable[[mmap.mmap], None] | None:
        return self._ch.on_unmap

    @on_unmap.setter
    def on_unmap(self, hook: Callable[[mmap.mmap], None] | None) -> None:
        self._ch.on_unmap = hook

    # -- operations --------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Value]) -> None:
        parts = [as_parts(v) for v in values]
        sizes = [sum(len(x) for x in ps) for ps in parts]
        self._ch.run(lambda link: self._put(link, keys, parts, sizes))

    def _put(
        self,
        link: Link,
        keys: Sequence[bytes],
        parts: list[list[memoryview]],
        sizes: list[int],
    ) -> None:
        if link.shm is None:
            self._ch.call(
                link,
                p.Op.PUT,
                p.encode_keys(keys, sizes),
                [x for ps in parts for x in ps],
                sum(sizes),
            )
            return
        t0 = time.monotonic()
        _, meta = self._ch.call(link, p.Op.PUT_ALLOC, p.encode_keys(keys, sizes))
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
        self._ch.in_time(link, t0, "put_deadline", "put")
        self._ch.send(link, p.Op.PUT_COMMIT, p.encode_u32(ticket))
        # The commit has no reply; a request after it on this connection is
        # served after it, so its answer means the put is visible to every
        # client (a flushed store is then a hit on another node at once).
        self._ch.call(link, p.Op.EXISTS, p.encode_keys(keys[:1]))

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(keys)

        def fresh(i: int, size: int) -> list[memoryview]:
            view = out[i] = np.empty(size, np.uint8).data
            return [view]

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
        threads = self._reader_threads
        assert threads is not None  # made with the readers
        futures = [
            threads.submit(reader.get_into, keys[a:b], parts[a:b], spread=False)
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
        with self._ch.lock:
            if self._readers is None:
                self._readers = []
                for _ in range(READERS - 1):
                    ch = self._ch
                    reader = KVClient(
                        ch.host,
                        ch.port,
                        timeout=ch.timeout,
                        shm=False,
                        token=ch.token,
                        tls=ch.tls,
                        tls_ca=ch.tls_ca,
                    )
                    try:
                        _ = reader.shm_active  # connects (and authenticates) now
                    except (RemoteUnavailable, RemoteRefused, RemoteAuthFailed) as e:
                        log.info(
                            "kvtier server %s:%d: %d more read connections (%s); "
                            "large gets use those",
                            self._ch.host,
                            self._ch.port,
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

        def lease(link: Link) -> tuple[Link, np.ndarray, float, memoryview] | None:
            if link.shm is None or not link.borrowable:
                return None
            t0 = time.monotonic()
            return link, link.shm, t0, self._ch.call(link, p.Op.GET_SHM, p.encode_keys(keys))[1]

        leased = self._ch.run(lease)
        if leased is None:
            return None
        link, pool, t0, meta = leased
        ticket, entries = p.decode_extents(meta)
        places = [
            (ext[0][0], size) if size != p.MISSING and len(ext) == 1 else None
            for size, ext in entries
        ]
        leading = next(
            (i for i, (size, _) in enumerate(entries) if size == p.MISSING), len(entries)
        )

        def release() -> None:
            with self._ch.lock:
                # that connection closed: the server let go of the lease then
                if link is not self._ch.link:
                    return
                try:
                    self._ch.send(link, p.Op.RELEASE, p.encode_u32(ticket))
                except RemoteUnavailable:  # dropped now: the same
                    pass

        return ShmLease(places, leading, pool, release, t0 + link.bound("lease_timeout") / 2)

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
        with self._ch.lock:
            return dict(self._ch.connect().info)

    @property
    def shm_active(self) -> bool:
        with self._ch.lock:
            return self._ch.connect().shm is not None

    def close(self) -> None:
        with self._ch.lock:
            self._ch.drop()
            readers, self._readers = self._readers or [], None
            threads, self._reader_threads = self._reader_threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        for reader in readers:
            reader.close()

    # -- on the channel ------------------------------------------------------------------

    def _simple(self, op: p.Op, meta: bytes) -> memoryview:
        """A request without payload, its reply's meta."""
        return self._ch.run(lambda link: self._ch.call(link, op, meta)[1])

    def _get(
        self, keys: Sequence[bytes], dest: Callable[[int, int], list[memoryview] | None]
    ) -> None:
        """GET `keys`; for each present value of `size` bytes, `dest(i, size)`
        names the buffers it goes into (None: not wanted, skipped)."""
        self._ch.run(lambda link: self._get_on(link, keys, dest))

    def _get_on(
        self,
        link: Link,
        keys: Sequence[bytes],
        dest: Callable[[int, int], list[memoryview] | None],
    ) -> None:
        if link.shm is not None:
            t0 = time.monotonic()
            _, meta = self._ch.call(link, p.Op.GET_SHM, p.encode_keys(keys))
            ticket, entries = p.decode_extents(meta)
            try:
                copy = []
                for i, (size, extents) in enumerate(entries):
                    parts = None if size == p.MISSING else dest(i, size)
                    if parts is not None:
                        copy += from_extents(link.shm, extents, parts)
                run_copy(copy)
            finally:
                self._ch.send(link, p.Op.RELEASE, p.encode_u32(ticket))
            self._ch.in_time(link, t0, "lease_timeout", "get")
            return
        h, meta = self._ch.call(link, p.Op.GET, p.encode_keys(keys))
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
            self._ch.fail(link, e)


def _shares(sizes: Sequence[int], most: int, least_bytes: int) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive values, about equal in bytes, at most `most` of them
    and each at least `least_bytes` (one range when the total is smaller than two)."""
    total = sum(sizes)
    n = max(1, min(most, len(sizes), total // least_bytes))
    shares: list[tuple[int, int]] = []
    a = acc = 0
    for i, size in enumerate(sizes):
        acc += size
        if len(shares) < n - 1 and acc >= total * (len(shares) + 1) / n:
            shares.append((a, i + 1))
            a = i + 1
    shares.append((a, len(sizes)))
    return shares
