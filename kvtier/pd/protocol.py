"""The disaggregated-prefill wire protocol: every message, typed and versioned.

One frame:

    magic "KP" | version u8 | type u8 | header length u32 | payload length u64
    header: a JSON object whose keys are exactly the message's fields
    payload: raw bytes (only Alloc, Write, Hello and Welcome carry any)

A request's KV may be reserved by several Allocs (one per prefill step, the
sender writing one step's chunks while the next is computed); one Commit at
the end makes all of them hits. Alloc's digests travel as a binary payload,
DIGEST_BYTES each in prompt order, not as JSON text.

Who sends what:

    sender ──▶ receiver init port    Hello(format, channel, event)    ◀── Welcome(buffer, event)
                                                                          | Error
    sender ──▶ receiver alloc port   Alloc(req, tokens) + digests     ◀── Allocated(blocks)
                                                                          | NoRoom | Error
                                     Write(req, block) + bytes        (tcp channel; no reply)
                                     Commit(req, event)               ◀── Ok | Error
                                     Abort(req)                       ◀── Ok
    proxy  ──▶ receiver alloc port   Release(req)                     ◀── Ok
    sender ──▶ proxy notify port     PrefillDone(req, ok, tokens)     (no reply)

Anything else (a bad magic, another version, an unknown type, a header
that is not the message's fields with their types, a payload larger than
the receiver allows) is a `ProtocolError`: the peer gets an Error and the
connection is closed. Nothing in a frame is trusted before it is checked.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.errors import KvtierError
from kvtier.framing import Framing, ProtocolError, recv_exact

VERSION = 3
# magic, version, then message type, header length, payload length
FRAME = Framing("kvtier PD protocol", b"KP", VERSION, "BIQ")
MAX_HEADER = 1 << 20  # bytes of JSON
MAX_LIST = 1 << 16
DIGEST_BYTES = 16  # a chunk key's digest (kvtier.keys.ChunkKey)
SMALL_PAYLOAD = 1 << 16  # sent in one call with its frame head
MAX_STR = 4096


class PdPeerError(KvtierError):
    """A PD peer refused an operation or could not be reached in time."""


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[int] = 0


@dataclass(frozen=True)
class Hello(Message):
    """Sender → init port. The receiver checks that the KV bytes mean the same on both sides."""

    TYPE: ClassVar[int] = 1
    sender: str  # a name for logs and NIXL (host:pid)
    kv_format: str  # KVFormat.tag(): model, layout, dtype, TP rank/size
    chunk_size: int
    bytes_per_token: int
    channel: str
    commit_event: str  # cuda_ipc: hex of the CUDA IPC event its Commits may point at; "" none


@dataclass(frozen=True)
class Welcome(Message):
    """Init port → sender: the receiver's buffer. The payload is the channel's
    registration (NIXL agent metadata, or the CUDA IPC handle as JSON)."""

    TYPE: ClassVar[int] = 2
    receiver: str
    block_bytes: int
    num_blocks: int
    device: str  # "cpu" or "cuda:N"
    base_ptr: int  # address of block 0 in the receiver (NIXL descriptors)
    commit_event: bool  # the receiver opened the Hello's event: a Commit may name it


@dataclass(frozen=True)
class Alloc(Message):
    """Reserve blocks for chunks of one request, all or none; the payload is their
    chunk-key digests (`DIGEST_BYTES` each, in prompt order). A request's later Allocs
    add to its reservation."""

    TYPE: ClassVar[int] = 3
    req_id: str
    tokens: list[int]  # tokens of each chunk

    def payload_limit(self) -> int:
        return DIGEST_BYTES * len(self.tokens)


@dataclass(frozen=True)
class Allocated(Message):
    TYPE: ClassVar[int] = 4
    req_id: str
    blocks: list[int]  # block index per chunk; -1: the receiver holds that chunk already


@dataclass(frozen=True)
class NoRoom(Message):
    TYPE: ClassVar[int] = 5
    req_id: str
    free_blocks: int
    needed_blocks: int
    num_blocks: int


@dataclass(frozen=True)
class Write(Message):
    """The payload is the chunk's bytes, for a block reserved to this request (tcp channel)."""

    TYPE: ClassVar[int] = 6
    req_id: str
    block: int


@dataclass(frozen=True)
class Commit(Message):
    """Every block reserved for the request (by all its Allocs) is written, or (`event`,
    the Hello's commit_event) will be once that CUDA event completes: the receiver waits
    for it, then the chunks become hits. The sender need not wait for its own copies
    before sending: the Commit's round trip runs beside their tail."""

    TYPE: ClassVar[int] = 7
    req_id: str
    event: str  # "" or the sender's commit_event


