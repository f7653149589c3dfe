"""The CPU RAM tier: chunks in blocks of the host pool, evicted in `cache_policy` order (LRU).

The tier owns one reference to each block it stores. `get` hands out a
second reference (the block is then pinned: eviction skips it) that the
caller gives back with `block.release()` once its load has completed.
`allocate` makes room by evicting the least recently used unpinned chunks;
when every stored chunk is pinned it returns None instead of waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from kvtier.keys import ChunkKey
from kvtier.memory import ChunkBytes, HostPool, MemoryBlock
from kvtier.tiers.policy import EvictionOrder


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class StoredChunk:
    block: ChunkBytes  # a pool block; a chunk lent by the store server when it comes from there
    num_tokens: int


class CpuTier:
    def __init__(self, pool: HostPool, policy: str = "LRU") -> None:
        self.pool = pool
        self.stats = TierStats()
        self._chunks: dict[ChunkKey, StoredChunk] = {}
        self._order: EvictionOrder[ChunkKey] = EvictionOrder(policy)
        self._lock = threading.Lock()
        # Told of each chunk stored, and of each evicted, deleted or cleared (KV events, the
        # P2P index); called under the tier's lock, in the order of the changes: cheap calls.
        self.on_stored: list[Callable[[ChunkKey], None]] = []
        self.on_removed: list[Callable[[ChunkKey], None]] = []

    def __len__(self) -> int:
        return len(self._chunks)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._chunks)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def prefix_hits(self, keys: Iterable[ChunkKey]) -> int:
        """How many of `keys`, from the first, are all present."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._chunks:
                    break
                n += 1
        return n

    def get(self, key: ChunkKey) -> StoredChunk | None:
        """The chunk with its block retained for the caller, or None."""
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is None:
                self.stats.misses += 1
                return None
            self._order.touch(key)
            chunk.block.retain()
            self.stats.hits += 1
            return chunk

    def allocate(self) -> MemoryBlock | None:
        """A block for a new chunk, evicting LRU chunks to make room."""
        block = self.pool.allocate()
        while block is None:
            if not self._evict_one():
                return None
            block = self.pool.allocate()
        return block

    def put(self, key: ChunkKey, block: MemoryBlock, num_tokens: int) -> None:
        """Store `block` under `key`; the tier takes over the caller's reference."""
        with self._lock:
            old = self._chunks.pop(key, None)
            self._chunks[key] = StoredChunk(block, num_tokens)
            self._order.add(key)
            self.stats.puts += 1
            for hook in self.on_stored:
                hook(key)
        if old is not None:
            old.block.release()

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            chunk = self._chunks.pop(key, None)
            self._order.discard(key)
            if chunk is not None:
                self._removed([key])
        if chunk is None:
            return False
        chunk.block.release()
        return True

    def clear(self) -> None:
        with self._lock:
            chunks, self._chunks = self._chunks, {}
            self._order.clear()
            self._removed(list(chunks))
        for chunk in chunks.values():
            chunk.block.release()

    def _removed(self, keys: list[ChunkKey]) -> None:
        for hook in self.on_removed:
            for key in keys:
                hook(key)

    def _evict_one(self) -> bool:
        """Drop the first chunk in eviction order that nobody is reading; False if none."""
        with self._lock:
            for key in self._order.victims():
                # The CPU tier keeps only pool blocks: `put` takes a MemoryBlock.
                block = cast(MemoryBlock, self._chunks[key].block)
                if not block.pinned:
                    break
            else:
                return False
            del self._chunks[key]
            self._order.discard(key)
            self.stats.evictions += 1
            self._removed([key])
        block.release()
        return True
