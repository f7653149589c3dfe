"""Copies to the host that the caller did not wait for: what puts each in the tiers once
they have landed. A layerwise store's chunks (storing.py) land so at the
engine's next store, flush, clear or close, or at once where a lookup asks for their keys;
a recurrent state's snapshot (states.py) at the next save, load or lookup."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

from kvtier.keys import ChunkKey
from kvtier.stalls import synchronized
from kvtier.transfer import InFlight


class Landing:
    def __init__(self) -> None:
        # each copy's InFlight lives here until it lands: what it reads (staging) with it
        self._flying: list[tuple[InFlight, frozenset[ChunkKey], Callable[[], None]]] = []
        self._lock = threading.Lock()  # stores on vLLM's thread, lookups on the lookup server's

    def add(self, flight: InFlight, keys: Collection[ChunkKey], land: Callable[[], None]) -> None:
        with self._lock:
            self._flying.append((flight, frozenset(keys), land))

    def holds(self, key: ChunkKey) -> bool:
        """Whether `key` is on its way."""
        with self._lock:
            return any(key in keys for _, keys, _ in self._flying)

    def settle(self, wait: bool = False, keys: Collection[ChunkKey] | None = None) -> None:
        """Land what has arrived; with `wait`, everything. With `keys` (a lookup's), only what
        holds one of them, waiting for its copies: the rest lands on the thread that stores
        (a lower tier's full queue may make a landing wait, never a lookup that needs none)."""
        if not self._flying:
            return
        ready: list[tuple[InFlight, frozenset[ChunkKey], Callable[[], None]]] = []
        flying: list[tuple[InFlight, frozenset[ChunkKey], Callable[[], None]]] = []
        with self._lock:
            for entry in self._flying:
                flight, theirs, _ = entry
                if keys is not None:
                    due = not theirs.isdisjoint(keys)
                else:
                    due = wait or flight.done.query()
                (ready if due else flying).append(entry)
            self._flying = flying
        for flight, _, land in ready:
            synchronized("stores landing", flight.done)
            land()

    def __len__(self) -> int:
        return len(self._flying)
