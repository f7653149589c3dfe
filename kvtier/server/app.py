"""`kvtier server`: the store server process (InfiniStore's role).

One uvloop event loop serves every client connection (connection.py) and
the management HTTP API (manage.py); there is no thread per client. The
value pool is allocated once at start (pool.py) and indexed with LRU
eviction between watermarks (index.py).

RDMA: the flags InfiniStore takes (--dev-name, --link-type,
--hint-gid-index) are accepted. Without that device the server says so in
one line and serves TCP; the RDMA design is in docs/rdma.md.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from kvtier.logs import get_logger
from kvtier.server.connection import Connection
from kvtier.server.index import KVIndex
from kvtier.server.pool import PagePool
from kvtier.server.protocol import host_id

log = get_logger("kvtier.server")

AUTH_TOKEN_ENV = "KVTIER_SERVER_TOKEN"
INFINIBAND_SYSFS = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    service_port: int = 12345
    manage_port: int = 18080
    prealloc_bytes: int = 1 << 30
    page_size: int = 256 << 10
    evict_low: float = 0.8
    evict_high: float = 0.95
    auth_token: str | None = None
    dev_name: str | None = None
    link_type: str = "IB"
    hint_gid_index: int | None = None
    shm: bool = True  # offer the same-host shared-memory path

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.auth_token:
            raise ValueError(
                f"--host {self.host} is not a loopback address: the management API needs a token there. "
                f"Pass --auth-token or set {AUTH_TOKEN_ENV}"
            )
        if self.link_type not in ("IB", "Ethernet"):
            raise ValueError(f"--link-type {self.link_type!r}: expected IB or Ethernet")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rdma_note(opts: ServerOptions) -> str | None:
    """One line about RDMA when it was asked for; None when it was not."""
    if opts.dev_name is None:
        return None
    if not (INFINIBAND_SYSFS / opts.dev_name).exists():
        return f"RDMA device {opts.dev_name} not available; serving TCP"
    # The device exists, but the RDMA transport is designed, not built (docs/rdma.md).
    return (f"RDMA device {opts.dev_name} found ({opts.link_type}, gid index {opts.hint_gid_index}), "
            "but this kvtier build has no RDMA transport; serving TCP")


class ServerState:
    """What every connection and the management API share."""

    def __init__(self, opts: ServerOptions) -> None:
        self.opts = opts
        self.pool = PagePool(opts.prealloc_bytes, opts.page_size)
        self.index = KVIndex(self.pool, low=opts.evict_low, high=opts.evict_high)
        self.scratch = memoryview(bytearray(256 << 10))  # where refused payloads are read into
        self.host_id = host_id()
        self.pid = os.getpid()
        self.shm_enabled = opts.shm
        self.rdma_note = rdma_note(opts)

    def stats(self) -> dict:
        s = self.index.stats
        return {
            "keys": len(self.index), "value_bytes": self.index.value_bytes, "used_bytes": self.pool.used_bytes,
            "capacity_bytes": self.pool.capacity, "hits": s.hits, "misses": s.misses,
            "evictions": s.evictions, "puts": s.puts, "rejected_puts": s.rejected_puts,
            "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "connections": s.connections,
            "accepted_connections": s.accepted_connections, "protocol_errors": s.protocol_errors,
        }

    def close(self) -> None:
        try:
            self.pool.close()
        except BufferError:  # a view is still exported; the process is exiting anyway
            pass


async def serve(opts: ServerOptions, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or cancellation)."""
    from kvtier.server.manage import start_management

    state = ServerState(opts)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(state), opts.host, opts.service_port,
                                      reuse_address=True)
    runner = await start_management(state, opts.host, opts.manage_port, opts.auth_token)
    if state.rdma_note:
        log.warning(state.rdma_note)
    log.info("kvtier server on %s:%d (TCP%s), management http://%s:%d, pool %.2f GB in %d pages of %d KiB",
             opts.host, opts.service_port, ", same-host shared memory" if opts.shm else "", opts.host,
             opts.manage_port, state.pool.capacity / 1e9, state.pool.num_pages, opts.page_size >> 10)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.info("kvtier server stopping")
        server.close()
        await runner.cleanup()
        state.close()


def run(opts: ServerOptions) -> None:
    import uvloop

    uvloop.run(serve(opts))
