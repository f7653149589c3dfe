"""CacheEngine: the one entry point engines call to store, look up and load KV.

    store(tokens, slots)     keys → allocate blocks → gather KV → put in the tiers (store.py)
    start_store(..., layerwise=True)   the same, one layer at a time as the engine computes it
    lookup(tokens)           keys → longest stored prefix, in tokens
    retrieve(tokens, slots)  keys → get (pins blocks) → scatter KV → release

`tokens` are a prompt's token ids from its first token; `slots` are the
paged-cache slot of each of those tokens (block_id * block_size + offset).
Only whole chunks move (plus the partial last chunk when
`save_unfull_chunk`), so callers pass the prefix they want considered.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtier.codec import Codec
from kvtier.config import KvtierConfig
from kvtier.keys import ChunkSpan, KVFormat, chunk_spans
from kvtier.logs import get_logger
from kvtier.memory import HostPool, MemoryBlock
from kvtier.remote import open_store
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier, StoredChunk
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer import LayerHandle, LayerSaver, PagedKV, make_transfer

log = get_logger(__name__)

Tokens = Sequence[int] | np.ndarray | torch.Tensor


@dataclass
class EngineStats:
    stored_tokens: int = 0
    retrieved_tokens: int = 0
    skipped_store_tokens: int = 0  # dropped because the pool was full of pinned chunks


class CacheEngine:
    def __init__(
        self,
        config: KvtierConfig,
        kv: PagedKV,
        fmt: KVFormat,
        *,
        transfer: str = "auto",
    ) -> None:
        self.config = config
        self.kv = kv
        self.fmt = fmt
        self.chunk_size = config.chunk_size
        self.pool = HostPool(
            config.cpu_pool_bytes,
            config.chunk_size * kv.bytes_per_token(),
            hugepages=config.local_cpu_use_hugepages,
        )
        self.tiers = TieredStore(CpuTier(self.pool), _remote_tier(config, kv), keep_cpu=config.local_cpu,
                                 bytes_per_token=kv.bytes_per_token())
        self.transfer = make_transfer(kv, transfer)
        self.stats = EngineStats()
        self._warned: OrderedDict[str, None] = OrderedDict()  # requests told their store was cut
        if not config.local_cpu and self.tiers.remote is None:
            log.warning("local_cpu is false and no other tier is configured: kvtier stores nothing")
        log.info(
            "CacheEngine: %s, %d layers, chunk %d tokens = %.2f MB, CPU pool %d chunks (%.2f GB), "
            "transfer %s",
            fmt.tag(), kv.num_layers, self.chunk_size, self.pool.block_bytes / 1e6,
            self.pool.num_blocks, self.pool.capacity / 1e9, self.transfer.name,
        )

    # -- queries ---------------------------------------------------------------

    def spans(self, tokens: Tokens) -> list[ChunkSpan]:
        return chunk_spans(_as_numpy(tokens), self.fmt, self.chunk_size, self.config.save_unfull_chunk)

    def lookup(self, tokens: Tokens) -> int:
        """Number of leading tokens whose KV is stored (a chunk boundary)."""
        spans = self.spans(tokens)
        hits = self.tiers.prefix_hits([s.key for s in spans])
        return spans[hits - 1].end if hits else 0

    # -- store -----------------------------------------------------------------

    def store(self, tokens: Tokens, slots: torch.Tensor, *, start: int = 0, request_id: str = "") -> int:
        """Store the chunks of `tokens` that end after `start` and are not stored yet.

        Returns the number of tokens stored. When the pool is full of chunks
        in use, the rest of this store is skipped (logged once), never waited on.
        """
        return self.start_store(tokens, slots, start=start, request_id=request_id).finish()

    def start_store(self, tokens: Tokens, slots: torch.Tensor, *, start: int = 0, request_id: str = "",
                    layerwise: bool = False) -> Storing:
        """`store`, split in two: what to store is decided (blocks allocated) now.

        Without `layerwise` the KV is copied out before this returns. With
        it, the caller calls `save(layer)` as each layer's KV is written, so
        layer i moves to the host while later layers compute, and `finish()`
        at the end, which puts the chunks in the tiers.
        """
        slots = self._check(tokens, slots)
        t0 = time.perf_counter()
        todo: list[ChunkSpan] = []
        if self.config.local_cpu or self.tiers.remote is not None:
            todo = [s for s in self.spans(tokens) if s.end > start]
            todo = [s for s, new in zip(todo, self.tiers.missing([s.key for s in todo])) if new]
        blocks = self._allocate(todo, request_id)
        todo = todo[: len(blocks)]
        owned = list(zip(todo, blocks))
        handle = None
        if owned:
            try:
                chunks = [b.view(self.kv.dtype, self.kv.chunk_shape(s.num_tokens)) for s, b in owned]
                if layerwise:
                    handle = self.transfer.gather_layerwise(_concat_slots(slots, todo), chunks)
                else:
                    self.transfer.gather(_concat_slots(slots, todo), chunks)
            except BaseException:
                _release(owned)
                raise
        return Storing(self, owned, handle, t0, len(slots), request_id)

    def _allocate(self, spans: list[ChunkSpan], request_id: str) -> list[MemoryBlock]:
        blocks = []
        for span in spans:
            block = self.tiers.allocate()
            if block is None:
                skipped = sum(s.num_tokens for s in spans[len(blocks):])
                self.stats.skipped_store_tokens += skipped
                self._warn_skip(skipped, request_id)
                break
            blocks.append(block)
        return blocks

    def _warn_skip(self, skipped: int, request_id: str) -> None:
        """Once per request, though chunked prefill stores a request many times."""
        if request_id and request_id in self._warned:
            return
        log.warning("CPU pool full of chunks in use: skipping the store of %d tokens for request %s "
                    "(said once per request)", skipped, request_id or "-")
        if request_id:
            self._warned[request_id] = None
            if len(self._warned) > 1024:
                self._warned.popitem(last=False)

    # -- retrieve --------------------------------------------------------------

    def retrieve(self, tokens: Tokens, slots: torch.Tensor, *, start: int = 0, request_id: str = "") -> torch.Tensor:
        """Load stored KV for tokens [start, len(slots)) into the paged KV.

        `tokens` may run past `slots`: the extra tokens only make the keys
        (so the first tokens of a stored chunk can be loaded alone, e.g. all
        but the last prompt token). Returns a bool mask over `slots`: True
        where KV was loaded. Loading stops at the first chunk not stored.
        """
        return self.start_retrieve(tokens, slots, start=start, request_id=request_id).finish()

    def start_retrieve(self, tokens: Tokens, slots: torch.Tensor, *, start: int = 0, request_id: str = "",
                       layerwise: bool = False) -> Retrieval:
        """`retrieve`, split in two: what to load is decided (and pinned) now.

        With `layerwise`, layers load in order in the background; the caller
        calls `wait(layer)` before it uses a layer and `finish()` at the end.
        Without, everything is loaded before this returns.
        """
        slots = self._check(tokens, slots, exact=False)
        end = len(slots)
        mask = torch.zeros(end, dtype=torch.bool)
        t0 = time.perf_counter()
        spans = [s for s in self.spans(tokens) if s.start < end]
        found = list(zip(spans, self.tiers.get_prefix(spans)))
        try:
            loading = [(s, c) for s, c in found if s.end > start]
            handle = self._scatter(slots, loading, start, end, layerwise) if loading else None
        except BaseException:
            for _, chunk in found:
                chunk.block.release()
            raise
        if loading:
            mask[max(start, loading[0][0].start) : min(end, loading[-1][0].end)] = True
        return Retrieval(self, mask, [c.block for _, c in found], handle, t0, request_id)

    def _scatter(self, slots: torch.Tensor, found: list[tuple[ChunkSpan, StoredChunk]], start: int, end: int,
                 layerwise: bool) -> LayerHandle | None:
        """Every chunk in one transfer, whole. A chunk cut by `start` or `end`
        writes only its tokens inside [start, end): the others get slot -1,
        which the transfers skip (the slots before `start` may be prefix-cache
        blocks the engine shares; after `end` there are no slots)."""
        views = [c.block.view(self.kv.dtype, self.kv.chunk_shape(s.num_tokens)) for s, c in found]
        first, last = found[0][0].start, found[-1][0].end
        a, b = max(start, first), min(end, last)
        targets = torch.full((last - first,), -1, dtype=torch.int64)
        targets[a - first : b - first] = slots[a:b]  # slicing only: this runs before any byte moves
        if layerwise:
            return self.transfer.scatter_layerwise(targets, views)
        self.transfer.scatter(targets, views)
        return None

    # -- housekeeping ------------------------------------------------------------

    def clear(self) -> None:
        """Drop every chunk of the CPU tier (blocks in use are freed when released)."""
        self.tiers.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until stored chunks have been sent to the remote tier; False on timeout."""
        return self.tiers.flush(timeout)

    def close(self) -> None:
        """Send what is still queued for the remote tier, then disconnect."""
        self.tiers.close(timeout=self.config.blocking_timeout_secs)

    def _check(self, tokens: Tokens, slots: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """Validate engine input at the boundary; returns slots as int64 on CPU."""
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise ValueError("slot_mapping must be a 1-D tensor of slot indices")
        if slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise ValueError(f"slot_mapping must hold integers, got {slots.dtype}")
        if len(tokens) != slots.numel() if exact else len(tokens) < slots.numel():
            raise ValueError(f"{len(tokens)} tokens but {slots.numel()} slots: every token needs one slot"
                             + (" and every slot one token" if exact else ""))
        slots = slots.to("cpu", torch.int64)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.kv.num_slots):
            raise ValueError(
                f"slot_mapping out of range: values in [{int(slots.min())}, {int(slots.max())}], "
                f"the KV cache has {self.kv.num_slots} slots"
            )
        return slots


