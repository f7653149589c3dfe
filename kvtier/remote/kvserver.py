"""kvtier:// and infinistore:// — our store server, through its own client."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from kvtier.logs import get_logger
from kvtier.server.client import KVClient

log = get_logger(__name__)


def open_kvserver(url: str, timeout: float) -> KVClient:
    parts = urlsplit(url)
    device = parse_qs(parts.query).get("device", [None])[0]
    if device is not None:
        # InfiniStore's connector uses RDMA only; ours talks TCP (or shared memory
        # on the same host) until the RDMA transport of docs/rdma.md is built.
        log.info("remote %s: RDMA device %s requested; kvtier's client uses TCP", url, device)
    return KVClient(parts.hostname or "127.0.0.1", parts.port or 12345, timeout=timeout)
