"""CacheEngine: the one entry point engines call to store, look up and load KV.

    store(tokens, slots)     keys → allocate blocks → gather KV → put in the tiers (store.py),
                             in batches when the pool is smaller than the store
    start_store(..., layerwise=True)   the same, one layer at a time as the engine computes it
    find(tokens, lease_for)  keys → longest prefix stored in any tier; optionally leased
                             (protected) until the request's retrieve
    prefetch(tokens)         disk and remote chunks of that prefix up into CPU RAM
    retrieve(tokens, slots)  keys → fetch (pins blocks) → scatter KV → release, batch by batch

`tokens` are a prompt's token ids from its first token; `slots` are the
paged-cache slot of each of those tokens (block_id * block_size + offset).
Only whole chunks move (plus the partial last chunk when
`save_unfull_chunk`), so callers pass the prefix they want considered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from kvtier.codec import HEADER, KV_CODECS, U64, Codec
from kvtier.config import KvtierConfig
from kvtier.errors import ConfigError
from kvtier.keys import ChunkSpan, KVFormat, SpanMemo
from kvtier.logs import get_logger
from kvtier.memory import HostPool, MemoryBlock, front_view
from kvtier.remote import open_store
from kvtier.leases import Leases
from kvtier.store import CPU, TieredStore
from kvtier.tiers.cpu import CpuTier, StoredChunk
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer import LayerHandle, LayerSaver, PagedKV, Quant, Upload, make_transfer

log = get_logger(__name__)

Tokens = Sequence[int] | np.ndarray | torch.Tensor


@dataclass
class EngineStats:
    stored_tokens: int = 0
    retrieved_tokens: int = 0
    skipped_store_tokens: int = 0  # not stored: every pool block was held by readers
    prefetched_tokens: int = 0
    store_seconds: float = 0.0
    retrieve_seconds: float = 0.0
    loaded_by_tier: dict[str, int] = field(default_factory=dict)  # tokens loaded, by the tier they came from


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """A chunk stored in or evicted from the CPU tier (recorded with `enable_kv_events`)."""

    stored: bool
    digest: bytes
    parent: bytes | None = None  # the previous chunk of the prompt (stored events)
    token_ids: list[int] = field(default_factory=list)


MAX_EVENTS = 100_000  # recorded and not yet taken; older ones are dropped


@dataclass(frozen=True)
class Hit:
    """A lookup's answer, in tokens from the prompt's start (chunk boundaries)."""

    tokens: int  # stored in some tier
    in_cpu: int  # of those, the leading ones whose chunks are all in CPU RAM


@dataclass
class _Ahead:
    """A hit's chunks on their way to the device since its lookup (`upload_ahead`)."""

    request_id: str
    held: list[tuple[ChunkSpan, StoredChunk]]  # retained until the load ends, or the ahead is dropped
    upload: Upload
    layerwise: bool

    def drop(self) -> None:
        self.upload.wait()  # the copies read the host blocks until they end
        _release_held(self.held)


