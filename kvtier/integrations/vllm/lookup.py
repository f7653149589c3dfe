"""Prefix lookup across processes: vLLM's scheduler asks the workers.

vLLM's scheduler and its workers live in different processes (the CPU
platform always uses the multiprocess executor), while the tiers live in
the worker. Each worker rank serves the scheduler on a ZMQ IPC socket:

    request:  "KL" | version u8 (6) | op u8 | request-id length u16 | request id (utf-8)
              | payload
        LOOKUP   payload: the tokens the engine has already (its own prefix cache), flags
                 (bit 0: a hit all in CPU RAM will load beside the engine's steps, not
                 inside one), both u32; the request's identity (its keys' root and
                 multimodal items: `Identity.wire`, keys.py); then the token ids, u32, all
                 little-endian; the worker leases the hit for that request (protected
                 until its load), and may start moving it
        RELEASE  the request will not load what it looked up
        RESET    drop the worker's local tiers (vLLM's reset_prefix_cache)
    reply:    two little-endian u64 and a u8: LOOKUP (hit tokens, of them in CPU RAM,
              whether the worker holds them: a worker that will load none of the hit,
              since the engine has it, lets it go at once, and the scheduler sends no
              RELEASE); otherwise (1, 0, 0) done

The client waits at most `timeout_s`; a worker that does not answer is a
miss (0 tokens), never a hang. A worker in the scheduler's own process (vLLM's
uniprocess executor, one GPU: both run on the engine core's thread) is asked by
a direct call instead, with no socket and no handoff of the GIL between threads
while vLLM's scheduler waits (inside vLLM on an H200 a lookup took 1.31-1.46 ms
over the socket, 0.93-1.17 ms called directly; results/gpu-h200-vllm-2026-11-28/README.md).
"""

from __future__ import annotations

import enum
import os
import struct
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from kvtier.framing import Framing, ProtocolError
from kvtier.keys import PLAIN, Identity, token_bytes
from kvtier.logs import get_logger

log = get_logger(__name__)

VERSION = 6
BESIDE = 1  # LOOKUP flag: a CPU-RAM hit loads beside the steps
# magic, version, then op and the request id's length (kvtier.framing)
HEAD = Framing("kvtier lookup protocol", b"KL", VERSION, "BH")
REPLY = struct.Struct("<QQB")


class Op(enum.IntEnum):
    LOOKUP = 1
    RELEASE = 2
    RESET = 3


@dataclass(frozen=True)
class Found:
    """A lookup's answer over every rank: the hit (the shortest rank's), of it in CPU RAM,
    and whether some rank holds it for the request (to be released if it is not loaded)."""

    tokens: int
    in_cpu: int
    held: bool


@dataclass(frozen=True)
class Handlers:
    """What a worker does for each op."""

    # (tokens, identity, request id, computed, loads beside the steps) -> (hit, in CPU, held for it)
    lookup: Callable[[np.ndarray, Identity, str, int, bool], tuple[int, int, bool]]
    release: Callable[[str], None]
    reset: Callable[[], None]


def socket_path(engine_id: str, rank: int) -> str:
    """Where rank `rank`'s worker answers. On Linux an abstract socket (`@name`): no
    file is left behind by a process that is killed; elsewhere a file in the temp
    directory. ipc paths are limited to ~100 bytes, so keep them short."""
    name = f"kvtier-{engine_id[:24]}-{rank}"
    return (
        f"ipc://@{name}"
        if sys.platform == "linux"
        else f"ipc://{tempfile.gettempdir()}/{name}.sock"
    )


def encode(op: Op, request_id: str = "", payload: bytes = b"") -> bytes:
    rid = request_id.encode()
    return HEAD.pack(op, len(rid)) + rid + payload


def decode(message: bytes) -> tuple[Op, str, bytes]:
    """(op, request id, payload); a ProtocolError (a ValueError) for anything malformed."""
    op, n = HEAD.unpack(message)
    if op not in Op._value2member_map_:
        raise ProtocolError(f"kvtier lookup protocol: unknown op {op}")
    if len(message) < HEAD.size + n or (len(message) - HEAD.size - n) % 4:
        raise ProtocolError("lookup message length does not match its request id and tokens")
    return Op(op), message[HEAD.size : HEAD.size + n].decode(), message[HEAD.size + n :]


