"""One decoder as a PD sender sees it: the handshake, the alloc connection, and the
reservations a request's chunks get there (Alloc, in pieces, one ahead of the writes).

    DecoderLink(host, init_port, alloc_port, hello, channel, timeout)
        init port: Hello → Welcome (+ the channel's registration), then the alloc
        connection that carries Alloc/Write/Commit/Abort in order
    reserve(rid, spans, held, pieces, ...)   the blocks of `spans`, piece by piece
    commit(rid, stream, wait_writes)         Commit; over cuda_ipc sent before the writes
                                             are done, naming an event the decoder waits for
    call(msg)                                one request, its reply (Abort)
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from kvtier import framing
from kvtier.keys import ChunkSpan
from kvtier.pd import protocol as proto
from kvtier.pd.channels import Peer, SenderChannel
from kvtier.pd.commit_events import commit_event

CONNECT_TIMEOUT = 5.0
RETRY_STEP = 0.05  # s between Allocs while the decoder's buffer is full


class DecoderLink:
    """One decoder, as seen from this sender: its Welcome, and the alloc connection."""

    def __init__(
        self,
        host: str,
        init_port: int,
        alloc_port: int,
        hello: proto.Hello,
        channel: SenderChannel,
        timeout: float,
    ) -> None:
        event, handle = commit_event() if not channel.staged else (None, "")
        with socket.create_connection((host, init_port), timeout=CONNECT_TIMEOUT) as init:
            init.settimeout(timeout)
            proto.send(init, dataclasses.replace(hello, commit_event=handle))
            msg, n = proto.recv(init, max_payload=1 << 24)
            welcome = proto.expect(msg, proto.Welcome)
            registration = framing.recv_exact(init, n)
        self.peer: Peer = channel.connect(welcome, registration)  # type: ignore[arg-type]
        # the decoder opened it: a Commit goes out right behind the writes and names it
        self.commit_event: torch.cuda.Event | None = event if welcome.commit_event else None
        self._event_handle = handle
        self.sock = socket.create_connection((host, alloc_port), timeout=CONNECT_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout)
        self.name = f"{host}:{alloc_port}"

    def call(self, msg: proto.Message, payload: bytes = b"") -> proto.Message:
        proto.send(self.sock, msg, payload)
        return proto.recv(self.sock)[0]

    def commit(
        self, rid: str, stream: torch.cuda.Stream | None, wait_writes: Callable[[], None]
    ) -> float:
        """Commit the request; returns the ms spent in `wait_writes` (the request's queued
        writes, on `stream`). With the decoder's consent (`commit_event`) the Commit leaves
        before they are done, naming an event recorded behind them that the decoder waits
        for: its round trip runs beside the copies' tail instead of after it."""
        event = self.commit_event if stream is not None else None
        if event is not None:
            event.record(stream)
            proto.send(self.sock, proto.Commit(rid, self._event_handle))
        t0 = time.perf_counter()
        wait_writes()
        waited = (time.perf_counter() - t0) * 1e3
        if event is None:
            proto.send(self.sock, proto.Commit(rid, ""))
        proto.expect(proto.recv(self.sock)[0], proto.Ok)
        return waited

    def close(self) -> None:
        self.sock.close()

    def reserve(
        self,
        rid: str,
        spans: list[ChunkSpan],
        held: int,
        pieces: tuple[int, int] | None,
        timeout: float,
        on_wait: Callable[[], None],
        on_first: Callable[[list[ChunkSpan]], None] | None = None,
    ) -> Iterator[tuple[list[ChunkSpan], list[int]]]:
        """The decoder's blocks for `spans` (the request holds `held` already), piece by
        piece (`_pieces`; None: all at once), one Alloc ahead: piece k+1's Alloc is on its
        way before piece k is handed out, so the decoder reserves it while the caller
        queues piece k's writes, and the first write starts after a small piece's Alloc
        instead of the whole prompt's. A piece that finds no room waits for it after the
        others (`alloc`), holding what the others reserved, as a step does with its
        request's earlier steps (bounded by `timeout`, pd_allocation_timeout_sec, then all
        of it is freed). `on_first(piece)` runs once the first piece's Alloc is on the wire
        (the caller's work that needs no block of the decoder's). After a failure a reply
        may be left unread: the caller closes this link (PdSender drops it on every failure)."""
        # the pieces would each fit, the request never
        if held + len(spans) > self.peer.welcome.num_blocks:
            raise _too_big(held + len(spans), self.peer.welcome.num_blocks)
        ahead: deque[list[ChunkSpan]] = deque()
        no_room: list[list[ChunkSpan]] = []
        for piece in _pieces(spans, *pieces) if pieces else [spans]:
            proto.send(self.sock, *_alloc_msg(rid, piece))
            if on_first is not None:
                on_first(piece)
                on_first = None
            ahead.append(piece)
            if len(ahead) > 1:
                yield from self._allocated(ahead.popleft(), no_room)
        while ahead:
            yield from self._allocated(ahead.popleft(), no_room)
        for piece in no_room:
            yield piece, self.alloc(rid, piece, timeout, on_wait)

    def _allocated(
        self, piece: list[ChunkSpan], no_room: list[list[ChunkSpan]]
    ) -> Iterator[tuple[list[ChunkSpan], list[int]]]:
        """The reply to an Alloc sent ahead: its blocks, or the piece kept for later."""
        reply = proto.recv(self.sock)[0]
        if isinstance(reply, proto.Allocated):
            yield piece, _blocks(reply, piece)
            return
        _check_room(proto.expect(reply, proto.NoRoom))
        no_room.append(piece)

    def alloc(
        self, rid: str, spans: list[ChunkSpan], timeout: float, on_wait: Callable[[], None]
    ) -> list[int]:
        """Blocks for `spans`, retried for `timeout` s while the buffer is full (`on_wait`
        once, at the first wait)."""
        msg, digests = _alloc_msg(rid, spans)
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            reply = self.call(msg, digests)
            if isinstance(reply, proto.Allocated):
                return _blocks(reply, spans)
            room = _check_room(proto.expect(reply, proto.NoRoom))
            if time.monotonic() > deadline:
                raise proto.PdPeerError(
                    f"no room for {room.needed_blocks} chunks in the decoder's buffer "
                    f"within pd_allocation_timeout_sec={timeout}"
                )
            if not waited:
                on_wait()
                waited = True
            time.sleep(RETRY_STEP)


