"""The lookup: how long a prefix of a request's tokens is stored, where, held for it.

find(tokens, identity, hold_for)
  keys of the tokens (once a request: keys.SpanMemo)
  → locate each key in the tiers, CPU RAM first; a chunk a store still has on its
    way to the host counts as in CPU RAM, not waited for (landing.py; a hybrid
    model's stores of this prefix land first)
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
from kvtier.memory import ChunkBytes
from kvtier.tiers.base import CPU
from kvtier.tiers.holds import Holds
from kvtier.tiers.store import TieredStore

FLYING = "in flight"  # a chunk on its way to the host: a store's copies have not landed yet


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
    ) -> Hit:
        """CacheEngine.find (its contract is there)."""
        spans = self._spans(tokens, hold_for, identity)
        keys = [s.key for s in spans]
        if self.states is not None:
            self._settle(keys)  # a hybrid model's stores of this prefix land first (waited for)
        where = locate(self.tiers, self.landing, keys)
        # a shorter prompt's end, stored (tails.py)?
        if self.states is None and len(where) < len(spans):
            tail = self._tail(tokens, spans, len(where), identity)
            if tail is not None:
                n = len(where)
                spans = spans[:n] + [tail[0]]
                keys = keys[:n] + [tail[0].key]
                where = where + [tail[1]]
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
            self._hold_flying(hold_for, [k for k, w in zip(keys[:n], where[:n]) if w == FLYING])
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

    def _hold_flying(self, request_id: str, keys: list[ChunkKey]) -> None:
        """The blocks of chunks on their way join the request's hold, within its budget: once
        they land they are not evicted before its load."""
        lent = self.landing.borrow(keys)
        borrowed: list[ChunkBytes] = [f.block for f in lent if f is not None]
        landed = [k for k, f in zip(keys, lent) if f is None]  # since: in CPU RAM now, or gone
        if landed:
            borrowed += self.tiers.hold(landed, [CPU] * len(landed), len(landed))[0]
        budget = self.holds.budget()
        for block in borrowed[budget:]:
            block.release()
        if not self.holds.add(request_id, borrowed[:budget]):
            for block in borrowed[:budget]:
                block.release()


def locate(tiers: TieredStore, landing: Landing, keys: Sequence[ChunkKey]) -> list[str]:
    """Where each of the leading `keys` is (`TieredStore.locate`), or FLYING where a store
    still has it on its way to the host; up to the first that is neither."""
    where = tiers.locate(keys)
    while len(where) < len(keys) and landing.holds(keys[len(where)]):
        n = len(where) + 1
        where = where + [FLYING] + tiers.locate(keys[n:])
    return where
