"""Leases: a looked-up hit held for its request until the request loads it.

vLLM's scheduler asks for a prompt's hit, then plans the load; in between,
other requests' stores could evict the chunks it was promised. A lease,
taken at the lookup, holds them:

    CPU chunks   a reference on each block (eviction skips a block in use),
                 within a budget: all leases together hold at most half the
                 pool, so stores and loads keep room to stream through it
    disk chunks  pinned in the disk tier (never evicted while pinned)
    remote       cannot be held: a load that misses one is reported, and the
                 engine recomputes those tokens

A lease ends with its request's retrieve, a release (the request finished
without loading), the request's next lookup (a new lease replaces it), or
`pin_timeout_sec` after it was taken.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvtier.keys import ChunkKey
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.store import CPU, TieredStore

log = get_logger(__name__)


@dataclass
class Lease:
    deadline: float
    blocks: list[MemoryBlock] = field(default_factory=list)  # one reference each, the lease's
    disk_names: list[str] = field(default_factory=list)


class Leases:
    def __init__(self, tiers: TieredStore, timeout: float) -> None:
        self.tiers, self.timeout = tiers, timeout
        self.max_blocks = tiers.cpu.pool.num_blocks // 2
        self.expired = 0
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    def budget(self) -> int:
        """Blocks leases may still hold."""
        with self._lock:
            return max(0, self.max_blocks - sum(len(x.blocks) for x in self._leases.values()))

    def take(self, request_id: str, keys: Sequence[ChunkKey], where: Sequence[str]) -> None:
        """Hold the chunks of `keys`, found by `locate` in `where`, for `request_id`."""
        self.expire()
        self.release(request_id)
        lease = Lease(time.monotonic() + self.timeout)
        budget = self.budget()
        for key, tier in zip(keys, where):
            if tier == CPU and len(lease.blocks) < budget:
                chunk = self.tiers.cpu.get(key)
                if chunk is not None:
                    lease.blocks.append(chunk.block)
        disk = self.tiers.disk
        if disk is not None:
            lease.disk_names = disk.pin([k for k, t in zip(keys, where) if t == disk.name])
        with self._lock:
            self._leases[request_id] = lease

    def add(self, request_id: str, blocks: list[MemoryBlock]) -> bool:
        """The lease of `request_id` takes over one reference to each block; False if it has none."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.blocks += blocks
        return lease is not None

    def release(self, request_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._end(lease)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(rid, lease) for rid, lease in self._leases.items() if lease.deadline < now]
            for rid, _ in expired:
                del self._leases[rid]
        for rid, lease in expired:
            self.expired += 1
            log.warning("request %s: its looked-up hit waited %.0f s for a load (pin_timeout_sec); unpinned",
                        rid, self.timeout)
            self._end(lease)

    def release_all(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            self._end(lease)

    def _end(self, lease: Lease) -> None:
        for block in lease.blocks:
            block.release()
        if lease.disk_names and self.tiers.disk is not None:
            self.tiers.disk.unpin(lease.disk_names)
