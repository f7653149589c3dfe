"""A store-server connection's replies: framed and written without a copy in Python.

Replies go out as views of pool pages. What the kernel takes at once is
sent through our own socket object on the transport's descriptor, whose
send releases the GIL (uvloop's first write holds it through the syscall,
in which the kernel also delivers to the peer: half of the GIL time of two
busy loops was 24-byte PUT acks); whatever it does not take goes to the
transport. The values stay pinned until the transport has drained them.

The write-buffer high-water mark is 0: any reply the kernel did not take at
once pauses reading (back-pressure) until the transport drains, and the
drain is also when the pins of the replies sent are dropped. Over TLS
(the transport encrypts every byte, so no send of our own) reading is
not paused: uvloop's TLS layer stops writing while reading is paused.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from kvtier.buffers import IOV_MAX, as_parts, unsent
from kvtier.server import protocol as p
from kvtier.server.bounds import Holdings
from kvtier.server.index import Entry


class Replies:
    """`sock`: our own socket object on the transport's descriptor (None over TLS, where
    every byte goes through the transport, and for a socket not TCP's); `holdings`: where
    the values of replies not yet drained are pinned."""

    def __init__(
        self,
        transport: asyncio.Transport,
        sock: socket.socket | None,
        holdings: Holdings,
        tls: bool,
    ) -> None:
        self.transport, self._sock, self.holdings, self._tls = transport, sock, holdings, tls
        transport.set_write_buffer_limits(high=0)

    def send(
        self,
        h: p.Header,
        *,
        meta: bytes = b"",
        status: p.Status = p.Status.OK,
        payload: Sequence[memoryview] = (),
        payload_len: int = 0,
        pins: Sequence[Entry] = (),
    ) -> None:
        """The reply to the frame `h`: `meta`, then `payload` (views of `pins`' pages, pinned
        until they are out)."""
        head = p.pack_header(h.op | p.REPLY, h.req_id, len(meta), payload_len, flags=status) + meta
        parts = as_parts([head, *payload])
        rest = self._send_now(self._sock, parts) if self._sock is not None else parts
        if rest:
            self.transport.writelines(rest)
        self.holdings.pin(list(pins))
        if self.transport.get_write_buffer_size() == 0:
            self.holdings.unpin()

    def paused(self) -> None:
        """The transport holds replies the kernel did not take: stop reading requests (not
        over TLS, whose layer stalls its own writes while reading is paused; what replies
        pin there is bounded by --max-held-per-conn)."""
        if not self._tls:
            self.transport.pause_reading()

    def drained(self) -> None:
        """Every reply is out: their values unpinned, reading on again."""
        self.holdings.unpin()
        if not self._tls and not self.transport.is_closing():
            self.transport.resume_reading()

    def _send_now(self, sock: socket.socket, parts: list[memoryview]) -> list[memoryview]:
        """Send what the kernel takes at once, through our own socket object
        (its send releases the GIL, so other loops run meanwhile; the
        transport's first write holds it); the rest is for the transport."""
        if self.transport.get_write_buffer_size():
            return parts  # behind earlier bytes
        try:
            sent = sock.sendmsg(parts[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return parts  # the transport meets the same error and closes the connection
        return unsent(parts, sent)
