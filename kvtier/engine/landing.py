"""Copies to the host that the caller did not wait for: what puts each in the tiers once
they have landed. A store's chunks (storing.py) land so at the engine's next store, flush,
clear or close, or where a load that cannot wait on the GPU reads them; a recurrent state's
snapshot (states.py) at the next save, load or lookup.

A lookup never waits for them: a chunk on its way counts as found, and its block can be
borrowed (`borrow`) by a load whose copies up wait for the store's copies down on the GPU
(the two directions of PCIe at once), not on the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.keys import ChunkKey
from kvtier.memory import MemoryBlock
from kvtier.stalls import synchronized
from kvtier.transfer import InFlight


@dataclass(frozen=True)
class Flying:
    """A chunk still on its way to its block, lent to a reader: `block` retained for it (to
    release), its bytes there once `done` has completed."""

    block: MemoryBlock
    num_tokens: int
    done: torch.cuda.Event


@dataclass
class _Flight:
    flight: InFlight
    keys: frozenset[ChunkKey]
    land: Callable[[], None]
    blocks: dict[ChunkKey, tuple[MemoryBlock, int]]  # the chunks' blocks and tokens, if known
    claimed: bool = False  # a thread is landing it (it stays listed until it has landed)
    landed: threading.Event = field(default_factory=threading.Event)


class Landing:
    def __init__(self) -> None:
        # each copy's InFlight lives here until it lands: what it reads (staging) with it
        self._flying: list[_Flight] = []
        self._lock = threading.Lock()  # stores on vLLM's thread, lookups on the lookup server's

    def add(
        self,
        flight: InFlight,
        keys: Collection[ChunkKey],
        land: Callable[[], None],
        blocks: Sequence[tuple[MemoryBlock, int]] = (),
    ) -> None:
        """`blocks`: each key's block and tokens, in the order of `keys` (a store's: then a
        reader may borrow them before they land)."""
        with self._lock:
            self._flying.append(_Flight(flight, frozenset(keys), land, dict(zip(keys, blocks))))

    def holds(self, key: ChunkKey) -> bool:
        """Whether `key` is on its way."""
        with self._lock:
            return any(key in f.keys for f in self._flying)

    def borrow(self, keys: Sequence[ChunkKey]) -> list[Flying | None]:
        """Each key's chunk if it is on its way and its block known, retained for the caller;
        None for the others (landing or landed: in the tiers then, or never here)."""
        out: list[Flying | None] = []
        with self._lock:
            for key in keys:
                found = next((f for f in self._flying if key in f.blocks and not f.claimed), None)
                if found is None:
                    out.append(None)
                    continue
                block, num_tokens = found.blocks[key]
                out.append(Flying(block.retain(), num_tokens, found.flight.done))
        return out

    def settle(self, wait: bool = False, keys: Collection[ChunkKey] | None = None) -> None:
        """Land what has arrived; with `wait`, everything. With `keys` (a load's that reads
        them from CPU RAM), only what holds one of them, waiting for its copies: the rest lands
        on the thread that stores (a lower tier's full queue may make a landing wait, never a
        read that needs none)."""
        if not self._flying:
            return
        mine: list[_Flight] = []  # to land on this thread
        theirs: list[_Flight] = []  # due, and being landed by another thread
        with self._lock:
            for entry in self._flying:
                if keys is not None:
                    due = not entry.keys.isdisjoint(keys)
                else:
                    due = wait or entry.flight.done.query()
                if due and entry.claimed:
                    theirs.append(entry)
                elif due:
                    entry.claimed = True
                    mine.append(entry)
        failed: BaseException | None = None
        for entry in mine:
            try:
                synchronized("stores landing", entry.flight.done)
                entry.land()
            except BaseException as e:  # the others land still; the first failure is raised
                failed = failed or e
            finally:
                with self._lock:
                    self._flying.remove(entry)
                entry.landed.set()
        for entry in theirs:  # a reader of its keys finds them in the tiers on return
            entry.landed.wait()
        if failed is not None:
            raise failed

    def __len__(self) -> int:
        return len(self._flying)
