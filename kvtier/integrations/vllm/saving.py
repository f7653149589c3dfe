"""A step's stores off vLLM's engine thread.

Storing a step's chunks costs the host 1-2 ms (their keys, the pool's blocks, the staging, the
launches: results/gpu-h200-ab-2026-12-02/README.md), which vLLM's engine thread paid at
`wait_for_save` before it could schedule the next step. Here `wait_for_save` records an event
after the step's forward and hands the stores to one saver thread, which queues their gathers
on its own stream behind that event while the engine thread goes on (and, waiting for the
GPU, lets go of the GIL).

What the gathers read must not be written before they have read it. vLLM writes a request's
pages again only once it has freed them: the request finished, was aborted or was preempted.
The scheduler's side lists those requests in the next step's metadata (`KvtierMetadata.freed`);
before vLLM's next step writes anything (`handle_preemptions`, ahead of its zeroing and block
copies; `start_load_kv` again for an engine that does not call it) their stores are queued and
vLLM's stream waits for their reads. A running request's forward writes only slots past
what it stores.

    StepSaves.submit(specs)              wait_for_save: the step's stores to the thread
    StepSaves.order_freed(req_ids)       the stores of those requests queued, and the
                                         current stream ordered after their reads
    StepSaves.wait_on_path(tokens, identity)
                                         a lookup: the stores of chunks on its path are in
                                         the tiers (or landing), so a turn that follows at
                                         once hits them
    StepSaves.drain()                    every store queued (reset, close)

Not used with several KV cache groups (a sliding window frees pages of a running request),
a Mamba state or PD sends, which stay on the engine thread (worker.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtier.integrations.vllm.spec import TransferSpec
from kvtier.keys import Identity
from kvtier.logs import get_logger

log = get_logger(__name__)


@dataclass
class _Pending:
    """A store handed to the thread: whose, which prefix, and once queued the event after its
    gathers' reads (None on a CPU, where the thread copies synchronously)."""

    spec: TransferSpec
    future: Future[torch.cuda.Event | None]

    def read(self) -> bool:
        """Its gathers have read vLLM's pages (or it failed): nothing need wait for it."""
        if not self.future.done():
            return False
        event = self.future.result()
        return event is None or event.query()


class StepSaves:
    def __init__(
        self, store: Callable[[TransferSpec], object], device: torch.device, chunk_size: int
    ) -> None:
        self._store = store  # queues one spec's store on the current stream, not waited for
        self._device, self._chunk_size = device, chunk_size
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-store")
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()  # lookups may come on the lookup server's thread
        self._pending: list[_Pending] = []

    def submit(self, specs: Sequence[TransferSpec]) -> None:
        """On vLLM's thread, after the step's forward is queued: its stores to the thread."""
        on_gpu = self._device.type == "cuda"
        after = torch.cuda.current_stream(self._device).record_event() if on_gpu else None
        # the scheduler's side extends a request's block lists at later steps
        own = [replace(s, block_ids=[list(ids) for ids in s.block_ids]) for s in specs]
        future = self._thread.submit(self._run, own, after)
        with self._lock:
            self._pending = [p for p in self._pending if not p.read()]
            self._pending += [_Pending(s, future) for s in own]

    def _run(
        self, specs: list[TransferSpec], after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """On the thread: the stores queued behind the step's forward; an event after their
        reads of vLLM's pages. A store that fails is logged and dropped (its chunks are not
        put in the tiers): vLLM's step already ran."""
        if after is None:
            self._each(specs)
            return None
        stream = self._stream_()
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            try:
                self._each(specs)
            finally:
                read = stream.record_event()
        return read

    def _each(self, specs: list[TransferSpec]) -> None:
        for spec in specs:
            try:
                self._store(spec)
            except Exception:
                log.exception("request %s: its store failed; its chunks are not kept", spec.req_id)

    def _stream_(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    def order_freed(self, req_ids: Iterable[str]) -> None:
        """Before vLLM writes pages it freed: the stores that read them are queued, and the
        current stream waits for their reads."""
        freed = set(req_ids)
        if not freed:
            return
        with self._lock:
            waits = [p for p in self._pending if p.spec.req_id in freed]
            self._pending = [p for p in self._pending if p.spec.req_id not in freed]
        self._order_after(waits)

    def wait_on_path(self, tokens: np.ndarray, identity: Identity) -> None:
        """The stores whose chunks lie on `tokens`' path are queued (their chunks in the tiers,
        or landing where a lookup finds them)."""
        with self._lock:
            pending = [p for p in self._pending if not p.future.done()]
        for p in pending:
            if self._on_path(p.spec, tokens, identity):
                p.future.result()

    def _on_path(self, spec: TransferSpec, tokens: np.ndarray, identity: Identity) -> bool:
        """Whether `tokens` share the store's prefix up to its first chunk's end."""
        if spec.identity != identity:
            return False
        first = spec.start - spec.start % self._chunk_size
        end = min(len(tokens), len(spec.token_ids), first + self._chunk_size)
        if end <= first:
            return False
        return bool(np.array_equal(tokens[:end], np.asarray(spec.token_ids[:end])))

    def drain(self) -> None:
        """Every store handed over is queued, and the current stream waits for their reads."""
        with self._lock:
            waits, self._pending = self._pending, []
        self._order_after(waits)

    def _order_after(self, waits: list[_Pending]) -> None:
        events = {id(e): e for p in waits if (e := p.future.result()) is not None}
        if events:
            current = torch.cuda.current_stream(self._device)
            for event in events.values():
                current.wait_event(event)

    def close(self) -> None:
        self.drain()
        self._thread.shutdown(wait=True)
