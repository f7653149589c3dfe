"""The asking side of P2P sharing's wire (kvtier/fleet/peers.py): one connection to a peer.

A chunk comes back as bytes, checked by the codec, or, from a peer on this host, lent in place:
the client maps the peer's pool read-only once (`LentPool`, again when the peer's pool is
another: it restarted), copies each chunk out of it into its destination, and keeps the copies
only when the peer answers that it held them until then. A peer whose pool cannot be mapped
from here (another PID namespace, no permission) is asked for bytes from then on. With a
`NixlReader` (`transfer_channel: nixl`) a peer on another host lends them too, and the reader
moves them over NIXL (kvtier/fleet/peer_reads.py); a peer a NIXL read from fails is asked again
for bytes, and for bytes from then on.
"""

from __future__ import annotations

import mmap
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.buffers import Copy, run_copy
from kvtier.codec import Codec
from kvtier.errors import CorruptPayload, RemoteUnavailable
from kvtier.fleet.peer_reads import NIXL_POOL, NixlReader
from kvtier.fleet.peers import (
    BYTES,
    DENIED,
    DONE,
    HELD,
    KEY_LEN,
    LENT,
    NIXL_LENT,
    PLACE,
    POOL,
    REPLY,
    REQUEST,
    VALUE_LEN,
    WANTS_NIXL,
    PeerDenied,
)
from kvtier.framing import recv_exact, recv_into
from kvtier.logs import get_logger
from kvtier.memory import SharedArena
from kvtier.server.protocol import host_id
from kvtier.shm import open_mapped

log = get_logger(__name__)


@dataclass
class LentPool:
    """A peer's shared pool, mapped read-only here."""

    arena: SharedArena
    mapping: mmap.mmap
    array: np.ndarray  # the mapping's bytes, read-only

    @classmethod
    def open(cls, arena: SharedArena) -> LentPool | None:
        """The pool mapped, or None where this process cannot open it or finds another file."""
        expect = (arena.dev, arena.ino)
        try:
            opened = open_mapped(arena.path, arena.size, writable=False, expect=expect)
        except OSError as exc:
            log.info("P2P: the pool at %s cannot be opened (%s): bytes over TCP", arena.path, exc)
            return None
        if opened is None:
            return None  # another process's file under that number
        mapping = opened[1]
        return cls(arena, mapping, np.frombuffer(mapping, np.uint8))

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self.mapping.close()
        except BufferError:  # a copy still reads it (a request cut short): it goes with them
            pass


