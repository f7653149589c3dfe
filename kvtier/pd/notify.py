"""Where `kvtier proxy` hears that a request's KV is in its decoder's buffer.

    KvtierNotifications    kvtier's senders: PrefillDone frames (kvtier.pd.protocol) on
                           plain TCP connections to --proxy-port
    LmcacheNotifications   LMCache's PD senders (pd_role: sender): a ZMQ PUSH socket
                           connected to --proxy-port, one msgpack `ProxyNotif` (a msgspec
                           struct tagged "type", with `req_id`) per request whose NIXL
                           writes have completed

Either hands each to `on_done` as a PrefillDone; neither ever stops the proxy: a bad
message is logged and dropped (that request's decoder then waits out
--kv-ready-timeout and recomputes what is missing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from kvtier.logs import get_logger
from kvtier.pd import protocol as proto

log = get_logger(__name__)

OnDone = Callable[[proto.PrefillDone], None]
# a ZMQ peer's first byte (ZMTP 3 greeting); a kvtier frame starts with b"K"
ZMTP_SIGNATURE_START = b"\xff"


class Notifications(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...


class KvtierNotifications:
    def __init__(self, host: str, port: int, on_done: OnDone) -> None:
        self._host, self._port, self._on_done = host, port, on_done
        self._server: asyncio.AbstractServer | None = None
        self._told = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readexactly(1)
            # it waits for our greeting: it would sit here unheard
            if first == ZMTP_SIGNATURE_START:
                # ZMQ reconnects every 0.1 s: said once
                say = log.debug if self._told else log.warning
                say(
                    "proxy: a ZMQ peer connected to the notification port %d, "
                    "as LMCache's PD senders do; "
                    "kvtier's senders send PrefillDone frames. "
                    "For LMCache's prefillers and decoders run "
                    "`kvtier proxy --pd-engine lmcache`",
                    self._port,
                )
                self._told = True
                return
            head = first
            while True:
                head += await reader.readexactly(proto.FRAME.size - len(head))
                cls, header_len, payload_len = proto.parse_head(head)
                head = b""
                msg = proto.parse_header(cls, await reader.readexactly(header_len))
                if payload_len or not isinstance(msg, proto.PrefillDone):
                    raise proto.ProtocolError(
                        f"the notification port takes PrefillDone, got {cls.__name__}"
                    )
                self._on_done(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except proto.ProtocolError as exc:
            log.warning("proxy: bad message on the notification port: %s", exc)
        finally:
            writer.close()


class LmcacheNotifications:
    """LMCache 0.5.x's PD backend tells its proxy, per request, once the NIXL writes of
    the request's KV have completed: `ProxyNotif(req_id)` over ZMQ PUSH."""

    TAG = "ProxyNotif"

    def __init__(self, host: str, port: int, on_done: OnDone) -> None:
        self._decode = msgspec.msgpack.Decoder()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._url, self._on_done = f"tcp://{host}:{port}", on_done
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._sock.bind(self._url)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    async def _serve(self) -> None:
        while True:
            data = await self._sock.recv()
            try:
                req_id = self.parse(data)
            except ValueError as exc:
                log.warning(
                    "proxy: bad message on the notification port "
                    "(LMCache's ProxyNotif expected): %s",
                    exc,
                )
                continue
            self._on_done(proto.PrefillDone(req_id, True, 0, "LMCache ProxyNotif"))

    def parse(self, data: bytes) -> str:
        """The request id of a ProxyNotif; ValueError for anything else."""
        try:
            msg = self._decode.decode(data)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not msgpack: {exc}") from None
        if (
            not isinstance(msg, dict)
            or msg.get("type") != self.TAG
            or not isinstance(msg.get("req_id"), str)
        ):
            raise ValueError(f"not a {self.TAG}: {str(msg)[:200]}")
        return msg["req_id"]


ENGINES = {"kvtier": KvtierNotifications, "lmcache": LmcacheNotifications}


def notifications(engine: str, host: str, port: int, on_done: OnDone) -> Notifications:
    return ENGINES[engine](host, port, on_done)
