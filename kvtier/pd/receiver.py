"""The decoder's side of disaggregated prefill: the ports senders talk to.

PdReceiver   serves the init port (handshake) and the alloc port
             (Alloc/Write/Commit/Abort/Release), a thread per connection,
             on a `PdBuffer` (buffer.py).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from kvtier import framing
from kvtier.logs import get_logger
from kvtier.pd import protocol as proto
from kvtier.pd.buffer import PdBuffer
from kvtier.pd.channels import ReceiverChannel, TcpBounce
from kvtier.pd.commit_events import CommitEvents

log = get_logger(__name__)

FRAME_TIMEOUT = 30.0  # s for the rest of a frame once its head has arrived
MAX_CONNECTIONS = 256


class PdReceiver:
    """The init and alloc ports of one decoder worker (TP rank r: ports + r)."""

    def __init__(
        self,
        buffer: PdBuffer,
        channel: ReceiverChannel,
        host: str,
        init_port: int,
        alloc_port: int,
        chunk_size: int,
    ) -> None:
        self.buffer, self.channel, self.chunk_size = buffer, channel, chunk_size
        self._registration = channel.registration()
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._events = CommitEvents(buffer.pool.device if channel.name == "cuda_ipc" else None)
        self._listeners = [
            self._listen(host, init_port, self._serve_init),
            self._listen(host, alloc_port, self._serve_alloc),
        ]
        self.init_port = self._listeners[0].getsockname()[1]
        self.alloc_port = self._listeners[1].getsockname()[1]
        device = buffer.pool.device
        log.info(
            "PD receiver: %.2f GB buffer on %s (%d chunks), "
            "init port %s:%d, alloc port %s:%d, channel %s",
            buffer.pool.capacity / 1e9,
            device,
            buffer.pool.num_blocks,
            host,
            self.init_port,
            host,
            self.alloc_port,
            channel.name,
        )

    def _listen(
        self, host: str, port: int, serve: Callable[[socket.socket], None]
    ) -> socket.socket:
        sock = socket.create_server((host, port), reuse_port=False)
        threading.Thread(
            target=self._accept, args=(sock, serve), daemon=True, name=f"kvtier-pd-accept-{port}"
        ).start()
        return sock

    def _accept(self, listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._conns_lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._run, args=(conn, serve), daemon=True, name="kvtier-pd-conn"
            ).start()

    def _run(self, conn: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        try:
            serve(conn)
        except proto.ProtocolError as exc:
            self.buffer.stats.rejected_messages += 1
            log.warning("PD receiver: rejected a message from %s: %s", _peer_name(conn), exc)
            try:
                proto.send(conn, proto.Error(str(exc)[: proto.MAX_STR]))
            except OSError:
                pass
        except (ConnectionError, OSError, TimeoutError):
            pass  # the peer went away; its reservations were aborted by `serve`
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _next(self, conn: socket.socket, max_payload: int = 0) -> tuple[proto.Message, int]:
        """The next message: idle connections may wait, but a frame once begun must arrive in
        time."""
        conn.settimeout(None)
        head = framing.recv_exact(conn, proto.FRAME.size)
        conn.settimeout(FRAME_TIMEOUT)
        cls, header_len, payload_len = proto.parse_head(head)
        msg = proto.parse_header(cls, framing.recv_exact(conn, header_len))
        limit = (
            max_payload
            if cls is proto.Write
            else msg.payload_limit()
            if isinstance(msg, proto.Alloc)
            else 0
        )
        if payload_len > limit:
            raise proto.ProtocolError(
                f"{cls.__name__} carries {payload_len} bytes (at most {limit})"
            )
        return msg, payload_len

    def _serve_init(self, conn: socket.socket) -> None:
        while True:
            msg, _ = self._next(conn)
            hello = proto.expect(msg, proto.Hello)
            problem = self._check_hello(hello)
            if problem:
                log.warning("PD receiver: refused sender %s: %s", hello.sender, problem)
                proto.send(conn, proto.Error(problem))
                return
            pool = self.buffer.pool
            opened = self._events.open(hello.commit_event)
            proto.send(
                conn,
                proto.Welcome(
                    self.channel.agent_name() or socket.gethostname(),
                    pool.block_bytes,
                    pool.num_blocks,
                    str(pool.device),
                    pool.arena.data_ptr(),
                    opened,
                ),
                self._registration,
            )
            log.info(
                "PD receiver: sender %s connected (channel %s%s)",
                hello.sender,
                hello.channel,
                ", its Commits may come before its writes are done: they name a CUDA event"
                if opened
                else "",
            )

    def _check_hello(self, hello: proto.Hello) -> str:
        ours = (
            self.buffer.fmt.tag(),
            self.chunk_size,
            self.buffer.bytes_per_token,
            self.channel.name,
        )
        theirs = (hello.kv_format, hello.chunk_size, hello.bytes_per_token, hello.channel)
        names = ("KV format", "chunk_size", "bytes per token", "transfer_channel")
        for name, a, b in zip(names, ours, theirs):
            if a != b:
                return f"{name} differs: sender {b!r}, receiver {a!r}"
        return ""

    def _serve_alloc(self, conn: socket.socket) -> None:
        buffer, open_reservations = self.buffer, set()
        # tcp into a GPU buffer: made at this connection's first Write
        bounce: TcpBounce | None = None
        try:
            while True:
                msg, payload_len = self._next(conn, max_payload=buffer.pool.block_bytes)
                if isinstance(msg, proto.Alloc):
                    reply = buffer.alloc(msg, framing.recv_exact(conn, payload_len))
                    if isinstance(reply, proto.Allocated) and msg.req_id not in open_reservations:
                        open_reservations.add(msg.req_id)
                        self.channel.expect_writes()
                    proto.send(conn, reply)
                elif isinstance(msg, proto.Write):
                    target = buffer.write_target(msg.req_id, msg.block, payload_len)
                    if target.device.type == "cpu":
                        framing.recv_into(conn, target.numpy().data)
                    else:
                        bounce = bounce or TcpBounce(buffer.pool)
                        bounce.receive(conn, target)
                elif isinstance(msg, proto.Commit):
                    # nixl writes are complete when the sender commits, cuda_ipc's then or at
                    # the event it names; tcp's copies into a GPU buffer ran on this
                    # connection's stream.
                    self._events.wait(msg.event)
                    if bounce is not None:
                        bounce.wait()
                    chunks = buffer.commit(msg.req_id)
                    self._end_writes(open_reservations, msg.req_id)
                    proto.send(conn, proto.Ok(msg.req_id, chunks))
                elif isinstance(msg, proto.Abort):
                    buffer.abort(msg.req_id)
                    self._end_writes(open_reservations, msg.req_id)
                    proto.send(conn, proto.Ok(msg.req_id, 0))
                elif isinstance(msg, proto.Release):
                    buffer.release(msg.req_id)
                    proto.send(conn, proto.Ok(msg.req_id, 0))
                else:
                    raise proto.ProtocolError(f"the alloc port does not take {type(msg).__name__}")
        finally:
            for rid in list(open_reservations):  # the sender is gone mid-request
                buffer.abort(rid)
                self._end_writes(open_reservations, rid)

    def _end_writes(self, open_reservations: set[str], req_id: str) -> None:
        if req_id in open_reservations:
            open_reservations.discard(req_id)
            self.channel.writes_ended()

    def close(self) -> None:
        self._closed.set()
        self.channel.close()
        for sock in self._listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
            except OSError:
                pass
            sock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
