"""kvtier as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both"}'

vLLM makes two instances: the scheduler's (decides what to load and save)
and the worker's (owns the CacheEngine and moves the bytes). Per step:

    scheduler                                worker
    ---------                                ------
    get_num_new_matched_tokens ── lookup ──▶ LookupServer → engine.find (leases the hit;
                                               disk/remote chunks start coming up: prefetch)
    update_state_after_alloc   (plan load)
    build_connector_meta  ── KvtierMetadata ─▶ start_load_kv  → engine.retrieve
                                               (forward pass)   (or, async, in a thread)
                                               wait_for_save  → engine.store
                                               get_finished   → async loads that are done
    request_finished      (forget request; release an unused lease)

A hit that is all in CPU RAM loads synchronously, before the forward (a
memcpy). A hit with chunks on disk or remote loads asynchronously (vLLM's
WAITING_FOR_REMOTE_KVS): the request waits while other requests' steps go
on, and `get_finished` reports it loaded.

A promised hit is delivered: the lookup leases its chunks (CPU ones
pinned, disk ones kept from eviction) until the load. What can still fail
(a remote store that dies, a file that turns out corrupt) is reported
through `get_block_ids_with_load_errors`, and vLLM recomputes those tokens:
kvtier sets vLLM's `kv_load_failure_policy` to "recompute" (its default,
"fail", would end the request with an error for a cache miss).

Saves follow chunked prefill: after each step, the whole chunks computed so
far are stored ("Storing KV cache for 2048 out of 12288 tokens"), and the
partial last chunk once the prompt is done (if `save_unfull_chunk`).
Loads finish before the forward pass, or with `use_layerwise` run layer by
layer behind it: `wait_for_layer_load(layer)` waits only for that layer.
Saves run in `wait_for_save`, or with `use_layerwise` layer by layer:
`save_kv_layer(layer)` (vLLM calls it once the layer's attention has
written this step's KV) starts moving that layer to the host while later
layers compute, and `wait_for_save` puts the finished chunks in the tiers.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.config import KvtierConfig, load_config
from kvtier.engine import CacheEngine, Retrieval, Storing
from kvtier.integrations.lookup import Handlers, LookupClient, LookupServer, socket_path
from kvtier.keys import KVFormat
from kvtier.logs import get_logger
from kvtier.transfer import PagedKV

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = get_logger(__name__)

# kv_connector_extra_config keys of LMCache's connector that kvtier honours.
_EXTRA_KEYS = {"discard_partial_chunks"}


@dataclass
class TransferSpec:
    """Tokens [start, end) of a request to load or save, worker-side."""

    req_id: str
    token_ids: list[int]  # the prompt up to `end` or beyond (for keys)
    block_ids: list[int]
    start: int
    end: int
    background: bool = False  # load asynchronously (chunks below CPU RAM)

    def slots(self, block_size: int) -> torch.Tensor:
        n = self.end
        blocks = torch.tensor(self.block_ids[: -(-n // block_size)], dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64)
        return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:n]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0
    load: tuple[int, int, bool] | None = None  # tokens [start, end) to load next step, in the background?


def connector_config(vllm_config: VllmConfig) -> KvtierConfig:
    """kvtier config from file/env, plus LMCache-style extra config from vLLM."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    overrides: dict[str, Any] = {}
    for key in extra:
        if key not in _EXTRA_KEYS:
            raise ValueError(
                f"kv_connector_extra_config: unknown key {key!r}; kvtier reads "
                f"{sorted(_EXTRA_KEYS)} there, and everything else from its config file or env"
            )
    if "discard_partial_chunks" in extra:
        overrides["save_unfull_chunk"] = not _as_bool(extra["discard_partial_chunks"])
    return load_config(overrides=overrides)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in {"true", "1", "yes"}:
        return True
    if str(value).strip().lower() in {"false", "0", "no"}:
        return False
    raise ValueError(f"discard_partial_chunks = {value!r}: expected true or false")


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = connector_config(vllm_config)
        kv_cfg = vllm_config.kv_transfer_config
        self.engine_id = kv_cfg.engine_id
        self.can_load = kv_cfg.kv_role in ("kv_both", "kv_consumer")
        self.can_save = kv_cfg.kv_role in ("kv_both", "kv_producer")
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_size = self.config.chunk_size
        if role == KVConnectorRole.SCHEDULER:
            tp = vllm_config.parallel_config.tensor_parallel_size
            addresses = [socket_path(self.engine_id, r) for r in range(tp)]
            self._lookup = LookupClient(addresses, self.config.blocking_timeout_secs)
            self._requests: dict[str, _Request] = {}
            self._pending: dict[str, tuple[int, bool]] = {}  # req_id -> (hit end, async), between the two calls
            self._leased: set[str] = set()  # looked up with a hit, load not planned yet
            self._async_loads: list[str] = []  # async loads planned, to send with the next metadata
            if kv_cfg.kv_load_failure_policy != "recompute":
                # Read by vLLM's scheduler right after it builds this connector.
                log.info("kvtier sets kv_load_failure_policy %r -> 'recompute': KV that cannot be loaded "
                         "is recomputed; a cache miss never fails a request", kv_cfg.kv_load_failure_policy)
                kv_cfg.kv_load_failure_policy = "recompute"
        else:
            self.engine: CacheEngine | None = None
            self._server: LookupServer | None = None
            self._load_errors: set[int] = set()
            self._layer_index: dict[str, int] = {}
            self._loads: list[Retrieval] = []  # layerwise loads of this step
            self._stores: list[Storing] | None = None  # layerwise stores of this step, once begun
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-async-load")
            self._background: dict[str, tuple[TransferSpec, Future]] = {}

    # ======================================================================
    # Scheduler side
    # ======================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids
        if not self.can_load or not prompt:
            return 0, False
        rid = request.request_id
        hit, in_cpu = self._lookup.lookup(prompt, rid)
        # vLLM must compute at least one token itself to produce logits.
        hit = min(hit, len(prompt) - 1)
        need = max(0, hit - num_computed_tokens)
        background = need > 0 and in_cpu < hit
        log.info("Reqid: %s, Total tokens %d, hit tokens %d, need to load %d%s", rid, len(prompt), hit, need,
                 " (not all in CPU RAM: loading from disk/remote in the background)" if background else "")
        if need:
            self._pending[rid] = (num_computed_tokens + need, background)
            self._leased.add(rid)
        elif hit:
            self._lookup.release(rid)
        return need, background

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        end, background = self._pending.pop(rid, (0, False))
        if num_external_tokens > 0 and request.prompt_token_ids:
            state = self._requests.setdefault(rid, _Request(list(request.prompt_token_ids)))
            state.load = (end - num_external_tokens, end, background)
            if background:  # not scheduled this step: the blocks to load into are known only here
                state.block_ids = list(blocks.get_block_ids()[0])
                self._async_loads.append(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        meta = KvtierMetadata()
        for rid in self._async_loads:
            state = self._requests.get(rid)
            if state is not None and state.load is not None:
                self._plan_load(meta, rid, state)
        self._async_loads = []
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if not new.prompt_token_ids:
                continue
            state = self._requests.setdefault(new.req_id, _Request(list(new.prompt_token_ids)))
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: its blocks are new, and its KV must be recomputed.
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + sched.get(req_id, 0))
        return meta

    def _plan_load(self, meta: KvtierMetadata, req_id: str, state: _Request) -> None:
        start, end, background = state.load
        meta.loads.append(TransferSpec(req_id, state.prompt, list(state.block_ids), start, end, background))
        state.load = None
        self._leased.discard(req_id)  # the worker's retrieve ends the lease

    def _plan(self, meta: KvtierMetadata, req_id: str, state: _Request, computed_after_step: int) -> None:
        if state.load is not None:
            self._plan_load(meta, req_id, state)
        if not self.can_save or state.saved_upto >= len(state.prompt):
            return
        end = min(computed_after_step, len(state.prompt))
        if end < len(state.prompt):
            end -= end % self.chunk_size  # mid-prompt: whole chunks only
        if end > state.saved_upto:
            meta.saves.append(TransferSpec(req_id, state.prompt[:end], state.block_ids, state.saved_upto, end))
            state.saved_upto = end

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._pending.pop(rid, None)
        if rid in self._leased:  # looked up, never loaded (aborted, or finished without it)
            self._leased.discard(rid)
            self._lookup.release(rid)
        return False, None

    def reset_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: the workers drop kvtier's CPU RAM and disk tiers too."""
        return self._lookup.reset()

    # ======================================================================
    # Worker side
    # ======================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._layer_index = {name: i for i, name in enumerate(names)}
        model_config = self._vllm_config.model_config
        kv = PagedKV.wrap([kv_caches[n] for n in names], "vllm", mla=model_config.use_mla)
        rank = get_tensor_model_parallel_rank()
        fmt = KVFormat(
            model=model_config.model,
            layout="vllm-mla" if model_config.use_mla else "vllm",
            dtype=str(kv.dtype).removeprefix("torch."),
            tp_rank=rank,
            tp_size=get_tensor_model_parallel_world_size(),
        )
        self.engine = CacheEngine(self.config, kv, fmt)
        self._server = LookupServer(socket_path(self.engine_id, rank), Handlers(
            lookup=self._find, release=self.engine.release_lease, reset=self.engine.clear))

    def _find(self, tokens: np.ndarray, request_id: str) -> tuple[int, int]:
        """A scheduler lookup: lease the hit; chunks below CPU RAM start coming up now."""
        assert self.engine is not None
        hit = self.engine.find(tokens, lease_for=request_id)
        if hit.in_cpu < hit.tokens and self.can_load:
            self.engine.start_prefetch(tokens, request_id)
        return hit.tokens, hit.in_cpu

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata) and self.engine is not None
        for spec in meta.loads:
            if spec.background:
                log.info("request %s: loading %d tokens from disk/remote in the background",
                         spec.req_id, spec.end - spec.start)
                self._background[spec.req_id] = (spec, self._loader.submit(self._load, spec))
                continue
            load = self.engine.start_retrieve(spec.token_ids, spec.slots(self.block_size), start=spec.start,
                                              request_id=spec.req_id, layerwise=self.config.use_layerwise)
            if self.config.use_layerwise:
                self._loads.append(load)
            else:
                load.finish()
            self._check_loaded(spec, load.num_tokens)

    def _load(self, spec: TransferSpec) -> int:
        assert self.engine is not None
        return int(self.engine.retrieve(spec.token_ids, spec.slots(self.block_size), start=spec.start,
                                        request_id=spec.req_id).sum())

    def _check_loaded(self, spec: TransferSpec, loaded: int) -> None:
        """Blocks a load did not fill are reported: vLLM recomputes them."""
        loaded_end = spec.start + loaded
        if loaded_end < spec.end:
            first, last = loaded_end // self.block_size, (spec.end - 1) // self.block_size
            self._load_errors.update(spec.block_ids[first : last + 1])
            log.warning("request %s: %d of %d tokens could not be loaded (evicted, corrupt or unreachable); "
                        "vLLM recomputes them", spec.req_id, spec.end - loaded_end, spec.end - spec.start)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set()
        for rid, (spec, future) in list(self._background.items()):
            if not future.done():
                continue
            del self._background[rid]
            try:
                loaded = future.result()
            except Exception:  # noqa: BLE001 - any failure of a background load: report it, vLLM recomputes
                log.exception("request %s: background load failed", rid)
                loaded = 0
            self._check_loaded(spec, loaded)
            done.add(rid)
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            for load in self._loads:
                load.wait(index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        index = self._layer_index.get(layer_name)
        if not self.config.use_layerwise or index is None:
            return
        if self._stores is None:  # the step's first layer: decide what to store, allocate its blocks
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvtierMetadata) and self.engine is not None
            self._stores = [self.engine.start_store(spec.token_ids, spec.slots(self.block_size), start=spec.start,
                                                    request_id=spec.req_id, layerwise=True)
                            for spec in meta.saves]
        for store in self._stores:
            store.save(index)

    def wait_for_save(self) -> None:
        # vLLM calls this after every step's forward, also one that raised: a
        # layerwise store that missed a layer is dropped then (Storing.finish).
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata) and self.engine is not None
        loads, self._loads = self._loads, []
        for load in loads:
            load.finish()
        stores, self._stores = self._stores, None
        if stores is not None:
            for store in stores:
                store.finish()
            return
        for spec in meta.saves:
            self.engine.store(spec.token_ids, spec.slots(self.block_size),
                              start=spec.start, request_id=spec.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            self._lookup.close()
        else:
            self._loader.shutdown(wait=True)
            if self._server is not None:
                self._server.close()
                self._server = None
            if self.engine is not None:
                self.engine.close()  # sends what is still queued for the remote tier
