"""Chunk events (`enable_kv_events`): what every tier stored and removed, for vLLM to publish.

    stored in CPU RAM     when a store puts the chunk there (its parent, token ids, adapter)
    stored in a lower     when that tier's writer has written it (its own thread, any time
    tier (disk, remote)   before or after the store's own event: both orders meet here)
    removed               when CPU RAM or a local tier (disk) evicts or removes the chunk

`medium` is the tier's name ("cpu", "disk", "remote", a registered tier's). The remote store
evicts on its own, unseen: no removed events come from it. A stored event of a lower tier needs
its chunk's token ids, which the store's event gives; they wait for the writer (or the writer's
word waits for them) in bounded tables: under a backlog larger than MAX_WAITING chunks the
oldest go unannounced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.tiers.base import CPU
from kvtier.tiers.store import TieredStore

MAX_EVENTS = 100_000  # recorded and not yet taken; older ones are dropped
MAX_WAITING = 4096  # chunks whose lower tiers' stored events wait for the writer or the store


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """A chunk stored in or removed from one tier (`medium`: the tier's name)."""

    stored: bool
    digest: bytes
    parent: bytes | None = None  # the previous chunk of the prompt (stored events)
    token_ids: list[int] = field(default_factory=list)
    # the request's LoRA adapter: vLLM's id and name (stored events)
    lora: tuple[int, str] | None = None
    medium: str = CPU


class EventLog:
    """Chunk events of every tier, kept until taken (off: records nothing, hooks nothing)."""

    def __init__(self, tiers: TieredStore, on: bool) -> None:
        self._tiers = tiers
        self._events: deque[ChunkEvent] | None = None
        self._lock = threading.Lock()
        # chunk digest -> its stored event, for the lower tiers' writers to come
        self._templates: OrderedDict[bytes, ChunkEvent] = OrderedDict()
        # chunk digest -> the lower tiers that wrote it before its store's event came
        self._early: OrderedDict[bytes, list[str]] = OrderedDict()
        if on:
            self._events = deque(maxlen=MAX_EVENTS)
            self._hook(tiers)

    def _hook(self, tiers: TieredStore) -> None:
        tiers.cpu.on_removed.append(lambda key: self._removed(key.digest, CPU))
        for local in tiers.local:
            local.on_removed = lambda digest, name=local.name: self._removed(digest, name)
        for name, writer in tiers.writers.items():
            writer.on_written = lambda keys, name=name: self._written(name, keys)

    @property
    def on(self) -> bool:
        return self._events is not None

    def stored(
        self,
        spans: Sequence[ChunkSpan],
        tokens: np.ndarray,
        prompt: Sequence[ChunkSpan],
        lora: tuple[int, str] | None = None,
    ) -> None:
        """A store of `spans` is over: events of those now in CPU RAM, and of those the lower
        tiers wrote already; `prompt`: every chunk of `tokens` (their parents); `lora`: the
        adapter of the request that stored them."""
        if self._events is None:
            return
        parents = {s.end: s.key.digest for s in prompt}
        for span in spans:
            event = ChunkEvent(
                True,
                span.key.digest,
                parents.get(span.start),
                tokens[span.start : span.end].tolist(),
                lora,
            )
            if self._tiers.keep_cpu and self._tiers.cpu.contains(span.key):
                self._events.append(event)
            if self._tiers.lower:
                self._template(event)

    def _template(self, event: ChunkEvent) -> None:
        with self._lock:
            early = self._early.pop(event.digest, [])
            self._templates[event.digest] = event
            self._templates.move_to_end(event.digest)
            if len(self._templates) > MAX_WAITING:
                self._templates.popitem(last=False)
        self._emit([replace(event, medium=name) for name in early])

    def _written(self, tier: str, keys: Sequence[ChunkKey]) -> None:
        """Called on `tier`'s writer thread with the chunks it wrote."""
        events = []
        with self._lock:
            for key in keys:
                template = self._templates.get(key.digest)
                if template is not None:
                    events.append(replace(template, medium=tier))
                    continue
                self._early.setdefault(key.digest, []).append(tier)
                if len(self._early) > MAX_WAITING:
                    self._early.popitem(last=False)
        self._emit(events)

    def _removed(self, digest: bytes, tier: str) -> None:
        self._emit([ChunkEvent(False, digest, medium=tier)])

    def _emit(self, events: list[ChunkEvent]) -> None:
        if self._events is not None and events:
            self._events.extend(events)  # deque's extend and append are atomic

    def take(self) -> list[ChunkEvent]:
        if not self._events:
            return []
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events
