"""kvtier's calls on the inference engine's thread that took long, one log line each, with
what their time went to. Off unless `KVTIER_TRACE_STALLS_MS` is set (e.g. 5: calls of 5 ms
and longer); a diagnosis aid for serving runs (results/gpu-h200-vllm-2026-11-28/README.md),
not a metric.

    @traced("lookup")            times each call of the function (on any thread)
    synchronized(kind, event)    event.synchronize(), a host wait inside kvtier, counted into
                                 the call running on this thread (landing.py, staging.py)

A line splits the call's wall time into this thread's CPU time, the host waits kvtier
counted, the garbage collections that ran meanwhile (any thread's: they hold the GIL), and
what is left: the GIL held by another thread, or a wait kvtier does not count.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from kvtier.logs import get_logger

log = get_logger(__name__)

F = TypeVar("F", bound=Callable)


class Synchronizes(Protocol):
    def synchronize(self) -> None: ...


class Stalls:
    def __init__(self, threshold_ms: float | None) -> None:
        self.threshold_s = None if threshold_ms is None else threshold_ms / 1e3
        self._local = threading.local()  # .waits: {kind: s} of the call running on this thread
        # collections' total time, and when the one running began
        self._gc_s, self._gc_started = 0.0, 0.0
        if self.threshold_s is not None:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_started

    def waited(self, kind: str, seconds: float) -> None:
        waits = getattr(self._local, "waits", None)
        if waits is not None:
            waits[kind] = waits.get(kind, 0.0) + seconds

    def synchronized(self, kind: str, event: Synchronizes) -> None:
        """`event.synchronize()`, timed as a wait of `kind` while tracing is on."""
        if self.threshold_s is None:
            event.synchronize()
            return
        t0 = time.perf_counter()
        event.synchronize()
        self.waited(kind, time.perf_counter() - t0)

    def traced(self, name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            @functools.wraps(fn)
            def call(*args, **kwargs):
                if self.threshold_s is None or getattr(self._local, "waits", None) is not None:
                    return fn(*args, **kwargs)  # off, or inside a traced call (counted there)
                self._local.waits = {}
                t0, cpu0, gc0 = time.perf_counter(), time.thread_time(), self._gc_s
                try:
                    return fn(*args, **kwargs)
                finally:
                    wall = time.perf_counter() - t0
                    waits, self._local.waits = self._local.waits, None
                    if wall >= self.threshold_s:
                        self._say(name, wall, time.thread_time() - cpu0, self._gc_s - gc0, waits)

            return call  # type: ignore[return-value]

        return wrap

    @staticmethod
    def _say(name: str, wall: float, cpu: float, gcs: float, waits: dict[str, float]) -> None:
        rest = wall - cpu - gcs - sum(waits.values())
        parts = [f"cpu {cpu * 1e3:.1f}"] + [
            f"waiting for {k} {s * 1e3:.1f}" for k, s in waits.items()
        ]
        parts += [f"gc {gcs * 1e3:.1f}"] if gcs else []
        log.info(
            "slow call on the engine's thread: %s took %.1f ms (%s; the rest %.1f: the GIL, "
            "or an uncounted wait)",
            name,
            wall * 1e3,
            ", ".join(parts),
            max(rest, 0.0) * 1e3,
        )


def _threshold() -> float | None:
    value = os.environ.get("KVTIER_TRACE_STALLS_MS", "").strip()
    try:
        return float(value) if value else None
    except ValueError:
        log.warning(
            "KVTIER_TRACE_STALLS_MS=%r is not a number of milliseconds: slow calls are not traced",
            value,
        )
        return None


STALLS = Stalls(_threshold())
traced, synchronized = STALLS.traced, STALLS.synchronized
