"""The lookup: how long a prefix of a request's tokens is stored, where, held for it.

find(tokens, identity, hold_for)
  keys of the tokens (once a request: keys.SpanMemo)
  → stores of this prefix still landing settle first (landing.py)
  → locate each key in the tiers, CPU RAM first; a chunk a store still has on its
    way to the host counts within what the engine has already (`known`)
  → where the whole chunks stop, a stored tail: a shorter prompt's partial last
    chunk that these tokens continue (tails.py)
  → cut to what is in CPU RAM (`cpu_only`), or to where a hybrid model's state
    snapshot is (states.py)
  → held for the request until its load (tiers/holds.py)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.engine.landing import Landing
from kvtier.engine.states import StatePath
from kvtier.engine.tails import Tails
from kvtier.keys import ChunkKey, ChunkSpan, Identity, KVFormat, tail_span
from kvtier.tiers.base import CPU
from kvtier.tiers.holds import Holds
from kvtier.tiers.store import TieredStore

FLYING = (
    "in flight"  # a chunk on its way to the host, before the caller's `known` (never held or read)
)


@dataclass(frozen=True)
class Hit:
    """A lookup's answer, in tokens from the prompt's start (chunk boundaries)."""

    tokens: int  # stored in some tier
    in_cpu: int  # of those, the leading ones whose chunks are all in CPU RAM


class FindPath:
    def __init__(
        self,
        tiers: TieredStore,
        holds: Holds,
        tails: Tails,
        landing: Landing,
        fmt: KVFormat,
        chunk_size: int,
        spans: Callable[[np.ndarray, str, Identity], list[ChunkSpan]],
        settle: Callable[[Sequence[ChunkKey]], None],
        states: StatePath | None,
    ) -> None:
        self.tiers, self.holds, self.tails, self.landing = tiers, holds, tails, landing
        self.fmt, self.chunk_size, self.states = fmt, chunk_size, states
        self._spans, self._settle = spans, settle

    def find(
        self,
        tokens: np.ndarray,
        identity: Identity,
        hold_for: str,
        limit: int | None,
        cpu_only: bool,
        known: int,
    ) -> Hit:
        """CacheEngine.find (its contract is there)."""
        spans = self._spans(tokens, hold_for, identity)
        keys = [s.key for s in spans]
        ahead = (
            0
            if self.states is not None
            else next((i for i, s in enumerate(spans) if s.end > known), len(spans))
        )
        self._settle(keys[ahead:])  # stores of this prefix land first (waited for)
        where = self._locate(keys, ahead)
        if self.states is None and len(where) < len(
            spans
        ):  # a shorter prompt's end, stored (tails.py)?
            tail = self._tail(tokens, spans, len(where), identity)
            if tail is not None:
                n = len(where)
                spans, keys, where = (
                    spans[:n] + [tail[0]],
                    keys[:n] + [tail[0].key],
                    where + [tail[1]],
                )
        in_cpu = next((i for i, w in enumerate(where) if w not in (CPU, FLYING)), len(where))
        if cpu_only:
            where = where[:in_cpu]
        n = len(where)
        state_keys: list[ChunkKey] = []
        state_where: list[str] = []
        if self.states is not None:
            end = len(tokens) if limit is None else limit
            n, state_keys, state_where = self.state_point(spans, where, end, cpu_only)
            # a snapshot below CPU RAM: the hit loads in the background
            in_cpu = 0 if any(w != CPU for w in state_where) else min(in_cpu, n)
        if hold_for:
            self.holds.take(hold_for, keys[:n] + state_keys, where[:n] + state_where)
        return Hit(spans[n - 1].end if n else 0, spans[in_cpu - 1].end if in_cpu else 0)

    def state_point(
        self, spans: list[ChunkSpan], where: list[str], limit: int, cpu_only: bool
    ) -> tuple[int, list[ChunkKey], list[str]]:
        """The chunks of the longest stored prefix of at most `limit` tokens whose end has a
        snapshot (every piece in some tier, or in CPU RAM), with its pieces' keys and tiers."""
        assert self.states is not None
        for i in range(len(where) - 1, -1, -1):
            if spans[i].end > limit or spans[i].num_tokens != self.chunk_size:
                continue
            keys = self.states.keys(spans[i].key)
            found = self.tiers.locate(keys)
            if len(found) == len(keys) and not (cpu_only and any(w != CPU for w in found)):
                return i + 1, keys, found
        return 0, [], []

    def _tail(
        self, tokens: np.ndarray, spans: list[ChunkSpan], n: int, identity: Identity
    ) -> tuple[ChunkSpan, str] | None:
        """The longest stored tail (a prompt's partial last chunk) after the first `n` spans,
        shorter than span n, that these tokens continue with; with its tier."""
        before = spans[n - 1] if n else None
        for length in self.tails.lengths(
            before.key.digest if before is not None else identity.root
        ):
            if length < spans[n].num_tokens:
                span = tail_span(tokens, before, length, self.fmt, identity)
                found = self.tiers.locate([span.key])
                if found:
                    return span, found[0]
        return None

    def _locate(self, keys: list[ChunkKey], ahead: int) -> list[str]:
        """`TieredStore.locate`, where the first `ahead` keys may also be on their way (FLYING)."""
        where = self.tiers.locate(keys)
        while len(where) < ahead and self.landing.holds(keys[len(where)]):
            n = len(where) + 1
            where = where + [FLYING] + self.tiers.locate(keys[n:])
        return where
