"""The connector's worker side: the engine, loads (before the forward, layer by layer,
or in the background), stores, and the load failures vLLM recomputes.

    register_kv_caches   the engine over vLLM's KV (layout.py), the lookup server
    start_load_kv        this step's loads: queued ahead of the forward, or in a thread
                         (beside the steps, on its own stream)
    wait_for_layer_load  layerwise: the forward waits for that layer
    save_kv_layer        counted (the store waits for a forward that wrote every layer)
    wait_for_save        loads finished and checked; the step's stores (a GPU's not waited
                         for); PD sends
    get_finished         background loads that are done, or whose copies are queued and
                         can no longer fail (later steps' streams wait for them)
"""

from __future__ import annotations

import contextlib
import sys
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine, Loading
from kvtier.engine.states import StateLoad
from kvtier.errors import ConfigError, UnsupportedKVLayout, UnsupportedModel
from kvtier.integrations.vllm.beside import Beside, BesideLoads
from kvtier.integrations.vllm.events import KvtierKVEvents, to_vllm
from kvtier.integrations.vllm.groups import KvGroups, state_layers
from kvtier.integrations.vllm.layout import vllm_kv
from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
from kvtier.integrations.vllm.metrics import KvtierStats, WorkerFigures
from kvtier.integrations.vllm.pd import WorkerPd
from kvtier.integrations.vllm.spec import KvtierMetadata, Shape, TransferSpec
from kvtier.keys import Identity, KVFormat
from kvtier.logs import get_logger
from kvtier.stalls import traced
from kvtier.tiers.base import Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = get_logger(__name__)


