"""Eviction order of the CPU and disk tiers: `cache_policy`, as LMCache offers it.

    LRU   least recently used first (a hit makes a chunk young again)
    FIFO  oldest stored first (hits do not matter)
    MRU   most recently used first (for scans that will not come back)
    LFU   fewest hits first; among equals, least recently used first

A tier tells its order what it stores (`add`), reads (`touch`) and drops
(`discard`), and walks `victims()` when it needs room, skipping what is in
use. Callers hold their tier's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

POLICIES = ("LRU", "FIFO", "MRU", "LFU")
K = TypeVar("K", bound=Hashable)


class EvictionOrder(Generic[K]):
    def __init__(self, policy: str = "LRU") -> None:
        self.policy = policy.upper()
        if self.policy not in POLICIES:
            raise ValueError(f"cache_policy {policy!r}: expected one of {', '.join(POLICIES)}")
        # stored, or (LRU, MRU, LFU) last used, order
        self._seq: OrderedDict[K, None] = OrderedDict()
        self._hits: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self._seq)

    def add(self, key: K) -> None:
        self._seq.pop(key, None)
        self._seq[key] = None
        self._hits[key] = 0

    def touch(self, key: K) -> None:
        if key not in self._seq:
            return
        if self.policy != "FIFO":
            self._seq.move_to_end(key)
        self._hits[key] += 1

    def discard(self, key: K) -> None:
        self._seq.pop(key, None)
        self._hits.pop(key, None)

    def clear(self) -> None:
        self._seq.clear()
        self._hits.clear()

    def victims(self) -> Iterator[K]:
        """Keys in the order they should go (a snapshot for LFU: O(n log n))."""
        if self.policy == "MRU":
            return reversed(self._seq)
        if self.policy == "LFU":
            # stable: ties stay LRU-first
            return iter(sorted(self._seq, key=self._hits.__getitem__))
        return iter(self._seq)
