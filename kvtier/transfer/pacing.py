"""A store's copies to the host, queued a few at a time so that the copy engine's queue stays
short.

On a GPU the copy engine that takes a store's copies down also takes vLLM's copy of each
step's sampled tokens, which its engine waits for before it schedules again, and it runs what
was queued on it in turn whatever the stream: a 128 KB copy queued 1 ms into a store of
2.15 GB waited 37.8 ms on an H200 (`python -m kvtier_tools.bench.h2d --down`,
results/gpu-h200-chat-deferred-2026-12-01), and in the chat workload the first tokens of the
requests beside the cold prompts' stores came 18-42 ms late
(results/gpu-h200-chat-aheads-2026-12-01, split/). So a store not waited for is cut in pieces
(PIECE_BYTES) queued by a thread as the copy engine has room: at most AHEAD_BYTES of them
queued and not done, what a small copy queued behind them waits for. Whoever needs a store's
bytes (`InFlight.done`: a load that borrows its chunks, a landing that waits) has every piece
up to its last queued at once.

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
AHEAD_BYTES = 64 << 20  # queued and not done at most: 1.2 ms at 55 GB/s


@dataclass
class _Piece:
    run: Run
    after: torch.cuda.Event  # the gather kernel that wrote its staging
    flight: InFlight | None = None  # on a flight's last piece
    done: torch.cuda.Event | None = None  # once queued

    @property
    def nbytes(self) -> int:
        return self.run[4] * self.run[5]


def pieces(run: Run, after: torch.cuda.Event, piece_bytes: int) -> list[_Piece]:
    """`run` cut into pieces of whole rows, each at most `piece_bytes` (or one row)."""
    host, dev, host_pitch, dev_pitch, width, rows = run
    step = max(1, piece_bytes // width)
    out = []
    for first in range(0, rows, step):
        count = min(step, rows - first)
        cut = (host + first * host_pitch, dev + first * dev_pitch, host_pitch, dev_pitch)
        out.append(_Piece((*cut, width, count), after))
    return out


class PacedCopies:
    """Copies from device staging to pinned host memory on `stream`, queued in order, at most
    `ahead_bytes` of them not yet done (one piece whatever its size). A thread queues them,
    while some are held; it sleeps on the oldest queued piece's event when there is no room."""

    def __init__(
        self,
        stream: torch.cuda.Stream,
        ahead_bytes: int = AHEAD_BYTES,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        """`ahead_bytes` 0: every piece queued at once (config gpu_store_ahead_mb)."""
        self._stream = stream
        self._ahead_bytes, self._piece_bytes = ahead_bytes, piece_bytes
        self._held: deque[_Piece] = deque()
        self._queued: deque[_Piece] = deque()  # in the order queued: one stream, ends in order
        self._ahead = 0  # bytes of the queued pieces not seen done
        self._lock = threading.Lock()
        self._feeder: threading.Thread | None = None  # runs while pieces are held
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
            if self._held and self._feeder is None:
                self._feeder = threading.Thread(
                    target=self._feed, name="kvtier-copies-down", daemon=True
                )
                self._feeder.start()
        return flight

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
        stream.wait_event(piece.after)
        host, dev, host_pitch, dev_pitch, width, rows = piece.run
        cudart.memcpy2d(host, host_pitch, dev, dev_pitch, width, rows, stream)
        piece.done = torch.cuda.Event(blocking=True)  # a wait for it sleeps, not spins
        piece.done.record(stream)
        self._queued.append(piece)
        self._ahead += piece.nbytes
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
        """Whether the first held piece may be queued now (the lock held): what is done is
        forgotten first."""
        while self._queued and _ended(self._queued[0]):
            self._ahead -= self._queued.popleft().nbytes
        if not self._queued or not self._ahead_bytes:
            return True
        return self._ahead + self._held[0].nbytes <= self._ahead_bytes

    def _feed(self) -> None:
        torch.cuda.set_device(self._stream.device)
        while True:
            oldest = None
            with self._lock:
                self._queue_while_room()
                if not self._held or self._failed is not None:
                    self._feeder = None
                    return
                oldest = self._queued[0].done
            assert oldest is not None
            oldest.synchronize()  # a blocking event: this thread sleeps


def _ended(piece: _Piece) -> bool:
    return piece.done is not None and piece.done.query()
