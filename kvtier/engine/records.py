"""What the engine counts and records: its stats, chunk events, its transfer log lines."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.keys import ChunkSpan
from kvtier.logs import get_logger
from kvtier.tiers.cpu import CpuTier

log = get_logger(__name__)

MAX_EVENTS = 100_000  # recorded and not yet taken; older ones are dropped


@dataclass
class EngineStats:
    stored_tokens: int = 0
    retrieved_tokens: int = 0
    skipped_store_tokens: int = 0  # not stored: every pool block was held by readers
    prefetched_tokens: int = 0
    store_seconds: float = 0.0
    retrieve_seconds: float = 0.0
    loaded_by_tier: dict[str, int] = field(
        default_factory=dict
    )  # tokens loaded, by the tier they came from


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """A chunk stored in or evicted from the CPU tier (recorded with `enable_kv_events`)."""

    stored: bool
    digest: bytes
    parent: bytes | None = None  # the previous chunk of the prompt (stored events)
    token_ids: list[int] = field(default_factory=list)
    lora: tuple[int, str] | None = (
        None  # the request's LoRA adapter: vLLM's id and name (stored events)
    )


class EventLog:
    """Chunk events of the CPU tier, kept until taken (off: records nothing)."""

    def __init__(self, cpu: CpuTier, on: bool) -> None:
        self._cpu = cpu
        self._events: deque[ChunkEvent] | None = None
        if on:
            events: deque[ChunkEvent] = deque(maxlen=MAX_EVENTS)
            cpu.on_evict = lambda key: events.append(ChunkEvent(False, key.digest))
            self._events = events

    def stored(
        self,
        spans: Sequence[ChunkSpan],
        tokens: np.ndarray,
        prompt: Sequence[ChunkSpan],
        lora: tuple[int, str] | None = None,
    ) -> None:
        """Events of `spans` now in the CPU tier; `prompt`: every chunk of `tokens` (their
        parents); `lora`: the adapter of the request that stored them."""
        if self._events is None:
            return
        parents = {s.end: s.key.digest for s in prompt}
        for span in spans:
            if self._cpu.contains(span.key):
                self._events.append(
                    ChunkEvent(
                        True,
                        span.key.digest,
                        parents.get(span.start),
                        tokens[span.start : span.end].tolist(),
                        lora,
                    )
                )

    @property
    def on(self) -> bool:
        return self._events is not None

    def take(self) -> list[ChunkEvent]:
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events


class SkipWarnings:
    """A store cut short is said once per request, though chunked prefill stores a request
    many times."""

    def __init__(self, remembered: int = 1024) -> None:
        self._said: OrderedDict[str, None] = OrderedDict()
        self._remembered = remembered

    def warn(self, skipped: int, request_id: str) -> None:
        if request_id and request_id in self._said:
            return
        log.warning(
            "CPU pool full of chunks in use (being read, or this store's own with no disk or "
            "remote tier to stream to): skipping the store of %d tokens for request %s (said "
            "once per request)",
            skipped,
            request_id or "-",
        )
        if request_id:
            self._said[request_id] = None
            if len(self._said) > self._remembered:
                self._said.popitem(last=False)


def log_transfer(
    what: str,
    n: int,
    total: int,
    request_id: str,
    nbytes: int,
    seconds: float,
    how: str = "",
    queued: bool = False,
) -> None:
    """`queued`: `seconds` is the time to queue copies that were not waited for (no rate)."""
    if queued:
        log.info(
            "%s %d out of %d tokens for request %s (%.1f MB; copies queued in %.1f ms, not "
            "waited for%s)",
            what,
            n,
            total,
            request_id or "-",
            nbytes / 1e6,
            seconds * 1e3,
            how,
        )
        return
    log.info(
        "%s %d out of %d tokens for request %s (%.1f MB in %.1f ms, %.2f GB/s%s)",
        what,
        n,
        total,
        request_id or "-",
        nbytes / 1e6,
        seconds * 1e3,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        how,
    )
