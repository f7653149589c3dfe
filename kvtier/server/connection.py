"""One client connection of the store server: frames in, dispatched, replies out (replies.py).

A connection lives on one of the server's event loops (app.py); what it
shares with the other loops, it reaches through the index, under its lock.

Bytes land where they belong without a copy in Python: `get_buffer` hands
the event loop the header buffer, then the meta buffer, then, for a PUT,
the pool pages reserved for the values, so the kernel copies payloads
straight into the pool. While a PUT's values arrive, SO_RCVLOWAT asks the
kernel to wake the loop once per MiB (never for more than is still owed),
so a value comes in a few large reads instead of dozens of small ones.

Replies go out through `Replies` (replies.py): views of pool pages, pinned until
the transport has drained them, with back-pressure on reading.

Anything that is not the protocol (bad magic or version, an absurd length,
truncated meta) closes this connection with the reason logged; other
connections are not affected. The request-reply operations are in ops.py.

Access and bounds (auth.py, bounds.py): with tokens, only HELLO and AUTH
(with small meta) are read until AUTH succeeds, and the tenant's prefix is
put in front of every key. A connection counts the bytes it holds (leases,
reservations, replies still pinned in the transport) against
`--max-held-per-conn`; a timer drops leases older than `--lease-timeout`
(and aborts a connection whose replies have not drained by then), aborts
a put whose values or commit take longer than `--put-deadline` (closing
the connection), and closes a connection silent for `--idle-timeout`.
"""

from __future__ import annotations

import asyncio
import enum
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kvtier.logs import get_logger
from kvtier.server import auth
from kvtier.server import protocol as p
from kvtier.server.bounds import Holdings, PendingPut
from kvtier.server.ops import Handler, Ops
from kvtier.server.replies import Replies

if TYPE_CHECKING:
    from kvtier.server.state import ServerState

log = get_logger("kvtier.server")


def _kernel() -> tuple[int, ...]:
    release = platform.release().split("-")[0].split(".")
    return tuple(int(x) for x in release[:2] if x.isdigit())


# A PUT's values wake the loop once per _LOWAT bytes (SO_RCVLOWAT). Kernels
# since 5.10 wake a reader anyway when its receive window closes, so a
# low-water mark above what the window lets in cannot stall the stream.
_LOWAT = 1 << 20 if sys.platform == "linux" and _kernel() >= (5, 10) else 0


class _Read(enum.Enum):
    HEADER = 1
    META = 2
    PAYLOAD = 3  # a PUT's values, into reserved pool pages
    DISCARD = 4  # a refused PUT's values, read and dropped to keep the stream in step
    CLOSED = 5


_PRE_AUTH_META = 4096  # the most meta a connection may send before AUTH succeeds


