"""TieredStore: where chunks live — the CPU tier, then the remote tier.

    prefix_hits(keys)   CPU tier first; the rest asked of the remote store in one round trip
    get_prefix(spans)   retained chunks of the longest stored prefix; remote hits come back
                        in one batch, received straight into fresh CPU blocks (kept in the
                        CPU tier)
    allocate()          a CPU block (evicts LRU)
    put(key, block, n)  the CPU tier keeps it; the remote writer sends it in the background
    flush()             wait until the background sends are out

The CPU pool is also the staging area of the remote tier, as in LMCache:
with `local_cpu: false` blocks hold chunks only while they are being sent
or loaded.

Ownership: `put` takes over the caller's block reference. The background
writer holds one more reference per queued chunk (so eviction cannot free
it mid-send) and drops it once sent; `get_prefix` hands the caller one
reference per chunk, released by the caller when its load is done.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.tiers.cpu import CpuTier, StoredChunk
from kvtier.tiers.remote import RemoteTier

log = get_logger(__name__)

WRITE_BATCH = 8  # chunks per remote put


class TieredStore:
    def __init__(self, cpu: CpuTier, remote: RemoteTier | None, *, keep_cpu: bool, bytes_per_token: int) -> None:
        self.cpu, self.remote, self.keep_cpu = cpu, remote, keep_cpu
        self.bytes_per_token = bytes_per_token
        # Queued chunks hold their blocks. With the CPU tier on, at most half the
        # pool waits, so a slow remote cannot stop the CPU tier from evicting;
        # without it, the pool is only staging and may all wait.
        pending = cpu.pool.num_blocks // 2 if keep_cpu else cpu.pool.num_blocks
        self._writer = _RemoteWriter(remote, max_pending=max(1, pending)) if remote else None

    def prefix_hits(self, keys: Sequence[ChunkKey]) -> int:
        n = self.cpu.prefix_hits(keys) if self.keep_cpu else 0
        if self.remote is not None and n < len(keys):
            n += self.remote.match_prefix(keys[n:])
        return n

    def missing(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which keys no tier holds (the ones a store should write)."""
        if self.keep_cpu:
            return [not self.cpu.contains(k) for k in keys]
        if self.remote is not None and keys:
            return [not found for found in self.remote.exists(keys)]
        return [True] * len(keys)

    def get_prefix(self, spans: Sequence[ChunkSpan]) -> list[StoredChunk]:
        """Chunks for the first spans, up to the first that no tier has; each retained."""
        found: list[StoredChunk] = []
        for span in spans if self.keep_cpu else ():
            chunk = self.cpu.get(span.key)
            if chunk is None:
                break
            found.append(chunk)
        if self.remote is not None and len(found) < len(spans):
            found += self._fetch(spans[len(found):])
        return found

    def _fetch(self, spans: Sequence[ChunkSpan]) -> list[StoredChunk]:
        """The remote prefix of `spans`, received straight into fresh CPU blocks."""
        spans = spans[: self.remote.match_prefix([s.key for s in spans])]
        blocks = []
        for _ in spans:
            block = self.cpu.allocate()
            if block is None:
                break
            blocks.append(block)
        spans = spans[: len(blocks)]
        got = self.remote.get_into([s.key for s in spans],
                                   [b.data[: s.num_tokens * self.bytes_per_token].numpy().data
                                    for s, b in zip(spans, blocks)]) if spans else []
        chunks = []
        for span, block, num_tokens in zip(spans, blocks, got):
            if num_tokens != span.num_tokens:  # a miss or a corrupt chunk ends the prefix
                break
            if self.keep_cpu:
                self.cpu.put(span.key, block.retain(), span.num_tokens)
            chunks.append(StoredChunk(block, span.num_tokens))
        for block in blocks[len(chunks):]:
            block.release()
        return chunks

    def allocate(self) -> MemoryBlock | None:
        return self.cpu.allocate()

    def put(self, key: ChunkKey, block: MemoryBlock, num_tokens: int) -> None:
        if self._writer is not None:
            self._writer.submit(key, block.retain() if self.keep_cpu else block, num_tokens * self.bytes_per_token,
                                num_tokens)
        if self.keep_cpu:
            self.cpu.put(key, block, num_tokens)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.flush(timeout) if self._writer else True

    def clear(self) -> None:
        self.cpu.clear()

    def close(self, timeout: float = 30.0) -> None:
        if self._writer is not None:
            self._writer.close(timeout)
            self.remote.close()


class _RemoteWriter:
    """One thread that sends stored chunks to the remote tier, in batches, in order.

    At most `max_pending` chunks wait; beyond that a store is not sent
    remotely (counted in `dropped`), so a slow remote never fills the pool.
    """

    def __init__(self, remote: RemoteTier, max_pending: int) -> None:
        self.remote, self.max_pending = remote, max_pending
        self.dropped = 0
        self._queue: deque[tuple[ChunkKey, MemoryBlock, int, int]] = deque()
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, key: ChunkKey, block: MemoryBlock, nbytes: int, num_tokens: int) -> None:
        """Takes over the caller's reference to `block`."""
        with self._cond:
            if len(self._queue) >= self.max_pending or self._closed:
                self.dropped += 1
                block.release()
                return
            self._queue.append((key, block, nbytes, num_tokens))
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(WRITE_BATCH, len(self._queue)))]
                self._busy = len(batch)
            try:
                self.remote.put([k for k, *_ in batch],
                                [(b.data[:n].numpy().data, t) for _, b, n, t in batch])
            finally:
                for _, block, _, _ in batch:
                    block.release()
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        if not self.flush(timeout):
            log.warning("remote writer: %d chunks not sent after %.0f s; dropping them", len(self._queue), timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