class Retrieval:
    """A retrieve in flight. `mask`: the tokens it loads. The blocks it reads
    stay pinned in the CPU tier until `finish()`, which is safe to call twice."""

    def __init__(self, engine: CacheEngine, mask: torch.Tensor, blocks: list[MemoryBlock],
                 handle: LayerHandle | None, t0: float, request_id: str) -> None:
        self.mask = mask
        self._engine, self._blocks, self._handle = engine, blocks, handle
        self._t0, self._request_id = t0, request_id

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def wait(self, layer: int) -> None:
        if self._handle is not None:
            self._handle.wait(layer)

    def finish(self) -> torch.Tensor:
        if self._blocks is None:
            return self.mask
        try:
            if self._handle is not None:
                self._handle.finish()
        finally:
            for block in self._blocks:
                block.release()
            self._blocks = None
        loaded = self.num_tokens
        if loaded:
            engine = self._engine
            engine.stats.retrieved_tokens += loaded
            _log_transfer("Retrieved KV cache for", loaded, len(self.mask), self._request_id,
                          loaded * engine.kv.bytes_per_token(), time.perf_counter() - self._t0)
        return self.mask


class Storing:
    """A store in flight: its chunks' blocks are allocated and belong to it
    until `finish()` puts them in the tiers (or `cancel()` frees them)."""

    def __init__(self, engine: CacheEngine, chunks: list[tuple[ChunkSpan, MemoryBlock]],
                 handle: LayerSaver | None, t0: float, total: int, request_id: str) -> None:
        self._engine, self._chunks, self._handle = engine, chunks, handle
        self._t0, self._total, self._request_id = t0, total, request_id

    @property
    def num_tokens(self) -> int:
        return _tokens(self._chunks)

    def save(self, layer: int) -> None:
        """Layer `layer`'s KV is computed: start moving it (layerwise stores only)."""
        if self._handle is not None:
            self._handle.save(layer)

    def finish(self) -> int:
        """Wait for the copies, put the chunks in the tiers; the tokens stored.

        A layerwise store some layer of which was never saved (the forward
        stopped early) is dropped, not stored: that layer was not computed.
        """
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return 0
        try:
            if self._handle is not None:
                self._handle.finish()
        except BaseException:
            _release(chunks)
            raise
        unsaved = self._handle.unsaved() if self._handle is not None else []
        if unsaved:
            log.warning("request %s: layers %s were never saved; its store of %d tokens is dropped",
                        self._request_id or "-", unsaved, _tokens(chunks))
            _release(chunks)
            return 0
        engine = self._engine
        for span, block in chunks:
            engine.tiers.put(span.key, block, span.num_tokens)
        stored = _tokens(chunks)
        engine.stats.stored_tokens += stored
        _log_transfer("Storing KV cache for", stored, self._total, self._request_id,
                      stored * engine.kv.bytes_per_token(), time.perf_counter() - self._t0,
                      ", layer by layer" if self._handle is not None else "")
        return stored

    def cancel(self) -> None:
        """Drop the store (e.g. the forward failed): its blocks go back to the pool."""
        chunks, self._chunks = self._chunks, []
        try:
            if self._handle is not None and chunks:
                self._handle.finish()  # no copy may still write into a block being freed
        finally:
            _release(chunks)


