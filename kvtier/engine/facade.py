"""CacheEngine: the one entry point engines call to store, look up and load KV.

    store(tokens, slots)     keys → allocate blocks → gather KV → put in the tiers (storing.py),
                             in batches when the pool is smaller than the store
    start_store(..., layerwise=True)   the same, one layer at a time as the engine computes it
    find(tokens, hold_for)  keys → longest prefix stored in any tier; optionally held
                             (protected) until the request's retrieve (finding.py)
    upload_ahead(tokens, rid)  a hit all in CPU RAM starts crossing to the device (ahead.py)
    prefetch(tokens)         disk and remote chunks of that prefix up into CPU RAM (prefetch.py)
    retrieve(tokens, slots)  keys → pinned, lent or fetched chunks → scatter KV → verify →
                             release, batch by batch (loading.py)
    save_state / load_state  a hybrid model's recurrent state at a chunk's end (states.py);
                             with it, `find` ends a hit only where such a snapshot is

Copies to the host that a caller did not wait for (a layerwise store's `finish(wait=False)`,
a state snapshot) land in the tiers at the next store, flush, clear or close, and at a lookup
of their keys.

`tokens` are a prompt's token ids from its first token; `slots` are the
paged-cache slot of each of those tokens (block_id * block_size + offset);
`identity` is what else decides their KV (a LoRA adapter, images, a cache_salt:
keys.py), folded into every key: a call without it keys a plain text prompt.
Only whole chunks move (plus the partial last chunk when
`save_unfull_chunk`), so callers pass the prefix they want considered.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvtier.config import KvtierConfig
from kvtier.engine.ahead import AheadSlot
from kvtier.engine.build import build
from kvtier.engine.events import ChunkEvent
from kvtier.engine.finding import FindPath, Hit
from kvtier.engine.job import Job
from kvtier.engine.landing import Landing
from kvtier.engine.loading import Loading, LoadPath
from kvtier.engine.mover import Tokens, as_numpy
from kvtier.engine.prefetch import Prefetcher
from kvtier.engine.states import StateLayers, StateLoad, StatePath
from kvtier.engine.storing import StorePath, Storing
from kvtier.engine.tails import Tails
from kvtier.fleet.worker import ControlWorker
from kvtier.keys import PLAIN, ChunkKey, ChunkSpan, Identity, KVFormat
from kvtier.logs import get_logger
from kvtier.memory import HostPool, MemoryBlock
from kvtier.tiers.cpu import CpuTier
from kvtier.transfer import PagedKV, Transfer

log = get_logger(__name__)


class CacheEngine:
    def __init__(
        self,
        config: KvtierConfig,
        kv: PagedKV,
        fmt: KVFormat,
        *,
        transfer: str = "auto",
        cpu: CpuTier | None = None,
        states: StateLayers | None = None,
    ) -> None:
        """`cpu`: a CPU tier to use instead of a new pool of `max_local_cpu_size` (a PD
        receiver's buffer: the chunks senders commit there are this engine's hits).
        `states`: the recurrent layers of a hybrid model (Mamba), whose state at a hit's
        end must load with its KV (states.py)."""
        parts = build(config, kv, fmt, transfer, cpu)
        self.config, self.kv, self.chunk_size = config, kv, config.chunk_size
        self.quant, self.fmt, self.mover = parts.quant, parts.fmt, parts.mover
        self.tiers = parts.tiers
        self.holds = parts.holds
        self.stats = parts.stats
        self.events = parts.events
        self._spans = parts.spans
        self.peers = parts.peers
        # stores whose copies to the host are in flight; in a fleet on a GPU, an idle instance's
        # land in the background (peers, the P2P index and KV events see them)
        fleet = config.enable_p2p or config.enable_kv_events or config.enable_controller
        self.landing = Landing(background=kv.device.type == "cuda" and fleet)
        self.ahead = AheadSlot(self.tiers, self.mover, self.landing)
        self.prefetcher = Prefetcher(
            self.tiers, self.holds, self.stats, enabled=config.local_cpu and bool(self.tiers.lower)
        )
        self.tails = Tails()
        self.storing = StorePath(
            self.tiers,
            self.mover,
            self.stats,
            self.events,
            self._spans.spans,
            enabled=config.local_cpu or bool(self.tiers.lower),
            tails=self.tails,
            chunk_size=config.chunk_size,
            landing=self.landing,
        )
        self.loading = LoadPath(
            self.tiers,
            self.mover,
            self.holds,
            self.ahead,
            self.prefetcher,
            self.stats,
            self._spans.spans,
            self.landing,
        )
        self.states = (
            None if states is None else StatePath(states, self.tiers, self.pool.block_bytes)
        )
        self.finding = FindPath(
            self.tiers,
            self.holds,
            self.tails,
            self.landing,
            self.fmt,
            self.chunk_size,
            self._spans.spans,
            lambda keys: self._settle(keys=keys),
            self.states,
        )
        self.worker = _control_worker(self) if config.enable_controller else None
        # host chunks, staged over PCIe
        if kv.device.type == "cuda" and self.pool.device.type == "cpu":
            self.mover.warm_up(self.pool, self.chunk_size)
        if not self.tiers.keep_cpu and not self.tiers.lower and not config.enable_pd:
            log.warning("local_cpu is false and no other tier is configured: kvtier stores nothing")
        log.info(
            "CacheEngine: %s, %d layers, chunk %d tokens = %.2f MB, CPU pool %d chunks (%.2f GB), "
            "transfer %s%s",
            self.fmt.tag(),
            kv.num_layers,
            self.chunk_size,
            self.pool.block_bytes / 1e6,
            self.pool.num_blocks,
            self.pool.capacity / 1e9,
            self.transfer.name,
            ""
            if self.quant is None
            else f", lossy KV codec {self.quant.name} (chunks "
            f"{self.chunk_bytes_per_token / kv.bytes_per_token():.3f} of the KV's bytes)",
        )

    @property
    def pool(self) -> HostPool:
        return self.tiers.cpu.pool

    @property
    def transfer(self) -> Transfer:
        return self.mover.transfer

    @property
    def chunk_bytes_per_token(self) -> int:
        """Bytes of one token in a chunk: the KV's, or the lossy codec's."""
        return self.mover.bytes_per_token

    # -- queries ---------------------------------------------------------------

    def spans(
        self, tokens: Tokens, request_id: str = "", identity: Identity = PLAIN
    ) -> list[ChunkSpan]:
        """The chunks of `tokens`; hashed once per request where `request_id` is given."""
        return self._spans.spans(as_numpy(tokens), request_id, identity)

    def lookup(self, tokens: Tokens, identity: Identity = PLAIN) -> int:
        """Number of leading tokens whose KV is stored in some tier (a chunk boundary)."""
        return self.find(tokens, identity=identity).tokens

    def find(
        self,
        tokens: Tokens,
        *,
        identity: Identity = PLAIN,
        hold_for: str = "",
        limit: int | None = None,
        cpu_only: bool = False,
    ) -> Hit:
        """The longest stored prefix; with `cpu_only`, the longest all in CPU RAM (where a
        load must not fail). With recurrent layers (states.py), the longest of at most `limit`
        tokens that ends where a state snapshot is. With `hold_for` (a request id) its chunks
        are held for that request until its retrieve (kvtier/tiers/holds.py).

        A chunk a store still has on its way to the host counts as found (in CPU RAM), and is
        not waited for: a lookup waiting there made vLLM's scheduler wait for the GPU's step
        (the store's copies queue behind its forward). Its load reads it once it has landed,
        or, uploaded ahead, copies it up behind the store's copies on the GPU (landing.py).
        The path: finding.py."""
        return self.finding.find(as_numpy(tokens), identity, hold_for, limit, cpu_only)

    def release_hold(self, request_id: str) -> None:
        """The request will not load what it looked up (finished, aborted)."""
        self.loading.release(request_id)

    def upload_ahead(
        self,
        tokens: Tokens,
        request_id: str,
        *,
        identity: Identity = PLAIN,
        start: int = 0,
        layerwise: bool = False,
        beside: bool = False,
    ) -> bool:
        """Start the copies of a hit all in CPU RAM (its chunks that end after `start`, the
        tokens the engine has already) toward the device now, at the scheduler's lookup:
        the slots come with the request's `start_retrieve`, which then queues only the
        kernels. True if its copies are queued (now or by an earlier call). `beside`: its load
        will run beside the engine's steps (`retrieve(beside=True)`); they are queued on the
        ahead slot's thread (ahead.py; True: the load finds out whether they were)."""
        spans = [s for s in self.spans(tokens, request_id, identity) if s.end > start]
        if beside:
            self.ahead.start_later(spans, request_id, layerwise, beside=True)
            return True
        return self.ahead.start(spans, request_id, layerwise, beside)

    def prefetch(self, tokens: Tokens, *, request_id: str = "", identity: Identity = PLAIN) -> int:
        """Bring the stored prefix's disk and remote chunks up into CPU RAM ahead of a load;
        with `request_id`, into that request's hold. Returns the tokens brought up."""
        return self.prefetcher.run(self.spans(tokens, request_id, identity), request_id)

    def start_prefetch(self, tokens: Tokens, request_id: str, identity: Identity = PLAIN) -> Future:
        """`prefetch` in the background; that request's retrieve waits for it first. With
        recurrent layers, the pieces of the longest prefix's state snapshot come up too."""
        spans = self.spans(tokens, request_id, identity)
        if self.states is not None:
            where = self.tiers.locate([s.key for s in spans])
            n, keys, _ = self.finding.state_point(spans, where, len(tokens), False)
            spans = spans[:n] + [ChunkSpan(k, 0, self.states.piece_tokens) for k in keys]
        return self.prefetcher.start(spans, request_id)

    # -- store -----------------------------------------------------------------

    def store(
        self,
        tokens: Tokens,
        slots: torch.Tensor,
        *,
        start: int = 0,
        request_id: str = "",
        identity: Identity = PLAIN,
    ) -> int:
        """Store the chunks of `tokens` that end after `start` and are not stored yet.

        Returns the number of tokens stored. A store larger than the pool
        streams through it in batches (waiting, bounded, for the writers);
        it is cut short only when every block is held by readers (logged
        once per request, counted in `stats.skipped_store_tokens`).
        """
        return self.start_store(
            tokens, slots, start=start, request_id=request_id, identity=identity
        ).finish()

    def start_store(
        self,
        tokens: Tokens,
        slots: torch.Tensor,
        *,
        start: int = 0,
        request_id: str = "",
        identity: Identity = PLAIN,
        layerwise: bool = False,
    ) -> Storing:
        """`store`, split in two: what to store is decided now.

        Without `layerwise` the KV is copied out at `finish()`. With it,
        blocks for as many chunks as the pool has free now are allocated
        here; the caller calls `save(layer)` as each layer's KV is written,
        so layer i moves to the host while later layers compute, and
        `finish()` at the end, which puts those chunks in the tiers and
        streams the rest (chunks that got no block) through the pool.
        """
        slots = self._check(tokens, slots)
        self._settle()  # landed stores are in the tiers: not stored twice
        return self.storing.start(
            Job(as_numpy(tokens), slots, start, request_id, identity), layerwise
        )

    def allocate_staging(self, spans: Sequence[ChunkSpan]) -> list[tuple[ChunkSpan, MemoryBlock]]:
        """Pool blocks for the first of `spans` (as many as free now; the first may wait),
        owned by the caller: a PD sender's staging."""
        return self.storing.allocate(spans, wait=True)

    def gather_into(
        self, slots: torch.Tensor, spans: Sequence[ChunkSpan], buffers: Sequence[torch.Tensor]
    ) -> None:
        """Copy the KV of `spans` into byte buffers of the caller (a PD sender's staging
        blocks, or a decoder's GPU buffer mapped over CUDA IPC)."""
        self.mover.gather_into(slots, spans, buffers)

    def gather_addressed(
        self,
        slots: torch.Tensor,
        spans: Sequence[ChunkSpan],
        places: Sequence[tuple[torch.Tensor, int]],
    ) -> Callable[[int, int], None]:
        """`gather_into` for device buffers (a PD sender's ring), queued a group of chunks at
        a time by the returned `launch(first, end)`; the tables of every chunk go up once."""
        return self.mover.gather_addressed(slots, spans, places)

    def take_events(self) -> list[ChunkEvent]:
        """The chunk events recorded since the last call (with `enable_kv_events`)."""
        return self.events.take()

    # -- retrieve --------------------------------------------------------------

    def retrieve(
        self,
        tokens: Tokens,
        slots: torch.Tensor,
        *,
        start: int = 0,
        request_id: str = "",
        identity: Identity = PLAIN,
        beside: bool = False,
    ) -> torch.Tensor:
        """Load stored KV for tokens [start, len(slots)) into the paged KV.

        `tokens` may run past `slots`: the extra tokens only make the keys
        (so the first tokens of a stored chunk can be loaded alone, e.g. all
        but the last prompt token). Returns a bool mask over `slots`: True
        where KV was loaded. Loading stops at the first chunk not stored.
        `beside`: a load beside the engine's steps (on a thread, its own stream):
        its kernels run on that stream, which waits there for the chunks' copies
        into device staging, so the transfer's kernel stream, which the steps' own
        loads and stores share, never waits for them (nor does this thread: its
        kernels are queued at once).
        """
        return self.start_retrieve(
            tokens, slots, start=start, request_id=request_id, identity=identity, beside=beside
        ).finish()

    def start_retrieve(
        self,
        tokens: Tokens,
        slots: torch.Tensor,
        *,
        start: int = 0,
        request_id: str = "",
        identity: Identity = PLAIN,
        layerwise: bool = False,
        beside: bool = False,
    ) -> Loading:
        """`retrieve`, split in two: what to load is decided (and pinned) now.

        With every chunk in CPU RAM, the copies are queued and this returns
        at once: the caller's stream is ordered after them (so the forward's
        launches overlap the copies), and the chunks stay pinned until
        `finish()`. With `layerwise` too (or every chunk lent whole by the
        store server of this host, CPU tier off), layers load in order; the
        caller calls `wait(layer)` before it uses a layer. `finish()` at the
        end gives the mask to trust. Otherwise (chunks from disk or remote,
        batch by batch) everything is loaded before this returns. Either way
        the request's hold ends at `finish()`.
        """
        slots = self._check(tokens, slots, exact=False)
        return self.loading.start(
            Job(as_numpy(tokens), slots, start, request_id, identity), layerwise, beside
        )

    def save_state(
        self, tokens: Tokens, blocks: list[int], *, request_id: str = "", identity: Identity = PLAIN
    ) -> bool:
        """Snapshot each recurrent layer's state block `blocks[l]`, the state after the last of
        `tokens` (a whole chunk's end), queued after the caller's stream. False: not stored."""
        key = self._key_ending(tokens, request_id, identity)
        return key is not None and self._states().save(key, blocks)

    def load_state(
        self,
        tokens: Tokens,
        blocks: list[int],
        *,
        request_id: str = "",
        identity: Identity = PLAIN,
        also: list[int] | None = None,
    ) -> StateLoad | None:
        """The snapshot taken after the last of `tokens` into each recurrent layer's block
        `blocks[l]` (and `also[l]`), queued on the caller's stream; `finish()` the result once
        the forward that reads it is queued. None: not stored (or unreadable), nothing written."""
        key = self._key_ending(tokens, request_id, identity)
        return None if key is None else self._states().load(key, blocks, also)

    def _states(self) -> StatePath:
        if self.states is None:
            raise RuntimeError(
                "this engine was built without recurrent layers (CacheEngine(states=...))"
            )
        return self.states

    def _key_ending(self, tokens: Tokens, request_id: str, identity: Identity) -> ChunkKey | None:
        """The key of the whole chunk that ends with the last of `tokens`, or None."""
        spans = self.spans(tokens, request_id, identity)
        if not spans or spans[-1].end != len(tokens) or spans[-1].num_tokens != self.chunk_size:
            return None
        return spans[-1].key

    def metrics(self) -> dict[str, float]:
        """A snapshot of the engine's counters (cumulative) and gauges; a per-tier
        one is `name:tier` (the names of integrations/vllm/metrics.py)."""
        stats, tiers = self.stats, self.tiers
        bpt = self.chunk_bytes_per_token  # a token's bytes in the tiers
        out: dict[str, float] = {
            "store_seconds": stats.store_seconds,
            "load_seconds": stats.retrieve_seconds,
            "step_loads": stats.step_loads,
            "step_loads_ahead": stats.step_loads_ahead,
            "skipped_store_tokens": stats.skipped_store_tokens,
            "evictions:cpu": tiers.cpu.stats.evictions,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_capacity_bytes": self.pool.capacity,
            "write_queue_depth": sum(w.pending for w in tiers.writers.values()),
        }
        if tiers.keep_cpu:
            out["stored_tokens:cpu"] = stats.stored_tokens
            out["stored_bytes:cpu"] = stats.stored_tokens * bpt
        for name, writer in tiers.writers.items():
            out[f"stored_tokens:{name}"] = writer.stats.written_tokens
            out[f"stored_bytes:{name}"] = writer.stats.written_tokens * bpt
            out[f"dropped_writes:{name}"] = writer.stats.dropped
        for local in tiers.local:
            out[f"evictions:{local.name}"] = local.evictions
        for tier, tokens in stats.loaded_by_tier.items():
            out[f"loaded_tokens:{tier}"], out[f"loaded_bytes:{tier}"] = tokens, tokens * bpt
        return out

    # -- housekeeping ------------------------------------------------------------

    def clear(self) -> None:
        """Drop every chunk of CPU RAM and disk (blocks in use are freed when released)."""
        self.ahead.drop()
        self._settle(wait=True)
        self.tiers.clear()
        self.tails.clear()
        # "(CPU RAM and disk)": the line operators and tests/test_vllm_tiers.py read
        others = "".join(f" and {t.name}" for t in self.tiers.local)
        log.info("cleared the local tiers (CPU RAM%s)", others)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until stored chunks have been written to disk and remote; False on timeout."""
        self._settle(wait=True)
        return self.tiers.flush(timeout)

    def close(self) -> None:
        """Write what is still queued for disk and remote, then let go of them."""
        self.prefetcher.close()
        self.ahead.close()
        self._settle(wait=True)
        self.landing.close()
        self.holds.release_all()
        self.tiers.close(timeout=self.config.blocking_timeout_secs)
        if self.peers is not None:
            self.peers.close()
        if self.worker is not None:
            self.worker.close()

    def _settle(self, wait: bool = False, keys: Sequence[ChunkKey] | None = None) -> None:
        """Stores and state snapshots whose copies to the host have ended go into the tiers
        (with `wait`, every one; with `keys`, a lookup's, only the stores holding any of them)."""
        self.landing.settle(wait, keys)
        if self.states is not None:
            self.states.settle(wait)

    def _check(self, tokens: Tokens, slots: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """Validate engine input at the boundary; returns slots as int64 on CPU. Grouped KV
        (`PagedKV.grouped`) takes one row of slots per group, [G, T], where -1 marks a token
        whose page that group no longer keeps (a sliding window's): it is not moved there."""
        groups = self.kv.groups
        if (
            not isinstance(slots, torch.Tensor)
            or slots.dim() != (1 if groups == 1 else 2)
            or (groups > 1 and slots.shape[0] != groups)
        ):
            raise ValueError(
                "slot_mapping must be a 1-D tensor of slot indices"
                if groups == 1
                else (
                    f"slot_mapping must be a [{groups}, T] tensor: a row of slots per KV cache "
                    "group"
                )
            )
        if slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise ValueError(f"slot_mapping must hold integers, got {slots.dtype}")
        n = slots.shape[-1]
        if len(tokens) != n if exact else len(tokens) < n:
            raise ValueError(
                f"{len(tokens)} tokens but {n} slots: every token needs one slot"
                + (" and every slot one token" if exact else "")
            )
        slots = slots.to("cpu", torch.int64)
        lowest = 0 if groups == 1 else -1
        if slots.numel() and (int(slots.min()) < lowest or int(slots.max()) >= self.kv.num_slots):
            raise ValueError(
                f"slot_mapping out of range: values in [{int(slots.min())}, {int(slots.max())}], "
                f"the KV cache has {self.kv.num_slots} slots"
            )
        return slots


def _control_worker(engine: CacheEngine) -> ControlWorker:
    """This rank's API for `kvtier controller`, registered at controller_url."""
    config = engine.config
    assert config.controller_url is not None  # _check_controller
    port = config.controller_worker_port
    worker = ControlWorker(
        engine,
        config.instance_id or f"{socket.gethostname()}-{os.getppid()}",
        config.controller_worker_host,
        port + engine.fmt.tp_rank if port else 0,
        config.remote_auth_token,
    )
    worker.register_with(config.controller_url, config.controller_heartbeat_s)
    log.info("controller API of rank %d on %s", engine.fmt.tp_rank, worker.url)
    return worker
