"""The kvtier store server's wire protocol, version 1: the one place it is declared.

Every message, request or reply, is one frame:

    +--------+---------+----+-------+--------+----------+-------------+
    | magic  | version | op | flags | req_id | meta_len | payload_len |   24-byte header
    | "KVTS" |   u8    | u8 |  u16  |  u32   |   u32    |     u64     |   (little-endian)
    +--------+---------+----+-------+--------+----------+-------------+
    | meta: meta_len bytes (keys, sizes, small results)                |
    | payload: payload_len bytes (values, back to back)                |
    +------------------------------------------------------------------+

A reply has op | REPLY and `flags` holds a Status; an error reply's meta is
its message in UTF-8. A reply with req_id 0 and an error status is the
server's parting word (e.g. at its connection cap) before it closes. Meta
encodings, per op (n = number of keys, u16-length prefixed keys, u64 sizes):

    PUT          req meta: n, keys, sizes      payload: the values  -> reply: empty
    GET          req meta: n, keys                                  -> reply meta: n sizes
                 (MISSING for absent keys), payload: the present values in order
    EXISTS       req meta: n, keys                                  -> reply meta: n bytes 0/1
    MATCH_PREFIX req meta: n, keys                                  -> reply meta: u32 count
    DELETE       req meta: n, keys                                  -> reply meta: u32 count
    STATS        empty                                              -> reply meta: JSON
    HELLO        req meta: JSON {"host_id"}                         -> reply meta: JSON (with a
                 token: {"auth", "challenge"} and no shm until AUTH; see auth.py)
    AUTH         req meta: JSON {"proof"}                           -> reply meta: JSON
                 {"tenant", "shm"}
    PUT_ALLOC    req meta: n, keys, sizes (shared memory puts)      -> reply meta: u32 ticket,
                 then per key: u32 extent count, (u64 offset, u64 length) extents
    PUT_COMMIT   req meta: u32 ticket (no reply)
    GET_SHM      req meta: n, keys                                  -> reply meta: u32 ticket, then
                 per key: u64 size (MISSING if absent), extents as in PUT_ALLOC
    RELEASE      req meta: u32 ticket (no reply)

Readers check every length against a limit before allocating anything:
`parse_header` refuses a bad magic, an unknown version or op, and lengths
past MAX_META / MAX_PAYLOAD with `ProtocolError`, after which the server
closes that connection.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.framing import Framing, ProtocolError

VERSION = 1
# magic, version, then op, flags, request id, meta length, payload length
FRAMING = Framing("kvtier server protocol", b"KVTS", VERSION, "BHIIQ")
HEADER_SIZE = FRAMING.size  # 24
MAX_META = 4 << 20  # 4 MiB of keys and sizes per frame: ~40k keys
MAX_PAYLOAD = 1 << 40  # 1 TiB: larger than any pool; beyond it a length is garbage
MAX_KEY = 1024
MAX_KEYS = 65536
MISSING = (1 << 64) - 1
REPLY = 0x80

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_EXTENT = struct.Struct("<QQ")


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    EXISTS = 4
    MATCH_PREFIX = 5
    DELETE = 6
    STATS = 7
    PUT_ALLOC = 8
    PUT_COMMIT = 9
    GET_SHM = 10
    RELEASE = 11
    AUTH = 12


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1  # a bad request that left the connection usable
    TOO_LARGE = 2  # a value larger than the whole pool
    POOL_FULL = 3  # no room even after evicting everything evictable
    UNAUTHORIZED = 4  # no AUTH yet, or a wrong proof: the connection is closed
    OVER_LIMIT = 5  # past a bound of this connection (bytes held); the connection stays usable


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    flags: int
    req_id: int
    meta_len: int
    payload_len: int

    @property
    def is_reply(self) -> bool:
        return bool(self.op & REPLY)


def pack_header(op: int, req_id: int, meta_len: int, payload_len: int = 0, flags: int = 0) -> bytes:
    return FRAMING.pack(op, flags, req_id, meta_len, payload_len)


def parse_header(buf: bytes | bytearray | memoryview, *, replies: bool = False) -> Header:
    """A frame's head; ProtocolError (the connection is closed) for anything else."""
    op, flags, req_id, meta_len, payload_len = FRAMING.unpack(buf)
    base = op & ~REPLY
    if bool(op & REPLY) != replies or base not in Op._value2member_map_:
        raise ProtocolError(f"unknown op {op:#x}")
    if meta_len > MAX_META:
        raise ProtocolError(f"meta length {meta_len} exceeds the limit {MAX_META}")
    if payload_len > MAX_PAYLOAD:
        raise ProtocolError(f"payload length {payload_len} exceeds the limit {MAX_PAYLOAD}")
    return Header(op, flags, req_id, meta_len, payload_len)