def _check_room(reply: proto.Message) -> proto.NoRoom:
    """A NoRoom that waiting may cure; a request larger than the whole buffer fails now."""
    assert isinstance(reply, proto.NoRoom)
    if reply.needed_blocks > reply.num_blocks:
        raise _too_big(reply.needed_blocks, reply.num_blocks)
    return reply


def _too_big(chunks: int, num_blocks: int) -> proto.PdPeerError:
    return proto.PdPeerError(
        f"{chunks} chunks do not fit the decoder's buffer of {num_blocks} "
        "(raise pd_buffer_size there)"
    )


def _alloc_msg(rid: str, spans: list[ChunkSpan]) -> tuple[proto.Alloc, bytes]:
    """Alloc for `spans` and its payload, their key digests in order."""
    return proto.Alloc(rid, [s.num_tokens for s in spans]), b"".join(s.key.digest for s in spans)


def _blocks(reply: proto.Allocated, spans: list[ChunkSpan]) -> list[int]:
    if len(reply.blocks) != len(spans):
        raise proto.ProtocolError("Allocated: wrong number of blocks")
    return reply.blocks


def _pieces(spans: list[ChunkSpan], first: int, most: int) -> Iterator[list[ChunkSpan]]:
    """`spans` in pieces of `first`, twice that, ... up to `most` chunks: a small first
    piece starts the writes early, larger ones cost fewer round trips and launches."""
    i, n = 0, first
    while i < len(spans):
        yield spans[i : i + n]
        i, n = i + n, min(2 * n, most)
