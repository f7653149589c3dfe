"""Loads beside vLLM's steps (vLLM's asynchronous loads: the request waits, then joins a
later step): a CPU-RAM hit while other requests run (async_loading), or a hit below CPU RAM.

Each runs on the worker's loader thread. On a GPU it runs on its own stream, after what
vLLM's stream held when its step began (the blocks' earlier readers), never ordered into
vLLM's stream, so the running requests' steps never wait for its copies.

    BesideLoads.start(spec, load)   `load(beside)` on the thread, on the loads' stream
    BesideLoads.start_now(spec, queue, land)
                                    a hit all in CPU RAM: `queue(beside)` queues its copies
                                    now, on this thread (on the loads' stream; nothing there
                                    blocks), and the thread only runs `land`, which waits for
                                    them and lets the chunks go: vLLM hears of it at this
                                    step's end, not when a thread that waits for the GIL
                                    behind vLLM's own has got to it
    Beside.queued(tokens)           the load's copies are queued and nothing can cut it
                                    short: an event after them (on a GPU)
    BesideLoads.finished()          the loads to report to vLLM: done, or queued so
    BesideLoads.order_step()        this step's stream waits for the loads reported while
                                    their copies could still run (its forward may read them)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.integrations.vllm.spec import TransferSpec
from kvtier.logs import get_logger

log = get_logger(__name__)


@dataclass
class Beside:
    """One load beside the steps: its spec, its thread's future, and, once its copies are
    queued and it can no longer be cut short, an event after them and its tokens."""

    spec: TransferSpec
    on_gpu: bool
    future: Future | None = None
    _queued: tuple[torch.cuda.Event, int] | None = None  # set where its copies are queued
    started: float = field(default_factory=time.perf_counter)  # at start_load_kv
    queued_s: float | None = None  # its copies queued, s after `started`

    def queued(self, tokens: int) -> None:
        """Called on the load's stream (in start_load_kv or on the loader thread) after its
        copies are queued: from here vLLM may be told the load is done (BesideLoads.finished)."""
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record()  # the current stream: the loads', ordered after the copies
            self._queued = (event, tokens)
        self.queued_s = time.perf_counter() - self.started


class BesideLoads:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-async-load")
        self._loads: dict[str, Beside] = {}
        self._stream: torch.cuda.Stream | None = None  # the loads' (on a GPU)
        # Loads reported done while their copies may still run: every later step's stream
        # waits for their events, until their threads have seen the copies end.
        self._landing: list[tuple[torch.cuda.Event, Future]] = []

    @property
    def stream(self) -> torch.cuda.Stream:
        """The loads' stream (one thread runs them): never vLLM's, so a load beside the
        steps holds none of their kernels behind its copies."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def start(self, spec: TransferSpec, load: Callable[[Beside], int]) -> None:
        beside, after = self._begin(spec)
        beside.future = self._thread.submit(self._run, beside, load, after)

    def start_now(
        self, spec: TransferSpec, queue: Callable[[Beside], Any], land: Callable[[Beside, Any], int]
    ) -> None:
        beside, after = self._begin(spec)
        try:
            queued = self._run(beside, queue, after)
        # reported as a failed load (finished): vLLM recomputes
        except Exception as exc:  # noqa: BLE001
            beside.future = Future()
            beside.future.set_exception(exc)
            return
        beside.future = self._thread.submit(land, beside, queued)

    def _begin(self, spec: TransferSpec) -> tuple[Beside, torch.cuda.Event | None]:
        # Its blocks may be ones a forward queued before this step still reads (a request
        # preempted at this step's schedule): the load's own stream waits for it.
        after = None
        if self.device.type == "cuda":
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        beside = self._loads[spec.req_id] = Beside(spec, on_gpu=after is not None)
        return beside, after

    def _run(
        self, beside: Beside, work: Callable[[Beside], Any], after: torch.cuda.Event | None
    ) -> Any:
        if after is None:
            return work(beside)
        self.stream.wait_event(after)
        # the calling thread's current device need not be the KV's (a TP rank's)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return work(beside)

    def finished(self) -> Iterator[tuple[TransferSpec, int]]:
        """(spec, tokens loaded) of each load to report now: its thread is done (0 tokens
        if it failed), or its copies are queued and it cannot be cut short."""
        for rid, beside in list(self._loads.items()):
            future, queued = beside.future, beside._queued
            assert future is not None
            if future.done():
                try:
                    loaded = future.result()
                # any failure of a background load: report it, vLLM recomputes
                except Exception:  # noqa: BLE001
                    log.exception("request %s: background load failed", rid)
                    loaded = 0
            elif queued is not None:  # its copies may still run: the next steps wait for them
                event, loaded = queued
                self._landing.append((event, future))
            else:
                continue
            del self._loads[rid]
            _say_reported(beside, loaded, future.done())
            yield beside.spec, loaded

    def order_step(self) -> None:
        """vLLM's stream (this step's forward) waits for the loads reported done while their
        copies could still run; one whose thread saw them end needs no wait."""
        landing, self._landing = self._landing, []
        stream = torch.cuda.current_stream(self.device) if landing else None
        for event, future in landing:
            if not future.done():
                assert stream is not None
                stream.wait_event(event)
                self._landing.append((event, future))
            elif future.exception() is not None:  # after its copies were queued: a CUDA error
                log.error(
                    "a load beside the steps failed after it was reported: %s", future.exception()
                )

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _say_reported(beside: Beside, loaded: int, done: bool) -> None:
    """One line a load: when its copies were queued and when vLLM hears of it, from its
    start_load_kv (the step boundaries a load waits for show here)."""
    queued = (
        f"copies queued at {beside.queued_s * 1e3:.1f} ms, " if beside.queued_s is not None else ""
    )
    log.info(
        "request %s: %d of %d tokens loaded beside the steps: %sreported to vLLM at %.1f ms%s",
        beside.spec.req_id,
        loaded,
        beside.spec.end - beside.spec.start,
        queued,
        (time.perf_counter() - beside.started) * 1e3,
        "" if done else " (its copies still running)",
    )
