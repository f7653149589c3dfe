"""Disk and remote chunks of a hit brought up into CPU RAM ahead of its load."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.engine.records import EngineStats
from kvtier.keys import ChunkSpan
from kvtier.tiers.base import CPU
from kvtier.tiers.holds import Holds
from kvtier.tiers.store import TieredStore


class Prefetcher:
    def __init__(self, tiers: TieredStore, holds: Holds, stats: EngineStats, enabled: bool) -> None:
        self.tiers, self.holds, self.stats = tiers, holds, stats
        self._enabled = enabled  # a CPU tier and a tier below it
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefetch")

    def run(self, spans: list[ChunkSpan], request_id: str) -> int:
        """Bring the disk and remote chunks among `spans` up; with `request_id`, into that
        request's hold (within the holds' budget), else at most half the pool. The tokens
        brought up."""
        if not self._enabled:
            return 0
        where = self.tiers.locate([s.key for s in spans])
        below = [(s, w) for s, w in zip(spans, where) if w != CPU]
        below = below[: self.holds.budget() if request_id else self.tiers.cpu.pool.num_blocks // 2]
        brought = 0
        for batch in self.tiers.fetch([s for s, _ in below], [w for _, w in below]):
            if not self.holds.add(request_id, [chunk.block for _, chunk in batch]):
                for _, chunk in batch:
                    chunk.block.release()
            brought += sum(span.num_tokens for span, _ in batch)
        self.stats.prefetched_tokens += brought
        return brought

    def start(self, spans: list[ChunkSpan], request_id: str) -> Future:
        """`run` in the background; that request's load waits for it first (`wait`)."""
        future = self._pool.submit(self.run, spans, request_id)
        with self._lock:
            self._futures[request_id] = future
        future.add_done_callback(lambda f: self._forget(request_id, f))
        return future

    def wait(self, request_id: str) -> None:
        """Until the request's prefetch (if any) is over: its chunks are in CPU RAM and its hold."""
        with self._lock:
            future = self._futures.get(request_id) if request_id else None
        if future is not None:
            future.result()

    def _forget(self, request_id: str, future: Future) -> None:
        with self._lock:
            if self._futures.get(request_id) is future:
                del self._futures[request_id]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