class Connection(asyncio.BufferedProtocol):
    def __init__(self, state: ServerState, on_lost: Callable[[], None] = lambda: None) -> None:
        self.state, self.index, self.pool = state, state.index, state.pool
        self._on_lost = on_lost
        self.transport: asyncio.Transport  # set by connection_made, before any other event
        self.peer = "?"
        self._read = _Read.HEADER
        self._hdr = bytearray(p.HEADER_SIZE)
        self._buf = memoryview(self._hdr)  # what the current read state fills
        self._got = 0
        self._header: p.Header | None = None
        self._put: PendingPut | None = None  # a PUT whose values are arriving
        self._targets: list[memoryview] = []
        self._target = 0
        self._discard_left = 0
        self._left = 0  # payload bytes still to come
        self._lowat = 1  # the socket's SO_RCVLOWAT
        self._refusal: tuple[p.Status, str] | None = None
        self.holdings = Holdings(state)  # what it holds against its bounds (bounds.py)
        self._sock: socket.socket | None = None  # our own on the transport's: sends, SO_RCVLOWAT
        self.replies: Replies  # set by connection_made
        self._authed = state.tokens is None
        self._challenge: bytes | None = None
        self._host_id: str | None = None
        self._prefix = b""  # the tenant's namespace
        self._last_rx = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._handlers: dict[int, Handler] = {}  # set by connection_made, with the replies

    # -- transport events ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream's: asyncio's, or uvloop's (not a subclass of asyncio.Transport, the same methods)
        self.transport = cast(asyncio.Transport, transport)
        tls = self.state.tls is not None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not tls:  # over TLS every byte goes through the transport
                self._sock = socket.socket(sock.family, sock.type, fileno=os.dup(sock.fileno()))
                self._sock.setblocking(False)
        self.replies = Replies(self.transport, self._sock, self.holdings, tls)
        self._handlers = {
            p.Op.HELLO: self._hello,
            p.Op.AUTH: self._auth,
            **Ops(self.state, self.holdings, self._keys, self.replies.send).handlers(),
        }
        peer = transport.get_extra_info("peername") or ("?", "?")
        self.peer, self.peer_host = f"{peer[0]}:{peer[1]}", str(peer[0])
        self.holdings.peer_host = self.peer_host
        self.index.count(connections=1, accepted_connections=1)
        self._timer = asyncio.get_running_loop().call_later(self.state.tick, self._tick)
        log.debug("connection from %s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.index.count(connections=-1)
        self._on_lost()
        if self._timer is not None:
            self._timer.cancel()
        if self._sock is not None:
            self._sock.close()
        if self._put is not None:
            self.holdings.abort(self._put)
            self._put = None
        self.holdings.release_all()
        self._read = _Read.CLOSED
        log.debug("connection from %s closed", self.peer)

    def pause_writing(self) -> None:
        self.replies.paused()

    def resume_writing(self) -> None:
        self.replies.drained()

    # -- reading -----------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._read is _Read.PAYLOAD:
            return self._targets[self._target][self._got :]
        if self._read in (_Read.DISCARD, _Read.CLOSED):
            n = (
                min(len(self.state.scratch), self._discard_left)
                if self._read is _Read.DISCARD
                else 0
            )
            return self.state.scratch[: n or len(self.state.scratch)]
        return self._buf[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = time.monotonic()
        try:
            self._advance(nbytes)
        except p.ProtocolError as e:
            self._close(str(e))

    def _advance(self, nbytes: int) -> None:
        if self._read is _Read.CLOSED:
            return
        if self._read is _Read.DISCARD:
            self._discard_left -= nbytes
            if self._discard_left == 0:
                self._finish_refused_put()
            return
        self._got += nbytes
        if self._read is _Read.PAYLOAD:
            self._left -= nbytes
            if self._lowat > max(self._left, 1):
                self._set_lowat(self._left)
            while self._target < len(self._targets) and self._got == len(
                self._targets[self._target]
            ):
                self._target, self._got = self._target + 1, 0
            if self._target == len(self._targets):
                self._finish_put()
            return
        if self._got < len(self._buf):
            return
        if self._read is _Read.HEADER:
            self._header = p.parse_header(self._hdr)
            if not self._authed and not self._may_pass(self._header):
                return
            if self._header.meta_len:
                self._read = _Read.META
                self._buf = memoryview(bytearray(self._header.meta_len))
                self._got = 0
                return
        self._on_frame(self._frame, self._buf if self._read is _Read.META else memoryview(b""))

    @property
    def _frame(self) -> p.Header:
        """The header of the frame being read (parsed before its meta and payload)."""
        assert self._header is not None
        return self._header

    def _next_frame(self) -> None:
        self._read, self._buf, self._got = _Read.HEADER, memoryview(self._hdr), 0

    def _on_frame(self, h: p.Header, meta: memoryview) -> None:
        if h.op == p.Op.PUT:
            self._begin_put(h, meta)
            return
        if h.payload_len:
            raise p.ProtocolError(
                f"{p.Op(h.op).name} carries no payload, got {h.payload_len} bytes"
            )
        self._next_frame()
        self._handlers[h.op](h, meta)

    def _close(self, reason: str, counter: str = "protocol_errors") -> None:
        if counter == "protocol_errors":
            log.warning("closing connection from %s: %s", self.peer, reason)
        self.index.count(**{counter: 1})
        self._read = _Read.CLOSED
        self.transport.abort()

    # -- access ------------------------------------------------------------------------

    def _may_pass(self, h: p.Header) -> bool:
        """Before AUTH: only HELLO and AUTH, with small meta."""
        if h.op not in (p.Op.HELLO, p.Op.AUTH):
            self._deny(
                h,
                "no-auth",
                f"authenticate first: this server wants a token before {p.Op(h.op).name} "
                "(kvtier://host:port/?token_env=VAR, or the config key remote_auth_token)",
            )
            return False
        if h.meta_len > _PRE_AUTH_META or h.payload_len:
            raise p.ProtocolError(f"{p.Op(h.op).name} before AUTH with {h.meta_len} bytes of meta")
        return True

    def _deny(self, h: p.Header, why: str, message: str) -> None:
        """Refuse with one clear error, count it, and close once the reply is out."""
        self.index.count(auth_failures=1)
        self.state.note(self.peer_host, why, message)
        self._read = _Read.CLOSED
        self.replies.send(h, meta=message.encode(), status=p.Status.UNAUTHORIZED)
        self.transport.close()

    def _hello(self, h: p.Header, meta: memoryview) -> None:
        hello = p.decode_json(meta) if len(meta) else {}
        self._host_id = hello.get("host_id")
        opts = self.state.opts
        info = {
            "version": p.VERSION,
            "capacity": self.pool.capacity,
            "page_size": self.pool.page_size,
            "transport": "tls" if self.state.tls else "tcp",
            "rdma": self.state.rdma_note,
            "bounds": {
                "max_held": self.state.max_held,
                "lease_timeout": opts.lease_timeout,
                "put_deadline": opts.put_deadline,
                "idle_timeout": opts.idle_timeout,
            },
        }
        if self._authed:
            info["shm"] = self._shm_offer()
        else:
            self._challenge = auth.new_challenge()
            info.update(auth=auth.SCHEME, challenge=self._challenge.hex(), shm=None)
        self.replies.send(h, meta=p.encode_json(info))

    def _auth(self, h: p.Header, meta: memoryview) -> None:
        if self.state.tokens is None or self._authed:
            self.replies.send(h, meta=b"AUTH: this connection needs none", status=p.Status.ERROR)
            return
        challenge, self._challenge = self._challenge, None  # one try per challenge
        proof = p.decode_json(meta).get("proof")
        try:
            proof = bytes.fromhex(proof) if isinstance(proof, str) else b""
        except ValueError:
            proof = b""
        who = self.state.tokens.verify(challenge, proof) if challenge is not None else None
        if who is None:
            if challenge is None:
                self._deny(h, "no-challenge", "AUTH before HELLO's challenge")
            else:
                self._deny(h, "wrong-token", "authentication failed: wrong token")
            return
        self._authed, self._prefix = True, who.prefix
        log.debug("connection from %s is tenant %r", self.peer, who.name)
        self.replies.send(h, meta=p.encode_json({"tenant": who.name, "shm": self._shm_offer()}))

    def _shm_offer(self) -> dict | None:
        if self._host_id != self.state.host_id or not self.state.shm_enabled:
            return None
        return {"pid": self.state.pid, "fd": self.pool.fd, "size": self.pool.capacity}

    def _keys(self, meta: memoryview, *, with_sizes: bool = False) -> tuple[list[bytes], list[int]]:
        keys, sizes = p.decode_keys(meta, with_sizes=with_sizes)
        if self._prefix:
            keys = [self._prefix + k for k in keys]
        return keys, sizes

    # -- bounds (bounds.py) ---------------------------------------------------------------

    def _tick(self) -> None:
        """Expire what outlived its bound; runs every `state.tick` seconds."""
        if self._read is _Read.CLOSED:
            return
        expiry = self.holdings.check(self._put, self._last_rx)
        if expiry is not None and expiry.bound == "idle-timeout":
            self.index.count(idle_closed=1)
            self._read = _Read.CLOSED
            self.transport.close()
            return
        if expiry is not None:
            self.state.note(self.peer_host, expiry.bound, expiry.message)
            self._close(
                expiry.message,
                "put_deadlines" if expiry.bound == "put-deadline" else "lease_timeouts",
            )
            return
        self._timer = asyncio.get_running_loop().call_later(self.state.tick, self._tick)

    # -- PUT over the byte stream ----------------------------------------------------

    def _begin_put(self, h: p.Header, meta: memoryview) -> None:
        keys, sizes = self._keys(meta, with_sizes=True)
        if sum(sizes) != h.payload_len:
            raise p.ProtocolError(
                f"PUT sizes add up to {sum(sizes)}, payload is {h.payload_len} bytes"
            )
        put = self.holdings.reserve(keys, sizes)
        if isinstance(put, tuple):  # refused: read the values into nothing, then say why
            self._refusal = put
            self._read, self._discard_left = _Read.DISCARD, h.payload_len
            if h.payload_len == 0:
                self._finish_refused_put()
            return
        self._put = put
        self._targets = [
            v for pages, size in zip(put.pages, sizes) for v in self.pool.views(pages, size)
        ]
        self._read, self._target, self._got = _Read.PAYLOAD, 0, 0
        self._left = h.payload_len
        if not self._targets:
            self._finish_put()
        elif self._sock is not None and _LOWAT:
            self._set_lowat(min(self._left, _LOWAT))

    def _set_lowat(self, nbytes: int) -> None:
        """Wake this loop for the connection only once `nbytes` have arrived
        (SO_RCVLOWAT): a value then comes in a few large reads, not dozens of
        small ones each with its wakeup and callbacks."""
        self._lowat = max(nbytes, 1)
        assert self._sock is not None  # set where the kernel reads: no TLS
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, self._lowat)

    def _finish_put(self) -> None:
        put, self._put, self._targets = self._put, None, []
        assert put is not None
        self.holdings.commit(put)
        self._next_frame()
        self.replies.send(self._frame)

    def _finish_refused_put(self) -> None:
        assert self._refusal is not None
        status, message = self._refusal
        self._refusal = None
        self._next_frame()
        self.replies.send(self._frame, meta=message.encode(), status=status)
