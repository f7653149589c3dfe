"""One connection of the store server's client: its socket (plain or TLS), what the
server said in HELLO, and, on the server's host, its pool mapped here; and the
values borrowed from that pool in place (`ShmLease`)."""

from __future__ import annotations

import mmap
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtier import framing
from kvtier.buffers import IOV_MAX, as_parts, unsent
from kvtier.errors import RemoteUnavailable
from kvtier.logs import get_logger
from kvtier.shm import open_mapped, proc_path

log = get_logger(__name__)


def dial(host: str, port: int, timeout: float, tls: bool, tls_ca: str | None) -> socket.socket:
    """A connected socket, with the timeout kept by the kernel where it can be."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        if tls:
            ctx = ssl.create_default_context(cafile=tls_ca)
            sock = ctx.wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as e:
        raise RemoteUnavailable(
            f"kvtier server {host}:{port} unreachable{' over TLS' if tls else ''}: {e}"
        ) from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not tls:
        # Blocking, with the timeout kept by the kernel: Python's own timeout
        # polls before every call, and a blocking recv can wait for a whole value.
        # (An SSL socket keeps Python's: a kernel timeout there reads as "want read".)
        sock.settimeout(None)
        limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    return sock


@dataclass
class Link:
    sock: socket.socket
    info: dict
    shm: np.ndarray | None  # the server's pool, mapped, on the same host (the client's PoolMap)
    tls: bool = False
    used: float = field(default_factory=time.monotonic)
    borrowable: bool = True  # values may be lent out in place (see KVClient.borrow)
    replies: int = 0  # replies received on it: none since a call began, its server never answered

    def send(self, parts: list) -> None:
        if self.tls:  # an SSL socket has no sendmsg
            for part in as_parts(parts):
                self.sock.sendall(part)
        else:
            send_all(self.sock, parts)

    def recv_into(self, view: memoryview) -> None:
        if self.tls:  # nor recv flags
            while len(view):
                n = self.sock.recv_into(view)
                if n == 0:
                    raise ConnectionError("server closed the connection")
                view = view[n:]
        else:
            recv_exactly(self.sock, view)

    def bound(self, name: str) -> float:
        """A bound the server enforces (seconds), from its HELLO reply; inf if it has none."""
        return float(self.info.get("bounds", {}).get(name) or "inf")

    def close(self) -> None:
        """The connection only: the pool's mapping is the client's (PoolMap)."""
        self.sock.close()
        self.shm = None


@dataclass
class ShmLease:
    """Values borrowed from the server's pool: `places[i]` is (offset, bytes) of
    key i's value in `pool` (None: absent, or not one contiguous range);
    `leading`: how many keys, from the first, the server holds. Valid until
    `release()`, and only if the server did not drop the lease first:
    `in_time()` says so."""

    places: list[tuple[int, int] | None]
    leading: int
    pool: np.ndarray  # the whole mapped pool
    _release: Callable[[], None]
    _deadline: float
    _released: bool = False

    def in_time(self) -> bool:
        return time.monotonic() < self._deadline

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


def send_all(sock: socket.socket, parts: list) -> None:
    """One gathered send for header, meta and values (no extra segment and
    wakeup for the header alone), resumed where the kernel stopped taking."""
    views = [v for v in as_parts(parts) if len(v)]
    while views:
        views = unsent(views, sock.sendmsg(views[:IOV_MAX]))


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    framing.recv_into(sock, view, "server")


_SCRATCH = memoryview(bytearray(1 << 20))


def scratch_parts(size: int) -> list[memoryview]:
    """Where an unwanted value's bytes are read to, to keep the stream in step."""
    return [_SCRATCH[: min(len(_SCRATCH), size - off)] for off in range(0, size, len(_SCRATCH))]


@dataclass
class PoolMap:
    """The server's pool mapped into this process. The client keeps it across its
    connections to the same pool (a connection left idle is replaced; mapping and
    registering tens of GB with CUDA takes seconds), and lets it go once the pool is
    another (`inode` differs: the server restarted) or a connection failed."""

    inode: tuple[int, int]  # the memfd's (st_dev, st_ino)
    mapping: mmap.mmap
    array: np.ndarray
    borrowable: bool = True  # values may be lent out in place (see KVClient.borrow)
    replies: int = 0  # replies received on it: none since a call began, its server never answered
    on_unmap: Callable[[mmap.mmap], None] | None = None

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        if self.on_unmap is not None:
            self.on_unmap(self.mapping)
        try:
            self.mapping.close()
        except BufferError:  # a borrowed view is still alive: the map goes with it
            pass


def pool_inode(shm: dict) -> tuple[int, int] | None:
    """Which memfd the server offers (None: not reachable from here)."""
    try:
        st = os.stat(proc_path(shm["pid"], shm["fd"]))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def map_server_pool(shm: dict) -> PoolMap | None:
    """Map the server's pool memfd, or None (then values go over TCP)."""
    path = proc_path(shm["pid"], shm["fd"])
    try:
        opened = open_mapped(path, shm["size"], writable=True, populate=True)
    except OSError as e:  # another PID namespace or no permission: the byte stream still works
        log.info("kvtier server pool not mappable (%s): values go over TCP", e)
        return None
    assert opened is not None  # no file expected: whichever is there
    inode, mapping = opened
    return PoolMap(inode, mapping, np.frombuffer(mapping, np.uint8))
