"""kvtier as a vLLM v1 KV connector: the class vLLM imports.

    --kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_role": "kv_both"}'
    (with or without "kv_connector_module_path": "kvtier.integrations.vllm")

vLLM makes two instances: the scheduler's (decides what to load and save:
scheduler.py) and the worker's (owns the CacheEngine and moves the bytes:
worker.py). This class only hands each of vLLM's calls to its role's side.
Per step:

    scheduler                                worker
    ---------                                ------
    get_num_new_matched_tokens ── lookup ──▶ LookupServer → engine.find (leases the hit;
                                               disk/remote chunks start coming up: prefetch;
                                               a hit in CPU RAM starts crossing to the
                                               GPU: upload_ahead)
    update_state_after_alloc   (plan load)
    build_connector_meta  ── KvtierMetadata ─▶ start_load_kv  → engine.start_retrieve
                                               (forward pass)   (or, async, in a thread)
                                               wait_for_save  → engine.store
                                               get_finished   → async loads that are done
    request_finished      (forget request; release an unused lease)

A hit that is all in CPU RAM loads before the forward: its copies to the
GPU start at the lookup (into kvtier's staging; the slots are not known
yet), and `start_load_kv` queues the kernels that put it in vLLM's pages,
ahead of the forward on its stream. A hit with chunks on disk or remote
loads asynchronously (vLLM's WAITING_FOR_REMOTE_KVS): the request waits
while other requests' steps go on, and `get_finished` reports it loaded.

A promised hit is delivered: the lookup leases its chunks (CPU ones
pinned, disk ones kept from eviction) until the load. What can still fail
(a remote store that dies, a file that turns out corrupt) is reported
through `get_block_ids_with_load_errors`, and vLLM recomputes those tokens:
kvtier sets vLLM's `kv_load_failure_policy` to "recompute" (its default,
"fail", would end the request with an error for a cache miss).

Saves follow chunked prefill: after each step, the whole chunks computed so
far are stored ("Storing KV cache for 2048 out of 12288 tokens"), and the
partial last chunk once the prompt is done (if `save_unfull_chunk`).
With `use_layerwise`, loads run layer by layer behind the forward
(`wait_for_layer_load(layer)` waits only for that layer). A step's saves are
gathered after its forward, at `wait_for_save` (on a GPU their copies to the
host not waited for; worker.py). Disaggregated prefill: pd.py.

Hybrid models (`SupportsHMA`, groups.py): vLLM's hybrid allocator gives
sliding-window layers blocks of their own (a KV cache group), freed as the
window passes. A chunk still holds every layer's KV for its tokens; each
layer moves at its group's slots, and tokens whose page a group no longer
keeps (vLLM's null block) are skipped there. What a sliding layer's stored
chunk lacks (tokens its window had passed before the chunk was saved) no hit
at or after the chunk's end reads. Mamba layers (vLLM's
`--mamba-cache-mode align`) keep a state at each prefill step's end, on a
block end: where a save ends there, the state is stored beside the chunk
(engine/states.py), and a hit ends only where one is. vLLM (0.26 to 0.32)
cannot take a failed load back on a model with several groups (its
recompute path reads one block table), so there a hit is promised only from
CPU RAM, where its blocks are held; what lies below comes up for the next
request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.integrations.vllm.groups import kv_groups
from kvtier.integrations.vllm.identity import Identities
from kvtier.integrations.vllm.metrics import KvtierPromMetrics, KvtierStats
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.spec import (
    KvtierMetadata,
    config_with_extra,
    connector_config,
    shape_of,
)
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = get_logger(__name__)


class WrongRoleError(RuntimeError):
    """A call of vLLM's scheduler reached the worker's connector, or the other way round."""


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = kv_groups(kv_cache_config)
        config = connector_config(vllm_config)
        self.config = config = config if groups is None else groups.chunk_size(config)
        kv_cfg = vllm_config.kv_transfer_config
        can_load = kv_cfg.kv_role in ("kv_both", "kv_consumer")
        shape = shape_of(config, vllm_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(
                config,
                shape,
                kv_cfg.engine_id,
                vllm_config.parallel_config.tensor_parallel_size,
                can_load,
                kv_cfg.kv_role in ("kv_both", "kv_producer"),
                Identities.for_vllm(vllm_config),
                groups,
            )
            if kv_cfg.kv_load_failure_policy != "recompute":
                # Read by vLLM's scheduler right after it builds this connector.
                log.info(
                    "kvtier sets kv_load_failure_policy %r -> 'recompute': KV that cannot be "
                    "loaded is recomputed; a cache miss never fails a request",
                    kv_cfg.kv_load_failure_policy,
                )
                kv_cfg.kv_load_failure_policy = "recompute"
        else:
            self.worker = WorkerSide(config, shape, kv_cfg.engine_id, can_load, groups)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise loads and saves run in Python between the layers' graphs: vLLM then
        captures CUDA graphs piecewise (a full graph would replay without them)."""
        return config_with_extra(extra_config).use_layerwise

    @property
    def _scheduler(self) -> SchedulerSide:
        """The scheduler's side, which only vLLM's scheduler calls reach."""
        if self.scheduler is None:
            raise WrongRoleError("a scheduler call reached the worker's kvtier connector")
        return self.scheduler

    @property
    def _worker(self) -> WorkerSide:
        """The worker's side, which only vLLM's worker calls reach."""
        if self.worker is None:
            raise WrongRoleError("a worker call reached the scheduler's kvtier connector")
        return self.worker

    def _meta(self) -> KvtierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        return meta

    # -- scheduler side (scheduler.py) -------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator (SupportsHMA): `request_finished`, its blocks given per KV
        cache group."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool:
        return self._scheduler.reset_cache()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.add_events(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events()

    # -- worker side (worker.py) -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]) -> None:
        # vLLM declares tensors; a Mamba layer's value is the list of its state tensors
        self._worker.register_kv_caches(self._vllm_config, kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.get_finished()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._meta())

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.worker.events() if self.worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    # -- both: stats for vLLM's /metrics and its "KV Transfer metrics" log (metrics.py) ---------

    def get_kv_connector_stats(self) -> KvtierStats | None:
        return self.scheduler.stats() if self.scheduler is not None else self._worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        else:
            self._worker.close()
