"""The store path: a prompt's chunks not stored yet → pool blocks → gather → the tiers.

StorePath.start(tokens, slots)   decides what to store (and, layerwise, takes blocks
                                 for as many chunks as the pool has free now)
Storing.save(layer)              layerwise: layer `layer` is computed, move it
Storing.finish()                 waits for the copies, puts the chunks in the tiers,
                                 streams the rest through the pool batch by batch
Storing.finish(wait=False)       the same without waiting for the copies on a GPU (a
                                 layerwise store's, or a whole store's as far as the pool
                                 has free blocks): those chunks go into the tiers at a
                                 later `StorePath.landing.settle`, once they have landed
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.engine.events import EventLog
from kvtier.engine.job import Job
from kvtier.engine.landing import Landing
from kvtier.engine.mover import Mover, num_tokens, release_blocks, stamp
from kvtier.engine.records import EngineStats, SkipWarnings, log_transfer
from kvtier.engine.tails import Tails
from kvtier.keys import ChunkSpan, Identity
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.tiers.store import TieredStore
from kvtier.transfer import InFlight, LayerSaver

log = get_logger(__name__)


class StorePath:
    def __init__(
        self,
        tiers: TieredStore,
        mover: Mover,
        stats: EngineStats,
        events: EventLog,
        spans: Callable[[np.ndarray, str, Identity], list[ChunkSpan]],
        enabled: bool,
        tails: Tails,
        chunk_size: int,
        landing: Landing,
    ) -> None:
        self.tiers, self.mover, self.stats, self.events = tiers, mover, stats, events
        self._spans, self._enabled = spans, enabled  # enabled: some tier keeps chunks
        self.tails, self.chunk_size = tails, chunk_size
        self._skips = SkipWarnings()
        self.landing = landing  # stores whose copies to the host are in flight

    def start(self, job: Job, layerwise: bool) -> Storing:
        todo: list[ChunkSpan] = []
        if self._enabled:
            spans = self._spans(job.tokens, job.request_id, job.identity)
            if spans and spans[-1].num_tokens < self.chunk_size:  # a prompt's partial last chunk
                before = spans[-2].key.digest if len(spans) > 1 else job.identity.root
                self.tails.add(before, spans[-1].num_tokens)
            todo = [s for s in spans if s.end > job.start]
            # (in flight: an earlier store's)
            todo = [
                s
                for s, new in zip(todo, self.tiers.to_gather([s.key for s in todo]))
                if new and not self.landing.holds(s.key)
            ]
        owned: list[tuple[ChunkSpan, MemoryBlock]] = []
        handle = sums = None
        if layerwise and todo:
            owned = self.allocate(todo, wait=False)
            sums = self.mover.digest_sums(len(owned))
            try:
                handle = (
                    self.mover.gather_layerwise(job.slots, owned, digests=sums) if owned else None
                )
            except BaseException:
                release_blocks(owned)
                raise
        return Storing(self, job, owned, todo[len(owned) :], handle, sums)

    def allocate(
        self, spans: Sequence[ChunkSpan], wait: bool
    ) -> list[tuple[ChunkSpan, MemoryBlock]]:
        """Blocks for the first spans, as many as the pool gives now (the first may wait for
        writers)."""
        owned: list[tuple[ChunkSpan, MemoryBlock]] = []
        for span in spans:
            block = self.tiers.allocate(wait=wait and not owned)
            if block is None:
                break
            owned.append((span, block))
        return owned

    def stream(self, slots: torch.Tensor, spans: Sequence[ChunkSpan], request_id: str) -> int:
        """Gather `spans` batch by batch through the pool into the tiers; the tokens stored.

        With a tier below CPU RAM, a batch's blocks are reused once written
        there. Without one, this store's chunks stay held until it ends, so it
        never evicts its own prefix (which would leave its later chunks
        unreachable): it stores what fits.
        """
        stored, i, held = 0, 0, []
        try:
            while i < len(spans):
                owned = self.allocate(spans[i:], wait=True)
                if not owned:
                    self._skip(sum(s.num_tokens for s in spans[i:]), request_id)
                    break
                try:
                    self.mover.gather(slots, owned, digests=self.mover.digest_sums(len(owned)))
                except BaseException:
                    release_blocks(owned)
                    raise
                held += [block.retain() for _, block in owned] if not self.tiers.lower else []
                self.put(owned)
                stored += num_tokens(owned)
                i += len(owned)
        finally:
            for block in held:
                block.release()
        return stored

    def put(self, owned: Sequence[tuple[ChunkSpan, MemoryBlock]]) -> None:
        for span, block in owned:
            self.tiers.put(span.key, block, span.num_tokens)

    def _skip(self, skipped: int, request_id: str) -> None:
        self.stats.skipped_store_tokens += skipped
        self._skips.warn(skipped, request_id)

    def stored(
        self,
        job: Job,
        spans: list[ChunkSpan],
        count: int,
        layerwise: bool,
        seconds: float,
        queued: bool = False,
    ) -> None:
        """A store is over (`seconds` after its start; `queued`: its copies were queued then,
        not waited for): its events, stats and log line."""
        if self.events.on:
            prompt = self._spans(job.tokens, job.request_id, job.identity)
            self.events.stored(spans, job.tokens, prompt, job.identity.lora)
        self.stats.stored_tokens += count
        self.stats.store_seconds += seconds
        if count:
            log_transfer(
                "Storing KV cache for",
                count,
                job.num_tokens,
                job.request_id,
                count * self.mover.kv.bytes_per_token(),
                seconds,
                ", layer by layer" if layerwise else "",
                queued,
            )


class Storing:
    """A store in flight. Chunks that got a block at the start (layerwise) belong
    to it until `finish()` puts them in the tiers (or `cancel()` frees them);
    the rest are gathered at `finish()`, batch by batch through the pool."""

    def __init__(
        self,
        path: StorePath,
        job: Job,
        owned: list[tuple[ChunkSpan, MemoryBlock]],
        rest: list[ChunkSpan],
        handle: LayerSaver | None,
        digests: torch.Tensor | None = None,
    ) -> None:
        self._path, self._job, self._chunks, self._rest = path, job, owned, rest
        self._handle, self._digests = handle, digests

    @property
    def num_tokens(self) -> int:
        return num_tokens(self._chunks) + sum(s.num_tokens for s in self._rest)

    def save(self, layer: int) -> None:
        """Layer `layer`'s KV is computed: start moving it (layerwise stores only)."""
        if self._handle is not None:
            self._handle.save(layer)

    def finish(self, wait: bool = True) -> int:
        """Put the chunks in the tiers; the tokens stored. With `wait` their copies have
        landed on return. Without it, on a GPU, the chunks that have a block (a layerwise
        store's; a whole store's, as many as the pool has free now) go into the tiers at a
        later `StorePath.landing.settle`, once their copies have landed (the caller's stream
        is ordered after their reads of the KV); the rest streams through the pool now.

        A layerwise store some layer of which was never saved (the forward
        stopped early) is dropped, not stored: that layer was not computed.
        """
        chunks, self._chunks = self._chunks, []
        rest, self._rest = self._rest, []
        if not chunks and not rest:
            return 0
        flight = self._end_saves(chunks, wait)
        if self._handle is not None and self._handle.unsaved():
            return self._drop(chunks, rest, flight)
        # a whole store: the copies of what fits now not waited for
        if self._handle is None and not wait:
            chunks, flight = self._gather_later(rest)
            rest = rest[len(chunks) :]
        path = self._path
        job = self._job
        digests = self._digests
        layerwise = self._handle is not None
        spans = [s for s, _ in chunks] + rest
        # the chunks are in: into the tiers before the rest streams through the pool
        if flight is None:
            stamp(chunks, digests)
            path.put(chunks)
            stored = num_tokens(chunks) + path.stream(job.slots, rest, job.request_id)
            path.stored(job, spans, stored, layerwise, job.seconds())
            return stored
        stored = num_tokens(chunks) + path.stream(job.slots, rest, job.request_id)
        seconds = job.seconds()

        def land() -> None:
            stamp(chunks, digests, path.mover.readback)
            path.put(chunks)
            path.stored(job, spans, stored, layerwise, seconds, queued=True)

        # it holds the staging until then; a load may borrow the blocks before (landing.py)
        path.landing.add(
            flight, [s.key for s, _ in chunks], land, [(b, s.num_tokens) for s, b in chunks]
        )
        return stored

    def _end_saves(
        self, chunks: list[tuple[ChunkSpan, MemoryBlock]], wait: bool
    ) -> InFlight | None:
        """A layerwise store's copies: waited for (None), or in flight."""
        if self._handle is None:
            return None
        try:
            if wait:
                self._handle.finish()
                return None
            return self._handle.finish_later()
        except BaseException:
            release_blocks(chunks)
            raise

    def _drop(
        self,
        chunks: list[tuple[ChunkSpan, MemoryBlock]],
        rest: list[ChunkSpan],
        flight: InFlight | None,
    ) -> int:
        if flight is not None:
            flight.done.synchronize()  # no copy may still write into a block being freed
        log.warning(
            "request %s: layers %s were never saved; its store of %d tokens is dropped",
            self._job.request_id or "-",
            self._handle.unsaved() if self._handle is not None else [],
            num_tokens(chunks) + sum(s.num_tokens for s in rest),
        )
        release_blocks(chunks)
        return 0

    def _gather_later(
        self, spans: list[ChunkSpan]
    ) -> tuple[list[tuple[ChunkSpan, MemoryBlock]], InFlight | None]:
        """The first `spans`, as many as the pool has free blocks for now, gathered and their
        copies to the host queued (in flight, or landed already where nothing runs beside)."""
        path = self._path
        owned = path.allocate(spans, wait=False)
        if not owned:
            return [], None
        self._digests = path.mover.digest_sums(len(owned))
        try:
            return owned, path.mover.gather(
                self._job.slots, owned, digests=self._digests, wait=False
            )
        except BaseException:
            release_blocks(owned)
            raise

    def cancel(self) -> None:
        """Drop the store (e.g. the forward failed): its blocks go back to the pool."""
        chunks, self._chunks, self._rest = self._chunks, [], []
        try:
            if self._handle is not None and chunks:
                self._handle.finish()  # no copy may still write into a block being freed
        finally:
            release_blocks(chunks)
