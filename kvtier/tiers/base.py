"""What a tier is: its name, and the protocols of the tiers below CPU RAM."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from kvtier.keys import ChunkKey


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


class LowerTier(ChunkSource, Protocol):
    """A tier below CPU RAM (DiskTier, RemoteTier): chunk bytes in and out of pool blocks."""

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[tuple[memoryview, int, int]]) -> bool:
        """Each chunk as (its bytes, num_tokens, its KV digest or 0: MemoryBlock.digest)."""


class LendingTier(LowerTier, Protocol):
    """A lower tier that may also lend chunks in place (the store server on this host)."""

    def can_borrow(self) -> bool: ...
    def max_held(self) -> float:
        """Bytes one connection may hold lent; 0 while the store is down."""

    def borrow(
        self, keys: Sequence[ChunkKey], raw_sizes: Sequence[int], *, whole: bool = False
    ) -> list | None:
        """The leading chunks of `keys` lent in place, each (block, num_tokens); None: copy
        instead."""