# address -> the handlers of a server in this process that takes direct calls
# (LookupServer's `direct`)
_IN_PROCESS: dict[str, Handlers] = {}


def answer(handlers: Handlers, op: Op, request_id: str, payload: bytes) -> tuple[int, int, int]:
    """A request's reply; ValueError for a malformed one."""
    if op == Op.LOOKUP:
        if len(payload) < 8:
            raise ValueError("a lookup without its count of computed tokens and its flags")
        computed, flags = struct.unpack_from("<II", payload)
        identity, size = Identity.from_wire(memoryview(payload)[8:])
        tokens = np.frombuffer(payload, dtype="<u4", offset=8 + size)
        hit, in_cpu, held = handlers.lookup(
            tokens, identity, request_id, computed, bool(flags & BESIDE)
        )
        return hit, in_cpu, int(held)
    if op == Op.RELEASE:
        handlers.release(request_id)
    else:
        handlers.reset()
    return 1, 0, 0


class LookupServer:
    """Answers the scheduler for one worker from a daemon thread; with `direct`, a client in
    this process calls `handlers` itself (on its own thread) instead."""

    def __init__(self, address: str, handlers: Handlers, direct: bool = False) -> None:
        self.address = address
        self._handlers = handlers
        if direct:
            _IN_PROCESS[address] = handlers
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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
            message = self._sock.recv()
            self._sock.send(REPLY.pack(*answered(self._handlers, message)))

    def close(self) -> None:
        if _IN_PROCESS.get(self.address) is self._handlers:
            del _IN_PROCESS[self.address]
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        path = self.address.removeprefix("ipc://")
        if not path.startswith("@") and os.path.exists(path):
            os.unlink(path)


def answered(handlers: Handlers, message: bytes) -> tuple[int, int, int]:
    """`answer` of an encoded request; a malformed one is answered "no hit"."""
    try:
        return answer(handlers, *decode(message))
    except ValueError as exc:
        log.warning("lookup request rejected: %s", exc)
        return 0, 0, 0


class LookupClient:
    """Asks every worker rank; the hit is the shortest of their answers."""

    def __init__(self, addresses: list[str], timeout_s: float) -> None:
        self.addresses = addresses
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks = [self._connect(a) for a in addresses]

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.connect(address)
        return sock

    def lookup(
        self,
        tokens: list[int] | np.ndarray,
        request_id: str = "",
        computed: int = 0,
        beside: bool = False,
        identity: Identity = PLAIN,
    ) -> Found:
        """The hit over every rank; none if a rank is silent (what the others hold expires
        with `pin_timeout_sec`). `computed`: the leading tokens the engine has already (not
        to be loaded); `beside`: a hit all in CPU RAM will load beside the engine's steps."""
        flags = BESIDE if beside else 0
        payload = struct.pack("<II", computed, flags) + identity.wire() + token_bytes(tokens)
        replies = self._ask(encode(Op.LOOKUP, request_id, payload))
        if replies is None:
            return Found(0, 0, False)
        return Found(
            min(r[0] for r in replies), min(r[1] for r in replies), any(r[2] for r in replies)
        )

    def release(self, request_id: str) -> None:
        self._ask(encode(Op.RELEASE, request_id))

    def reset(self) -> bool:
        return self._ask(encode(Op.RESET)) is not None

    def _ask(self, message: bytes) -> list[tuple[int, int, int]] | None:
        replies = []
        for i, sock in enumerate(self._socks):
            handlers = _IN_PROCESS.get(self.addresses[i])
            if handlers is not None:  # the worker is in this process: no socket, no thread
                replies.append(answered(handlers, message))
                continue
            try:
                sock.send(message)
                replies.append(REPLY.unpack(sock.recv()))
            except zmq.Again:
                # A REQ socket that timed out is stuck mid-exchange: replace it.
                log.warning(
                    "lookup at %s timed out after %d ms: treated as a miss",
                    self.addresses[i],
                    self.timeout_ms,
                )
                sock.close(0)
                self._socks[i] = self._connect(self.addresses[i])
                return None
        return replies

    def close(self) -> None:
        for sock in self._socks:
            sock.close(0)
