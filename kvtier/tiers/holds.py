"""Holds: a looked-up hit held for its request until the request loads it.
(The store server's lease, of chunks it lends in place, is another thing: server/bounds.py.)

vLLM's scheduler asks for a prompt's hit, then plans the load; in between,
other requests' stores could evict the chunks it was promised. A hold,
taken at the lookup, keeps them:

    CPU chunks   a reference on each block (eviction skips a block in use),
                 within a budget: all holds together hold at most half the
                 pool, so stores and loads keep room to stream through it
    disk chunks  pinned in the disk tier (never evicted while pinned), and so
                 in every tier that can pin (a PinningTier)
    remote       cannot be held: a load that misses one is reported, and the
                 engine recomputes those tokens

A hold ends with its request's retrieve, a release (the request finished
without loading), the request's next lookup (a new hold replaces it), or
`pin_timeout_sec` after it was taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey
from kvtier.logs import get_logger
from kvtier.memory import ChunkBytes
from kvtier.tiers.store import Pins, TieredStore

log = get_logger(__name__)


@dataclass
class Hold:
    deadline: float
    blocks: list[ChunkBytes] = field(default_factory=list)  # one reference each, the hold's
    pins: Pins = field(default_factory=list)


class Holds:
    def __init__(self, tiers: TieredStore, timeout: float) -> None:
        self.tiers, self.timeout = tiers, timeout
        self.max_blocks = tiers.cpu.pool.num_blocks // 2
        self.expired = 0
        self._holds: dict[str, Hold] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._holds)

    def budget(self) -> int:
        """Blocks holds may still hold."""
        with self._lock:
            return max(0, self.max_blocks - sum(len(x.blocks) for x in self._holds.values()))

    def take(self, request_id: str, keys: Sequence[ChunkKey], where: Sequence[str]) -> None:
        """Hold the chunks of `keys`, found by `locate` in `where`, for `request_id`."""
        self.expire()
        self.release(request_id)
        hold = Hold(time.monotonic() + self.timeout)
        hold.blocks, hold.pins = self.tiers.hold(keys, where, self.budget())
        with self._lock:
            self._holds[request_id] = hold

    def add(self, request_id: str, blocks: Sequence[ChunkBytes]) -> bool:
        """The hold of `request_id` takes over one reference to each block; False if it has none."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is not None:
                hold.blocks += blocks
        return hold is not None

    def release(self, request_id: str) -> None:
        with self._lock:
            hold = self._holds.pop(request_id, None)
        if hold is not None:
            self._end(hold)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(rid, hold) for rid, hold in self._holds.items() if hold.deadline < now]
            for rid, _ in expired:
                del self._holds[rid]
        for rid, hold in expired:
            self.expired += 1
            log.warning(
                "request %s: its looked-up hit waited %.0f s for a load (pin_timeout_sec); "
                "unpinned",
                rid,
                self.timeout,
            )
            self._end(hold)

    def release_all(self) -> None:
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
        for hold in holds:
            self._end(hold)

    def _end(self, hold: Hold) -> None:
        self.tiers.unhold(hold.blocks, hold.pins)
