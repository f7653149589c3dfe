"""What kvtier's three wire formats share: a fixed head that starts with a magic and a
version, checked in one place; exact reads from a blocking socket; one error for a peer
that speaks something else.

    kvtier server  (server/protocol.py)          "KVTS", op, flags, ids and lengths
    PD             (pd/protocol.py)              "KP", message type, header and payload lengths
    vLLM lookups   (integrations/vllm/lookup.py) "KL", op, request id length

Each protocol keeps its messages; a head is `Framing.pack(*fields)` out and
`Framing.unpack(buf)` in, which refuses another magic or version by name.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

from kvtier.errors import KvtierError


class ProtocolError(KvtierError, ValueError):
    """The peer sent bytes that are not this protocol (or not this version of it)."""


@dataclass(frozen=True)
class Framing:
    """A protocol's frame head: magic, version, then `fields` (a struct format without
    byte order: little-endian, no padding)."""

    name: str  # says which protocol in its errors, e.g. "kvtier server protocol"
    magic: bytes
    version: int
    fields: str
    head: struct.Struct = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fmt = f"<{len(self.magic)}sB{self.fields}"
        object.__setattr__(self, "head", struct.Struct(fmt))

    @property
    def size(self) -> int:
        return self.head.size

    def pack(self, *fields: object) -> bytes:
        return self.head.pack(self.magic, self.version, *fields)

    def unpack(self, buf: bytes | bytearray | memoryview) -> tuple:
        """The head's fields after magic and version; a ProtocolError names what differs."""
        if len(buf) < self.size:
            raise ProtocolError(f"{self.name}: a head of {len(buf)} bytes, {self.size} expected")
        magic, version, *fields = self.head.unpack_from(buf)
        if magic != self.magic:
            raise ProtocolError(
                f"{self.name}: bad magic {bytes(magic)!r} (expected {self.magic!r})"
            )
        if version != self.version:
            raise ProtocolError(
                f"{self.name}: unsupported protocol version {version} "
                f"(this kvtier speaks {self.version})"
            )
        return tuple(fields)


def recv_into(sock: socket.socket, view: memoryview, peer: str = "peer") -> None:
    """Fill `view` from a blocking socket; ConnectionError if the peer closes first."""
    while len(view):
        n = sock.recv_into(view, 0, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError(f"{peer} closed the connection")
        view = view[n:]


def recv_exact(sock: socket.socket, n: int, peer: str = "peer") -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), peer)
    return bytes(buf)