class CacheEngine:
    def __init__(
        self,
        config: KvtierConfig,
        kv: PagedKV,
        fmt: KVFormat,
        *,
        transfer: str = "auto",
        cpu: CpuTier | None = None,
    ) -> None:
        """`cpu`: a CPU tier to use instead of a new pool of `max_local_cpu_size` (a PD
        receiver's buffer: the chunks senders commit there are this engine's hits)."""
        self.config = config
        self.kv = kv
        # A lossy codec (remote_serde int8 | fp8) decides the bytes of every chunk, in every
        # tier: the key names it, so its chunks and lossless ones never meet.
        self.quant = Quant(config.remote_serde, kv.heads, kv.head_size) if config.remote_serde in KV_CODECS else None
        self.fmt = fmt if self.quant is None else dataclasses.replace(fmt, dtype=f"{fmt.dtype}+{self.quant.name}")
        self.chunk_size = config.chunk_size
        self._spans = SpanMemo(self.fmt, config.chunk_size, config.save_unfull_chunk)
        # Bytes of one token in a chunk (the KV's own, or the codec's); `kv.bytes_per_token()`
        # stays the KV's, the bytes a load delivers.
        self.chunk_bytes_per_token = (kv.bytes_per_token() if self.quant is None
                                      else self.quant.bytes_per_token(kv.num_layers, kv.kv))
        # A chunk's tensor, [L, K, T, NH, HS] of the KV's dtype or the codec's rows [L, K, T, R] uint8:
        # its dtype, and its dimensions before and after T (asked once per chunk on every load).
        self._chunk_dtype, self._chunk_dims = ((kv.dtype, ((kv.num_layers, kv.kv), (kv.heads, kv.head_size)))
                                               if self.quant is None else
                                               (torch.uint8, ((kv.num_layers, kv.kv), (self.quant.row_bytes,))))
        shared_tier = cpu is not None
        if cpu is None:
            cpu = CpuTier(HostPool(config.cpu_pool_bytes, config.chunk_size * self.chunk_bytes_per_token,
                                   hugepages=config.local_cpu_use_hugepages), config.cache_policy)
        self.pool = cpu.pool
        self.tiers = TieredStore(
            cpu, keep_cpu=config.local_cpu or shared_tier,
            bytes_per_token=self.chunk_bytes_per_token,
            disk=_disk_tier(config, self.chunk_bytes_per_token, self.fmt), remote=_remote_tier(config, kv, self.quant),
            disk_min_stores=config.local_disk_min_stores, wait_s=config.blocking_timeout_secs)
        self.transfer = make_transfer(kv, transfer, self.quant)
        # KV digests (codec.kv_digest), summed on the GPU as chunks cross: stored with each
        # chunk gathered here, and what chunks lent by the store server are checked by here,
        # so the load path hashes nothing on the CPU. Needs a layer of a chunk in whole words.
        self._digests = (self.transfer.name == "triton" and kv.device.type == "cuda"
                         and self.chunk_bytes_per_token // kv.num_layers % 4 == 0)
        if self.tiers.remote is not None:
            self.tiers.remote.digests_on_device = self._digests
        self.stats = EngineStats()
        self._warned: OrderedDict[str, None] = OrderedDict()  # requests told their store was cut
        self.leases = Leases(self.tiers, config.pin_timeout_sec)
        self._events: deque[ChunkEvent] | None = deque(maxlen=MAX_EVENTS) if config.enable_kv_events else None
        if self._events is not None:
            cpu.on_evict = lambda key: self._events.append(ChunkEvent(False, key.digest))
        self._prefetches: dict[str, Future] = {}
        self._ahead: _Ahead | None = None  # one hit uploading ahead of its load (upload_ahead)
        self._lock = threading.Lock()  # prefetches, the ahead
        self._transfer_lock = threading.Lock()  # one gather/scatter at a time (loads may run in a thread)
        # Where a finished layerwise load reads its digest sums back: not the caller's stream,
        # which holds the whole forward that read the layers (it need not be over yet).
        self._readback = torch.cuda.Stream(kv.device) if self._digests else None
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefetch")
        if kv.device.type == "cuda" and self.pool.device.type == "cpu":  # host chunks, staged over PCIe
            self._warm_up()
        if not self.tiers.keep_cpu and not self.tiers.lower and not config.enable_pd:
            log.warning("local_cpu is false and no other tier is configured: kvtier stores nothing")
        log.info(
            "CacheEngine: %s, %d layers, chunk %d tokens = %.2f MB, CPU pool %d chunks (%.2f GB), "
            "transfer %s%s",
            self.fmt.tag(), kv.num_layers, self.chunk_size, self.pool.block_bytes / 1e6,
            self.pool.num_blocks, self.pool.capacity / 1e9, self.transfer.name,
            "" if self.quant is None else f", lossy KV codec {self.quant.name} (chunks "
            f"{self.chunk_bytes_per_token / kv.bytes_per_token():.3f} of the KV's bytes)",
        )

    def _warm_up(self) -> None:
        """Run each copy path once, moving nothing (every slot -1): its kernels' compile or
        load, its streams and staging buffers cost the start, not the first requests."""
        block = self.pool.allocate()
        if block is None:
            return
        try:
            view = self.chunk_view(block.data, self.chunk_size)
            nothing = torch.full((self.chunk_size,), -1, dtype=torch.int64)
            with self._transfer_lock:
                self.transfer.gather(nothing, [view], digests=self._digest_sums(1))
                self.transfer.scatter(nothing, [view])()
                self.transfer.scatter(nothing, [view], upload=self.transfer.upload([view]))()
                saver = self.transfer.gather_layerwise(nothing, [view], digests=self._digest_sums(1))
                for layer in range(self.kv.num_layers):
                    saver.save(layer)
                saver.finish()
                for upload in (None, self.transfer.upload([view], layer_major=True)):
                    loading = self.transfer.scatter_layerwise(nothing, [view], upload=upload)
                    for layer in range(self.kv.num_layers):
                        loading.wait(layer)
                    loading.finish()
            torch.cuda.synchronize(self.kv.device)
        finally:
            block.release()

    # -- queries ---------------------------------------------------------------

    def spans(self, tokens: Tokens, request_id: str = "") -> list[ChunkSpan]:
        """The chunks of `tokens`; hashed once per request where `request_id` is given."""
        return self._spans.spans(_as_numpy(tokens), request_id)

    def lookup(self, tokens: Tokens) -> int:
        """Number of leading tokens whose KV is stored in some tier (a chunk boundary)."""
        return self.find(tokens).tokens

    def find(self, tokens: Tokens, *, lease_for: str = "") -> Hit:
        """The longest stored prefix. With `lease_for` (a request id) its chunks are
        held for that request until its retrieve (kvtier/leases.py)."""
        spans = self.spans(tokens, lease_for)
        keys = [s.key for s in spans]
        where = self.tiers.locate(keys)
        in_cpu = next((i for i, w in enumerate(where) if w != CPU), len(where))
        if lease_for:
            self.leases.take(lease_for, keys[: len(where)], where)
        return Hit(spans[len(where) - 1].end if where else 0, spans[in_cpu - 1].end if in_cpu else 0)

    def release_lease(self, request_id: str) -> None:
        """The request will not load what it looked up (finished, aborted)."""
        self.leases.release(request_id)
        self._drop_ahead(request_id)

    # -- a load's copies started at its lookup ---------------------------------------------

    def upload_ahead(self, tokens: Tokens, request_id: str, *, start: int = 0, layerwise: bool = False) -> bool:
        """Start the copies of a hit all in CPU RAM (its chunks that end after `start`, the
        tokens the engine has already) toward the device now, at the scheduler's lookup:
        the slots come with the request's `start_retrieve`, which then queues only the
        kernels. One request at a time (its staging is device memory the size of its hit).
        True if its copies are queued (now or by an earlier call)."""
        spans = [s for s in self.spans(tokens, request_id) if s.end > start]
        keys = [s.key for s in spans]
        with self._lock:
            ahead = self._ahead
            if ahead is not None and ahead.request_id != request_id:
                return False  # another request's load is ahead
            if ahead is not None and [s.key for s, _ in ahead.held] == keys and ahead.layerwise == layerwise:
                return True  # looked up again (it waited for blocks): the same chunks
            self._ahead = None
        if ahead is not None:
            ahead.drop()
        where = self.tiers.locate(keys)
        if not where or any(w != CPU for w in where):
            return False
        batches = self.tiers.fetch(spans[: len(where)], where)
        try:
            held = next(batches, [])
        finally:
            batches.close()
        try:
            with self._transfer_lock:
                upload = self.transfer.upload([self.chunk_view(c.block.data, s.num_tokens) for s, c in held],
                                              layer_major=layerwise) if held else None
        except BaseException:
            _release_held(held)
            raise
        if upload is None:
            _release_held(held)
            return False
        with self._lock:
            if self._ahead is None:
                self._ahead = _Ahead(request_id, held, upload, layerwise)
                return True
        _Ahead(request_id, held, upload, layerwise).drop()  # raced with another lookup: it went first
        return False

    def _take_ahead(self, request_id: str, keys: list, layerwise: bool) -> _Ahead | None:
        """The request's ahead if its chunks hold `keys` in a row (the load's may be fewer:
        the tokens the engine found it had by the time it loads); else None (and it is dropped)."""
        with self._lock:
            ahead = self._ahead
            if ahead is None or ahead.request_id != request_id:
                return None
            self._ahead = None
        have = [s.key for s, _ in ahead.held]
        i = have.index(keys[0]) if keys and keys[0] in have else -1
        if i >= 0 and have[i : i + len(keys)] == keys and ahead.layerwise == layerwise:
            return ahead
        ahead.drop()
        return None

    def _drop_ahead(self, request_id: str | None = None) -> None:
        """Drop the ahead (of `request_id` only, if given)."""
        with self._lock:
            ahead = self._ahead
            if ahead is None or (request_id is not None and ahead.request_id != request_id):
                return
            self._ahead = None
        ahead.drop()

    def prefetch(self, tokens: Tokens, *, request_id: str = "") -> int:
        """Bring the stored prefix's disk and remote chunks up into CPU RAM ahead of a load;
        with `request_id`, into that request's lease (within the lease budget), else at
        most half the pool. Returns the tokens brought up."""
        if not self.config.local_cpu or not self.tiers.lower:
            return 0
        spans = self.spans(tokens, request_id)
        where = self.tiers.locate([s.key for s in spans])
        below = [(s, w) for s, w in zip(spans, where) if w != CPU]
        below = below[: self.leases.budget() if request_id else self.pool.num_blocks // 2]
        brought = 0
        for batch in self.tiers.fetch([s for s, _ in below], [w for _, w in below]):
            if not self.leases.add(request_id, [chunk.block for _, chunk in batch]):
                for _, chunk in batch:
                    chunk.block.release()
            brought += sum(span.num_tokens for span, _ in batch)
        self.stats.prefetched_tokens += brought
        return brought

    def start_prefetch(self, tokens: Tokens, request_id: str) -> Future:
        """`prefetch` in the background; that request's retrieve waits for it first."""
        future = self._prefetcher.submit(self.prefetch, _as_numpy(tokens).copy(), request_id=request_id)
        with self._lock:
            self._prefetches[request_id] = future
        future.add_done_callback(lambda f: self._forget_prefetch(request_id, f))
        return future

    def _forget_prefetch(self, request_id: str, future: Future) -> None:
        with self._lock:
            if self._prefetches.get(request_id) is future:
                del self._prefetches[request_id]

    # -- store -----------------------------------------------------------------

    def store(self, tokens: Tokens, slots: torch.Tensor, *, start: int = 0, request_id: str = "") -> int:
        """Store the chunks of `tokens` that end after `start` and are not stored yet.

        Returns the number of tokens stored. A store larger than the pool
        streams through it in batches (waiting, bounded, for the writers);
        it is cut short only when every block is held by readers (logged
        once per request, counted in `stats.skipped_store_tokens`).
        """
        return self.start_store(tokens, slots, start=start, request_id=request_id).finish()

    def start_store(self, tokens: Tokens, slots: torch.Tensor, *, start: int = 0, request_id: str = "",
                    layerwise: bool = False) -> Storing:
        """`store`, split in two: what to store is decided now.

        Without `layerwise` the KV is copied out at `finish()`. With it,
        blocks for as many chunks as the pool has free now are allocated
        here; the caller calls `save(layer)` as each layer's KV is written,
        so layer i moves to the host while later layers compute, and
        `finish()` at the end, which puts those chunks in the tiers and
        streams the rest (chunks that got no block) through the pool.
        """
        slots = self._check(tokens, slots)
        t0 = time.perf_counter()
        todo: list[ChunkSpan] = []
        if self.config.local_cpu or self.tiers.lower:
            todo = [s for s in self.spans(tokens, request_id) if s.end > start]
            todo = [s for s, new in zip(todo, self.tiers.to_gather([s.key for s in todo])) if new]
        owned: list[tuple[ChunkSpan, MemoryBlock]] = []
        handle = sums = None
        if layerwise and todo:
            owned = self._allocate(todo, wait=False)
            sums = self._digest_sums(len(owned))
            try:
                handle = self._gather(slots, owned, layerwise=True, digests=sums) if owned else None
            except BaseException:
                _release(owned)
                raise
        return Storing(self, owned, todo[len(owned):], slots, handle, t0, request_id, _as_numpy(tokens), sums)

    def chunk_view(self, data: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The chunk at the front of the byte buffer `data`, as the transfers take it:
        [L, K, T, NH, HS] of the KV's dtype, or the codec's rows [L, K, T, R] uint8."""
        before, after = self._chunk_dims
        return front_view(data if data.dtype == torch.uint8 else data.view(torch.uint8), self._chunk_dtype,
                          (*before, num_tokens, *after))

    def _allocate(self, spans: Sequence[ChunkSpan], wait: bool) -> list[tuple[ChunkSpan, MemoryBlock]]:
        """Blocks for the first spans, as many as the pool gives now (the first may wait for writers)."""
        owned = []
        for span in spans:
            block = self.tiers.allocate(wait=wait and not owned)
            if block is None:
                break
            owned.append((span, block))
        return owned

    def allocate_staging(self, spans: Sequence[ChunkSpan]) -> list[tuple[ChunkSpan, MemoryBlock]]:
        """Pool blocks for the first of `spans` (as many as free now; the first may wait),
        owned by the caller: a PD sender's staging."""
        return self._allocate(spans, wait=True)

    def gather_into(self, slots: torch.Tensor, spans: Sequence[ChunkSpan], buffers: Sequence[torch.Tensor]) -> None:
        """Copy the KV of `spans` into byte buffers of the caller (a PD sender's staging
        blocks, or a decoder's GPU buffer mapped over CUDA IPC)."""
        chunks = [self.chunk_view(buf, s.num_tokens) for s, buf in zip(spans, buffers)]
        with self._transfer_lock:
            self.transfer.gather(_concat_slots(slots, spans), chunks)

    def _gather(self, slots: torch.Tensor, owned: list[tuple[ChunkSpan, MemoryBlock]],
                layerwise: bool = False, digests: torch.Tensor | None = None) -> LayerSaver | None:
        """The KV into the blocks, now (whole: with their digests stamped) or as layers are saved."""
        spans = [s for s, _ in owned]
        chunks = [self.chunk_view(b.data, s.num_tokens) for s, b in owned]
        with self._transfer_lock:
            if layerwise:
                return self.transfer.gather_layerwise(_concat_slots(slots, spans), chunks, digests=digests)
            self.transfer.gather(_concat_slots(slots, spans), chunks, digests=digests)
        _stamp(owned, digests)
        return None

    def _digest_sums(self, count: int) -> torch.Tensor | None:
        """Where a gather of `count` chunks adds their KV digests (None: not computed here)."""
        return torch.zeros(count, dtype=torch.int64, device=self.kv.device) if self._digests and count else None

    def _stream_store(self, slots: torch.Tensor, spans: Sequence[ChunkSpan], request_id: str) -> int:
        """Gather `spans` batch by batch through the pool into the tiers; the tokens stored.

        With a tier below CPU RAM, a batch's blocks are reused once written
        there. Without one, this store's chunks stay held until it ends, so it
        never evicts its own prefix (which would leave its later chunks
        unreachable): it stores what fits.
        """
        stored, i, held = 0, 0, []
        try:
            while i < len(spans):
                owned = self._allocate(spans[i:], wait=True)
                if not owned:
                    skipped = sum(s.num_tokens for s in spans[i:])
                    self.stats.skipped_store_tokens += skipped
                    self._warn_skip(skipped, request_id)
                    break
                try:
                    self._gather(slots, owned, digests=self._digest_sums(len(owned)))
                except BaseException:
                    _release(owned)
                    raise
                for span, block in owned:
                    if not self.tiers.lower:
                        held.append(block.retain())
                    self.tiers.put(span.key, block, span.num_tokens)
                stored += _tokens(owned)
                i += len(owned)
        finally:
            for block in held:
                block.release()
        return stored

    def _warn_skip(self, skipped: int, request_id: str) -> None:
        """Once per request, though chunked prefill stores a request many times."""
        if request_id and request_id in self._warned:
            return
        log.warning("CPU pool full of chunks in use (being read, or this store's own with no disk or remote "
                    "tier to stream to): skipping the store of %d tokens for request %s (said once per request)",
                    skipped, request_id or "-")
        if request_id:
            self._warned[request_id] = None
            if len(self._warned) > 1024:
                self._warned.popitem(last=False)

    def _record_stored(self, spans: Sequence[ChunkSpan], tokens: np.ndarray) -> None:
        """KV events of chunks now in the CPU tier (with `enable_kv_events`)."""
        if self._events is None or not self.tiers.keep_cpu:
            return
        parents = {s.end: s.key.digest for s in self.spans(tokens)}
        for span in spans:
            if self.tiers.cpu.contains(span.key):
                self._events.append(ChunkEvent(True, span.key.digest, parents.get(span.start),
                                               tokens[span.start:span.end].tolist()))

    def take_events(self) -> list[ChunkEvent]:
        """The chunk events recorded since the last call."""
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events

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

        With every chunk in CPU RAM, the copies are queued and this returns
        at once: the caller's stream is ordered after them (so the forward's
        launches overlap the copies), and the chunks stay pinned until
        `finish()`. With `layerwise` too (or every chunk lent whole by the
        store server of this host, CPU tier off), layers load in order; the
        caller calls `wait(layer)` before it uses a layer. `finish()` at the
        end gives the mask to trust. Otherwise (chunks from disk or remote,
        batch by batch) everything is loaded before this returns. Either way
        the request's lease ends at `finish()`.
        """
        slots = self._check(tokens, slots, exact=False)
        end = len(slots)
        mask = torch.zeros(end, dtype=torch.bool)
        t0 = time.perf_counter()
        with self._lock:
            prefetch = self._prefetches.get(request_id) if request_id else None
        if prefetch is not None:
            prefetch.result()  # its chunks are in CPU RAM (and in the lease) now
        spans = [s for s in self.spans(tokens, request_id) if s.start < end]
        handle, held, loaded, batches, upload = None, [], 0, None, None
        try:
            if layerwise:  # lent whole by the store server of this host (CPU tier off), found by the lease
                held = self.tiers.lend_whole([s for s in spans if s.end > start])
            if held:
                todo = [(s, self.tiers.remote.name) for s, _ in held]
            else:
                where = self.tiers.locate([s.key for s in spans])
                todo = [(s, w) for s, w in zip(spans, where) if s.end > start]
                all_cpu = all(w == CPU for _, w in todo)
                ahead = self._take_ahead(request_id, [s.key for s, _ in todo], layerwise) if all_cpu else None
                if ahead is not None:  # on their way up since the lookup
                    held, upload = ahead.held, ahead.upload
                else:
                    batches = self.tiers.fetch([s for s, _ in todo], [w for _, w in todo], ahead=not all_cpu)
                    if all_cpu:  # from CPU RAM: one batch, pinned until finish()
                        held = next(batches, [])
                    else:
                        loaded = self._load_batches(slots, batches, start, end)
            if held:
                handle = (self._scatter(slots, held, start, end, layerwise=True, upload=upload) if layerwise else
                          _Queued(self._scatter(slots, held, start, end, layerwise=False, wait=False,
                                                upload=upload)))
                loaded = min(len(held), len(todo))
        except BaseException:
            _release_held(held)
            self.release_lease(request_id)
            raise
        finally:
            if batches is not None:
                batches.close()
        if loaded:
            first, last = todo[0][0], todo[loaded - 1][0]
            mask[max(start, first.start) : min(end, last.end)] = True
        return Retrieval(self, mask, held, handle, t0, request_id, todo[:loaded], start)

    def _load_batches(self, slots: torch.Tensor, batches, start: int, end: int) -> int:
        """Whole loads, batch after batch; how many chunks loaded. Lent chunks are
        checked once their copies are over, and what fails counts as not loaded
        (and ends the load). A lent batch's copies are queued before the one
        before it is checked and released, so the copy engine does not idle
        between them; a batch in pool blocks is settled at once (reading ahead
        needs its blocks)."""
        loaded, inflight = 0, []  # batches whose copies may still run, each with what waits for them
        try:
            for batch in itertools.chain(batches, [None]):  # None: the end, where every batch is settled
                keep = 0
                if batch is not None:
                    pooled = any(c.block.pool is not None for _, c in batch)
                    inflight.append((batch, self._device_idle))  # until scatter returns: if it raises, wait for all
                    inflight[-1] = (batch, self._scatter(slots, batch, start, end, layerwise=False, wait=pooled))
                    keep = 0 if pooled else 1
                while len(inflight) > keep:
                    good, whole = self._checked(*inflight.pop(0))
                    loaded += good
                    if not whole:
                        return loaded
        finally:
            for entry in inflight:
                _settle(*entry)
        return loaded

    def _checked(self, batch: list[tuple[ChunkSpan, StoredChunk]], copied: Callable[[], None]) -> tuple[int, bool]:
        """A batch whose copies are queued: its leading chunks that hold (lent ones: their
        checksums or their digests on the device, and their lease), once it is given
        back; and whether that is all of them."""
        try:
            good = _verified(batch)
        finally:
            _settle(batch, copied)
        if good < len(batch):
            log.warning("%d chunks loaded from the store server failed their checksum or outlived "
                        "their lease; recomputed", len(batch) - good)
        return good, good == len(batch)

    def _device_idle(self) -> None:
        """Wait for everything queued on the KV's device (nothing to wait for on a host)."""
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)

    def _scatter(self, slots: torch.Tensor, found: list[tuple[ChunkSpan, StoredChunk]], start: int, end: int,
                 layerwise: bool, wait: bool = True, upload: Upload | None = None):
        """The chunks in one transfer (a layerwise handle, or what waits for the
        copies out of the chunks), whole. A chunk cut by `start` or `end`
        writes only its tokens inside [start, end): the others get slot -1,
        which the transfers skip (the slots before `start` may be prefix-cache
        blocks the engine shares; after `end` there are no slots)."""
        views = upload.chunks() if upload is not None else [self.chunk_view(c.block.data, s.num_tokens)
                                                             for s, c in found]
        digests = found[0][1].block.device_check(len(found), self.kv.device)  # lent, checked on the GPU
        first, last = found[0][0].start, found[-1][0].end
        a, b = max(start, first), min(end, last)
        targets = torch.full((last - first,), -1, dtype=torch.int64)
        targets[a - first : b - first] = slots[a:b]  # slicing only: this runs before any byte moves
        with self._transfer_lock:
            if layerwise:
                return self.transfer.scatter_layerwise(targets, views, digests=digests, upload=upload)
            return self.transfer.scatter(targets, views, wait=wait, digests=digests, upload=upload)

    # -- housekeeping ------------------------------------------------------------

    def clear(self) -> None:
        """Drop every chunk of CPU RAM and disk (blocks in use are freed when released)."""
        self._drop_ahead()
        self.tiers.clear()
        log.info("cleared the local tiers (CPU RAM%s)", " and disk" if self.tiers.disk is not None else "")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until stored chunks have been written to disk and remote; False on timeout."""
        return self.tiers.flush(timeout)

    def close(self) -> None:
        """Write what is still queued for disk and remote, then let go of them."""
        self._prefetcher.shutdown(wait=True)
        self._drop_ahead()
        self.leases.release_all()
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
    """A retrieve in flight. `mask`: the tokens it loads. The chunks it reads
    stay held (pinned in the CPU tier, or lent by the store server) until
    `finish()`, which is safe to call twice. Lent chunks of a layerwise load
    are checked while their layers move; if one fails, `finish()` returns the
    mask cut before it, and the caller recomputes the rest (a forward that
    already read those layers is to be thrown away)."""

    def __init__(self, engine: CacheEngine, mask: torch.Tensor, held: list[tuple[ChunkSpan, StoredChunk]],
                 handle: LayerHandle | None, t0: float, request_id: str,
                 loaded: list[tuple[ChunkSpan, str]], start: int) -> None:
        self.mask = mask
        self._engine, self._held, self._handle = engine, held, handle
        self._t0, self._request_id = t0, request_id
        self._loaded, self._start = loaded, start

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def wait(self, layer: int) -> None:
        if self._handle is not None:
            self._handle.wait(layer)

    def finish(self) -> torch.Tensor:
        if self._held is None:
            return self.mask
        held, self._held = self._held, None
        engine = self._engine
        try:
            if self._handle is not None:
                self._handle.finish()  # every layer's copies and digests are done: any stream may read them
            with torch.cuda.stream(engine._readback) if engine._readback is not None else contextlib.nullcontext():
                good = _verified(held)
        finally:
            _release_held(held)
            engine.release_lease(self._request_id)
        if good < len(held):
            self.mask[max(self._start, held[good][0].start) :] = False
            self._loaded = self._loaded[:good]
            log.warning("%d chunks loaded layer by layer from the store server failed their checksum or "
                        "outlived their lease: the tokens from %d on are to be recomputed",
                        len(held) - good, held[good][0].start)
        end = len(self.mask)
        by_tier = engine.stats.loaded_by_tier
        for span, tier in self._loaded:
            by_tier[tier] = by_tier.get(tier, 0) + min(end, span.end) - max(self._start, span.start)
        loaded = self.num_tokens
        if loaded:
            engine.stats.retrieved_tokens += loaded
            engine.stats.retrieve_seconds += time.perf_counter() - self._t0
            _log_transfer("Retrieved KV cache for", loaded, len(self.mask), self._request_id,
                          loaded * engine.kv.bytes_per_token(), time.perf_counter() - self._t0)
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


def _verified(chunks: list[tuple[ChunkSpan, StoredChunk]]) -> int:
    """How many of `chunks`, from the first, are known good (a lent one: its checksum and lease held)."""
    return next((k for k, (_, c) in enumerate(chunks) if not c.block.verified()), len(chunks))


def _stamp(owned: list[tuple[ChunkSpan, MemoryBlock]], digests: torch.Tensor | None) -> None:
    """Each block's KV digest, once its gather is done (codec.kv_digest; 0: none)."""
    if digests is not None:
        for (_, block), digest in zip(owned, digests.tolist()):
            block.digest = digest & U64


def _settle(batch: list[tuple[ChunkSpan, StoredChunk]], copied: Callable[[], None]) -> None:
    """Once a batch's copies are over, give its chunks back."""
    try:
        copied()
    finally:
        _release_held(batch)


class Storing:
    """A store in flight. Chunks that got a block at the start (layerwise) belong
    to it until `finish()` puts them in the tiers (or `cancel()` frees them);
    the rest are gathered at `finish()`, batch by batch through the pool."""

    def __init__(self, engine: CacheEngine, owned: list[tuple[ChunkSpan, MemoryBlock]], rest: list[ChunkSpan],
                 slots: torch.Tensor, handle: LayerSaver | None, t0: float, request_id: str,
                 tokens: np.ndarray, digests: torch.Tensor | None = None) -> None:
        self._engine, self._chunks, self._rest, self._slots, self._handle = engine, owned, rest, slots, handle
        self._t0, self._request_id, self._tokens, self._digests = t0, request_id, tokens, digests

    @property
    def num_tokens(self) -> int:
        return _tokens(self._chunks) + sum(s.num_tokens for s in self._rest)

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
        rest, self._rest = self._rest, []
        if not chunks and not rest:
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
                        self._request_id or "-", unsaved, _tokens(chunks) + sum(s.num_tokens for s in rest))
            _release(chunks)
            return 0
        engine = self._engine
        _stamp(chunks, self._digests)
        for span, block in chunks:
            engine.tiers.put(span.key, block, span.num_tokens)
        stored = _tokens(chunks) + engine._stream_store(self._slots, rest, self._request_id)
        engine._record_stored([s for s, _ in chunks] + rest, self._tokens)
        engine.stats.stored_tokens += stored
        engine.stats.store_seconds += time.perf_counter() - self._t0
        if stored:
            _log_transfer("Storing KV cache for", stored, len(self._slots), self._request_id,
                          stored * engine.kv.bytes_per_token(), time.perf_counter() - self._t0,
                          ", layer by layer" if self._handle is not None else "")
        return stored

    def cancel(self) -> None:
        """Drop the store (e.g. the forward failed): its blocks go back to the pool."""
        chunks, self._chunks, self._rest = self._chunks, [], []
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


