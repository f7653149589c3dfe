"""Copies to the host that the caller did not wait for: what puts each in the tiers once
they have landed. A store's chunks (storing.py) land so at the engine's next store, flush,
clear or close, or where a load that cannot wait on the GPU reads them. With `background` (an
instance of a fleet, on a GPU) a thread also lands those whose copies have been done IDLE_S
that no other call landed and no reader borrowed: an idle instance's last stores reach CPU RAM,
and so its peers, the P2P index and a router's KV events, without waiting for its next
request. A chunk a load borrowed lands on the engine's calls, as without it. A recurrent
state's snapshot (states.py) lands at the next save, load or lookup.

A lookup never waits for them: a chunk on its way counts as found, and its block can be
borrowed (`borrow`) by a load whose copies up wait for the store's copies down on the GPU
(the two directions of PCIe at once), not on the host. It can be borrowed while it is being
landed too: a lookup told it was gone would find it in no tier yet, and its load, with nothing
uploaded ahead, would wait for it to land (a background lander makes that window common).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.fleet.affinity import unpin_this_thread
from kvtier.keys import ChunkKey
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.stalls import synchronized
from kvtier.transfer import InFlight

log = get_logger(__name__)

POLL_S = 0.005  # how often the background lander asks which copies are done
IDLE_S = 0.05  # how long a copy stays done and unlanded before the background lander lands it


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
    arrived_at: float | None = None  # when the background lander first saw it done
    landed: threading.Event = field(default_factory=threading.Event)

    def borrowed(self) -> bool:
        """Whether a reader holds one of its blocks (`Landing.borrow`): the store's own
        reference is the only other."""
        return any(block.ref_count > 1 for block, _ in self.blocks.values())


class Landing:
    def __init__(self, background: bool = False) -> None:
        # each copy's InFlight lives here until it lands: what it reads (staging) with it
        self._flying: list[_Flight] = []
        self._lock = threading.Lock()  # stores on vLLM's thread, lookups on the lookup server's
        self._added = threading.Condition(self._lock)
        self._closed = False
        self._lander: threading.Thread | None = None
        if background:
            self._lander = threading.Thread(
                target=self._land_as_done, name="kvtier-landing", daemon=True
            )
            self._lander.start()

    def close(self) -> None:
        """Stop the background lander (what is still on its way lands at `settle(wait=True)`)."""
        with self._lock:
            self._closed = True
            self._added.notify()
        if self._lander is not None:
            self._lander.join()

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
            self._added.notify()

    def holds(self, key: ChunkKey) -> bool:
        """Whether `key` is on its way."""
        with self._lock:
            return any(key in f.keys for f in self._flying)

    def borrow(self, keys: Sequence[ChunkKey]) -> list[Flying | None]:
        """Each key's chunk if it is on its way or landing and its block known, retained for
        the caller; None for the others (landed: in the tiers then, or never here). A chunk
        being landed is lent too: its bytes are in its block whatever tier it goes in, and a
        reader told None before its landing ended would find it nowhere."""
        out: list[Flying | None] = []
        with self._lock:
            for key in keys:
                found = next((f for f in self._flying if key in f.blocks), None)
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
                    due = wait or entry.flight.arrived()
                if due and entry.claimed:
                    theirs.append(entry)
                elif due:
                    entry.claimed = True
                    mine.append(entry)
        self._land(mine, theirs)

    def _land(self, mine: list[_Flight], theirs: list[_Flight]) -> None:
        """Land `mine` (claimed by this thread), then wait for `theirs` (claimed by others)."""
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

    def _land_as_done(self) -> None:
        """The background lander: while copies are on their way, every POLL_S it notes which
        are done and lands those done for IDLE_S that no other thread is landing and no reader
        borrowed (a CUDA event's wait would spin a core)."""
        unpin_this_thread()
        while True:
            with self._lock:
                while not self._closed and all(f.claimed for f in self._flying):
                    self._added.wait()
                if self._closed:
                    return
                now = time.monotonic()
                mine: list[_Flight] = []  # claimed here, with the check: none is lent after it
                for entry in self._flying:
                    if entry.claimed:
                        continue
                    if entry.arrived_at is None and entry.flight.arrived():
                        entry.arrived_at = now
                    if (
                        entry.arrived_at is not None
                        and now - entry.arrived_at >= IDLE_S
                        and not entry.borrowed()
                    ):
                        entry.claimed = True
                        mine.append(entry)
            try:
                self._land(mine, [])
            except Exception as e:  # the storing thread sees its own; here nobody would
                log.warning("stores that landed in the background failed to go in: %s", e)
            time.sleep(POLL_S)
