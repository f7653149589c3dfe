"""P2P sharing's wire: an instance serves the chunks of its CPU RAM tier to its peers.

Each tensor-parallel rank of an instance with `enable_p2p` listens on `p2p_port` + rank
(`PeerServer`); a peer's rank r asks rank r, so ranks pair by themselves. One request, on a
connection kept open:

    request  head "KVPP" v3 (token length, host id length, key count, wants), the token, the
             asker's host id (empty: bytes only), each key (u16 length + bytes); wants
             WANTS_NIXL: lend to the asker's NIXL agent (kvtier/fleet/peer_reads.py)
    reply    head "KVPP" v3 (status, key count), then by status:
      OK     each value (u64 length, 0: a miss, + bytes)
      LENT   the pool (pid, fd, size, st_dev, st_ino), each chunk's place in it (offset, bytes,
             num_tokens; 0: a miss); the asker copies them out, sends DONE, and the holder
             answers HELD once it let them go (nothing answered: the copies are not used)
      NIXL_LENT  the pool's address and the holder's NIXL agent metadata, then the places as
             for LENT; the asker READs them over NIXL, then DONE and HELD as for LENT

A key is a chunk's wire key (keys.wire_key). Over TCP a value is the chunk as the remote tier
stores it (codec.Codec.encode: header, payload, checksum), so the asker checks it as it checks a
remote store's and a damaged or mismatched value is a miss. An asker on the holder's host (the
same host id, `p2p_shared_memory`) is lent the chunks in place instead: the holder's pool is a
memfd (memory.SharedArena) that the asker maps read-only and copies from (a large request over
the copy threads), no socket for the bytes. With `transfer_channel: nixl`, an asker on another
host reads them over NIXL the same way. A chunk is retained in the CPU tier while it is
encoded or lent: eviction cannot reuse its block under the reply or the copy; a holder lends for
at most `lease_s`, then ends the connection. With a token (`remote_auth_token`) a request
without it is refused; without one the server binds only a loopback host.
"""

from __future__ import annotations

import hmac
import socket
import socketserver
import struct
import threading

from kvtier.codec import Codec
from kvtier.errors import KvtierError
from kvtier.fleet.affinity import unpin_this_thread
from kvtier.fleet.peer_reads import NixlLender
from kvtier.framing import Framing, recv_exact
from kvtier.keys import ChunkKey, KVFormat
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock, SharedArena
from kvtier.server.protocol import host_id
from kvtier.server.state import is_loopback
from kvtier.tiers.cpu import CpuTier, StoredChunk

log = get_logger(__name__)

# token length, host id length, key count, wants
REQUEST = Framing("kvtier peer protocol", b"KVPP", 3, "HHIB")
REPLY = Framing("kvtier peer protocol", b"KVPP", 3, "BI")  # status, key count
KEY_LEN = struct.Struct("<H")
VALUE_LEN = struct.Struct("<Q")
POOL = struct.Struct("<IIQQQ")  # pid, fd, size, st_dev, st_ino of the holder's pool
PLACE = struct.Struct("<QQI")  # a chunk's offset in the pool, its bytes, num_tokens (0: a miss)
OK, DENIED, LENT, NIXL_LENT = 0, 1, 2, 3
BYTES, WANTS_NIXL = 0, 1  # what an asker on another host wants
DONE, HELD = b"D", b"H"  # the asker copied what it was lent; the holder kept it until then
MAX_KEYS = 4096  # a request asking for more is not this protocol


class PeerDenied(KvtierError):
    """The peer refused the request: its token differs from this instance's."""


