"""TieredStore: where chunks live — CPU RAM, then the lower tiers in order (local disk,
registered tiers, the remote store: kvtier/tiers/registry.py).

    locate(keys)        the longest stored prefix, and for each of its chunks the
                        tier that holds it (CPU first, then each lower tier in order)
    fetch(spans)        that prefix in batches that fit the pool: CPU chunks retained,
                        disk and remote chunks read into fresh blocks (and kept in
                        the CPU tier: a disk or remote hit is promoted to RAM)
    allocate()          a CPU block; evicts LRU, waits (bounded) for the writers
    put(key, block, n)  the CPU tier keeps it; writers copy it to disk and remote

The CPU pool is the hot tier and the staging buffer of every tier below it
(as in LMCache). A store or a load larger than the pool streams through it:
a batch of blocks is filled, handed to the writers or scattered into the
engine's pages, and its blocks are reused. So a pool of a few chunks can
move prompts of any length to and from disk and remote; with `local_cpu:
false` the pool holds chunks only while they move.

Writers: one thread per lower tier, each with a bounded queue (a queued
chunk holds a reference to its block, so eviction cannot free it mid-write).
Policy when a queue is full: the store waits up to `blocking_timeout_secs`
for room, then drops that tier's copy of the chunk; waits and drops are
counted (`WriterStats`) and a drop is logged. `allocate` likewise waits,
bounded, for blocks that only writers hold: the pool is a buffer, not a
wall. It returns None only when every block is held by readers.

Ownership: `put` takes over the caller's block reference. `fetch` hands the
caller one reference per yielded chunk, released by the caller when its
load is done.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.logs import get_logger
from kvtier.memory import ChunkBytes, MemoryBlock
from kvtier.tiers.base import CPU, ChunkSource, LendingTier, LocalTier, LowerTier, PinningTier
from kvtier.tiers.cpu import CpuTier, StoredChunk
from kvtier.tiers.writers import Writer

log = get_logger(__name__)

WAIT_STEP = 0.05  # s between checks for a block freed by someone other than the writers
BORROW_BYTES = 512 << 20  # chunks lent in place per lease: well under a server's per-connection cap
LEND_WHOLE_SHARE = 0.9  # of the server's per-connection cap, for one layerwise lease
# A batch when the next is read ahead: small enough that reading and loading overlap.
AHEAD_BYTES = 256 << 20

Pins = list[tuple[PinningTier, list[str]]]  # per pinning tier, the handles of its pins


class TieredStore:
    """CPU RAM and the tiers below it (`lower`, in the order a lookup asks them). What a lower
    tier can do besides keeping chunks, it declares (kvtier/tiers/base.py): the store asks
    for a capability, never for a tier by name."""

    def __init__(
        self,
        cpu: CpuTier,
        *,
        keep_cpu: bool,
        bytes_per_token: int,
        lower: Sequence[LowerTier] = (),
        wait_s: float = 10.0,
        readers: Sequence[ChunkSource] = (),
    ) -> None:
        self.cpu = cpu
        self.keep_cpu = keep_cpu
        self.bytes_per_token = bytes_per_token
        self.wait_s = wait_s
        self.lower: list[LowerTier] = list(lower)
        names = [t.name for t in self.lower]
        if len(set(names)) < len(names):
            raise ValueError(f"two lower tiers share a name: {names}")
        self.local: list[LocalTier] = [t for t in self.lower if isinstance(t, LocalTier)]
        self.pinning: list[PinningTier] = [t for t in self.lower if isinstance(t, PinningTier)]
        # The first that lends, if any: its chunks are lent in place when the CPU tier is off.
        self.lending: LendingTier | None = next(
            (t for t in self.lower if isinstance(t, LendingTier)), None
        )
        # Where chunks are read from, in order: the lower tiers, then read-only views (other
        # tensor-parallel sizes' chunks, kvtier/tiers/reshard.py), asked only for what the
        # tiers miss.
        self.sources: list[ChunkSource] = [*self.lower, *readers]
        self._progress = threading.Condition()  # notified when a writer frees blocks
        # Queued and in-flight chunks hold their blocks. With the CPU tier on, at
        # most half the pool waits per writer, so the CPU tier keeps room to evict;
        # without it the pool is only staging and may all wait.
        blocks = cpu.pool.num_blocks
        pending = max(1, blocks // 2 if keep_cpu else blocks)
        self.writers = {t.name: Writer(t, pending, wait_s, self._progress) for t in self.lower}
        self._stores: OrderedDict[ChunkKey, int] = OrderedDict()  # stores of each key (min_stores)
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="kvtier-fetch-ahead")

    def tier(self, name: str) -> LowerTier:
        """The lower tier called `name` (KeyError if none is)."""
        for tier in self.lower:
            if tier.name == name:
                return tier
        raise KeyError(name)

    # -- where chunks are ---------------------------------------------------------------

    def locate(self, keys: Sequence[ChunkKey]) -> list[str]:
        """Per key of the longest stored prefix of `keys`, the name of the tier holding it."""
        where: list[str | None] = [
            CPU if self.keep_cpu and self.cpu.contains(k) else None for k in keys
        ]
        for tier in self.sources:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            for i, found in zip(todo, tier.exists([keys[i] for i in todo])):
                if found:
                    where[i] = tier.name
        n = where.index(None) if None in where else len(where)
        return where[:n]  # type: ignore[return-value]

    def to_gather(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which chunks a store must copy out of the engine: those in neither CPU RAM nor a
        local tier (with `local_cpu: false`: missing from any lower tier).

        Counts each key for the write filter; a chunk already in CPU RAM whose count
        reaches a local tier's `min_stores` is queued for that tier from there.
        """
        counts = [self._count_store(k) for k in keys]
        if not self.keep_cpu:
            have = [True] * len(keys)
            for tier in self.lower:
                have = [h and found for h, found in zip(have, tier.exists(keys))]
            return [not h for h in have]
        out = []
        for key, count in zip(keys, counts):
            in_cpu = self.cpu.contains(key)
            held = [t.exists([key])[0] for t in self.local]
            for tier, on_tier in zip(self.local, held):
                if in_cpu and not on_tier and count == tier.min_stores:
                    self._submit_from_cpu(tier, key)
            out.append(not (in_cpu or any(held)))
        return out

    def _submit_from_cpu(self, tier: LowerTier, key: ChunkKey) -> None:
        chunk = self.cpu.get(key)
        if chunk is not None:
            # The CPU tier keeps only pool blocks: `put` takes a MemoryBlock.
            block = cast(MemoryBlock, chunk.block)
            self._submit(tier, key, block, chunk.num_tokens)
            block.release()

    def _count_store(self, key: ChunkKey) -> int:
        count = self._stores.pop(key, 0) + 1
        self._stores[key] = count
        if len(self._stores) > 1 << 16:
            self._stores.popitem(last=False)
        return count

    # -- reads --------------------------------------------------------------------------

    def fetch(
        self, spans: Sequence[ChunkSpan], where: Sequence[str], *, ahead: bool = False
    ) -> Generator[list[tuple[ChunkSpan, StoredChunk]], None, None]:
        """The chunks of `spans`, found by `locate` in `where`, in batches that fit the
        pool; each chunk retained for the caller.

        Stops at the first chunk no tier can deliver (evicted, corrupt, a
        fault, or no block to read it into). With `ahead`, the next batch is
        read (received, copied, lent) on a thread while the caller uses this
        one, when the pool has a free block for it (so a batch then takes at
        most half the pool, and AHEAD_BYTES); closing the iterator early
        releases that batch too.
        """
        limit = None
        if ahead:
            per_chunk = max(1, max((s.num_tokens for s in spans), default=1) * self.bytes_per_token)
            limit = max(1, min(self.cpu.pool.num_blocks // 2, AHEAD_BYTES // per_chunk))
        i, pending = 0, None
        try:
            while i < len(where):
                if pending is not None:
                    batch, done = pending.result()
                    pending = None
                else:
                    batch, done = self._next_batch(spans, where, i, limit)
                i += len(batch)
                if ahead and batch and not done and i < len(where) and self.cpu.pool.free_blocks:
                    pending = self._ahead.submit(self._next_batch, spans, where, i, limit)
                if batch:
                    yield batch
                if done or not batch:
                    return
        finally:
            if pending is not None:
                for _, chunk in pending.result()[0]:
                    chunk.block.release()

    def _next_batch(
        self, spans: Sequence[ChunkSpan], where: Sequence[str], i: int, limit: int | None = None
    ) -> tuple[list[tuple[ChunkSpan, StoredChunk]], bool]:
        """Chunks from position i on, as many as the pool gives now (at most `limit`);
        (batch, whether the prefix ended)."""
        lending = self.lending
        if (
            not self.keep_cpu
            and lending is not None
            and where[i] == lending.name
            and lending.can_borrow()
        ):
            lent = self._borrow(lending, spans, where, i)
            if lent is not None:
                return lent
        batch: list[tuple[ChunkSpan, StoredChunk]] = []
        reads: dict[str, list[int]] = {}  # tier name -> positions in batch
        ended = False
        while i + len(batch) < len(where) and (limit is None or len(batch) < limit):
            span = spans[i + len(batch)]
            tier: str | None = where[i + len(batch)]
            chunk = self.cpu.get(span.key) if tier == CPU else None
            # evicted since `locate` (maybe by this fetch): a copy below?
            if tier == CPU and chunk is None:
                tier = next((t.name for t in self.sources if t.exists([span.key])[0]), None)
                ended = tier is None
            if tier is not None and tier != CPU:
                # The first block of a batch may wait for the writers; later ones
                # only take what is free now, and the batch goes out as it is.
                block = self.allocate(wait=not batch)
                ended = block is None and not batch
                chunk = None if block is None else StoredChunk(block, span.num_tokens)
                if chunk is not None:
                    reads.setdefault(tier, []).append(len(batch))
            if chunk is None:
                break
            batch.append((span, chunk))
        good = self._read(batch, reads)
        if good < len(batch):  # a miss, a fault or a corrupt chunk ends the prefix
            ended = True
            for _, chunk in batch[good:]:
                chunk.block.release()
            batch = batch[:good]
        if self.keep_cpu:  # promote what came from below
            for p in sorted({p for pos in reads.values() for p in pos if p < good}):
                span, chunk = batch[p]
                # read into a pool block by `_read` (positions in `reads` only)
                block = cast(MemoryBlock, chunk.block)
                self.cpu.put(span.key, block.retain(), span.num_tokens)
        return batch, ended

    def _read(self, batch: list[tuple[ChunkSpan, StoredChunk]], reads: dict[str, list[int]]) -> int:
        """Read each tier's positions of `batch` (`reads`: tier name -> positions) into their
        blocks. A chunk one tier cannot deliver (a corrupt file, a fault) is read from the
        next tier down that holds it (a disk chunk from the remote store); the position of
        the first chunk no tier delivered, or len(batch)."""
        good = len(batch)
        for k, tier in enumerate(self.sources):
            pos = reads.get(tier.name, [])
            got = (
                tier.get_into([batch[p][0].key for p in pos], [self._bytes(*batch[p]) for p in pos])
                if pos
                else []
            )
            for p in (p for p, n in zip(pos, got) if n != batch[p][0].num_tokens):
                key = batch[p][0].key
                below = next((t for t in self.sources[k + 1 :] if t.exists([key])[0]), None)
                if below is None:
                    good = min(good, p)
                else:
                    log.info(
                        "chunk %s: %s could not deliver it, reading it from %s",
                        key,
                        tier.name,
                        below.name,
                    )
                    reads.setdefault(below.name, []).append(p)
        return good

    def _borrow(
        self, lending: LendingTier, spans: Sequence[ChunkSpan], where: Sequence[str], i: int
    ) -> tuple[list[tuple[ChunkSpan, StoredChunk]], bool] | None:
        """The lending tier's chunks from position i on, lent in place (the store server of
        this host; nothing to keep, so no pool block to copy them into). The next batch
        starts at the first chunk not lent; None: the chunk at i was not lent, the copying
        path reads it (or finds it missing)."""
        # A quarter of the server's per-connection cap: a load reading ahead holds up to three
        # leases.
        j, nbytes, limit = i, 0, min(BORROW_BYTES, lending.max_held() / 4)
        while j < len(where) and where[j] == lending.name and (j == i or nbytes < limit):
            nbytes += spans[j].num_tokens * self.bytes_per_token
            j += 1
        taken = spans[i:j]
        lent = lending.borrow(
            [s.key for s in taken], [s.num_tokens * self.bytes_per_token for s in taken]
        )
        if lent is None:
            return None
        batch = []
        for span, (block, n) in zip(taken, lent):
            if n != span.num_tokens:
                break
            batch.append((span, StoredChunk(block, n)))
        for block, _ in lent[len(batch) :]:
            block.release()
        return (batch, False) if batch else None

    def lend_whole(self, spans: Sequence[ChunkSpan]) -> list[tuple[ChunkSpan, StoredChunk]]:
        """The leading chunks of `spans` that the lending tier (the store server of this
        host) holds, all lent in place in one lease, for a layerwise load (which moves layer
        l of every chunk before layer l+1). One round trip, no `locate`: the lease says
        which chunks are there. [] unless the CPU tier is off, none of them is in a local
        tier, every one held is lent (none split over pages, no bad header) and `spans` fit
        in most of what the server lets one connection hold: then `locate` and `fetch` do
        it. Their tier is `self.lending.name`."""
        lending = self.lending
        if not spans or self.keep_cpu or lending is None or not lending.can_borrow():
            return []
        keys = [s.key for s in spans]
        if any(any(t.exists(keys)) for t in self.local):
            return []
        nbytes = sum(s.num_tokens for s in spans) * self.bytes_per_token
        if nbytes > LEND_WHOLE_SHARE * lending.max_held():
            return []
        sizes = [s.num_tokens * self.bytes_per_token for s in spans]
        lent = lending.borrow(keys, sizes, whole=True)
        if lent is None or any(n != s.num_tokens for s, (_, n) in zip(spans, lent)):
            for block, _ in lent or []:
                block.release()
            return []
        return [(span, StoredChunk(block, n)) for span, (block, n) in zip(spans, lent)]

    def _bytes(self, span: ChunkSpan, chunk: StoredChunk) -> memoryview:
        return chunk.block.data[: span.num_tokens * self.bytes_per_token].numpy().data

    # -- writes -------------------------------------------------------------------------

    def hold(
        self, keys: Sequence[ChunkKey], where: Sequence[str], most_blocks: int
    ) -> tuple[list[ChunkBytes], Pins]:
        """Keep the chunks of `keys` (found by `locate` in `where`) from eviction: a reference
        on each CPU block (at most `most_blocks`), a pin in each pinning tier that holds
        some; both to `unhold`."""
        blocks: list[ChunkBytes] = []
        for key, tier in zip(keys, where):
            if tier == CPU and len(blocks) < most_blocks:
                chunk = self.cpu.get(key)
                if chunk is not None:
                    blocks.append(chunk.block)
        pins: Pins = []
        for pinning in self.pinning:
            mine = [k for k, t in zip(keys, where) if t == pinning.name]
            handles = pinning.pin(mine) if mine else []
            if handles:
                pins.append((pinning, handles))
        return blocks, pins

    def unhold(self, blocks: Sequence[ChunkBytes], pins: Pins) -> None:
        for block in blocks:
            block.release()
        for pinning, handles in pins:
            pinning.unpin(handles)

    def allocate(self, wait: bool = True) -> MemoryBlock | None:
        """A CPU block (evicting LRU chunks). When only writers hold the others and
        `wait`, wait for them, up to `wait_s`; None when every block is held by readers."""
        if not wait:
            return self.cpu.allocate()
        deadline = time.monotonic() + self.wait_s
        while True:
            block = self.cpu.allocate()
            if block is not None:
                return block
            busy = any(w.pending for w in self.writers.values())
            left = deadline - time.monotonic()
            if left <= 0 or not (busy or self.cpu.pool.free_blocks):
                return None
            with self._progress:
                self._progress.wait(min(left, WAIT_STEP))

    def put(self, key: ChunkKey, block: MemoryBlock, num_tokens: int) -> None:
        """Keep the chunk in the CPU tier and queue it for each lower tier whose write filter
        it passes (and, for a local tier, that does not hold it); takes over `block`."""
        stores = self._stores.get(key, 1)
        for tier in self.lower:
            if stores < tier.min_stores:
                continue
            if isinstance(tier, LocalTier) and tier.exists([key])[0]:
                continue
            self._submit(tier, key, block, num_tokens)
        if self.keep_cpu:
            self.cpu.put(key, block, num_tokens)
        else:
            block.release()

    def _submit(self, tier: LowerTier, key: ChunkKey, block: MemoryBlock, num_tokens: int) -> None:
        self.writers[tier.name].submit(
            key, block.retain(), num_tokens * self.bytes_per_token, num_tokens
        )

    # -- housekeeping -------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every writer is idle; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for writer in self.writers.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not writer.flush(left):
                return False
        return True

    def copy_to(self, name: str, keys: Sequence[ChunkKey]) -> int:
        """Queue the chunks of `keys` that CPU RAM holds for lower tier `name`; how many."""
        tier = self.tier(name)
        held = [k for k in keys if self.cpu.contains(k)]
        for key in held:
            self._submit_from_cpu(tier, key)
        return len(held)

    def delete(self, keys: Sequence[ChunkKey], name: str | None = None) -> int:
        """Drop the chunks of `keys` from CPU RAM and the local tiers (`name`: that one only);
        a load already reading one finishes, one that counted on it recomputes. How many."""
        n = 0
        if name in (None, CPU):
            n += sum(self.cpu.delete(key) for key in keys)
        for tier in self.local:
            if name in (None, tier.name):
                n += sum(tier.delete(key) for key in keys)
        return n

    def clear(self) -> None:
        """Drop every chunk of CPU RAM and the local tiers; leased and pinned ones stay until
        released."""
        self.cpu.clear()
        for tier in self.local:
            tier.clear()

    def close(self, timeout: float = 30.0) -> None:
        self._ahead.shutdown()
        for writer in self.writers.values():
            writer.close(timeout)
        for tier in self.lower:
            tier.close()
