"""kvtier as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both"}'

vLLM makes two instances: the scheduler's (decides what to load and save)
and the worker's (owns the CacheEngine and moves the bytes). Per step:

    scheduler                                worker
    ---------                                ------
    get_num_new_matched_tokens ── lookup ──▶ LookupServer → engine.find (leases the hit;
                                               disk/remote chunks start coming up: prefetch;
                                               a hit in CPU RAM starts crossing to the
                                               GPU: upload_ahead)
    update_state_after_alloc   (plan load)
    build_connector_meta  ── KvtierMetadata ─▶ start_load_kv  → engine.retrieve
                                               (forward pass)   (or, async, in a thread)
                                               wait_for_save  → engine.store
                                               get_finished   → async loads that are done
    request_finished      (forget request; release an unused lease)

A hit that is all in CPU RAM loads before the forward: its copies to the
GPU start at the lookup (into kvtier's staging; the slots are not known
yet), and `start_load_kv` queues the kernels that put it in vLLM's pages,
ahead of the forward on its stream. A hit with chunks on disk or remote loads asynchronously (vLLM's
WAITING_FOR_REMOTE_KVS): the request waits while other requests' steps go
on, and `get_finished` reports it loaded.

A promised hit is delivered: the lookup leases its chunks (CPU ones
pinned, disk ones kept from eviction) until the load. What can still fail
(a remote store that dies, a file that turns out corrupt) is reported
through `get_block_ids_with_load_errors`, and vLLM recomputes those tokens:
kvtier sets vLLM's `kv_load_failure_policy` to "recompute" (its default,
"fail", would end the request with an error for a cache miss).

Disaggregated prefill (`enable_pd`, kvtier/pd/): on a prefiller
(`pd_role: sender`, kv_producer) the scheduler reads the decoder a proxy
named in the request's `kv_transfer_params.disagg_spec`, and each save also
pushes its chunks into that decoder's buffer (`wait_for_save` →
PdSender.send). On a decoder (`pd_role: receiver`, kv_consumer) the engine's
CPU tier is the PD buffer, so received chunks are ordinary hits; once loaded
they are freed (`kv_transfer_params.pd_req_id`).

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
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.config import KvtierConfig, load_config
from kvtier.engine import CacheEngine, Loading, Storing
from kvtier.errors import ConfigError, UnsupportedKVLayout
from kvtier.integrations.lookup import Handlers, LookupClient, LookupServer, socket_path
from kvtier.integrations.vllm_events import KvtierKVEvents, to_vllm
from kvtier.integrations.vllm_metrics import KvtierPromMetrics, KvtierStats, deltas
from kvtier.keys import KVFormat
from kvtier.logs import get_logger
from kvtier.pd import make_buffer, start_receiver
from kvtier.pd.receiver import PdBuffer, PdReceiver
from kvtier.pd.sender import PdSender, Target
from kvtier.integrations.vllm_layout import cpu_kernel_layout, vllm_kv

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = get_logger(__name__)

# kv_connector_extra_config keys of LMCache's connector that kvtier honours.
# lmcache_rpc_port names LMCache's scheduler-worker socket; kvtier's are named by
# the engine id, so it is accepted and has no effect.
_EXTRA_KEYS = {"discard_partial_chunks", "lmcache_rpc_port"}


@dataclass
class TransferSpec:
    """Tokens [start, end) of a request to load or save, worker-side."""

    req_id: str
    token_ids: list[int]  # the prompt up to `end` or beyond (for keys)
    block_ids: list[int]
    start: int
    end: int
    background: bool = False  # load asynchronously (chunks below CPU RAM)
    pd_target: Target | None = None  # save: push these chunks to a decoder (PD sender)
    last: bool = False  # save: the prompt's last chunk is in this one
    pd_req_id: str = ""  # load: the proxy's id of this request; its PD chunks are freed once loaded

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
    pd_target: Target | None = None  # PD sender: where this request's KV goes
    pd_req_id: str = ""  # PD receiver: the proxy's id of this request


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
    config = load_config(overrides=overrides)
    _check_pd_role(config, vllm_config.kv_transfer_config.kv_role)
    return config


def _check_pd_role(config: KvtierConfig, kv_role: str) -> None:
    """A PD sender computes and saves (kv_producer); a receiver loads (kv_consumer)."""
    if not config.enable_pd:
        return
    wanted = {"sender": "kv_producer", "receiver": "kv_consumer"}[config.pd_role or ""]
    if kv_role not in (wanted, "kv_both"):
        raise ConfigError("pd_role", config.pd_role,
                          f"a role matching vLLM's kv_role {kv_role!r}: pd_role {config.pd_role} "
                          f"runs with kv_role {wanted}")


def _cpu_whole_blocks(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's KV moves in whole blocks here: on a CPU whose attention kernel is not
    "vec" (vllm_layout.py). Known to the scheduler, which has no KV tensors to look at."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or vllm_config.model_config.use_mla:
        return current_platform.is_cpu()
    return cpu_kernel_layout(vllm_config) == "vllm"


def usable_hit(hit: int, prompt_len: int, granularity: int, min_tokens: int) -> int:
    """The tokens of a stored prefix vLLM can be told of: at most all but the last prompt
    token (vLLM computes at least one to get logits), whole blocks where the KV layout
    needs them (`granularity`), and none below `min_retrieve_tokens`."""
    hit = min(hit, prompt_len - 1)
    hit -= hit % granularity
    return hit if hit >= max(min_tokens, 1) else 0


def pd_target(params: dict[str, Any] | None) -> Target | None:
    """The decoder a proxy named for this request (LMCache's `disagg_spec`), if any."""
    spec = (params or {}).get("disagg_spec")
    if not isinstance(spec, dict):
        return None
    try:
        init, alloc = spec["receiver_init_port"], spec["receiver_alloc_port"]
        return Target(str(spec["receiver_host"]), int(init[0] if isinstance(init, list) else init),
                      int(alloc[0] if isinstance(alloc, list) else alloc), str(spec["req_id"]))
    except (KeyError, TypeError, ValueError, IndexError):
        log.warning("kv_transfer_params.disagg_spec %r is malformed: this request's KV is not sent", spec)
        return None


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
        # vLLM's CPU kernels other than "vec" lay out tokens inside a block their own way:
        # kvtier then moves whole blocks, and a hit must end on a block boundary.
        self.whole_blocks = _cpu_whole_blocks(vllm_config)
        if self.whole_blocks and self.chunk_size % self.block_size:
            raise ConfigError("chunk_size", self.chunk_size,
                              f"a multiple of vLLM's block size {self.block_size}: this CPU's attention kernel "
                              "stores tokens inside a block its own way, so kvtier moves whole blocks")
        if role == KVConnectorRole.SCHEDULER:
            tp = vllm_config.parallel_config.tensor_parallel_size
            addresses = [socket_path(self.engine_id, r) for r in range(tp)]
            self._lookup = LookupClient(addresses, self.config.lookup_timeout_ms / 1000)
            self._requests: dict[str, _Request] = {}
            self._pending: dict[str, tuple[int, bool]] = {}  # req_id -> (hit end, async), between the two calls
            self._leased: set[str] = set()  # looked up with a hit, load not planned yet
            self._async_loads: list[str] = []  # async loads planned, to send with the next metadata
            self._pd_ids: dict[str, str] = {}  # PD receiver: request id -> the proxy's id, until planned
            self._counts = {"lookups": 0, "lookup_tokens": 0, "hit_tokens": 0}  # since the last stats
            self._kv_events: list[KVCacheEvent] = []  # from the workers, until vLLM publishes them
            self._live: dict[str, Request] = {}  # save_decode_cache: requests whose decoded tokens are stored too
            self._pd_sends = self.config.enable_pd and self.config.pd_role == "sender"
            self._pd_targets: dict[str, Target] = {}  # PD sender: request id -> its decoder, until scheduled
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
            self._loads: list[tuple[Loading, TransferSpec]] = []  # loads of this step, finished at wait_for_save
            self._stores: list[Storing] | None = None  # layerwise stores of this step, once begun
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-async-load")
            self._background: dict[str, tuple[TransferSpec, Future]] = {}
            self.pd_buffer: PdBuffer | None = None  # PD receiver: the buffer senders write into
            self._pd_receiver: PdReceiver | None = None
            self._pd_sender: PdSender | None = None
            self._failed_tokens = 0  # promised tokens that could not be loaded
            self._reported: dict[str, float] = {}  # counters as last reported to vLLM

    # ======================================================================
    # Scheduler side
    # ======================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids
        if self._pd_sends:
            target = pd_target(request.kv_transfer_params) or self._fixed_peer(request.request_id)
            if target is not None:
                self._pd_targets[request.request_id] = target
        if not self.can_load or not prompt:
            return 0, False
        rid = request.request_id
        stored, in_cpu = self._lookup.lookup(prompt, rid, num_computed_tokens)
        hit = self._usable(stored, len(prompt))
        need = max(0, hit - num_computed_tokens)
        if self.config.enable_pd and self.config.pd_role == "receiver":
            pd_id = str((request.kv_transfer_params or {}).get("pd_req_id", ""))
            if pd_id:
                self._pd_ids[rid] = pd_id
        background = need > 0 and in_cpu < hit
        self._counts["lookups"] += 1
        self._counts["lookup_tokens"] += len(prompt)
        self._counts["hit_tokens"] += hit
        log.info("Reqid: %s, Total tokens %d, hit tokens %d, need to load %d%s", rid, len(prompt), hit, need,
                 " (not all in CPU RAM: loading from disk/remote in the background)" if background else "")
        if need:
            self._pending[rid] = (num_computed_tokens + need, background)
            self._leased.add(rid)
        elif stored:  # leased by the lookup, not used
            self._lookup.release(rid)
        return need, background

    def _usable(self, stored: int, prompt_len: int) -> int:
        """The tokens of a stored prefix vLLM is told of (the same rule on both sides)."""
        return usable_hit(stored, prompt_len, self.block_size if self.whole_blocks else 1,
                          self.config.min_retrieve_tokens)

    def _fixed_peer(self, request_id: str) -> Target | None:
        c = self.config
        if c.pd_peer_host is None or c.pd_peer_init_port is None or c.pd_peer_alloc_port is None:
            return None
        return Target(c.pd_peer_host, c.pd_peer_init_port, c.pd_peer_alloc_port, request_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if self.config.save_decode_cache and self.can_save:
            self._live[rid] = request  # its all_token_ids grow as it decodes
        end, background = self._pending.pop(rid, (0, False))
        if num_external_tokens > 0 and request.prompt_token_ids:
            state = self._requests.setdefault(rid, _Request(list(request.prompt_token_ids)))
            state.load = (end - num_external_tokens, end, background)
            state.pd_req_id = self._pd_ids.pop(rid, "")
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
            if self._pd_sends and state.pd_target is None:
                state.pd_target = self._pd_targets.pop(new.req_id, None)
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
        meta.loads.append(TransferSpec(req_id, state.prompt, list(state.block_ids), start, end, background,
                                       pd_req_id=state.pd_req_id))
        state.load = None
        self._leased.discard(req_id)  # the worker's retrieve ends the lease

    def _plan(self, meta: KvtierMetadata, req_id: str, state: _Request, computed_after_step: int) -> None:
        if state.load is not None:
            self._plan_load(meta, req_id, state)
        if not self.can_save:
            return
        tokens = state.prompt
        live = self._live.get(req_id)
        if live is not None and computed_after_step > len(tokens):  # save_decode_cache: the output too
            tokens = list(live.all_token_ids)
        if state.saved_upto >= len(tokens):
            return
        end = min(computed_after_step, len(tokens))
        if end != len(state.prompt):
            end -= end % self.chunk_size  # mid-prompt or decoding: whole chunks only
        if end > state.saved_upto:
            meta.saves.append(TransferSpec(req_id, tokens[:end], state.block_ids, state.saved_upto, end,
                                           pd_target=state.pd_target, last=end == len(state.prompt)))
            state.saved_upto = end

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._pending.pop(rid, None)
        self._pd_ids.pop(rid, None)
        self._pd_targets.pop(rid, None)
        self._live.pop(rid, None)
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
        vkv = vllm_kv(self._vllm_config, kv_caches, names)
        if vkv.whole_blocks != self.whole_blocks:  # the scheduler rounded hits by what it expected
            raise UnsupportedKVLayout(vkv.backend, f"layout {vkv.kv.layout}", "what the scheduler expected")
        kv = vkv.kv
        rank = get_tensor_model_parallel_rank()
        fmt = KVFormat(
            model=self._vllm_config.model_config.model,
            layout=vkv.chunk_layout,
            dtype=str(kv.dtype).removeprefix("torch."),
            tp_rank=rank,
            tp_size=get_tensor_model_parallel_world_size(),
        )
        if self.config.enable_pd and self.config.pd_role == "receiver":
            self.pd_buffer = make_buffer(self.config, kv, fmt)
            self.engine = CacheEngine(self.config, kv, fmt, cpu=self.pd_buffer.tier)
            self._pd_receiver = start_receiver(self.config, self.pd_buffer, rank)
        else:
            self.engine = CacheEngine(self.config, kv, fmt)
        if self.config.enable_pd and self.config.pd_role == "sender":
            self._pd_sender = PdSender(self.engine, self.config, rank)
        self._server = LookupServer(socket_path(self.engine_id, rank), Handlers(
            lookup=self._find, release=self.engine.release_lease, reset=self.engine.clear))

    def _find(self, tokens: np.ndarray, request_id: str, computed: int) -> tuple[int, int]:
        """A scheduler lookup: lease the hit. Chunks below CPU RAM start coming up into it
        now; a hit all in CPU RAM that the scheduler will load (the same rule as there)
        starts its copies to the GPU now, before vLLM's step that loads it."""
        assert self.engine is not None
        hit = self.engine.find(tokens, lease_for=request_id)
        if not self.can_load or self._usable(hit.tokens, len(tokens)) <= computed:
            return hit.tokens, hit.in_cpu
        if hit.in_cpu < hit.tokens:
            self.engine.start_prefetch(tokens, request_id)
        else:
            self.engine.upload_ahead(tokens, request_id, start=computed, layerwise=self.config.use_layerwise)
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
            # From CPU RAM the copies are queued ahead of the forward (layer by layer with
            # use_layerwise); finished, and checked, at wait_for_save.
            load = self.engine.start_retrieve(spec.token_ids, spec.slots(self.block_size), start=spec.start,
                                              request_id=spec.req_id, layerwise=self.config.use_layerwise)
            self._loads.append((load, spec))

    def _load(self, spec: TransferSpec) -> int:
        assert self.engine is not None
        try:
            return int(self.engine.retrieve(spec.token_ids, spec.slots(self.block_size), start=spec.start,
                                            request_id=spec.req_id).sum())
        finally:
            self._pd_loaded(spec.pd_req_id)

    def _pd_loaded(self, pd_req_id: str) -> None:
        """PD receiver: the request's chunks are in vLLM's pages now; free them in the buffer."""
        if self.pd_buffer is not None and pd_req_id:
            self.pd_buffer.release(pd_req_id)

    def _check_loaded(self, spec: TransferSpec, loaded: int) -> None:
        """Blocks a load did not fill are reported: vLLM recomputes them."""
        loaded_end = spec.start + loaded
        if loaded_end < spec.end:
            self._failed_tokens += spec.end - loaded_end
            first, last = loaded_end // self.block_size, (spec.end - 1) // self.block_size
            self._load_errors.update(spec.block_ids[first : last + 1])
            log.warning("request %s: %d of %d tokens could not be loaded (evicted, corrupt or unreachable); "
                        "vLLM recomputes them", spec.req_id, spec.end - loaded_end, spec.end - spec.start)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.pd_buffer is not None:
            self.pd_buffer.expire()
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
            for load, _ in self._loads:
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
        for load, spec in loads:
            load.finish()  # its mask is final now (a lent chunk may fail its check after its layers were read)
            self._pd_loaded(spec.pd_req_id)
            self._check_loaded(spec, load.num_tokens)
        stores, self._stores = self._stores, None
        if stores is not None:
            for store in stores:
                store.finish()
        else:
            for spec in meta.saves:
                self.engine.store(spec.token_ids, spec.slots(self.block_size),
                                  start=spec.start, request_id=spec.req_id)
        if self._pd_sender is not None:
            for spec in meta.saves:
                if spec.pd_target is not None:
                    self._pd_sender.send(spec.pd_target, spec.token_ids, spec.slots(self.block_size),
                                         start=spec.start, last=spec.last)

    # ======================================================================
    # Stats (vLLM's /metrics and its "KV Transfer metrics" log): vllm_metrics.py
    # ======================================================================

    def get_kv_connector_stats(self) -> KvtierStats | None:
        if self.role == KVConnectorRole.SCHEDULER:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            return KvtierStats(counts) if any(counts.values()) else None
        if self.engine is None:
            return None
        now = self._counters()
        changed = deltas(now, self._reported)
        self._reported = now
        stats = KvtierStats(changed)
        return None if stats.is_empty() else stats

    def _counters(self) -> dict[str, float]:
        """This worker's cumulative counters and current gauges (vllm_metrics.py names)."""
        engine = self.engine
        assert engine is not None
        bpt, tiers = engine.chunk_bytes_per_token, engine.tiers  # bytes the tiers hold
        here = "pd" if self.pd_buffer is not None else "cpu"  # a PD receiver's CPU tier is its buffer
        out: dict[str, float] = {
            "store_seconds": engine.stats.store_seconds, "load_seconds": engine.stats.retrieve_seconds,
            "skipped_store_tokens": engine.stats.skipped_store_tokens, "load_failure_tokens": self._failed_tokens,
            f"evictions:{here}": tiers.cpu.stats.evictions,
            "pool_used_bytes": engine.pool.used_bytes, "pool_capacity_bytes": engine.pool.capacity,
            "write_queue_depth": sum(w.pending for w in tiers.writers.values()),
        }
        if tiers.keep_cpu:
            out[f"stored_tokens:{here}"] = engine.stats.stored_tokens
            out[f"stored_bytes:{here}"] = engine.stats.stored_tokens * bpt
        for name, writer in tiers.writers.items():
            out[f"stored_tokens:{name}"] = writer.stats.written_tokens
            out[f"stored_bytes:{name}"] = writer.stats.written_tokens * bpt
            out[f"dropped_writes:{name}"] = writer.stats.dropped
        if tiers.disk is not None:
            out["evictions:disk"] = tiers.disk.stats.evictions
        for tier, tokens in engine.stats.loaded_by_tier.items():
            name = here if tier == "cpu" else tier
            out[f"loaded_tokens:{name}"] = tokens
            out[f"loaded_bytes:{name}"] = tokens * bpt
        if self._pd_sender is not None:
            out["stored_tokens:pd"] = self._pd_sender.stats.sent_tokens
            out["stored_bytes:pd"] = self._pd_sender.stats.sent_bytes
        return out

    # -- KV events (enable_kv_events): vllm_events.py --------------------------------------

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        if self.engine is None or not self.config.enable_kv_events:
            return None
        events = self.engine.take_events()
        return KvtierKVEvents(to_vllm(events, self.chunk_size)) if events else None

    def update_connector_output(self, connector_output: Any) -> None:
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KvtierKVEvents):
            self._kv_events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._kv_events = self._kv_events, []
        return events

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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
            if self._pd_receiver is not None:
                self._pd_receiver.close()
            if self._pd_sender is not None:
                self._pd_sender.close()
            if self.engine is not None:
                self.engine.close()  # sends what is still queued for the remote tier