class PeerServer:
    """Serves `cpu`'s chunks of format `fmt` on host:port, each encoded by `codec`, or lent in
    place (for at most `lease_s`): to an asker on this host when `cpu`'s pool is shared, to
    one that wants NIXL when `nixl` is given (owned: closed with the server)."""

    def __init__(
        self,
        cpu: CpuTier,
        fmt: KVFormat,
        codec: Codec,
        bytes_per_token: int,
        host: str,
        port: int,
        token: str | None,
        lease_s: float,
        nixl: NixlLender | None = None,
    ) -> None:
        token_or_loopback(token, host, "p2p_host", "peers would read this instance's KV")
        self._cpu, self._codec, self._tag, self._token = cpu, codec, fmt.tag(), token
        self._fmt, self._bytes_per_token, self._lease_s = fmt, bytes_per_token, lease_s
        self._arena: SharedArena | None = cpu.pool.shared
        self.nixl = nixl  # the NIXL side of its lends, if any
        self._host_id = host_id().encode()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                unpin_this_thread()
                outer._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(
            (host, port), Handler, bind_and_activate=False
        )
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        try:
            self._server.server_bind()
            self._server.server_activate()
        except OSError as exc:
            self._server.server_close()
            if nixl is not None:
                nixl.close()
            raise KvtierError(f"P2P: cannot listen on {host}:{port}: {exc.strerror}") from exc
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._accept, name="kvtier-p2p-server", daemon=True)
        self._thread.start()
        self.served = 0  # chunks sent to peers as bytes
        self.lent = 0  # chunks lent in place (to peers on this host, or over NIXL)
        log.info("P2P: serving this instance's CPU RAM chunks to peers on %s", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        if self.nixl is not None:
            self.nixl.close()

    def _accept(self) -> None:
        unpin_this_thread()
        self._server.serve_forever()

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = sock.recv(REQUEST.size, socket.MSG_WAITALL)
                if not head:
                    return  # the peer closed between requests
                token_len, host_len, count, wants = REQUEST.unpack(head)
                if count > MAX_KEYS:
                    return
                token = recv_exact(sock, token_len, "P2P peer").decode() if token_len else None
                asker_host = recv_exact(sock, host_len, "P2P peer")
                keys = [recv_exact(sock, _key_len(sock), "P2P peer") for _ in range(count)]
                if self._token is not None and not hmac.compare_digest(
                    (token or "").encode(), self._token.encode()
                ):
                    sock.sendall(REPLY.pack(DENIED, 0))
                    return
                if self._arena is not None and asker_host == self._host_id:
                    arena = self._arena
                    pool = POOL.pack(arena.pid, arena.fd, arena.size, arena.dev, arena.ino)
                    self._lend(sock, keys, LENT, pool)
                elif wants == WANTS_NIXL and self.nixl is not None:
                    self.nixl.hold()  # its agent is driven while the asker may read
                    try:
                        self._lend(sock, keys, NIXL_LENT, self.nixl.header())
                    finally:
                        self.nixl.release()
                else:
                    self._reply(sock, keys)
        except (OSError, ValueError) as exc:  # a peer gone, or bytes of another protocol
            log.debug("P2P: a peer's connection ended: %s", exc)

    def _reply(self, sock: socket.socket, keys: list[bytes]) -> None:
        sock.sendall(REPLY.pack(OK, len(keys)))
        for wire in keys:
            chunk = self._chunk(wire)
            if chunk is None:
                sock.sendall(VALUE_LEN.pack(0))
                continue
            block = chunk.block
            try:  # the payload is a view of the block: retained until it is sent
                raw = block.data[: chunk.num_tokens * self._bytes_per_token].numpy().data
                digest = block.digest if isinstance(block, MemoryBlock) else 0
                parts = self._codec.encode(raw, chunk.num_tokens, digest)
                sock.sendall(VALUE_LEN.pack(sum(len(part) for part in parts)))
                for part in parts:
                    sock.sendall(part)
            finally:
                block.release()
            self.served += 1

    def _lend(self, sock: socket.socket, keys: list[bytes], status: int, pool: bytes) -> None:
        """Each chunk's place in the pool (`pool` says how to reach it), its block retained
        until the asker says it copied them out (DONE) or `lease_s` passed (then the
        connection ends, unanswered)."""
        chunks = [self._chunk(wire) for wire in keys]
        try:
            parts = [REPLY.pack(status, len(keys)), pool]
            parts += [self._place(chunk) for chunk in chunks]
            sock.sendall(b"".join(parts))
            sock.settimeout(self._lease_s)
            if recv_exact(sock, len(DONE), "P2P peer") != DONE:
                raise ValueError("not DONE after a lease")
            sock.settimeout(None)
            self.lent += sum(chunk is not None for chunk in chunks)
            sock.sendall(HELD)  # every block was retained until now
        finally:
            for chunk in chunks:
                if chunk is not None:
                    chunk.block.release()

    def _place(self, chunk: StoredChunk | None) -> bytes:
        if chunk is None or not isinstance(chunk.block, MemoryBlock):
            return PLACE.pack(0, 0, 0)
        offset = chunk.block.index * chunk.block.pool.block_bytes
        return PLACE.pack(offset, chunk.num_tokens * self._bytes_per_token, chunk.num_tokens)

    def _chunk(self, wire: bytes) -> StoredChunk | None:
        """The chunk `wire` names, retained; None where this instance does not hold it."""
        tag, _, digest = wire.decode(errors="replace").rpartition(":")
        if tag != self._tag:
            return None
        try:
            key = ChunkKey(self._fmt, bytes.fromhex(digest))
        except ValueError:
            return None
        return self._cpu.get(key)


def token_or_loopback(token: str | None, host: str, key: str, otherwise: str) -> None:
    """A service of the fleet binds a non-loopback host only with the fleet's token."""
    if token is None and not is_loopback(host):
        raise KvtierError(
            f"{key} {host} is not a loopback address: without a token {otherwise}. "
            "Set remote_auth_token (the fleet's token)"
        )


def _key_len(sock: socket.socket) -> int:
    (n,) = KEY_LEN.unpack(recv_exact(sock, KEY_LEN.size, "P2P peer"))
    return n