def _tokens(chunks: list[tuple[ChunkSpan, MemoryBlock]]) -> int:
    return sum(span.num_tokens for span, _ in chunks)


def _release(chunks: list[tuple[ChunkSpan, MemoryBlock]]) -> None:
    for _, block in chunks:
        block.release()


def _remote_tier(config: KvtierConfig, kv: PagedKV) -> RemoteTier | None:
    if config.remote_url is None:
        return None
    codec = Codec(config.remote_serde, itemsize=kv.dtype.itemsize)
    log.info("remote tier: %s (serde %s)", config.remote_url, config.remote_serde)
    return RemoteTier(open_store(config.remote_url, config.blocking_timeout_secs), codec, config.remote_url)


def _as_numpy(tokens: Tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy()
    return np.asarray(tokens)


def _concat_slots(slots: torch.Tensor, spans: Sequence[ChunkSpan]) -> torch.Tensor:
    if len(spans) == 1 or all(a.end == b.start for a, b in zip(spans, spans[1:])):
        return slots[spans[0].start : spans[-1].end]
    return torch.cat([slots[s.start : s.end] for s in spans])


def _log_transfer(what: str, n: int, total: int, request_id: str, nbytes: int, seconds: float,
                  how: str = "") -> None:
    log.info(
        "%s %d out of %d tokens for request %s (%.1f MB in %.1f ms, %.2f GB/s%s)",
        what, n, total, request_id or "-", nbytes / 1e6, seconds * 1e3,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0, how,
    )
