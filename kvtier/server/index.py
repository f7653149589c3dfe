"""The server's key → value map over the page pool, with LRU eviction.

Ownership: the index holds each committed value; a reader (a reply being
sent, a same-host client copying out) takes a reference with `pin` and
gives it back with `unpin`. Pages return to the pool when a value is both
out of the index (deleted, replaced, evicted) and unpinned. A put owns its
pages from `reserve` until `commit` (now visible) or `abort`, so a put that
never completes is never seen.

Eviction is LRU between two watermarks: when a commit takes usage above
`high` of the pool, unpinned values go, oldest first, until usage is below
`low`. A `reserve` that finds too few free pages evicts what it needs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.server.pool import PagePool


@dataclass(eq=False, slots=True)
class Entry:
    pages: list[int]
    size: int
    pins: int = 0
    live: bool = True  # in the index; a dead entry frees its pages at its last unpin


@dataclass
class IndexStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    rejected_puts: int = 0
    connections: int = 0
    accepted_connections: int = 0
    protocol_errors: int = 0


class KVIndex:
    def __init__(self, pool: PagePool, *, low: float = 0.8, high: float = 0.95) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError(f"eviction watermarks must satisfy 0 < low <= high <= 1, got {low}, {high}")
        self.pool, self.low, self.high = pool, low, high
        self.stats = IndexStats()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.value_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- reads -------------------------------------------------------------------

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [k in self._entries for k in keys]

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, are all present."""
        for i, key in enumerate(keys):
            if key not in self._entries:
                return i
        return len(keys)

    @staticmethod
    def pin(entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and not entry.live:
            self.pool.free(entry.pages)

    # -- writes ------------------------------------------------------------------

    def reserve(self, nbytes: int) -> list[int] | None:
        """Pages for a value being received, evicting LRU values if needed; None if impossible."""
        if self.pool.pages_for(nbytes) > self.pool.num_pages:
            return None
        pages = self.pool.allocate(nbytes)
        while pages is None:
            if not self._evict_one():
                return None
            pages = self.pool.allocate(nbytes)
        return pages

    def abort(self, pages: list[int]) -> None:
        self.pool.free(pages)

    def commit(self, key: bytes, pages: list[int], size: int) -> None:
        """Make a fully received value visible, replacing any old one."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._drop(old)
        self._entries[key] = Entry(pages, size)
        self.value_bytes += size
        self.stats.puts += 1
        self.stats.bytes_in += size
        if self.pool.used_bytes > self.high * self.pool.capacity:
            while self.pool.used_bytes > self.low * self.pool.capacity and self._evict_one():
                pass

    def delete(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._drop(entry)
                n += 1
        return n

    def purge(self) -> int:
        """Drop every value (pinned ones are freed when their readers finish)."""
        return self.delete(list(self._entries))

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[key]
                self._drop(entry)
                self.stats.evictions += 1
                return True
        return False

    def _drop(self, entry: Entry) -> None:
        entry.live = False
        self.value_bytes -= entry.size
        if entry.pins == 0:
            self.pool.free(entry.pages)
