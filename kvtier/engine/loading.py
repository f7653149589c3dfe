"""The load path: a prompt's stored prefix → its chunks (pinned, lent or fetched) → scatter
→ verify → release.

LoadPath.start(tokens, slots)   decides what to load and holds it; from CPU RAM (or
                                lent whole by the store server) the copies are queued
                                and it returns; from disk or remote it loads batch by batch
Loading.wait(layer)             layerwise: the caller's stream waits for layer `layer`
Loading.finish()                the mask to trust (lent chunks checked), chunks released
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Generator

import numpy as np
import torch

from kvtier.engine.ahead import AheadSlot
from kvtier.engine.finding import FLYING, locate
from kvtier.engine.job import Job
from kvtier.engine.landing import Landing
from kvtier.engine.mover import Mover, release_held
from kvtier.engine.prefetch import Prefetcher
from kvtier.engine.records import EngineStats, log_transfer
from kvtier.keys import ChunkSpan, Identity
from kvtier.logs import get_logger
from kvtier.tiers.base import CPU
from kvtier.tiers.cpu import StoredChunk
from kvtier.tiers.holds import Holds
from kvtier.tiers.store import TieredStore
from kvtier.transfer import LayerHandle, Upload

log = get_logger(__name__)

Held = list[tuple[ChunkSpan, StoredChunk]]
Batches = Generator[Held, None, None]


class LoadPath:
    def __init__(
        self,
        tiers: TieredStore,
        mover: Mover,
        holds: Holds,
        ahead: AheadSlot,
        prefetcher: Prefetcher,
        stats: EngineStats,
        spans: Callable[[np.ndarray, str, Identity], list[ChunkSpan]],
        landing: Landing,
    ) -> None:
        self.tiers, self.mover, self.holds, self.ahead = tiers, mover, holds, ahead
        self.prefetcher, self.stats, self._spans = prefetcher, stats, spans
        self.landing = landing

    def release(self, request_id: str) -> None:
        """The request will not load (more of) what it looked up: its hold and its ahead go."""
        self.holds.release(request_id)
        self.ahead.drop(request_id)

    def start(self, job: Job, layerwise: bool, beside: bool = False) -> Loading:
        slots, start, request_id, end = job.slots, job.start, job.request_id, job.num_tokens
        mask = torch.zeros(end, dtype=torch.bool)
        self.prefetcher.wait(request_id)
        spans = [s for s in self._spans(job.tokens, request_id, job.identity) if s.start < end]
        held: Held = []
        handle, loaded = None, 0
        try:
            todo, held, upload, batches = self._sources(spans, start, request_id, layerwise)
            if batches is not None:
                try:
                    loaded = self._load_batches(slots, batches, start, end)
                finally:
                    batches.close()
            # its kernels on the load's own stream, after the copies (CacheEngine.retrieve)
            if held and beside:
                upload = upload or self.mover.upload(held, layer_major=layerwise, beside=True)
            if held and not beside:
                self.stats.step_loads += 1
                self.stats.step_loads_ahead += upload is not None
            if held:
                handle = (
                    self.mover.scatter_layerwise(slots, held, start, end, upload=upload)
                    if layerwise
                    else _Queued(
                        self.mover.scatter(
                            slots,
                            held,
                            start,
                            end,
                            wait=False,
                            upload=upload,
                            beside=beside,
                        )
                    )
                )
                loaded = min(len(held), len(todo))
        except BaseException:
            release_held(held)
            self.release(request_id)
            raise
        if loaded:
            first, last = todo[0][0], todo[loaded - 1][0]
            mask[max(start, first.start) : min(end, last.end)] = True
        return Loading(self, job, mask, held, handle, todo[:loaded])

    def _sources(
        self, spans: list[ChunkSpan], start: int, request_id: str, layerwise: bool
    ) -> tuple[list[tuple[ChunkSpan, str]], Held, Upload | None, Batches | None]:
        """The chunks to load, each with its tier, and where their bytes come from: lent
        whole by the store server of this host (layerwise, CPU tier off, found by the
        lease); on their way up since the lookup (chunks a store had on their way to CPU RAM
        too: their copies up wait for its copies down on the GPU); pinned in CPU RAM (one
        batch, held until `finish()`; a store's chunks on their way land first); or, from disk
        or remote, batches to load one after another."""
        if layerwise:
            held = self.tiers.lend_whole([s for s in spans if s.end > start])
            if held and self.tiers.lending is not None:
                return [(s, self.tiers.lending.name) for s, _ in held], held, None, None
        where = locate(self.tiers, self.landing, [s.key for s in spans])
        todo = [(s, CPU if w == FLYING else w) for s, w in zip(spans, where) if s.end > start]
        all_cpu = all(w == CPU for _, w in todo)
        ahead = (
            self.ahead.take(request_id, [s.key for s, _ in todo], layerwise) if all_cpu else None
        )
        if ahead is not None:
            return todo, ahead.held, ahead.upload, None
        flying = [s.key for s, w in zip(spans, where) if w == FLYING and s.end > start]
        if flying:  # read from CPU RAM: once landed
            self.landing.settle(keys=flying)
            where = self.tiers.locate([s.key for s in spans])
            todo = [(s, w) for s, w in zip(spans, where) if s.end > start]
            all_cpu = all(w == CPU for _, w in todo)
        batches = self.tiers.fetch([s for s, _ in todo], [w for _, w in todo], ahead=not all_cpu)
        if not all_cpu:
            return todo, [], None, batches
        try:
            return todo, next(batches, []), None, None
        finally:
            batches.close()

    def _load_batches(self, slots: torch.Tensor, batches: Batches, start: int, end: int) -> int:
        """Whole loads, batch after batch; how many chunks loaded. Lent chunks are
        checked once their copies are over, and what fails counts as not loaded
        (and ends the load). A lent batch's copies are queued before the one
        before it is checked and released, so the copy engine does not idle
        between them; a batch in pool blocks is settled at once (reading ahead
        needs its blocks)."""
        loaded = 0
        inflight = []  # batches whose copies may still run, each with what waits for them
        try:
            # None: the end, where every batch is settled
            for batch in itertools.chain(batches, [None]):
                keep = 0
                if batch is not None:
                    pooled = any(c.block.pool is not None for _, c in batch)
                    # until scatter returns: if it raises, wait for all
                    inflight.append((batch, self.mover.device_idle))
                    inflight[-1] = batch, self.mover.scatter(slots, batch, start, end, wait=pooled)
                    keep = 0 if pooled else 1
                while len(inflight) > keep:
                    good, whole = _checked(*inflight.pop(0))
                    loaded += good
                    if not whole:
                        return loaded
        finally:
            for entry in inflight:
                _settle(*entry)
        return loaded

    def loaded(self, job: Job, count: int, by_tier: list[tuple[ChunkSpan, str]]) -> None:
        """A load is over: its stats and log line."""
        tiers, total = self.stats.loaded_by_tier, job.num_tokens
        for span, tier in by_tier:
            tiers[tier] = tiers.get(tier, 0) + min(total, span.end) - max(job.start, span.start)
        if count:
            self.stats.retrieved_tokens += count
            self.stats.retrieve_seconds += job.seconds()
            log_transfer(
                "Retrieved KV cache for",
                count,
                total,
                job.request_id,
                count * self.mover.kv.bytes_per_token(),
                job.seconds(),
            )


class Loading:
    """A load in flight. `mask`: the tokens it loads. The chunks it reads
    stay held (pinned in the CPU tier, or lent by the store server) until
    `finish()`, which is safe to call twice. Lent chunks of a layerwise load
    are checked while their layers move; if one fails, `finish()` returns the
    mask cut before it, and the caller recomputes the rest (a forward that
    already read those layers is to be thrown away)."""

    def __init__(
        self,
        path: LoadPath,
        job: Job,
        mask: torch.Tensor,
        held: Held,
        handle: LayerHandle | None,
        loaded: list[tuple[ChunkSpan, str]],
    ) -> None:
        self.mask = mask
        self._held: Held | None
        self._path = path
        self._job = job
        self._held = held
        self._handle = handle
        self._loaded = loaded

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def settled(self) -> bool:
        """Whether `finish()` can no longer cut the mask: every chunk it reads is a block
        of the pool (checked when it came in), none lent by the store server, whose
        checksums and lease are known only once its copies are over."""
        return self._held is None or all(c.block.pool is not None for _, c in self._held)

    def wait(self, layer: int) -> None:
        if self._handle is not None:
            self._handle.wait(layer)

    def finish(self) -> torch.Tensor:
        if self._held is None:
            return self.mask
        held, self._held = self._held, None
        path = self._path
        try:
            if self._handle is not None:
                # every layer's copies and digests are done: any stream may read them
                self._handle.finish()
            readback = path.mover.readback
            with torch.cuda.stream(readback) if readback is not None else contextlib.nullcontext():
                good = _verified(held)
        finally:
            release_held(held)
            path.release(self._job.request_id)
        if good < len(held):
            self.mask[max(self._job.start, held[good][0].start) :] = False
            self._loaded = self._loaded[:good]
            log.warning(
                "%d chunks loaded layer by layer from the store server failed their checksum or "
                "outlived their lease: the tokens from %d on are to be recomputed",
                len(held) - good,
                held[good][0].start,
            )
        path.loaded(self._job, self.num_tokens, self._loaded)
        return self.mask


class _Queued:
    """A whole load's copies, queued ahead of the caller's stream (a LayerHandle whose
    layers are all ordered before whatever the caller queues next)."""

    def __init__(self, copied: Callable[[], None]) -> None:
        self._copied = copied

    def wait(self, layer: int) -> None:
        pass  # the caller's stream already waits for every layer

    def finish(self) -> None:
        self._copied()


def _verified(chunks: Held) -> int:
    """How many of `chunks`, from the first, are known good (a lent one: its checksum and
    lease held)."""
    return next((k for k, (_, c) in enumerate(chunks) if not c.block.verified()), len(chunks))


def _settle(batch: Held, copied: Callable[[], None]) -> None:
    """Once a batch's copies are over, give its chunks back."""
    try:
        copied()
    finally:
        release_held(batch)


def _checked(batch: Held, copied: Callable[[], None]) -> tuple[int, bool]:
    """A batch whose copies are queued: its leading chunks that hold (lent ones: their
    checksums or their digests on the device, and their lease), once it is given
    back; and whether that is all of them."""
    try:
        good = _verified(batch)
    finally:
        _settle(batch, copied)
    if good < len(batch):
        log.warning(
            "%d chunks loaded from the store server failed their checksum or outlived "
            "their lease; recomputed",
            len(batch) - good,
        )
    return good, good == len(batch)
