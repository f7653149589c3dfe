"""The store server's options (its flags) and the state every connection and the
management API share: the pool, its index, tokens, TLS, the bounds."""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from kvtier.logs import get_logger
from kvtier.server.auth import Tokens, load_tokens
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
    tenants_file: Path | None = None  # tenant name -> token, besides --auth-token's
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_connections: int = 1024
    max_held_bytes: int | None = None  # per connection, leased + reserved; None: half the pool
    lease_timeout: float = 30.0  # s a lease (or a reply's pin) may live
    # s from a put's header (or PUT_ALLOC) to its last byte (or PUT_COMMIT)
    put_deadline: float = 30.0
    idle_timeout: float = 300.0  # s a connection may send nothing
    dev_name: str | None = None
    link_type: str = "IB"
    hint_gid_index: int | None = None
    shm: bool = True  # offer the same-host shared-memory path
    io_threads: int = min(os.cpu_count() or 1, 4)  # event loops serving connections

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.auth_token:
            raise ValueError(
                f"--host {self.host} is not a loopback address: "
                "the KV port and the management API need a "
                f"token there. Pass --auth-token or set {AUTH_TOKEN_ENV} "
                "(tenants' tokens, --tenants, come on top of it)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for name in ("service_port", "manage_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: expected a port, 0 to 65535"
                )
        for name in ("lease_timeout", "put_deadline", "idle_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: expected seconds > 0"
                )
        if self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections}: need at least 1")
        if self.max_held_bytes is not None and self.max_held_bytes <= 0:
            raise ValueError(f"--max-held-per-conn {self.max_held_bytes}: expected bytes > 0")
        if self.link_type not in ("IB", "Ethernet"):
            raise ValueError(f"--link-type {self.link_type!r}: expected IB or Ethernet")
        if self.io_threads < 1:
            raise ValueError(f"--io-threads {self.io_threads}: need at least 1")


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
    return (
        f"RDMA device {opts.dev_name} found ({opts.link_type}, gid index {opts.hint_gid_index}), "
        "but this kvtier build has no RDMA transport; serving TCP"
    )


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
        self.tokens: Tokens | None = load_tokens(opts.auth_token, opts.tenants_file)
        self.tls: ssl.SSLContext | None = _tls_context(opts) if opts.tls_cert else None
        self.max_held = opts.max_held_bytes or self.pool.capacity // 2
        # how often each connection checks its bounds: a bound is enforced within a quarter of
        # itself (<= 1 s)
        self.tick = max(
            0.05, min(1.0, min(opts.lease_timeout, opts.put_deadline, opts.idle_timeout) / 4)
        )
        self._noted: set[tuple[str, str]] = set()
        # open connections per I/O loop (app.py counts them)
        self.loop_connections = [0] * opts.io_threads

    def stats(self) -> dict:
        return {**self.index.snapshot(), "loop_connections": list(self.loop_connections)}

    def note(self, peer_host: str, bound: str, message: str) -> None:
        """Log `message` the first time `peer_host` hits `bound` (counting is the caller's)."""
        if (peer_host, bound) in self._noted:
            return
        if len(self._noted) > 100_000:  # a flood of hosts: forget, and log again
            self._noted.clear()
        self._noted.add((peer_host, bound))
        log.warning("client %s: %s (logged once per client host)", peer_host, message)

    def close(self) -> None:
        try:
            self.pool.close()
        except BufferError:  # a view is still exported; the process is exiting anyway
            pass


def _tls_context(opts: ServerOptions) -> ssl.SSLContext:
    assert opts.tls_cert is not None  # made only where --tls-cert is given
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--tls-cert {opts.tls_cert} / --tls-key {opts.tls_key}: {e}") from None
    return ctx
