"""The prefiller's side of disaggregated prefill: push a request's KV into a decoder.

    send(target, tokens, slots, start, last)     after each prefill step of a request
        keys of the chunks ending after `start`
        → Alloc on the decoder's alloc port (retried until `pd_allocation_timeout_sec`),
          digests in binary; a request's later steps add to its reservation
          (`pieces`: a step in pieces, one Alloc ahead of the writes: `DecoderLink.reserve`)
        → the channel writes them: staged (tcp, nixl) batch by batch through the
          staging pool, or (cuda_ipc) queued on the GPU behind the forward that
          wrote them (the first groups gathered into the sender's ring while the
          Alloc travels), copied into the decoder's GPU buffer while vLLM
          computes the next step (`IpcWriter`): the step does not wait for them
          (where vLLM frees a request's pages before its last step, `drop` makes
          the next forward wait for its queued writes first)
        and at the prompt's last step (`last`):
        → Commit: the decoder now finds every chunk of the request as a hit (cuda_ipc
          sends it right behind the writes, naming a CUDA event recorded after them that
          the decoder waits for; the others after the writes are done)
        → PrefillDone to the proxy.

A failure (no room in time, the decoder gone) frees what this request holds
on both sides (after its queued writes are done: a block is never handed on
while a copy may still land in it), tells the proxy `ok=False` and never
fails the prefill: the decoder then recomputes what is missing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.config import KvtierConfig
from kvtier.keys import PLAIN, ChunkSpan, Identity
from kvtier.logs import get_logger
from kvtier.memory import HostPool, MemoryBlock
from kvtier.pd import protocol as proto
from kvtier.pd.channels import Placement, SenderChannel
from kvtier.pd.ipc_writes import IpcWriter, Step
from kvtier.pd.link import CONNECT_TIMEOUT, DecoderLink

if TYPE_CHECKING:
    from kvtier.engine import CacheEngine

log = get_logger(__name__)


@dataclass(frozen=True)
class Target:
    """Where one request's KV goes: the decoder's host and its ports (TP rank 0's)."""

    host: str
    init_port: int
    alloc_port: int
    req_id: str  # the proxy's id for the request (the decoder and the proxy know it by this)


@dataclass
class SendStats:
    requests: int = 0
    sent_tokens: int = 0
    sent_bytes: int = 0
    failed: int = 0
    waited_for_room: int = 0
    last_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the last request's Alloc, write, Commit
    # and the host's work around them in its last send: the prompt's keys before, and after the
    # Commit the log lines and the proxy's notice (what `kvtier bench pd` called "the rest")
    last_keys_ms: float = 0.0
    last_after_ms: float = 0.0
    # cuda_ipc: GPU time from its last step's KV written to its last write done
    last_tail_ms: float = 0.0


@dataclass
class _Open:
    """A request whose KV is on its way: what its steps reserved and queued until its Commit."""

    conn: DecoderLink
    sent: int = 0  # tokens of the request's chunks handed to the decoder so far
    moved: int = 0  # of those, tokens whose bytes moved (the decoder lacked them)
    chunks: int = 0  # chunks of the request the decoder holds for it
    # queued cuda_ipc writes, per piece of a step: (the step's KV written by the forward,
    # its last copy done)
    writes: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    alloc_ms: float = 0.0
    write_ms: float = 0.0
    tail_ms: float = 0.0  # GPU time from the last step's forward to its last copy

    def wait_writes(self) -> None:
        for _, done in self.writes:
            done.synchronize()
        if self.writes:
            kv_written, done = self.writes[-1]
            self.tail_ms = kv_written.elapsed_time(done)
        self.writes.clear()


class PdSender:
    def __init__(self, engine: CacheEngine, config: KvtierConfig, tp_rank: int) -> None:
        self.engine, self.config, self.tp_rank = engine, config, tp_rank
        # Staging for tcp and nixl: the sender's own pd_buffer_size on pd_buffer_device when
        # set (as in LMCache's prefiller config; on a GPU, NIXL then moves VRAM to VRAM),
        # else the engine's CPU pool. cuda_ipc gathers straight into the decoder's buffer.
        self.staging = engine.pool
        if config.pd_buffer_size > 0 and config.pd_channel != "cuda_ipc":
            device = str(engine.kv.device) if config.pd_buffer_device == "cuda" else "cpu"
            self.staging = HostPool(config.pd_buffer_size, engine.pool.block_bytes, device=device)
        self.channel = SenderChannel(config.pd_channel, self.staging)
        self.stats = SendStats()
        # chunks in a step's first and largest Alloc piece (`DecoderLink.reserve`), or None: a step
        # at once. cuda_ipc, paired on two H100s (2026-11-26,
        # results/gpu2-h100x2-2026-11-26c/README.md): one Alloc a step was faster than pieces of
        # 4, 8, 16 at 4k and 16k tokens, 4-5 %; staged channels pipeline their own batches
        # (`_push_staged`)
        self.pieces: tuple[int, int] | None = None
        # cuda_ipc: Commit before the writes are done (`DecoderLink.commit`)
        self.early_commit = True
        # cuda_ipc: gather into the ring while the Alloc travels (`_write`)
        self.gather_early = True
        self._hello = proto.Hello(
            f"{socket.gethostname()}:{os.getpid()}",
            engine.fmt.tag(),
            config.chunk_size,
            engine.kv.bytes_per_token(),
            config.pd_channel,
            "",
        )
        self._conns: dict[tuple[str, int, int], DecoderLink] = {}
        self._proxy: socket.socket | None = None
        self._proxy_warned = False
        self._lock = threading.Lock()
        self._failed: set[str] = set()  # requests whose transfer broke: later steps are not sent
        self._open: dict[str, _Open] = {}  # requests sent in part, until their last step
        log.info(
            "PD sender: channel %s, proxy %s:%s",
            config.pd_channel,
            config.pd_proxy_host,
            config.pd_proxy_port,
        )

    def send(
        self,
        target: Target,
        tokens: Sequence[int],
        slots: torch.Tensor,
        *,
        start: int,
        last: bool,
        identity: Identity = PLAIN,
    ) -> int:
        """Push the chunks of `tokens` that end after `start`; the tokens sent (0 on failure).
        At `last`, the request's Commit: its KV is a hit on the decoder when this returns.
        The chunks go under their keys with the request's `identity` (keys.py): the decoder's
        lookup of the same request, with the same adapter, images and salt, finds them."""
        rid = target.req_id
        if rid in self._failed:
            if last:
                self._failed.discard(rid)
            return 0
        t0 = time.perf_counter()
        # hashed once a request
        spans = [s for s in self.engine.spans(tokens, rid, identity) if s.end > start]
        t_keys = time.perf_counter()
        sent = 0
        try:
            if spans or rid in self._open:
                req = self._open.get(rid)
                if req is None:
                    req = self._open[rid] = _Open(self._connection(target))
                if spans:
                    sent = self._write(req, rid, spans, slots)
                if last:
                    self._commit(req, rid)
            t_commit = time.perf_counter()
        except (proto.PdPeerError, proto.ProtocolError, OSError) as exc:
            self.stats.failed += 1
            log.warning(
                "PD: request %s: KV not sent to %s:%d (%s); the decoder will recompute it",
                rid,
                target.host,
                target.alloc_port,
                exc,
            )
            self._abandon(rid)
            self._drop_connection(target)
            if not last:
                self._failed.add(rid)
            self._notify(proto.PrefillDone(rid, False, 0, str(exc)[:200]))
            return 0
        req = self._open.pop(rid, None) if last else None
        # the proxy first: the decoder's leg of the request waits for this notice, not for the logs
        if last:
            self._notify(proto.PrefillDone(rid, True, req.sent if req is not None else 0, ""))
        if sent:
            log.info(
                "PD: sent KV of %d tokens (%d..%d) for request %s to %s:%d in %.1f ms over %s%s",
                sent,
                spans[0].start,
                spans[-1].end,
                rid,
                target.host,
                target.alloc_port,
                (time.perf_counter() - t0) * 1e3,
                self.config.pd_channel,
                "" if last or self.channel.staged else " (its writes queued on the GPU)",
            )
        if last:
            self._count_sent(rid, req)
            self.stats.last_keys_ms = (t_keys - t0) * 1e3
            self.stats.last_after_ms = (time.perf_counter() - t_commit) * 1e3
            self.stats.last_tail_ms = req.tail_ms if req is not None else 0.0
        return sent

    def _count_sent(self, rid: str, req: _Open | None) -> None:
        """A request's KV is all in the decoder's buffer: counted, and said."""
        total, moved = (req.sent, req.moved) if req is not None else (0, 0)
        self.stats.requests += 1
        self.stats.sent_tokens += moved
        self.stats.sent_bytes += moved * self.engine.kv.bytes_per_token()
        if req is not None and total:
            tail = (
                f", its last writes {req.tail_ms:.1f} ms on the GPU after its last forward"
                if req.tail_ms
                else ""
            )
            log.info(
                "PD: request %s: KV of %d tokens in the decoder's buffer%s%s",
                rid,
                total,
                tail,
                f" ({total - moved} tokens were there already)" if moved < total else "",
            )

    def _write(self, req: _Open, rid: str, spans: list[ChunkSpan], slots: torch.Tensor) -> int:
        """Reserve `spans` on the decoder piece by piece and write (or queue) each piece's
        bytes into it as its reservation comes back (`DecoderLink.reserve`); cuda_ipc
        gathers the first piece's first groups into its ring while that Alloc travels."""
        t0 = time.perf_counter()
        alloc_s, ipc = 0.0, self.channel.ipc
        ahead: list[Step] = []  # the first piece's, gathered while its Alloc travels

        def gather_ahead(piece: list[ChunkSpan]) -> None:
            if ipc is not None and self.gather_early:
                ahead.append(self._ipc_step(ipc, slots, piece, None))
                ipc.gather(ahead[0], ipc.SLOTS)

        pieces = req.conn.reserve(
            rid,
            spans,
            req.chunks,
            self.pieces,
            self.config.pd_allocation_timeout_sec,
            self._waited_for_room,
            gather_ahead,
        )
        kv_written = None  # the step's forward done: its pieces' writes start after it
        while True:
            a0 = time.perf_counter()
            got = next(pieces, None)
            alloc_s += time.perf_counter() - a0
            if got is None:
                break
            piece, blocks = got
            todo = [(s, b) for s, b in zip(piece, blocks) if b >= 0]
            if todo and ipc is not None:
                step = (
                    ahead.pop()
                    if ahead and ahead[0].items is piece and ipc.current(ahead[0])
                    else None
                )
                if step is None:  # not gathered ahead: only the chunks the decoder lacks
                    piece, blocks = [s for s, _ in todo], [b for _, b in todo]
                    step = self._ipc_step(
                        ipc, slots, piece, kv_written or (ahead[0].kv_written if ahead else None)
                    )
                views = self.channel.views(req.conn.peer, blocks, step.nbytes)
                kv_written, done = ipc.write(step, views)
                req.writes.append((kv_written, done))
            elif todo:
                self._push_staged(
                    req.conn, rid, todo, slots, time.monotonic() + self.config.blocking_timeout_secs
                )
            ahead.clear()  # only the first reply may find the ring as gathered ahead
            req.moved += sum(s.num_tokens for s, _ in todo)
        if ipc is not None and slots.dim() == 2:
            # Grouped KV (vLLM's hybrid allocator): a sliding window's blocks may be handed to
            # another request at the next step, whose forward would write them before queued
            # gathers read them.
            torch.cuda.current_stream(ipc.device).wait_stream(ipc.gather_stream)
        req.alloc_ms += alloc_s * 1e3
        req.write_ms += (time.perf_counter() - t0 - alloc_s) * 1e3
        sent = sum(s.num_tokens for s in spans)
        req.sent += sent
        req.chunks += len(spans)
        return sent

    def _ipc_step(
        self,
        ipc: IpcWriter,
        slots: torch.Tensor,
        piece: list[ChunkSpan],
        kv_written: torch.cuda.Event | None,
    ) -> Step:
        per_token = self.engine.kv.bytes_per_token()
        return ipc.start(
            lambda places: self.engine.gather_addressed(slots, piece, places),
            piece,
            [s.num_tokens * per_token for s in piece],
            kv_written,
        )

    def _commit(self, req: _Open, rid: str) -> None:
        t0 = time.perf_counter()
        early = self.early_commit and req.writes and self.channel.ipc is not None
        stream = self.channel.ipc.copy_stream if early else None
        waited = req.conn.commit(rid, stream, req.wait_writes)
        total = (time.perf_counter() - t0) * 1e3
        self.stats.last_ms = (req.alloc_ms, req.write_ms + waited, total - waited)

    def drop(self, rid: str) -> None:
        """vLLM freed the request's pages before its last step (preempted, or finished
        early) and its next forward may write other KV into them: that forward waits, on
        the GPU, for the writes still queued from them; the decoder's reservation is given
        up. A preempted request that runs again sends anew; nothing is told to the proxy
        here (its prefill request ends only when the request does)."""
        self._failed.discard(rid)
        req = self._open.get(rid)
        if req is None:
            return
        if req.writes:
            assert self.channel.ipc is not None
            forward = torch.cuda.current_stream(self.channel.ipc.device)
            for _, done in req.writes:
                forward.wait_event(done)
        log.info(
            "PD: request %s: its pages were freed before its last step; "
            "its reservation on the decoder is given up",
            rid,
        )
        self._abandon(rid)

    def _abandon(self, rid: str) -> None:
        """Free the request's reservation on the decoder once no queued write can land in it."""
        req = self._open.pop(rid, None)
        if req is None:
            return
        try:
            req.wait_writes()
        finally:
            try:
                req.conn.call(proto.Abort(rid))
            except (OSError, proto.ProtocolError, proto.PdPeerError):
                pass

    def _waited_for_room(self) -> None:
        self.stats.waited_for_room += 1

    def _push_staged(
        self,
        conn: DecoderLink,
        rid: str,
        todo: list[tuple[ChunkSpan, int]],
        slots: torch.Tensor,
        deadline: float,
    ) -> None:
        """Batch by batch through the staging pool, each batch gathered while the channel
        writes the one before (NIXL moves it without this thread; tcp has sent it)."""
        engine, per_token, i = self.engine, self.engine.kv.bytes_per_token(), 0
        batch = max(1, self.staging.num_blocks // 2)  # two batches in flight
        pending: tuple[object, list[MemoryBlock]] | None = None
        try:
            while i < len(todo):
                owned = self._staging_blocks([s for s, _ in todo[i : i + batch]])
                if not owned:
                    if pending is None:
                        raise proto.PdPeerError("no staging block free in the CPU pool")
                    done, pending = pending, None
                    self._finish(done, deadline)
                    continue
                blocks = [b for _, b in owned]
                try:
                    engine.gather_into(
                        slots,
                        [s for s, _ in owned],
                        [b.data[: s.num_tokens * per_token] for s, b in owned],
                    )
                    # the channel's DMA reads what the kernel wrote
                    if self.staging.device.type == "cuda":
                        torch.cuda.synchronize(self.staging.device)
                    items = [
                        Placement(todo[i + j][1], s.num_tokens * per_token, b)
                        for j, (s, b) in enumerate(owned)
                    ]
                    started = self.channel.push(conn.peer, conn.sock, rid, items)
                except BaseException:
                    for block in blocks:
                        block.release()
                    raise
                done, pending = pending, (started, blocks)
                if done is not None:
                    self._finish(done, deadline)
                i += len(owned)
            done, pending = pending, None
            if done is not None:
                self._finish(done, deadline)
        finally:
            # a failure with a write under way: it is waited for before its blocks go
            if pending is not None:
                try:
                    self._finish(pending, time.monotonic() + 5.0)
                except proto.PdPeerError:
                    pass

    def _finish(self, pending: tuple[object, list[MemoryBlock]], deadline: float) -> None:
        """Wait for a batch's write and free its staging blocks."""
        started, blocks = pending
        try:
            self.channel.finish(started, deadline)
        finally:
            for block in blocks:
                block.release()

    def _staging_blocks(self, spans: list[ChunkSpan]) -> list[tuple[ChunkSpan, MemoryBlock]]:
        if self.staging is self.engine.pool:
            return self.engine.allocate_staging(spans)
        owned = []
        for span in spans:  # a pool of the sender's own: what the batch in flight leaves
            block = self.staging.allocate()
            if block is None:
                break
            owned.append((span, block))
        return owned

    def _connection(self, target: Target) -> DecoderLink:
        rank = self.tp_rank
        key = (target.host, target.init_port + rank, target.alloc_port + rank)
        with self._lock:
            conn = self._conns.get(key)
            if conn is None:
                conn = DecoderLink(
                    *key, self._hello, self.channel, self.config.blocking_timeout_secs
                )
                self._conns[key] = conn
                log.info("PD: connected to decoder %s:%d (init port %d)", key[0], key[2], key[1])
            return conn

    def _drop_connection(self, target: Target) -> None:
        key = (target.host, target.init_port + self.tp_rank, target.alloc_port + self.tp_rank)
        with self._lock:
            conn = self._conns.pop(key, None)
        if conn is not None:
            conn.close()

    def _notify(self, msg: proto.PrefillDone) -> None:
        """Tell the proxy (rank 0 only); a proxy that is not there is logged once, never fatal."""
        c = self.config
        if self.tp_rank != 0 or c.pd_proxy_host is None or c.pd_proxy_port is None:
            return
        for attempt in range(2):
            try:
                if self._proxy is None:
                    self._proxy = socket.create_connection(
                        (c.pd_proxy_host, c.pd_proxy_port), timeout=CONNECT_TIMEOUT
                    )
                proto.send(self._proxy, msg)
                return
            except OSError as exc:
                if self._proxy is not None:
                    self._proxy.close()
                    self._proxy = None
                if attempt and not self._proxy_warned:
                    log.warning(
                        "PD: cannot tell the proxy at %s:%d that request %s is done (%s)",
                        c.pd_proxy_host,
                        c.pd_proxy_port,
                        msg.req_id,
                        exc,
                    )
                    self._proxy_warned = True

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        if self._proxy is not None:
            self._proxy.close()
