"""A client's connection to `kvtier server`, kept between calls and made again when it fails
(KVClient's ops run on it): dialled, HELLO, authenticated (auth.py), the server's pool mapped
once on the same host (and kept across connections to the same pool), each request framed and
its reply read, a fault turned into RemoteUnavailable (the connection dropped, the next call
connects again), and a call on a kept connection the restarted server closed sent again."""

from __future__ import annotations

import itertools
import mmap
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from kvtier.errors import RemoteAuthFailed, RemoteRefused, RemoteUnavailable, ValueTooLarge
from kvtier.server import auth
from kvtier.server import protocol as p
from kvtier.server.link import Link, PoolMap, dial, map_server_pool, pool_inode

T = TypeVar("T")


class Channel:
    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        shm: bool,
        token: str | None,
        tls: bool,
        tls_ca: str | None,
    ) -> None:
        self.host, self.port, self.timeout, self.use_shm = host, port, timeout, shm
        self.token, self.tls, self.tls_ca = token, tls, tls_ca
        # Called with each mapping of the server's pool, and before it is unmapped
        # (e.g. to register it with CUDA); on_map returning False: no borrowing.
        self.on_map: Callable[[mmap.mmap], bool] | None = None
        self.on_unmap: Callable[[mmap.mmap], None] | None = None
        self.link: Link | None = None  # the kept connection (None: the next call connects)
        self._pool: PoolMap | None = None  # kept across connections to the same pool
        self.lock = threading.Lock()  # held by a call from its request to its reply's end
        self._req_ids = itertools.count(1)

    def run(self, work: Callable[[Link], T]) -> T:
        """`work(link)` on the kept connection, under the lock. Where a kept connection turns
        out closed before any reply to `work` (the server restarted since the link's last use),
        `work` goes once more on a new connection: a restart costs no miss. Either no request
        of `work` reached a live server, or its reply was lost, and every op of KVClient may
        run twice (a put stores the same bytes again; a lease dies with its connection)."""
        with self.lock:
            kept = self.link
            link = self.connect()
            replies = link.replies
            try:
                return work(link)
            except RemoteUnavailable as e:
                stale = link is kept and link.replies == replies
                if not stale or not isinstance(e.__cause__, ConnectionError):
                    raise
            return work(self.connect())

    def connect(self) -> Link:
        """The kept connection, or a new one (the caller holds the lock)."""
        if self.link is not None:
            if time.monotonic() - self.link.used < self.link.bound("idle_timeout") / 2:
                self.link.used = time.monotonic()
                return self.link
            self.drop(keep_pool=True)  # the server may be closing it as idle: take a fresh one
        sock = dial(self.host, self.port, self.timeout, self.tls, self.tls_ca)
        link = Link(sock, {}, None, tls=self.tls)
        _, meta = self.call(
            link, p.Op.HELLO, p.encode_json({"host_id": p.host_id() if self.use_shm else ""})
        )
        link.info = p.decode_json(meta)
        if link.info.get("auth"):
            self._authenticate(link)
        if link.info.get("shm"):
            pool = self._pool_of(link.info["shm"])
            if pool is not None:
                link.shm, link.borrowable = pool.array, pool.borrowable
        self.link = link
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
        _, meta = self.call(link, p.Op.AUTH, p.encode_json({"proof": proof.hex()}))
        link.info.update(p.decode_json(meta))

    def in_time(self, link: Link, t0: float, bound: str, what: str) -> None:
        """Fail a same-host copy that took more than half of the server's `bound`
        (after which it frees what the copy used)."""
        took = time.monotonic() - t0
        if took > link.bound(bound) / 2:
            self.fail(
                link,
                TimeoutError(
                    f"a shared-memory {what} took {took:.1f} s, more than half the "
                    f"server's {bound} ({link.bound(bound):g} s): dropped"
                ),
            )

    def drop(self, keep_pool: bool = False) -> None:
        """Close the connection; the pool's mapping too unless `keep_pool` (a healthy
        server: the next connection finds the same pool)."""
        if self.link is not None:
            self.link.close()
            self.link = None
        if not keep_pool:
            self._release_pool()

    def send(
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
            self.fail(link, e)
        return req_id

    def call(
        self,
        link: Link,
        op: p.Op,
        meta: bytes,
        parts: Sequence[memoryview] = (),
        payload_len: int = 0,
    ) -> tuple[p.Header, memoryview]:
        """Send a request and read its reply's header and meta; the reply's
        payload (a GET's values) is left for the caller to read."""
        req_id = self.send(link, op, meta, parts, payload_len)
        try:
            head = bytearray(p.HEADER_SIZE)
            link.recv_into(memoryview(head))
            h = p.parse_header(head, replies=True)
            link.replies += 1
            # the server's last word before it closes
            parting = h.req_id == 0 and h.flags != p.Status.OK
            if not parting and (h.op != op | p.REPLY or h.req_id != req_id):
                raise p.ProtocolError(f"reply {h.op:#x}/{h.req_id} to request {op:#x}/{req_id}")
            if h.payload_len and op != p.Op.GET:
                raise p.ProtocolError(
                    f"a {op.name} reply carries no payload, got {h.payload_len} bytes"
                )
            meta_buf = memoryview(bytearray(h.meta_len))
            link.recv_into(meta_buf)
        except (OSError, p.ProtocolError) as e:
            self.fail(link, e)
        if h.flags != p.Status.OK:
            message = (
                f"kvtier server {self.host}:{self.port}: {bytes(meta_buf).decode(errors='replace')}"
            )
            if parting or h.flags == p.Status.UNAUTHORIZED:  # the server closes this connection
                if link is self.link:
                    self.drop(keep_pool=True)
                else:
                    link.close()
            if h.flags == p.Status.UNAUTHORIZED:
                raise RemoteAuthFailed(message)
            raise (ValueTooLarge if h.flags == p.Status.TOO_LARGE else RemoteRefused)(message)
        return h, meta_buf

    def fail(self, link: Link, e: Exception) -> NoReturn:
        # SO_RCVTIMEO / SO_SNDTIMEO (or TLS's) ran out
        if isinstance(e, (BlockingIOError, socket.timeout)):
            e = TimeoutError(f"no progress within {self.timeout} s")
        if link is self.link:
            self.drop()
        else:
            link.close()
        raise RemoteUnavailable(f"kvtier server {self.host}:{self.port}: {e}") from e