class PeerClient:
    """One connection to a peer's PeerServer, opened on first use and again after a fault.
    `shared_memory`: ask to be lent chunks in place when the peer is on this host; `reader`
    (shared with the other clients): ask a peer on another host to lend them over NIXL."""

    def __init__(
        self,
        address: str,
        timeout: float,
        token: str | None,
        codec: Codec,
        shared_memory: bool,
        reader: NixlReader | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.address, self._host, self._port = address, host, int(port)
        self._timeout, self._token, self._codec = timeout, token, codec
        self._host_id = host_id().encode() if shared_memory else b""
        self._pool: LentPool | None = None
        self._reader = reader
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.copied = 0  # chunks copied out of the peer's pool (the rest came as bytes)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | None]:
        """Write each key's chunk into its `outs` entry (exactly its size): num_tokens, None
        where the peer does not hold it or it came damaged; RemoteUnavailable when the peer
        cannot be reached or its connection ends mid-reply, PeerDenied on a refusal."""
        with self._lock:
            try:
                return self._get_into(keys, outs)
            except (OSError, ValueError) as exc:
                self._close()  # and the pool: a peer gone must not live on in this mapping
                raise RemoteUnavailable(f"P2P peer {self.address}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._close()

    def _get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | None]:
        sock = self._connected()
        token = (self._token or "").encode()
        reader = self._reader
        wants = WANTS_NIXL if reader is not None and reader.covers(outs) else BYTES
        head = REQUEST.pack(len(token), len(self._host_id), len(keys), wants)
        parts = [head, token, self._host_id]
        for key in keys:
            parts += [KEY_LEN.pack(len(key)), key]
        sock.sendall(b"".join(parts))
        status, count = REPLY.unpack(recv_exact(sock, REPLY.size, self.address))
        if status == DENIED:
            self._close()
            raise PeerDenied(f"P2P peer {self.address} refused the request: a wrong token")
        if count != len(keys):
            raise ValueError(f"{count} values for {len(keys)} keys")
        if status == NIXL_LENT and reader is not None:
            read = self._read_lent(sock, reader, outs)
            return self._get_into(keys, outs) if read is None else read
        if status != LENT:
            return [self._receive(sock, key, out) for key, out in zip(keys, outs)]
        got = self._copy_lent(sock, outs)
        if got is None:  # not mappable from here: bytes from now on
            self._host_id = b""
            return self._get_into(keys, outs)
        return got

    def _receive(self, sock: socket.socket, key: bytes, out: memoryview) -> int | None:
        (n,) = VALUE_LEN.unpack(recv_exact(sock, VALUE_LEN.size, self.address))
        if n == 0:
            return None
        value = memoryview(bytearray(n))
        recv_into(sock, value, self.address)
        try:
            return self._codec.decode_into(value, out)
        except CorruptPayload as exc:
            log.warning("P2P: chunk %s from %s is damaged (%s): a miss", key, self.address, exc)
            return None

    def _copy_lent(
        self, sock: socket.socket, outs: Sequence[memoryview]
    ) -> list[int | None] | None:
        """The chunks lent in the peer's pool, copied into `outs`; None where the pool cannot
        be mapped here (nothing copied)."""
        arena = SharedArena(*POOL.unpack(recv_exact(sock, POOL.size, self.address)))
        places = recv_exact(sock, PLACE.size * len(outs), self.address)
        pool = self._mapped(arena)
        got = [] if pool is None else self._copy(pool, places, outs)
        sock.sendall(DONE)
        if recv_exact(sock, len(HELD), self.address) != HELD:
            raise ValueError("the peer did not say it held what it lent")
        self.copied += sum(n is not None for n in got)
        return got if pool is not None else None

    def _read_lent(
        self, sock: socket.socket, reader: NixlReader, outs: Sequence[memoryview]
    ) -> list[int | None] | None:
        """The chunks lent in the peer's pool, read into `outs` over NIXL; None where the
        read failed (nothing in `outs` used; the lease ended in order, the connection stays;
        this peer is asked for bytes from then on)."""
        base, meta_len = NIXL_POOL.unpack(recv_exact(sock, NIXL_POOL.size, self.address))
        metadata = recv_exact(sock, meta_len, self.address)
        places = recv_exact(sock, PLACE.size * len(outs), self.address)
        got: list[int | None] = []
        reads, into = [], []
        for i, out in enumerate(outs):
            offset, nbytes, num_tokens = PLACE.unpack_from(places, i * PLACE.size)
            if num_tokens == 0 or nbytes != len(out):
                got.append(None)
                continue
            reads.append((offset, nbytes))
            into.append(out)
            got.append(num_tokens)
        failed = False
        try:
            reader.read(metadata, base, reads, into)
        except ConnectionError as exc:
            log.warning("P2P: peer %s: %s; bytes over TCP from now on", self.address, exc)
            self._reader, failed = None, True
        sock.sendall(DONE)
        if recv_exact(sock, len(HELD), self.address) != HELD:
            raise ValueError("the peer did not say it held what it lent")
        return None if failed else got

    @staticmethod
    def _copy(pool: LentPool, places: bytes, outs: Sequence[memoryview]) -> list[int | None]:
        """Each lent chunk copied into its `outs` entry (over the copy threads when the
        request is large); per chunk its num_tokens, None where it was not lent whole."""
        got: list[int | None] = []
        pairs: Copy = []
        for i, out in enumerate(outs):
            offset, nbytes, num_tokens = PLACE.unpack_from(places, i * PLACE.size)
            if num_tokens == 0 or nbytes != len(out) or offset + nbytes > pool.arena.size:
                got.append(None)
                continue
            pairs.append((np.frombuffer(out, np.uint8), pool.array[offset : offset + nbytes]))
            got.append(num_tokens)
        run_copy(pairs)
        return got

    def _mapped(self, arena: SharedArena) -> LentPool | None:
        if self._pool is not None and self._pool.arena != arena:  # the peer's pool is another
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = LentPool.open(arena)
            if self._pool is not None:
                log.info(
                    "P2P: peer %s is on this host: chunks are copied out of its pool (%.2f GiB)",
                    self.address,
                    arena.size / 2**30,
                )
        return self._pool

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
