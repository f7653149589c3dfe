"""A hit's copies started at its lookup (`CacheEngine.upload_ahead`).

vLLM's scheduler asks for a hit some milliseconds before the worker's
`start_load_kv` knows the request's slots. A hit all in CPU RAM starts
crossing PCIe into the transfer's device staging then; the load queues only
the kernels that scatter it. One request at a time: its staging is device
memory the size of its hit.

A hit that will load beside the engine's running steps has its copies queued on the slot's
own thread (`start_later`): the lookup returns to vLLM's scheduler without their host time
(~1.2 ms for a chat turn's hit on an H200, `kvtier_tools.bench.host_time`), which the thread can
spend while the engine thread waits for its step on the GPU (torch lets go of the GIL in its
calls and waits; inside vLLM's serving the effect is not measured apart yet). The request's
load (`take`) and any `drop` or `start` wait for it first.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtier.engine.landing import Landing
from kvtier.engine.mover import Mover, release_held
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.logs import get_logger
from kvtier.tiers.base import CPU
from kvtier.tiers.cpu import StoredChunk
from kvtier.tiers.store import TieredStore
from kvtier.transfer import Upload

log = get_logger(__name__)


@dataclass
class Ahead:
    request_id: str
    # retained until the load ends, or the ahead is dropped
    held: list[tuple[ChunkSpan, StoredChunk]]
    upload: Upload
    layerwise: bool

    def keys(self) -> list[ChunkKey]:
        return [s.key for s, _ in self.held]

    def drop(self) -> None:
        self.upload.wait()  # the copies read the host blocks until they end
        release_held(self.held)


class AheadSlot:
    def __init__(self, tiers: TieredStore, mover: Mover, landing: Landing) -> None:
        self.tiers, self.mover, self.landing = tiers, mover, landing
        self._ahead: Ahead | None = None
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None  # start_later's, made at its first use
        # the last start_later's (done or not: waiting again is free)
        self._later: Future | None = None

    @property
    def request_id(self) -> str | None:
        self._wait_later()
        ahead = self._ahead
        return None if ahead is None else ahead.request_id

    def start(
        self, spans: list[ChunkSpan], request_id: str, layerwise: bool, beside: bool = False
    ) -> bool:
        """Queue the copies of `spans` if they are all in CPU RAM; True if queued (now or
        before)."""
        self._wait_later()
        return self._start(spans, request_id, layerwise, beside)

    def start_later(
        self, spans: list[ChunkSpan], request_id: str, layerwise: bool, beside: bool = False
    ) -> None:
        """`start` on the slot's thread. A failure there is logged and leaves no ahead (the
        request's load then copies the chunks itself)."""
        self._wait_later()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-upload-ahead")
        self._later = self._thread.submit(self._start_logged, spans, request_id, layerwise, beside)

    def _start_logged(
        self, spans: list[ChunkSpan], request_id: str, layerwise: bool, beside: bool
    ) -> None:
        try:
            self._start(spans, request_id, layerwise, beside)
        except Exception:
            log.exception(
                "request %s: its hit's copies could not be queued at its lookup; its load "
                "queues them",
                request_id,
            )

    def _wait_later(self) -> None:
        later = self._later  # kept: each caller on any thread waits for it (result() again is free)
        if later is not None:
            later.result()

    def close(self) -> None:
        """Drop the ahead; end the slot's thread."""
        self.drop()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _start(
        self, spans: list[ChunkSpan], request_id: str, layerwise: bool, beside: bool
    ) -> bool:
        keys = [s.key for s in spans]
        with self._lock:
            ahead = self._ahead
            if ahead is not None and ahead.request_id != request_id:
                return False  # another request's load is ahead
            if ahead is not None and ahead.keys() == keys and ahead.layerwise == layerwise:
                return True  # looked up again (it waited for blocks): the same chunks
            self._ahead = None
        if ahead is not None:
            ahead.drop()
        ahead = self._upload(spans, request_id, layerwise, beside)
        if ahead is None:
            return False
        with self._lock:
            if self._ahead is None:
                self._ahead = ahead
                return True
        ahead.drop()  # raced with another lookup: it went first
        return False

    def _upload(
        self, spans: list[ChunkSpan], request_id: str, layerwise: bool, beside: bool
    ) -> Ahead | None:
        held, ready = self._held(spans)
        try:
            upload = (
                self.mover.upload(held, layer_major=layerwise, beside=beside, ready=ready)
                if held
                else None
            )
        except BaseException:
            release_held(held)
            raise
        if upload is None:
            release_held(held)
            return None
        return Ahead(request_id, held, upload, layerwise)

    def _held(
        self, spans: list[ChunkSpan]
    ) -> tuple[list[tuple[ChunkSpan, StoredChunk]], list[torch.cuda.Event | None]]:
        """The leading chunks of `spans` retained for an upload, from CPU RAM or from a store
        that has them on their way there; with each the event its copy up waits for (the
        store's copies down: None for a chunk in CPU RAM). Empty unless the first is one."""
        lent = self.landing.borrow([s.key for s in spans])
        rest = [s for s, f in zip(spans, lent) if f is None]
        where = self.tiers.locate([s.key for s in rest])
        where = where[: next((i for i, w in enumerate(where) if w != CPU), len(where))]
        batches = self.tiers.fetch(rest[: len(where)], where)
        try:
            fetched = iter(next(batches, []))
        finally:
            batches.close()
        held: list[tuple[ChunkSpan, StoredChunk]] = []
        ready: list[torch.cuda.Event | None] = []
        for span, flying in zip(spans, lent):
            if flying is not None:
                held.append((span, StoredChunk(flying.block, flying.num_tokens)))
                ready.append(flying.done)
                continue
            got = next(fetched, None)
            if got is None or got[0] != span:
                if got is not None:
                    release_held([got])
                break
            held.append(got)
            ready.append(None)
        release_held(list(fetched))  # after the first chunk missing: not uploaded
        for _, flying in zip(spans[len(held) :], lent[len(held) :]):
            if flying is not None:
                flying.block.release()
        return held, ready

    def take(self, request_id: str, keys: list[ChunkKey], layerwise: bool) -> Ahead | None:
        """The request's ahead if its chunks hold `keys` in a row (the load's may be fewer:
        the tokens the engine found it had by the time it loads); else None (and it is dropped)."""
        self._wait_later()
        with self._lock:
            ahead = self._ahead
            if ahead is None or ahead.request_id != request_id:
                return None
            self._ahead = None
        have = ahead.keys()
        i = have.index(keys[0]) if keys and keys[0] in have else -1
        if i >= 0 and have[i : i + len(keys)] == keys and ahead.layerwise == layerwise:
            return ahead
        ahead.drop()
        return None

    def drop(self, request_id: str | None = None) -> None:
        """Drop the ahead (of `request_id` only, if given)."""
        self._wait_later()
        with self._lock:
            ahead = self._ahead
            if ahead is None or (request_id is not None and ahead.request_id != request_id):
                return
            self._ahead = None
        ahead.drop()
