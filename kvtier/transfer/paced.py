"""A store's copies to the host, queued on the copy engine a few at a time.

The copy engine serves device-to-host copies in the order they were queued, from every
stream. A whole store queued at once (1 GB a step of 8,192 tokens of an 8B model, ~20 ms
over PCIe) holds vLLM's own small copies to the host behind it: each next step's sampled
tokens, and with them every request's next token. The pacer keeps at most `ahead` bytes of
a store queued and queues the next piece, from its own thread, as an earlier one lands;
vLLM's copies wait behind at most that much (~1.2 ms at 64 MiB).

Its stream is its own, so a load's copies up (another direction, another engine) are never
queued behind a store's either.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvtier.logs import get_logger

log = get_logger(__name__)

AHEAD = 64 << 20  # bytes of one store queued on the copy engine at a time


@dataclass
class Piece:
    """One copy: queued on the pacer's stream after `after` (its gather), moving `nbytes`."""

    copy: Callable[[torch.cuda.Stream], None]
    nbytes: int
    after: torch.cuda.Event | None = None


@dataclass
class Paced:
    """A store's copies in the pacer's hands: done once all were queued and have landed
    (InFlight.done's query/synchronize)."""

    _queued: threading.Event = field(default_factory=threading.Event)
    _last: torch.cuda.Event | None = None
    _error: BaseException | None = None

    def query(self) -> bool:
        if not self._queued.is_set():
            return False
        return self._error is not None or self._last is None or self._last.query()

    def synchronize(self) -> None:
        self._queued.wait()
        if self._error is not None:
            raise RuntimeError("a store's copies to the host failed") from self._error
        if self._last is not None:
            self._last.synchronize()


class Pacer:
    def __init__(self, device: torch.device, ahead: int = AHEAD) -> None:
        self.device, self.ahead = device, ahead
        self.stream: torch.cuda.Stream | None = None  # made at the first store (none on a CPU)
        self._jobs: queue.SimpleQueue[tuple[list[Piece], Paced]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, pieces: list[Piece]) -> Paced:
        done = Paced()
        with self._lock:
            if self._thread is None:
                self.stream = torch.cuda.Stream(self.device)
                self._thread = threading.Thread(target=self._run, name="kvtier-pacer", daemon=True)
                self._thread.start()
        self._jobs.put((pieces, done))
        return done

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            pieces, done = self._jobs.get()
            try:
                self._feed(pieces, done)
            except BaseException as e:  # noqa: BLE001 - reported by the store's done, never lost
                log.exception("a store's copies to the host failed")
                done._error = e
            finally:
                done._queued.set()

    def _feed(self, pieces: list[Piece], done: Paced) -> None:
        assert self.stream is not None
        flying: collections.deque[tuple[torch.cuda.Event, int]] = collections.deque()
        queued = 0
        for piece in pieces:
            while flying and queued + piece.nbytes > self.ahead:
                event, nbytes = flying.popleft()
                event.synchronize()  # (the GIL is let go meanwhile)
                queued -= nbytes
            if piece.after is not None:
                self.stream.wait_event(piece.after)
            piece.copy(self.stream)
            flying.append((self.stream.record_event(), piece.nbytes))
            queued += piece.nbytes
        done._last = self.stream.record_event()
