"""Prefix lookup across processes: vLLM's scheduler asks the workers.

vLLM's scheduler and its workers live in different processes (the CPU
platform always uses the multiprocess executor), while the CPU tier lives
in the worker. Each worker rank serves lookups on a ZMQ IPC socket:

    request:  token ids as little-endian u32 bytes
    reply:    8 bytes, little-endian u64: stored prefix length in tokens

The client waits at most `timeout_s`; a worker that does not answer is a
miss (0 tokens), never a hang.
"""

from __future__ import annotations

import os
import struct
import tempfile
import threading
from typing import Callable

import numpy as np
import zmq

from kvtier.keys import token_bytes
from kvtier.logs import get_logger

log = get_logger(__name__)


def socket_path(engine_id: str, rank: int) -> str:
    # ipc paths are limited to ~100 bytes, so keep them short.
    return f"ipc://{tempfile.gettempdir()}/kvtier-{engine_id[:24]}-{rank}.sock"


class LookupServer:
    """Answers prefix lookups for one worker from a daemon thread."""

    def __init__(self, address: str, lookup: Callable[[np.ndarray], int]) -> None:
        self.address = address
        self._lookup = lookup
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            payload = self._sock.recv()
            try:
                hit = self._lookup(np.frombuffer(payload, dtype="<u4"))
            except ValueError as exc:  # malformed request: answer "no hit"
                log.warning("lookup request rejected: %s", exc)
                hit = 0
            self._sock.send(struct.pack("<Q", hit))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


class LookupClient:
    """Asks every worker rank; the hit is the shortest of their answers."""

    def __init__(self, addresses: list[str], timeout_s: float) -> None:
        self.addresses = addresses
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._socks = [self._connect(a) for a in addresses]

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.connect(address)
        return sock

    def lookup(self, tokens: list[int] | np.ndarray) -> int:
        payload = token_bytes(tokens)
        hits = []
        for i, sock in enumerate(self._socks):
            try:
                sock.send(payload)
                hits.append(struct.unpack("<Q", sock.recv())[0])
            except zmq.Again:
                # A REQ socket that timed out is stuck mid-exchange: replace it.
                log.warning("lookup at %s timed out after %d ms: treated as a miss",
                            self.addresses[i], self.timeout_ms)
                sock.close(0)
                self._socks[i] = self._connect(self.addresses[i])
                return 0
        return min(hits) if hits else 0

    def close(self) -> None:
        for sock in self._socks:
            sock.close(0)
