"""Writers: one thread per lower tier copies queued chunks into it, in batches, in order.

Each has a bounded queue (a queued chunk holds a reference to its block, so
eviction cannot free it mid-write). When a queue is full, a store waits up
to `blocking_timeout_secs` for room, then drops that tier's copy of the
chunk; waits and drops are counted (`WriterStats`) and a drop is logged.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.tiers.base import LowerTier

log = get_logger(__name__)

WRITE_BATCH = 8  # chunks per call into a lower tier


@dataclass
class WriterStats:
    written: int = 0  # chunks handed to the tier
    written_tokens: int = 0
    waits: int = 0  # stores that found the queue full and waited
    dropped: int = 0  # chunks not written: the queue stayed full for wait_s


class Writer:
    """One thread that copies queued chunks into one lower tier, in batches, in order."""

    def __init__(
        self, tier: LowerTier, max_pending: int, wait_s: float, progress: threading.Condition
    ) -> None:
        self.tier = tier
        self.max_pending = max_pending
        self.wait_s = wait_s
        self._progress = progress
        self.stats = WriterStats()
        # KV events: called (on this writer's thread) with the keys of each batch the tier took.
        self.on_written: Callable[[list[ChunkKey]], None] | None = None
        self._queue: deque[tuple[ChunkKey, MemoryBlock, int, int]] = deque()
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self._stalled = False  # a wait for room timed out; cleared when a batch is done
        self._last_drop_log = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"kvtier-{tier.name}-writer", daemon=True
        )
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._queue) + self._busy

    def submit(self, key: ChunkKey, block: MemoryBlock, nbytes: int, num_tokens: int) -> None:
        """Takes over the caller's reference to `block`.

        A full queue (queued plus in flight) is waited on for up to `wait_s`;
        if it is still full the chunk is dropped, and until the tier makes
        progress again later chunks are dropped without waiting, so a stalled
        tier costs one wait, not one per chunk.
        """
        with self._cond:
            if self.pending >= self.max_pending and not self._closed and not self._stalled:
                self.stats.waits += 1
                self._cond.wait_for(
                    lambda: self.pending < self.max_pending or self._closed, self.wait_s
                )
            if self.pending >= self.max_pending or self._closed:
                self._stalled = True
                self.stats.dropped += 1
                self._log_drop()
                block.release()
                return
            self._queue.append((key, block, nbytes, num_tokens))
            self._cond.notify_all()

    def _log_drop(self) -> None:
        now = time.monotonic()
        if now - self._last_drop_log > 10:
            self._last_drop_log = now
            log.warning(
                "%s writer: queue full for %.0f s; chunks not written to %s (%d so far)",
                self.tier.name,
                self.wait_s,
                self.tier.name,
                self.stats.dropped,
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(WRITE_BATCH, len(self._queue)))]
                self._busy = len(batch)
                self._cond.notify_all()
            try:
                keys = [k for k, *_ in batch]
                taken = self.tier.put(
                    keys, [(b.data[:n].numpy().data, t, b.digest) for _, b, n, t in batch]
                )
                if taken and self.on_written is not None:
                    self.on_written(keys)
                self.stats.written += len(batch)
                self.stats.written_tokens += sum(t for *_, t in batch)
            finally:
                for _, block, _, _ in batch:
                    block.release()
                with self._cond:
                    self._busy = 0
                    self._stalled = False
                    self._cond.notify_all()
                with self._progress:
                    self._progress.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        if not self.flush(timeout):
            log.warning(
                "%s writer: %d chunks not written after %.0f s; dropping them",
                self.tier.name,
                len(self._queue),
                timeout,
            )
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            while self._queue:
                self._queue.popleft()[1].release()
