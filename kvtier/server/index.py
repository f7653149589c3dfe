"""The server's key → value map over the page pool, with LRU eviction.

Ownership: the index holds each committed value; a reader (a reply being
sent, a same-host client copying out) takes its values with `lease` and
gives them back with `release`. Pages return to the pool when a value is
both out of the index (deleted, replaced, evicted) and released. A put owns
its pages from `reserve` until `commit` (now visible) or `abort`, so a put
that never completes is never seen.

Threads: the server's event loops (one per I/O thread) share one index.
Every method is one request's whole work under one lock (a lookup and its
pin cannot be split by an eviction on another loop); the pool is touched
only from here, under that lock.

Eviction is LRU between two watermarks: when a commit takes usage above
`high` of the pool, unpinned values go, oldest first, until usage is below
`low`. A `reserve` that finds too few free pages evicts what it needs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

from kvtier.server.pool import PagePool


@dataclass(eq=False, slots=True)
class Entry:
    pages: list[int]
    size: int
    pins: int = 0  # leases not yet released
    live: bool = True  # in the index; a dead entry frees its pages at its last unpin


class TooLarge(Exception):
    """A value larger than the whole pool."""


class PoolFull(Exception):
    """No room even after evicting every value not being read."""


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
    auth_failures: int = 0  # connections refused for a missing or wrong token
    refused_connections: int = 0  # past --max-connections
    idle_closed: int = 0  # past --idle-timeout
    lease_timeouts: int = 0  # leases dropped (or connections closed) past --lease-timeout
    put_deadlines: int = 0  # puts aborted past --put-deadline
    over_limit: int = 0  # requests refused past --max-held-per-conn


class KVIndex:
    def __init__(self, pool: PagePool, *, low: float = 0.8, high: float = 0.95) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError(
                f"eviction watermarks must satisfy 0 < low <= high <= 1, got {low}, {high}"
            )
        self.pool, self.low, self.high = pool, low, high
        self._stats = IndexStats()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._value_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict:
        """The counters, with keys, value bytes and pool use, at one instant."""
        with self._lock:
            return {
                **asdict(self._stats),
                "keys": len(self._entries),
                "value_bytes": self._value_bytes,
                "used_bytes": self.pool.used_bytes,
                "capacity_bytes": self.pool.capacity,
            }

    def count(self, **deltas: int) -> None:
        """Add to counters kept outside the index's own operations (connections, errors)."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    # -- reads -------------------------------------------------------------------

    def lease(self, keys: list[bytes]) -> list[Entry | None]:
        """Each key's value, pinned until `release` (None where absent); counts hits and misses."""
        with self._lock:
            out: list[Entry | None] = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    self._stats.misses += 1
                else:
                    self._entries.move_to_end(key)
                    entry.pins += 1
                    self._stats.hits += 1
                    self._stats.bytes_out += entry.size
                out.append(entry)
            return out

    def release(self, entries: list[Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.pins -= 1
                if entry.pins == 0 and not entry.live:
                    self.pool.free(entry.pages)

    def exists(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, are all present."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._entries:
                    return i
            return len(keys)

    # -- writes ------------------------------------------------------------------

    def reserve(self, sizes: list[int]) -> list[list[int]]:
        """Pages for each value of a put, evicting LRU values if needed; all or
        nothing. Raises TooLarge or PoolFull (and counts the refused values)."""
        with self._lock:
            if any(s > self.pool.capacity for s in sizes):
                self._stats.rejected_puts += len(sizes)
                raise TooLarge(
                    f"value of {max(sizes)} bytes is larger than the server's whole pool "
                    f"({self.pool.capacity} bytes; see --prealloc-size)"
                )
            reserved: list[list[int]] = []
            for size in sizes:
                pages = self.pool.allocate(size)
                while pages is None and self._evict_one():
                    pages = self.pool.allocate(size)
                if pages is None:
                    for got in reserved:
                        self.pool.free(got)
                    self._stats.rejected_puts += len(sizes)
                    raise PoolFull(
                        f"pool full: no room for {sum(sizes)} bytes even after evicting "
                        "every value not being read"
                    )
                reserved.append(pages)
            return reserved

    def abort(self, reserved: list[list[int]]) -> None:
        with self._lock:
            for pages in reserved:
                self.pool.free(pages)

    def commit(self, keys: list[bytes], reserved: list[list[int]], sizes: list[int]) -> None:
        """Make fully received values visible, replacing any old ones."""
        with self._lock:
            for key, pages, size in zip(keys, reserved, sizes):
                old = self._entries.pop(key, None)
                if old is not None:
                    self._drop(old)
                self._entries[key] = Entry(pages, size)
                self._value_bytes += size
                self._stats.puts += 1
                self._stats.bytes_in += size
            if self.pool.used_bytes > self.high * self.pool.capacity:
                while self.pool.used_bytes > self.low * self.pool.capacity and self._evict_one():
                    pass

    def delete(self, keys: list[bytes]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._drop(entry)
                    n += 1
            return n

    def purge(self) -> int:
        """Drop every value (leased ones are freed when their readers release them)."""
        with self._lock:
            n = len(self._entries)
            for entry in self._entries.values():
                self._drop(entry)
            self._entries.clear()
            return n

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[key]
                self._drop(entry)
                self._stats.evictions += 1
                return True
        return False

    def _drop(self, entry: Entry) -> None:
        entry.live = False
        self._value_bytes -= entry.size
        if entry.pins == 0:
            self.pool.free(entry.pages)
