"""A store's copies to the host, queued one piece at a time so that other copies to the host
get in between.

On a GPU the copy engine that takes a store's copies down also takes vLLM's copy of each
step's sampled tokens, which its engine waits for before it schedules again; and it serves
one stream's queue until that is empty: a copy queued on another stream gets in only when
the store's stream has nothing queued. All of a store queued at once, a 128 KB copy queued
1 ms into 2 GiB waited 37.6 ms on an H200; with two 32 MiB pieces queued at a time, so that
the queue never ran dry, 37.7 ms; one piece at a time, 0.42 ms, the store at 43 GB/s
instead of 54 (`python -m kvtier_tools.bench.h2d --down --programs --piece-mb ...`,
results/gpu-h200-pacing-2026-12-02). In the chat workload the first tokens of the requests
beside the cold prompts' stores had come 18-42 ms late (results/gpu-h200-chat-aheads-2026-12-01,
split/). So a store not waited for is cut in pieces (config gpu_store_piece_mb) and a thread
queues the next once the last has landed. Whoever needs a store's bytes (`InFlight.done`: a
load that borrows its chunks, a landing that waits) has every piece up to its last queued at
once.

PacedCopies.add(runs, keep)      the runs of a gather, each behind its kernel's event: an InFlight
PacedCopies.queue_through(f)     every piece up to f's last queued now (InFlight.done asks)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.logs import get_logger
from kvtier.transfer import cudart
from kvtier.transfer.base import InFlight

if TYPE_CHECKING:
    from kvtier.transfer.staging import Run

log = get_logger(__name__)

PIECE_BYTES = 32 << 20  # a chunk of Llama-3.1-8B's shape (256 tokens): 0.6 ms at 55 GB/s
FEEDER_IDLE_S = 2.0  # the feeder thread ends after this long with no store
BAND_ALIGN = 4096  # a band of a row wider than a piece starts at a multiple of this


@dataclass
class _Piece:
    run: Run
    after: torch.cuda.Event  # the gather kernel that wrote its staging
    flight: InFlight | None = None  # on a flight's last piece
    done: torch.cuda.Event | None = None  # once queued


def pieces(run: Run, after: torch.cuda.Event, piece_bytes: int) -> list[_Piece]:
    """`run` cut into pieces of at most `piece_bytes` (0: whole): whole rows where a row fits
    in a piece, else each row in bands (a row is a chunk: 32 MiB at Llama-3.1-8B's shape)."""
    host, dev, host_pitch, dev_pitch, width, rows = run
    if not piece_bytes:
        return [_Piece(run, after)]
    if width > piece_bytes:
        bands = -(-width // piece_bytes)
        band = -(-width // bands // BAND_ALIGN) * BAND_ALIGN
        out = []
        for r in range(rows):
            for o in range(0, width, band):
                at = (host + r * host_pitch + o, dev + r * dev_pitch + o, host_pitch, dev_pitch)
                out.append(_Piece((*at, min(band, width - o), 1), after))
        return out
    step = piece_bytes // width
    out = []
    for first in range(0, rows, step):
        count = min(step, rows - first)
        cut = (host + first * host_pitch, dev + first * dev_pitch, host_pitch, dev_pitch)
        out.append(_Piece((*cut, width, count), after))
    return out


class PacedCopies:
    """Copies from device staging to pinned host memory on `stream`, queued in order, one
    piece at a time: the next once the last has landed. What can be queued is, on the thread
    that adds it; a thread queues the rest, while some are held, sleeping on the last piece's
    event in between."""

    def __init__(self, stream: torch.cuda.Stream, piece_bytes: int = PIECE_BYTES) -> None:
        """`piece_bytes` 0: every copy queued at once, whole (config gpu_store_piece_mb 0)."""
        self._stream = stream
        self._piece_bytes = piece_bytes
        self._held: deque[_Piece] = deque()
        self._queued: deque[_Piece] = deque()  # in the order queued: one stream, ends in order
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)  # pieces held: the feeder wakes
        self._feeder: threading.Thread | None = None  # lives while stores come (FEEDER_IDLE_S)
        self._failed: BaseException | None = None

    def add(self, runs: Sequence[tuple[Run, torch.cuda.Event]], keep: object) -> InFlight:
        """The runs of one gather (each behind its kernel's event) to copy down: their flight,
        which keeps `keep` (what the copies read) until they have landed."""
        cut = [p for run, after in runs for p in pieces(run, after, self._piece_bytes)]
        flight = InFlight(None, keep=keep, held=self)
        if not cut:
            flight.mark_queued(self._stream.record_event())
            return flight
        cut[-1].flight = flight
        with self._lock:
            self._held.extend(cut)
            self._queue_while_room()  # on this thread: what fits now needs no other
            if self._held:
                self._wake_feeder()
        return flight

    def _wake_feeder(self) -> None:
        """The feeder to queue what is held (the lock held): started once, woken after."""
        if self._feeder is None:
            self._feeder = threading.Thread(
                target=self._feed, name="kvtier-copies-down", daemon=True
            )
            self._feeder.start()
        else:
            self._more.notify()

    def queue_through(self, flight: InFlight) -> None:
        with self._lock:
            while self._failed is None and self._held and not flight.is_queued:
                self._queue_next()
            if self._failed is not None:
                raise RuntimeError("a store's copy to the host failed") from self._failed

    def _queue_next(self) -> None:
        """Queue the first held piece (the lock held)."""
        piece = self._held.popleft()
        stream = self._stream
        host, dev, host_pitch, dev_pitch, width, rows = piece.run
        # the caller may be a thread whose current device is another (a lookup's borrow)
        with torch.cuda.device(stream.device):
            stream.wait_event(piece.after)
            cudart.memcpy2d(host, host_pitch, dev, dev_pitch, width, rows, stream)
            piece.done = torch.cuda.Event(blocking=True)  # a wait for it sleeps, not spins
            piece.done.record(stream)
        self._queued.append(piece)
        if piece.flight is not None:
            piece.flight.mark_queued(piece.done)
            piece.flight = None  # what it keeps (the staging) goes once its landing is over

    def _queue_while_room(self) -> None:
        """Queue held pieces while the copy engine has room (the lock held)."""
        while self._held and self._failed is None and self._room():
            try:
                self._queue_next()
            except BaseException as e:  # every flight held behind it raises it
                log.error("a store's copy to the host could not be queued: %s", e)
                self._failed = e

    def _room(self) -> bool:
        """Whether the first held piece may be queued now (the lock held): the ones queued
        before have landed (forgotten then), or nothing is paced."""
        while self._queued and _ended(self._queued[0]):
            self._queued.popleft()
        return not self._queued or not self._piece_bytes

    def _feed(self) -> None:
        """Queue held pieces as the last lands; with none held, wait for a store to add some,
        and end after FEEDER_IDLE_S without one. One thread for a burst of stores: a thread
        started per store cost the storing thread its start and the GIL handed to it."""
        while True:
            with self._lock:
                self._queue_while_room()
                while not self._held and self._failed is None:
                    if not self._more.wait(FEEDER_IDLE_S) and not self._held:
                        self._feeder = None
                        return
                    self._queue_while_room()
                if self._failed is not None:  # what is held stays: its flights raise
                    self._feeder = None
                    return
                oldest = self._queued[0].done
            assert oldest is not None
            oldest.synchronize()  # a blocking event: this thread sleeps


def _ended(piece: _Piece) -> bool:
    return piece.done is not None and piece.done.query()
