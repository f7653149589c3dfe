"""The store server's protocol spoken by hand, frame by frame: for tests that
must do what KVClient never does (stall, replay, hold leases, send garbage)."""

from __future__ import annotations

import socket

from kvtier.server import auth
from kvtier.server import protocol as p


class Raw:
    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.req = 0

    def send(
        self, op: int, meta: bytes = b"", payload: bytes = b"", payload_len: int | None = None
    ) -> int:
        self.req += 1
        size = len(payload) if payload_len is None else payload_len
        self.sock.sendall(p.pack_header(op, self.req, len(meta), size) + meta + payload)
        return self.req

    def reply(self) -> tuple[p.Header, bytes, bytes]:
        """The next reply: header, meta, payload."""
        h = p.parse_header(self._exactly(p.HEADER_SIZE), replies=True)
        return h, self._exactly(h.meta_len), self._exactly(h.payload_len)

    def call(
        self, op: int, meta: bytes = b"", payload: bytes = b""
    ) -> tuple[p.Header, bytes, bytes]:
        self.send(op, meta, payload)
        return self.reply()

    def hello(self, host_id: str = "") -> dict:
        h, meta, _ = self.call(p.Op.HELLO, p.encode_json({"host_id": host_id}))
        assert h.flags == p.Status.OK
        return p.decode_json(meta)

    def auth(self, token: str, challenge: str) -> tuple[p.Header, bytes]:
        proof = auth.prove(token, bytes.fromhex(challenge)).hex()
        h, meta, _ = self.call(p.Op.AUTH, p.encode_json({"proof": proof}))
        return h, meta

    def login(self, token: str | None, host_id: str = "") -> dict:
        info = self.hello(host_id)
        if token is not None:
            h, meta = self.auth(token, info["challenge"])
            assert h.flags == p.Status.OK, meta
            info.update(p.decode_json(meta))
        return info

    def closed(self, within: float = 5.0) -> bool:
        """True once the server has closed the connection (what it still sends is read and
        dropped)."""
        self.sock.settimeout(within)
        try:
            while self.sock.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise ConnectionError("server closed the connection")
            buf += got
        return bytes(buf)