@dataclass(frozen=True)
class Abort(Message):
    """The sender gives up its reservation (its write failed)."""

    TYPE: ClassVar[int] = 8
    req_id: str


@dataclass(frozen=True)
class Release(Message):
    """The request is done with (loaded, finished or cancelled): free its chunks."""

    TYPE: ClassVar[int] = 9
    req_id: str


@dataclass(frozen=True)
class Ok(Message):
    TYPE: ClassVar[int] = 10
    req_id: str
    chunks: int


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[int] = 11
    message: str


@dataclass(frozen=True)
class PrefillDone(Message):
    """Sender → proxy: the request's KV is in the decoder's buffer (ok), or will not be."""

    TYPE: ClassVar[int] = 12
    req_id: str
    ok: bool
    tokens: int
    detail: str


MESSAGES: dict[int, type[Message]] = {
    m.TYPE: m
    for m in (
        Hello,
        Welcome,
        Alloc,
        Allocated,
        NoRoom,
        Write,
        Commit,
        Abort,
        Release,
        Ok,
        Error,
        PrefillDone,
    )
}
_FIELDS = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
    for cls in MESSAGES.values()
}


# -- encoding ------------------------------------------------------------------------------


def encode(msg: Message, payload_len: int = 0) -> bytes:
    """The frame head and header of `msg`; the caller sends `payload_len` bytes after it."""
    # the fields as they are (messages are flat: no deep copy, as `dataclasses.asdict` makes)
    header = json.dumps(
        {name: getattr(msg, name) for name in _FIELDS[type(msg)]}, separators=(",", ":")
    ).encode()
    return FRAME.pack(msg.TYPE, len(header), payload_len) + header


def parse_head(head: bytes) -> tuple[type[Message], int, int]:
    """(message class, header length, payload length) of a frame head."""
    kind, header_len, payload_len = FRAME.unpack(head)
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown PD message type {kind}")
    if header_len > MAX_HEADER:
        raise ProtocolError(f"PD header of {header_len} bytes (at most {MAX_HEADER})")
    return cls, header_len, payload_len


def parse_header(cls: type[Message], header: bytes) -> Message:
    """Check that `header` holds exactly the fields of `cls`, with their types."""
    try:
        data = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{cls.__name__}: header is not JSON ({exc})") from None
    hints = _FIELDS[cls]
    if not isinstance(data, dict) or set(data) != set(hints):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ProtocolError(f"{cls.__name__}: fields {got}, expected {sorted(hints)}")
    for name, hint in hints.items():
        if not _matches(data[name], hint):
            raise ProtocolError(f"{cls.__name__}.{name} = {str(data[name])[:80]!r} is not {hint}")
    return cls(**data)


def _matches(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**64
    if hint is str:
        return isinstance(value, str) and len(value) <= MAX_STR
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or len(value) > MAX_LIST:
            return False
        # an Alloc's or Allocated's one per chunk: checked at once, not value by value
        if item is int:
            return all(type(v) is int for v in value) and (
                not value or (-(2**63) <= min(value) and max(value) < 2**64)
            )
        return all(_matches(v, item) for v in value)
    return False


# -- blocking sockets (sender, receiver) ---------------------------------------------------


def send(sock: socket.socket, msg: Message, payload: bytes | memoryview = b"") -> None:
    head = encode(msg, len(payload))
    if len(payload) > SMALL_PAYLOAD:
        sock.sendall(head)
        sock.sendall(payload)
    else:  # one segment: an Alloc's digests must not wait behind its head
        sock.sendall(head + bytes(payload))


def recv(sock: socket.socket, max_payload: int = 0) -> tuple[Message, int]:
    """The next message and the length of its payload, still unread on the socket."""
    cls, header_len, payload_len = parse_head(recv_exact(sock, FRAME.size, "PD peer"))
    msg = parse_header(cls, recv_exact(sock, header_len, "PD peer"))
    if payload_len > max_payload:
        raise ProtocolError(
            f"{cls.__name__} carries {payload_len} bytes (at most {max_payload} here)"
        )
    return msg, payload_len


def expect(msg: Message, cls: type[Message]) -> Message:
    """`msg` if it is a `cls`; a peer's Error (or anything else) raises."""
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, Error):
        raise PdPeerError(msg.message)
    raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
