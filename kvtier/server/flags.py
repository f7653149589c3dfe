"""`kvtier server`'s command line: its flags (InfiniStore's names among them) and the
server they make. `kvtier server ...` and `python -m kvtier.server ...` take the same."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvtier.server.app import run as serve
from kvtier.server.state import AUTH_TOKEN_ENV, ServerOptions, ServerState


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kvtier server", description="the store server: a KV pool for the cluster"
    )
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    D = ServerOptions  # the flags' defaults are the options'

    a = p.add_argument
    a("--host", default=D.host, help="address to bind (non-loopback needs --auth-token)")
    a("--service-port", type=int, default=D.service_port, help="KV protocol port")
    a("--manage-port", type=int, default=D.manage_port, help="management HTTP port")
    a(
        "--prealloc-size",
        type=float,
        default=D.prealloc_bytes / 1024**3,
        help="value pool, GiB, allocated at start",
    )
    a("--page-size-kb", type=int, default=D.page_size >> 10, help="pool page, KiB")
    a(
        "--evict-min-threshold",
        type=float,
        default=D.evict_low,
        help="evict down to this pool fraction",
    )
    a(
        "--evict-max-threshold",
        type=float,
        default=D.evict_high,
        help="evict when above this fraction",
    )
    a(
        "--auth-token",
        help="token for the KV port (HMAC handshake) and the management API "
        "(bearer); or $KVTIER_SERVER_TOKEN",
    )
    a("--tenants", help="YAML/JSON file: tenant name -> token; each tenant has its own keys")
    a("--tls-cert", help="PEM certificate: the KV port speaks TLS (clients: kvtiers://)")
    a("--tls-key", help="PEM private key of --tls-cert")
    a("--max-connections", type=int, default=D.max_connections, help="client connections at once")
    a(
        "--max-held-per-conn",
        type=float,
        help="GiB one connection may hold leased or reserved (default: half the pool)",
    )
    a(
        "--lease-timeout",
        type=float,
        default=D.lease_timeout,
        help="s after which a lease is dropped, even on a live connection",
    )
    a(
        "--put-deadline",
        type=float,
        default=D.put_deadline,
        help="s for a put's values to arrive after its header (or PUT_ALLOC to its commit)",
    )
    a("--idle-timeout", type=float, default=D.idle_timeout, help="s a connection may stay silent")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a("--dev-name", help="RDMA device, e.g. mlx5_0 (TCP is served when it is absent)")
    a("--link-type", default=D.link_type, choices=["IB", "Ethernet"], help="RDMA link type")
    a("--hint-gid-index", type=int, help="RDMA GID index (RoCE in Kubernetes)")
    a("--no-shm", action="store_true", help="no same-host shared-memory path")
    a(
        "--io-threads",
        type=int,
        help="event loops (one thread each) serving client connections; default: CPUs, at most 4",
    )


def run(args: argparse.Namespace) -> int:
    """The server of these flags, until it is stopped; 2 for flags that do not make one."""

    logging.getLogger("kvtier").setLevel(args.log_level.upper())
    try:
        opts = ServerOptions(
            host=args.host,
            service_port=args.service_port,
            manage_port=args.manage_port,
            prealloc_bytes=int(args.prealloc_size * 1024**3),
            page_size=args.page_size_kb << 10,
            evict_low=args.evict_min_threshold,
            evict_high=args.evict_max_threshold,
            auth_token=args.auth_token or os.environ.get(AUTH_TOKEN_ENV),
            tenants_file=Path(args.tenants) if args.tenants else None,
            tls_cert=Path(args.tls_cert) if args.tls_cert else None,
            tls_key=Path(args.tls_key) if args.tls_key else None,
            max_connections=args.max_connections,
            max_held_bytes=None
            if args.max_held_per_conn is None
            else int(args.max_held_per_conn * 2**30),
            lease_timeout=args.lease_timeout,
            put_deadline=args.put_deadline,
            idle_timeout=args.idle_timeout,
            dev_name=args.dev_name,
            link_type=args.link_type,
            hint_gid_index=args.hint_gid_index,
            shm=not args.no_shm,
            **({} if args.io_threads is None else {"io_threads": args.io_threads}),
        )
        state = ServerState(opts)
    except ValueError as e:
        print(f"kvtier server: {e}", file=sys.stderr)
        return 2
    serve(state)
    return 0