class WorkerSide:
    def __init__(
        self,
        config: KvtierConfig,
        shape: Shape,
        engine_id: str,
        can_load: bool,
        groups: KvGroups | None = None,
    ) -> None:
        self.config, self.shape, self.engine_id, self.can_load = config, shape, engine_id, can_load
        self.groups = groups  # vLLM's hybrid allocator: several KV cache groups
        self._state_names: list[str] = []  # Mamba layers, whose state is stored at chunk ends
        # several groups: hits coming up into CPU RAM before promised
        self._coming_up: dict[str, Future] = {}
        self.engine: CacheEngine | None = None
        self.pd = WorkerPd(config)
        self._server: LookupServer | None = None
        self._load_errors: set[int] = set()
        self._layer_index: dict[str, int] = {}
        # loads of this step, finished at wait_for_save (with a hybrid model's Mamba state, if
        # it loaded)
        self._loads: list[tuple[Loading, TransferSpec, StateLoad | None]] = []
        self._layers_written = 0  # by this step's forward (save_kv_layer calls)
        self._beside: BesideLoads | None = None  # loads beside the steps (register_kv_caches)
        self._step_wait = 0.0  # s this step has spent in kvtier so far (besides the forward)
        self._figures = WorkerFigures()

    def register_kv_caches(
        self, vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor | list[torch.Tensor]]
    ) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.model_executor.models.utils import extract_layer_index

        everything = sorted(kv_caches, key=extract_layer_index)
        names = [n for n in everything if isinstance(kv_caches[n], torch.Tensor)]  # attention KV
        # Mamba: a list of state tensors
        self._state_names = [n for n in everything if n not in names]
        if self._state_names and (self.groups is None or not self.groups.has_state):
            raise UnsupportedModel(
                f"layers {', '.join(self._state_names[:3])} keep a Mamba state, but vLLM's "
                "KV cache config has no Mamba group (its hybrid KV cache manager is off?)"
            )
        self._layer_index = {name: i for i, name in enumerate(names)}
        vkv = vllm_kv(vllm_config, kv_caches, names)
        # the scheduler rounded hits by what it expected
        if vkv.whole_blocks != self.shape.whole_blocks:
            raise UnsupportedKVLayout(
                vkv.backend, f"layout {vkv.kv.layout}", "what the scheduler expected"
            )
        kv, rows = vkv.kv, None if self.groups is None else self.groups.rows(names)
        if self.groups is not None:
            if not self.config.local_cpu and self.can_load:
                log.warning(
                    "several KV cache groups: kvtier promises a hit only from CPU RAM (vLLM cannot "
                    "recompute a failed load here), and local_cpu is false: no hit will load"
                )
            log.info(
                "vLLM's hybrid KV cache manager: %d KV cache groups; %d attention layers move "
                "at their group's blocks%s",
                len(self.groups.attention) + len(self.groups.recurrent),
                len(names),
                f", {len(self._state_names)} Mamba layers' state is stored at chunk ends"
                if self._state_names
                else "",
            )
        if rows is not None:  # several attention groups: each layer's tokens in blocks of its group
            kv = kv.grouped(rows)
        rank = get_tensor_model_parallel_rank()
        size = get_tensor_model_parallel_world_size()
        heads = vllm_config.model_config.get_total_num_kv_heads()
        if self.config.share_across_tp and not vllm_config.model_config.use_mla and size > heads:
            raise ConfigError(
                "share_across_tp",
                True,
                f"false here: {size} ranks share {heads} KV heads, "
                "so vLLM replicates them and no rank holds a slice of the heads",
            )
        fmt = KVFormat(
            model=vllm_config.model_config.model,
            layout=vkv.chunk_layout,
            dtype=str(vkv.kv.dtype).removeprefix("torch."),
            tp_rank=rank,
            tp_size=size,
        )
        states = state_layers(kv_caches, self._state_names) if self._state_names else None
        if states is not None and self.config.enable_pd:
            raise UnsupportedModel(
                "disaggregated prefill of a model with Mamba layers: kvtier's PD moves "
                "attention KV only"
            )
        self.engine = self.pd.make_engine(kv, fmt, rank, states)
        self._beside = BesideLoads(self.engine.kv.device)
        self._server = LookupServer(
            socket_path(self.engine_id, rank),
            Handlers(lookup=self._find, release=self._release, reset=self.engine.clear),
            direct=True,
        )

    def _release(self, request_id: str) -> None:
        assert self.engine is not None
        self._coming_up.pop(request_id, None)
        self.engine.release_hold(request_id)

    def _find(
        self,
        tokens: np.ndarray,
        identity: Identity,
        request_id: str,
        computed: int,
        beside: bool = False,
    ) -> tuple[int, int, bool]:
        """A scheduler lookup: hold the hit (and say so). Chunks below CPU RAM start coming
        up into it now; a hit all in CPU RAM that the scheduler will load (the same rule as
        there) starts its copies to the GPU now, before vLLM's step that loads it (`beside`:
        its load runs beside the steps); a hit none of which will be loaded (the engine has
        it) is let go at once."""
        assert self.engine is not None
        # Several KV cache groups: vLLM cannot recompute what a load failed to deliver
        # (connector.py), so the hit is promised from CPU RAM only. The scheduler asks again
        # while the rest comes up (SchedulerSide.get_num_new_matched_tokens); once that is
        # over, the part that made it is the hit.
        pending = self._coming_up.get(request_id)
        came_up = pending is not None and pending.done()
        hit = self.engine.find(
            tokens,
            identity=identity,
            hold_for=request_id,
            limit=len(tokens) - 1,
            cpu_only=came_up,
        )
        if self.groups is not None and self.can_load and hit.in_cpu < hit.tokens and not came_up:
            if pending is None:
                self._coming_up[request_id] = self.engine.start_prefetch(
                    tokens, request_id, identity
                )
            return hit.tokens, hit.in_cpu, True
        if not self.can_load or not self.shape.to_load(hit.tokens, len(tokens), computed):
            if hit.tokens:
                self._release(request_id)
            return hit.tokens, hit.in_cpu, False
        if hit.in_cpu < hit.tokens:
            self.engine.start_prefetch(tokens, request_id, identity)
        else:
            self.engine.upload_ahead(
                tokens[: hit.tokens],
                request_id,
                identity=identity,
                start=computed,
                layerwise=self.config.use_layerwise and not beside,
                beside=beside,
            )
        return hit.tokens, hit.in_cpu, True

    @traced("start_load_kv")
    def start_load_kv(self, meta: KvtierMetadata) -> None:
        assert self.engine is not None
        t0 = time.perf_counter()
        self.pd.dropped(meta.pd_dropped)  # before this step's forward is queued
        beside = self._beside_loads()
        beside.order_step()
        in_step: list[TransferSpec] = []
        for spec in meta.loads:
            self._coming_up.pop(spec.req_id, None)
            if not spec.background:
                in_step.append(spec)
            elif spec.from_cpu and not self._state_names:  # nothing in its way blocks: queued now
                beside.start_now(spec, self._queue_load, self._land)  # vLLM told: beside.py
            else:
                beside.start(spec, self._load)
        if in_step:
            timed = (
                contextlib.nullcontext()
                if self.config.use_layerwise
                else self._figures.forward_waits.around(self.engine.kv.device)
            )
            with timed:
                self._start_in_step(in_step)
        self._step_wait += time.perf_counter() - t0

    def _start_in_step(self, specs: list[TransferSpec]) -> None:
        """From CPU RAM the copies are queued ahead of the forward (layer by layer with
        use_layerwise); finished, and checked, at wait_for_save."""
        assert self.engine is not None
        for spec in specs:
            load = self.engine.start_retrieve(
                spec.token_ids,
                self._slots(spec),
                start=spec.start,
                request_id=spec.req_id,
                identity=spec.identity,
                layerwise=self.config.use_layerwise,
            )
            state = self._load_state(spec) if self._state_names else None
            self._loads.append((load, spec, state))

    def _slots(self, spec: TransferSpec) -> torch.Tensor:
        return spec.slots(
            self.shape.block_size, None if self.groups is None else self.groups.attention
        )

    def _load_state(self, spec: TransferSpec) -> StateLoad | None:
        """A hybrid model's Mamba state at the load's end into its blocks, queued on this
        thread's stream. None where it could not be (nothing written then).

        Loaded in the request's first step, it goes to that step's running block too:
        vLLM copied the state at the hit into it before this step's start_load_kv
        (preprocess_mamba, before the forward's context), from a block kvtier writes only now."""
        assert self.engine is not None and self.groups is not None
        size = self.groups.block_size
        blocks = self.groups.state_blocks(spec.block_ids, spec.end, self._state_names)
        running = (
            self.groups.state_blocks(
                spec.block_ids, -(-spec.step_end // size) * size, self._state_names
            )
            if spec.step_end
            else None
        )
        if blocks is None or (spec.step_end and running is None):
            return None
        return self.engine.load_state(
            spec.token_ids[: spec.end],
            blocks,
            request_id=spec.req_id,
            identity=spec.identity,
            also=running,
        )

    def _beside_loads(self) -> BesideLoads:
        if self._beside is None:  # an engine set without register_kv_caches (tests)
            assert self.engine is not None
            self._beside = BesideLoads(self.engine.kv.device)
        return self._beside

    def _load(self, beside: Beside) -> int:
        """A load beside the steps, on the loader thread (and its stream): chunks below CPU
        RAM come up batch by batch, then it lands."""
        return self._land(beside, self._queue_load(beside))

    def _queue_load(self, beside: Beside) -> Loading:
        """A load beside the steps started, on the loads' stream: from CPU RAM its copies are
        queued (and vLLM may be told at once), from below they have come up."""
        assert self.engine is not None
        spec = beside.spec
        try:
            loading = self.engine.start_retrieve(
                spec.token_ids,
                self._slots(spec),
                start=spec.start,
                request_id=spec.req_id,
                identity=spec.identity,
                beside=True,
            )
        except BaseException:
            self._landed(beside)
            raise
        if loading.settled and not self._state_names:
            # vLLM may be told now, before the copies end (it runs the request a step
            # or more later, on a stream that waits for them), not a step after.
            beside.queued(loading.num_tokens)
        return loading

    def _land(self, beside: Beside, loading: Loading) -> int:
        """On the loader thread: wait for a load's copies, let its chunks go; the tokens loaded."""
        try:
            return self._loaded_with_state(beside.spec, int(loading.finish().sum()))
        finally:
            self._landed(beside)

    def _landed(self, beside: Beside) -> None:
        self.pd.loaded(beside.spec.pd_req_id)
        self._figures.note_longest(
            "longest_background_load_seconds", time.perf_counter() - beside.started
        )

    def _loaded_with_state(self, spec: TransferSpec, loaded: int) -> int:
        if not self._state_names:
            return loaded
        state = self._load_state(spec) if loaded == spec.end - spec.start else None
        if state is None:
            return 0  # KV without its Mamba state is not the model's: all of it is recomputed
        state.finish()
        return loaded

    def _check_loaded(self, spec: TransferSpec, loaded: int) -> None:
        """Blocks a load did not fill are reported: vLLM recomputes them."""
        loaded_end = spec.start + loaded
        if loaded_end < spec.end:
            self._figures.failed_tokens += spec.end - loaded_end
            first = loaded_end // self.shape.block_size
            last = (spec.end - 1) // self.shape.block_size
            self._load_errors.update(spec.blocks_of(first, last))
            log.warning(
                "request %s: %d of %d tokens could not be loaded (evicted, corrupt or "
                "unreachable); vLLM recomputes them",
                spec.req_id,
                spec.end - loaded_end,
                spec.end - spec.start,
            )

    @traced("get_finished")
    def get_finished(self) -> set[str] | None:
        self.pd.expire()
        done = set()
        for spec, loaded in self._beside.finished() if self._beside is not None else ():
            self._check_loaded(spec, loaded)
            done.add(spec.req_id)
        return done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None and self._loads:
            t0 = time.perf_counter()
            for load, _, _ in self._loads:
                load.wait(index)
            self._step_wait += time.perf_counter() - t0

    def save_kv_layer(self, layer_name: str) -> None:
        """Counted only: a step's KV is stored whole at wait_for_save, once the forward has
        written every layer. On a GPU its copies to the host are not waited for there, and
        the next forward waits for the gathers only. Saved layer by layer inside the forward,
        each layer's launches cost ~0.2 ms of host time, which a step of a few hundred tokens
        does not hide (the chat workload's TTFT +10 ms;
        results/gpu-h100-vllm-2026-11-27/serving-8b-gpu-0.24/README.md); whole and waited
        for, the copy made cold TTFT +5.3 % at 16k."""
        if layer_name in self._layer_index:
            self._layers_written += 1

    @traced("wait_for_save")
    def wait_for_save(self, meta: KvtierMetadata) -> None:
        # vLLM calls this after every step's forward, also one that raised: its KV is then
        # not stored (_forward_wrote_every_layer).
        assert self.engine is not None
        t0 = time.perf_counter()
        loads, self._loads = self._loads, []
        for load, spec, state in loads:
            # its mask is final now (a lent chunk may fail its check after its layers were read)
            load.finish()
            self.pd.loaded(spec.pd_req_id)
            loaded = load.num_tokens
            # KV without its Mamba state is not the model's: all of it is recomputed
            if self._state_names:
                if state is None or loaded < spec.end - spec.start:
                    loaded = 0
                if state is not None:
                    state.finish()
            self._check_loaded(spec, loaded)
        # Copies to the host not waited for: the chunks land in the tiers at the engine's next
        # store (or a lookup of them). A host waiting here for the step's copies left the GPU
        # idle until vLLM queued the next step (its batch queue queues a step before the last
        # one ends).
        if meta.saves and self._forward_wrote_every_layer():  # nor its states, nor a PD send
            for spec in meta.saves:
                self.engine.start_store(
                    spec.token_ids,
                    self._slots(spec),
                    start=spec.start,
                    request_id=spec.req_id,
                    identity=spec.identity,
                ).finish(wait=False)
            for spec in meta.saves:
                if spec.state and self._state_names:
                    self._save_state(spec)
                self.pd.send(spec, self.shape.block_size)
        self._layers_written = 0
        self._figures.note_longest(
            "longest_step_wait_seconds", self._step_wait + time.perf_counter() - t0
        )
        self._step_wait = 0.0

    def _forward_wrote_every_layer(self) -> bool:
        """Whether this step's forward ran to its end: vLLM calls wait_for_save also after a
        forward that raised (then its KV is not the model's, and is not stored). A step that
        vLLM ran as one CUDA graph called no save_kv_layer."""
        raised = sys.exc_info()[1] is not None
        partial = 0 < self._layers_written < len(self._layer_index)
        if raised or partial:
            log.warning(
                "this step's forward %s: its KV is not stored",
                "raised"
                if raised
                else f"wrote {self._layers_written} of {len(self._layer_index)} layers",
            )
        return not (raised or partial)

    def _save_state(self, spec: TransferSpec) -> None:
        """The Mamba state this step ended with (at `spec.end`, a block end), beside its chunk."""
        assert self.engine is not None and self.groups is not None
        blocks = self.groups.state_blocks(spec.block_ids, spec.end, self._state_names)
        saved = blocks is not None and self.engine.save_state(
            spec.token_ids[: spec.end], blocks, request_id=spec.req_id, identity=spec.identity
        )
        if not saved:
            log.warning(
                "request %s: the Mamba state after %d tokens was not stored (%s)",
                spec.req_id,
                spec.end,
                "vLLM kept no block for it" if blocks is None else "no room, or not a chunk's end",
            )

    def stats(self) -> KvtierStats | None:
        if self.engine is None:
            return None
        return self._figures.report(self._counters())

    def _counters(self) -> dict[str, float]:
        """This worker's cumulative counters and current gauges (metrics.py names)."""
        assert self.engine is not None
        # a PD receiver's CPU tier is its buffer
        here = "pd" if self.pd.buffer is not None else "cpu"
        out = {_tier_named(k, here): v for k, v in self.engine.metrics().items()}
        out.update(self._figures.counters())
        if self.pd.sender is not None:
            out["stored_tokens:pd"] = self.pd.sender.stats.sent_tokens
            out["stored_bytes:pd"] = self.pd.sender.stats.sent_bytes
        return out

    def events(self) -> KvtierKVEvents | None:
        if self.engine is None or not self.config.enable_kv_events:
            return None
        events = self.engine.take_events()
        return KvtierKVEvents(to_vllm(events, self.shape.chunk_size)) if events else None

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._beside is not None:
            self._beside.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.pd.close()
        if self.engine is not None:
            self.engine.close()  # sends what is still queued for the remote tier


def _tier_named(key: str, here: str) -> str:
    name, _, tier = key.partition(":")
    return f"{name}:{here}" if tier == Tier.CPU else key
