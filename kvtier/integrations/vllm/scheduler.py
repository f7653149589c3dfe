"""The connector's scheduler side: request state, the lookup with its hold, load and save planning.

get_num_new_matched_tokens ── lookup ──▶ the workers (lookup.py): find and hold the hit;
                              loaded in the step, or beside the steps (async_loading);
                              the request's identity first (identity.py): a request
                              kvtier cannot key is neither looked up nor stored; one
                              whose covering span this engine never saved past vLLM's
                              own hit is not looked up (stored.py)
update_state_after_alloc      the load is planned for the blocks vLLM gave
build_connector_meta          this step's loads and saves (whole chunks as prefill goes)
request_finished              forget the request; release a hold it never used
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.config import KvtierConfig
from kvtier.integrations.vllm.events import KvtierKVEvents
from kvtier.integrations.vllm.groups import KvGroups
from kvtier.integrations.vllm.identity import Identities
from kvtier.integrations.vllm.lookup import LookupClient, socket_path
from kvtier.integrations.vllm.metrics import KvtierStats
from kvtier.integrations.vllm.pd import SchedulerPd
from kvtier.integrations.vllm.spec import KvtierMetadata, Shape, TransferSpec
from kvtier.integrations.vllm.stored import StoredEnds, applies
from kvtier.keys import Identity
from kvtier.logs import get_logger
from kvtier.pd.sender import Target
from kvtier.stalls import traced

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = get_logger(__name__)


@dataclass
class RequestState:
    """Scheduler-side state of one request."""

    prompt: list[int]
    identity: Identity
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_upto: int = 0
    # tokens [start, end) to load next step, in the background?
    load: tuple[int, int, bool] | None = None
    load_from_cpu: bool = False  # that load's hit was all in CPU RAM at the lookup
    # the stored prefix the load reads: it may end inside a chunk (a tail: engine/tails.py)
    stored: int = 0
    pd_target: Target | None = None  # PD sender: where this request's KV goes
    pd_req_id: str = ""  # PD receiver: the proxy's id of this request


class SchedulerSide:
    def __init__(
        self,
        config: KvtierConfig,
        shape: Shape,
        engine_id: str,
        tp_size: int,
        can_load: bool,
        can_save: bool,
        identities: Identities | None = None,
        groups: KvGroups | None = None,
    ) -> None:
        self.config, self.shape, self.can_load, self.can_save = config, shape, can_load, can_save
        self.identities = identities or Identities()
        # req_id -> what keys its KV, from its lookup (vLLM looks up every new request) to its end;
        # a request kvtier cannot key has none and is neither loaded nor stored
        self._identity: dict[str, Identity] = {}
        self.state_every = groups.block_size if groups is not None and groups.has_state else 0
        # Several KV cache groups: vLLM cannot recompute a failed load, so a hit is promised
        # only once it is in CPU RAM; until then the request waits (the workers bring it up).
        self.promise_from_cpu = groups is not None
        # A hit all in CPU RAM loads beside the steps (vLLM's asynchronous load: the request
        # joins a later step) per async_loading; a hit with several KV cache groups or a PD
        # decoder's always loads in its step.
        self.cpu_beside = (
            "never" if self.promise_from_cpu or config.enable_pd else config.async_loading
        )
        self._running: set[str] = set()  # requests the last step ran that have not finished
        # async_loading busy: the tokens this step may still load in it while others run
        self._in_step_left = config.in_step_load_tokens
        addresses = [socket_path(engine_id, r) for r in range(tp_size)]
        self.lookup = LookupClient(addresses, config.lookup_timeout_ms / 1000)
        self.pd = SchedulerPd(config)
        self._requests: dict[str, RequestState] = {}
        # req_id -> (hit end, async, stored, all from CPU RAM), between the two calls
        self._pending: dict[str, tuple[int, bool, int, bool]] = {}
        self._held: set[str] = set()  # looked up with a hit, load not planned yet
        self._async_loads: list[str] = []  # async loads planned, to send with the next metadata
        # since the last stats; lookup_seconds: vLLM's scheduler waiting on the workers' answers
        self._counts = {
            "lookups": 0,
            "lookups_skipped": 0,
            "lookup_tokens": 0,
            "hit_tokens": 0,
            "lookup_seconds": 0.0,
        }
        # what this engine saved, where no other way brings chunks in (stored.py); with the
        # requests looked up, whose block hashes its saves record
        self.saved_ends = (
            StoredEnds(shape.block_size, shape.chunk_size)
            if applies(config, can_save, groups is None)
            else None
        )
        self._looked_up: dict[str, Request] = {}
        self._longest_lookup = 0.0  # s, since the start
        self._kv_events: list[KVCacheEvent] = []  # from the workers, until vLLM publishes them
        # save_decode_cache: requests whose decoded tokens are stored too
        self._live: dict[str, Request] = {}
        self._pd_dropped: list[str] = []  # PD sends of finished requests, for the next metadata

    @traced("lookup")
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt, rid = request.prompt_token_ids, request.request_id
        self.pd.looked_up(rid, request.kv_transfer_params)
        identity = self.identities.of(request)
        if not isinstance(identity, Identity):
            self._identity.pop(rid, None)
            return 0, False
        self._identity[rid] = identity
        if self.saved_ends is not None:
            self._looked_up[rid] = request  # its saves are recorded under its block hashes
        if not self.can_load or not prompt:
            return 0, False
        if num_computed_tokens and self._adds_nothing(prompt, request, num_computed_tokens):
            return 0, False
        t0 = time.perf_counter()
        beside = self._loads_beside(rid, len(prompt) - 1 - num_computed_tokens)
        found = self.lookup.lookup(prompt, rid, num_computed_tokens, beside, identity)
        stored, in_cpu = found.tokens, found.in_cpu
        waited = time.perf_counter() - t0
        self._longest_lookup = max(self._longest_lookup, waited)
        self._counts["lookup_seconds"] += waited
        need = self.shape.to_load(stored, len(prompt), num_computed_tokens)
        if self.promise_from_cpu and in_cpu < stored and need:
            self._held.add(rid)  # coming up into CPU RAM: vLLM asks again next step
            return None, False
        hit = self.shape.usable(stored, len(prompt))
        below_cpu = in_cpu < hit
        background = need > 0 and (below_cpu or beside)
        if self.cpu_beside == "busy" and not background and self._others_run(rid):
            self._in_step_left -= need  # what this step loads while others run
        self._counts["lookups"] += 1
        self._counts["lookup_tokens"] += len(prompt)
        self._counts["hit_tokens"] += hit
        log.info(
            "Reqid: %s, Total tokens %d, hit tokens %d, need to load %d%s",
            rid,
            len(prompt),
            hit,
            need,
            ""
            if not background
            else " (not all in CPU RAM: loading from disk/remote in the background)"
            if below_cpu
            else " (loading beside the running requests' steps)",
        )
        if need:
            self._pending[rid] = (num_computed_tokens + need, background, stored, not below_cpu)
            self._held.add(rid)
        elif found.held:
            # a rank holds what this request will not load (another rank's hit was shorter)
            self.lookup.release(rid)
        return need, background

    def _adds_nothing(self, prompt: list[int], request: Request, computed: int) -> bool:
        """Whether nothing kvtier holds would load past vLLM's own hit of `computed` tokens,
        known without asking the workers: vLLM has all but less than a block, which the step
        computes anyway (Shape.to_load), or this engine never saved the span past it
        (stored.py)."""
        if not self.shape.to_load(len(prompt), len(prompt), computed):
            return True
        if self.saved_ends is None:
            return False
        if self.saved_ends.may_add(
            request.block_hashes,
            request.num_tokens,
            len(prompt),
            computed,
            lambda end: self.shape.to_load(end, len(prompt), computed),
        ):
            return False
        self._counts["lookups_skipped"] += 1
        return True

    def _loads_beside(self, request_id: str, most: int) -> bool:
        """Whether a hit all in CPU RAM, of at most `most` tokens, would load beside the steps:
        async_loading always, or busy while another request ran in the last step (its next
        steps would wait for the copies; an idle engine's only request is served soonest
        inside its step), unless the step still has `in_step_load_tokens` for it. Decided
        before the lookup, which starts the hit's copies either way. A small hit in its step
        adds little to a step whose copies started at the lookup, and beside the steps it
        joins one or two steps later: a chat turn's evicted tail (~1,360 tokens, 8B shape,
        an H200, 2026-12-01) took 15-20 ms more TTFT beside the steps."""
        if self.cpu_beside != "busy":
            return self.cpu_beside == "always"
        return self._others_run(request_id) and most > self._in_step_left

    def _others_run(self, request_id: str) -> bool:
        """Whether a request other than this one ran in the last step."""
        return bool(self._running - {request_id})

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if self.config.save_decode_cache and self.can_save:
            self._live[rid] = request  # its all_token_ids grow as it decodes
        end, background, stored, from_cpu = self._pending.pop(rid, (0, False, 0, False))
        if num_external_tokens > 0 and request.prompt_token_ids:
            state = self._requests.setdefault(
                rid, RequestState(list(request.prompt_token_ids), self._identity[rid])
            )
            state.load = (end - num_external_tokens, end, background)
            state.stored, state.load_from_cpu = stored, from_cpu
            state.pd_req_id = self.pd.proxy_id(rid)
            if background:  # not scheduled this step: the blocks to load into are known only here
                state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
                self._async_loads.append(rid)

    @traced("build_connector_meta")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        meta = KvtierMetadata()
        self._running = set(scheduler_output.num_scheduled_tokens)
        self._in_step_left = self.config.in_step_load_tokens
        for rid in self._async_loads:
            state = self._requests.get(rid)
            if state is not None and state.load is not None:
                self._plan_load(meta, rid, state, state.load)
        self._async_loads = []
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            identity = self._identity.get(new.req_id)
            if not new.prompt_token_ids or identity is None:  # (one kvtier cannot key: identity.py)
                continue
            state = self._requests.setdefault(
                new.req_id, RequestState(list(new.prompt_token_ids), identity)
            )
            state.block_ids = [list(ids) for ids in new.block_ids]
            if state.pd_target is None:
                state.pd_target = self.pd.target(new.req_id)
            self._plan(meta, new.req_id, state, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: its blocks are new, and its KV must be recomputed.
                state.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                # A sliding window's group does not say which of its blocks it freed since: their
                # ids stay here. A later save reads them only for tokens no hit ever needs from that
                # group (before the step's window; spec.py's TransferSpec.slots).
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + sched.get(req_id, 0))
        for req_id in scheduler_output.preempted_req_ids or ():  # their pages are free now
            state = self._requests.get(req_id)
            if state is not None and state.pd_target is not None:
                meta.pd_dropped.append(state.pd_target.req_id)
        meta.pd_dropped += self._pd_dropped
        self._pd_dropped = []
        return meta

    def _plan_load(
        self,
        meta: KvtierMetadata,
        req_id: str,
        state: RequestState,
        load: tuple[int, int, bool],
        step_end: int = 0,
    ) -> None:
        """The load `state.load` (`load`, passed not None) into `meta`; it is then cleared."""
        start, end, background = load
        # The tokens of the stored prefix only: where it ends inside a chunk (a shorter prompt's
        # end), the worker's chunk keys of them end with that prompt's partial chunk.
        tokens = state.prompt[: state.stored] if state.stored else state.prompt
        meta.loads.append(
            TransferSpec(
                req_id,
                tokens,
                [list(ids) for ids in state.block_ids],
                start,
                end,
                background,
                from_cpu=background and state.load_from_cpu,
                pd_req_id=state.pd_req_id,
                step_end=step_end,
                identity=state.identity,
            )
        )
        state.load = None
        self._held.discard(req_id)  # the worker's retrieve ends the hold

    def _plan(
        self, meta: KvtierMetadata, req_id: str, state: RequestState, computed_after_step: int
    ) -> None:
        if state.load is not None:
            self._plan_load(meta, req_id, state, state.load, computed_after_step)
        if not self.can_save:
            return
        tokens = state.prompt
        live = self._live.get(req_id)
        # save_decode_cache: the output too
        if live is not None and computed_after_step > len(tokens):
            tokens = list(live.all_token_ids)
        if state.saved_upto >= len(tokens):
            return
        end = min(computed_after_step, len(tokens))
        if end != len(state.prompt):
            end -= end % self.shape.chunk_size  # mid-prompt or decoding: whole chunks only
        if end > state.saved_upto:
            # A Mamba state is kept where a prefill step ends on a block end (vLLM's align mode).
            keeps_state = (
                self.state_every
                and end == computed_after_step
                and end % self.state_every == 0
                and end <= len(state.prompt)
            )
            meta.saves.append(
                TransferSpec(
                    req_id,
                    tokens[:end],
                    state.block_ids,
                    state.saved_upto,
                    end,
                    pd_target=state.pd_target,
                    last=end == len(state.prompt),
                    state=bool(keeps_state),
                    identity=state.identity,
                )
            )
            if self.saved_ends is not None:
                looked_up = self._looked_up.get(req_id)
                self.saved_ends.saved(
                    None if looked_up is None else looked_up.block_hashes,
                    0 if looked_up is None else looked_up.num_tokens,
                    state.saved_upto,
                    end,
                )
            state.saved_upto = end

    def request_finished(self, request: Request) -> None:
        rid = request.request_id
        self._running.discard(rid)
        state = self._requests.pop(rid, None)
        if state is not None and state.pd_target is not None:
            # a no-op on the worker once its last step sent
            self._pd_dropped.append(state.pd_target.req_id)
        self._pending.pop(rid, None)
        self._identity.pop(rid, None)
        self.pd.forget(rid)
        self._live.pop(rid, None)
        self._looked_up.pop(rid, None)
        if rid in self._held:  # looked up, never loaded (aborted, or finished without it)
            self._held.discard(rid)
            self.lookup.release(rid)

    def reset_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: the workers drop kvtier's CPU RAM and disk tiers too."""
        return self.lookup.reset()

    def stats(self) -> KvtierStats | None:
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        refused = {
            f"uncached_requests:{kind}": n for kind, n in self.identities.take_refused().items()
        }
        if not any(counts.values()) and not refused:
            return None
        return KvtierStats({**counts, **refused, "longest_lookup_seconds": self._longest_lookup})

    def add_events(self, events: KVConnectorKVEvents | None) -> None:
        """The workers' KV events, aggregated by vLLM (ours: None where no worker had any)."""
        if isinstance(events, KvtierKVEvents):
            self._kv_events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._kv_events = self._kv_events, []
        return events

    def close(self) -> None:
        self.lookup.close()