# -- meta encodings ----------------------------------------------------------------


class _Reader:
    """Bounds-checked cursor over a meta buffer."""

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf, self.pos = memoryview(buf), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ProtocolError(
                f"meta truncated: need {n} bytes at offset {self.pos} of {len(self.buf)}"
            )
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def u16(self) -> int:
        return _U16.unpack(self.take(2))[0]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def count(self) -> int:
        n = self.u32()
        if n > MAX_KEYS:
            raise ProtocolError(f"key count {n} exceeds the limit {MAX_KEYS}")
        return n

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} stray bytes after meta")


def encode_keys(keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> bytes:
    parts = [_U32.pack(len(keys))]
    for key in keys:
        if not 0 < len(key) <= MAX_KEY:
            raise ValueError(f"key of {len(key)} bytes: keys must be 1..{MAX_KEY} bytes")
        parts += [_U16.pack(len(key)), key]
    if sizes is not None:
        parts += [_U64.pack(s) for s in sizes]
    return b"".join(parts)


def decode_keys(
    meta: bytes | bytearray | memoryview, *, with_sizes: bool = False
) -> tuple[list[bytes], list[int]]:
    r = _Reader(meta)
    n = r.count()
    keys = []
    for _ in range(n):
        length = r.u16()
        if not 0 < length <= MAX_KEY:
            raise ProtocolError(f"key length {length} outside 1..{MAX_KEY}")
        keys.append(bytes(r.take(length)))
    sizes = [r.u64() for _ in range(n)] if with_sizes else []
    r.done()
    return keys, sizes


def encode_sizes(sizes: Sequence[int]) -> bytes:
    return _U32.pack(len(sizes)) + b"".join(_U64.pack(s) for s in sizes)


def decode_sizes(meta: bytes | bytearray | memoryview) -> list[int]:
    r = _Reader(meta)
    sizes = [r.u64() for _ in range(r.count())]
    r.done()
    return sizes


def encode_u32(value: int) -> bytes:
    return _U32.pack(value)


def decode_u32(meta: bytes | bytearray | memoryview) -> int:
    r = _Reader(meta)
    value = r.u32()
    r.done()
    return value


Extents = list[tuple[int, int]]  # (offset in the shared pool, length)


def encode_extents(ticket: int, entries: Sequence[tuple[int, Extents]]) -> bytes:
    """A ticket, then per key its size (MISSING if absent) and its pool extents."""
    parts = [_U32.pack(ticket), _U32.pack(len(entries))]
    for size, extents in entries:
        parts += [_U64.pack(size), _U32.pack(len(extents))]
        parts += [_EXTENT.pack(off, n) for off, n in extents]
    return b"".join(parts)


def decode_extents(meta: bytes | bytearray | memoryview) -> tuple[int, list[tuple[int, Extents]]]:
    r = _Reader(meta)
    ticket = r.u32()
    entries = []
    for _ in range(r.count()):
        size, n = r.u64(), r.u32()
        if n > MAX_META // _EXTENT.size:
            raise ProtocolError(f"extent count {n} exceeds the meta limit")
        entries.append((size, [_EXTENT.unpack(r.take(_EXTENT.size)) for _ in range(n)]))
    r.done()
    return ticket, entries


def encode_json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(meta: bytes | bytearray | memoryview) -> dict:
    try:
        obj = json.loads(bytes(meta))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"meta is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("meta JSON is not an object")
    return obj


def host_id() -> str:
    """Same value for every process of one kernel boot: how a client knows it shares our host."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"
