"""What a tier is: its name, and the protocols of the tiers below CPU RAM.

A tier below CPU RAM is a `LowerTier`: chunk bytes in (`put`) and out (`get_into`). What else
it can do, it declares by implementing a capability protocol, and TieredStore asks for that
capability, never for a tier by name:

    LocalTier     on this host: `exists` is cheap and says "no need to gather it again",
                  `clear()` empties it, it evicts on its own (the disk tier)
    PinningTier   keeps chunks from eviction while a request waits to load them (disk)
    LendingTier   lends chunks in place instead of copying them (the store server of this
                  host, mapped into this process)

A new kind of tier is a module that implements these and registers a factory
(kvtier/tiers/registry.py); nothing in TieredStore or the engine changes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvtier.keys import ChunkKey
from kvtier.memory import ChunkBytes


class Tier(enum.StrEnum):
    """Where a chunk is (metric labels and log lines use the value)."""

    CPU = "cpu"
    DISK = "disk"
    REMOTE = "remote"


CPU = Tier.CPU


class ChunkSource(Protocol):
    """Where chunks are read from below CPU RAM: a tier, or a read-only view (another tensor-
    parallel size's chunks, kvtier/tiers/reshard.py). `name` is what `locate` reports."""

    name: str

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        """Each chunk's bytes into outs[i] (exactly its size): its num_tokens, or None (a miss)."""
        ...


@runtime_checkable
class LowerTier(ChunkSource, Protocol):
    """A tier below CPU RAM: chunk bytes in and out of pool blocks, written by its own writer
    thread. `min_stores`: how many times a chunk is stored before it is written here (the
    write filter, LMCache's `local_disk_min_stores`; 1: at its first store)."""

    min_stores: int

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[tuple[memoryview, int, int]]) -> bool:
        """Each chunk as (its bytes, num_tokens, its KV digest or 0: MemoryBlock.digest)."""
        ...

    def close(self) -> None:
        """Let go of the medium; called after the tier's writer has written what it had."""
        ...


@runtime_checkable
class LocalTier(LowerTier, Protocol):
    """A lower tier on this host: a store skips gathering chunks it holds, `clear` empties it,
    and it evicts by itself (`evictions`: chunks evicted so far). `on_removed`, when set, is
    called with the key digest of each chunk it evicts or removes (KV events); a chunk it
    found at start, written by an earlier process, may go unnamed."""

    on_removed: Callable[[bytes], None] | None

    @property
    def evictions(self) -> int: ...

    def __len__(self) -> int:
        """Chunks it holds."""
        ...

    def clear(self) -> None:
        """Drop every chunk not pinned."""
        ...

    def delete(self, key: ChunkKey) -> bool:
        """Drop one chunk (pinned too: a load that counted on it recomputes); whether it was
        there."""
        ...


@runtime_checkable
class PinningTier(LowerTier, Protocol):
    """A lower tier that can keep chunks from eviction until they are unpinned."""

    def pin(self, keys: Sequence[ChunkKey]) -> list[str]:
        """Pin the chunks of `keys` it holds; the handles to give `unpin`."""
        ...

    def unpin(self, handles: Sequence[str]) -> None: ...


@runtime_checkable
class LendingTier(LowerTier, Protocol):
    """A lower tier that may also lend chunks in place (the store server on this host)."""

    def can_borrow(self) -> bool: ...

    def max_held(self) -> float:
        """Bytes one connection may hold lent; 0 while the store is down."""
        ...

    def borrow(
        self, keys: Sequence[ChunkKey], raw_sizes: Sequence[int], *, whole: bool = False
    ) -> Sequence[tuple[ChunkBytes, int]] | None:
        """The leading chunks of `keys` lent in place, each (block, num_tokens); None: copy
        instead."""
        ...
