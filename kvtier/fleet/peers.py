"""P2P sharing's wire: an instance serves the chunks of its CPU RAM tier to its peers.

Each tensor-parallel rank of an instance with `enable_p2p` listens on `p2p_port` + rank
(`PeerServer`); a peer's rank r asks rank r, so ranks pair by themselves. One request, on a
connection kept open:

    request  head "KVPP" v1 (token length, key count), the token, each key (u16 length + bytes)
    reply    head "KVPP" v1 (status, key count), each value (u64 length, 0: a miss, + bytes)

A key is a chunk's wire key (keys.wire_key); a value is the chunk as the remote tier stores it
(codec.Codec.encode: header, payload, checksum), so the asker checks it as it checks a remote
store's and a damaged or mismatched value is a miss. A chunk is retained in the CPU tier while it
is encoded: eviction cannot reuse its block under the reply. With a token (`remote_auth_token`)
a request without it is refused; without one the server binds only a loopback host.
"""

from __future__ import annotations

import hmac
import socket
import socketserver
import struct
import threading
from collections.abc import Sequence

from kvtier.codec import Codec
from kvtier.errors import KvtierError, RemoteUnavailable
from kvtier.fleet.affinity import unpin_this_thread
from kvtier.framing import Framing, recv_exact, recv_into
from kvtier.keys import ChunkKey, KVFormat
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.server.state import is_loopback
from kvtier.tiers.cpu import CpuTier, StoredChunk

log = get_logger(__name__)

REQUEST = Framing("kvtier peer protocol", b"KVPP", 1, "HI")  # token length, key count
REPLY = Framing("kvtier peer protocol", b"KVPP", 1, "BI")  # status, key count
KEY_LEN = struct.Struct("<H")
VALUE_LEN = struct.Struct("<Q")
OK, DENIED = 0, 1
MAX_KEYS = 4096  # a request asking for more is not this protocol


class PeerDenied(KvtierError):
    """The peer refused the request: its token differs from this instance's."""


class PeerServer:
    """Serves `cpu`'s chunks of format `fmt` on host:port, each encoded by `codec`."""

    def __init__(
        self,
        cpu: CpuTier,
        fmt: KVFormat,
        codec: Codec,
        bytes_per_token: int,
        host: str,
        port: int,
        token: str | None,
    ) -> None:
        token_or_loopback(token, host, "p2p_host", "peers would read this instance's KV")
        self._cpu, self._codec, self._tag, self._token = cpu, codec, fmt.tag(), token
        self._fmt, self._bytes_per_token = fmt, bytes_per_token
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
            raise KvtierError(f"P2P: cannot listen on {host}:{port}: {exc.strerror}") from exc
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._accept, name="kvtier-p2p-server", daemon=True)
        self._thread.start()
        self.served = 0  # chunks sent to peers
        log.info("P2P: serving this instance's CPU RAM chunks to peers on %s", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

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
                token_len, count = REQUEST.unpack(head)
                if count > MAX_KEYS:
                    return
                token = recv_exact(sock, token_len, "P2P peer").decode() if token_len else None
                keys = [recv_exact(sock, _key_len(sock), "P2P peer") for _ in range(count)]
                if self._token is not None and not hmac.compare_digest(
                    (token or "").encode(), self._token.encode()
                ):
                    sock.sendall(REPLY.pack(DENIED, 0))
                    return
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


class PeerClient:
    """One connection to a peer's PeerServer, opened on first use and again after a fault."""

    def __init__(self, address: str, timeout: float, token: str | None) -> None:
        host, _, port = address.rpartition(":")
        self.address, self._host, self._port = address, host, int(port)
        self._timeout, self._token = timeout, token
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value, None where the peer does not hold it; RemoteUnavailable when the
        peer cannot be reached or its connection ends mid-reply, PeerDenied on a refusal."""
        with self._lock:
            try:
                return self._get(keys)
            except (OSError, ValueError) as exc:
                self._close()
                raise RemoteUnavailable(f"P2P peer {self.address}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._close()

    def _get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        sock = self._connected()
        token = (self._token or "").encode()
        parts = [REQUEST.pack(len(token), len(keys)), token]
        for key in keys:
            parts += [KEY_LEN.pack(len(key)), key]
        sock.sendall(b"".join(parts))
        status, count = REPLY.unpack(recv_exact(sock, REPLY.size, self.address))
        if status == DENIED:
            self._close()
            raise PeerDenied(f"P2P peer {self.address} refused the request: a wrong token")
        if count != len(keys):
            raise ValueError(f"{count} values for {len(keys)} keys")
        out: list[bytes | None] = []
        for _ in keys:
            (n,) = VALUE_LEN.unpack(recv_exact(sock, VALUE_LEN.size, self.address))
            if n == 0:
                out.append(None)
                continue
            value = bytearray(n)
            recv_into(sock, memoryview(value), self.address)
            out.append(bytes(value))
        return out

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