def _release_held(chunks: list[tuple[ChunkSpan, StoredChunk]]) -> None:
    for _, chunk in chunks:
        chunk.block.release()


def _disk_tier(config: KvtierConfig, bytes_per_token: int, fmt: KVFormat) -> DiskTier | None:
    root = config.disk_path
    if root is None:
        return None
    chunk_file = HEADER.size + config.chunk_size * bytes_per_token
    if config.disk_bytes < chunk_file:
        raise ConfigError("max_local_disk_size", config.max_local_disk_size,
                          f"room for at least one chunk file ({chunk_file / 1e6:.2f} MB)")
    if fmt.tp_size > 1:  # one directory (and one lock) per rank
        root = root / f"tp{fmt.tp_rank}of{fmt.tp_size}"
    return DiskTier(root, config.disk_bytes, Codec("naive"), config.cache_policy)


def _remote_tier(config: KvtierConfig, kv: PagedKV, quant: Quant | None) -> RemoteTier | None:
    if config.remote_url is None:
        return None
    # Quantized chunks (kvtier/transfer/quant.py) are stored as their bytes are.
    codec = Codec("naive") if quant is not None else Codec(config.remote_serde, itemsize=kv.dtype.itemsize)
    log.info("remote tier: %s (serde %s)", config.remote_url, config.remote_serde)
    store = open_store(config.remote_url, config.blocking_timeout_secs, config.remote_auth_token)
    if kv.device.type == "cuda" and hasattr(store, "on_map"):
        # The server's pool, mapped here, is what the GPU copies lent chunks from:
        # page-locked, the copy is a DMA; unregistered it could not be lent.
        store.on_map, store.on_unmap = _register_pool, functools.partial(_unregister_pool, device=kv.device)
    return RemoteTier(store, codec, config.remote_url)


def _pool_address(mapping) -> int:
    view = np.frombuffer(mapping, np.uint8)
    try:
        return view.ctypes.data
    finally:
        del view


def _register_pool(mapping) -> bool:
    from kvtier.transfer import cudart

    t0 = time.perf_counter()
    try:
        cudart.host_register(_pool_address(mapping), len(mapping))
    except RuntimeError as e:  # locked-memory limits, permissions, an old driver
        log.warning("store server pool not registered with CUDA (%s): its chunks are copied through the "
                    "CPU pool instead", e)
        return False
    log.info("store server pool (%.2f GB) registered with CUDA in %.2f s: chunks go from it to the GPU by DMA",
             len(mapping) / 1e9, time.perf_counter() - t0)
    return True


def _unregister_pool(mapping, device: torch.device) -> None:
    """Before the pool's mapping goes (its connection closed, maybe under a load
    on another thread): no copy out of it may still be in flight on the GPU."""
    from kvtier.transfer import cudart

    torch.cuda.synchronize(device)
    try:
        cudart.host_unregister(_pool_address(mapping))
    except RuntimeError as e:
        log.warning("store server pool: cudaHostUnregister failed (%s)", e)


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
