"""Tails: the partial last chunks of stored prompts (`save_unfull_chunk`), found again
inside longer prompts.

A chunk's key hashes its tokens after its predecessor's key, so the partial chunk a
prompt ended with (its last 1 to chunk_size-1 tokens) has a key no longer prompt's whole
chunk at that place shares: a conversation's next turn, which repeats the prompt and
adds an answer and a question, would miss it and recompute up to a chunk's worth of
tokens (vLLM's own offloading reuses every whole block of 16). The engine notes, per
digest before a stored tail (the chunk before it, or the request's root: keys.py), the
tails' lengths; a lookup whose whole chunks end there tries those lengths on its own
tokens (a tail found is hashed and located like any chunk, so a stale note costs one
miss, never a wrong hit).
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class Tails:
    def __init__(self, size: int = 1 << 16) -> None:
        self.size = size
        # key before the tail -> lengths
        self._lengths: OrderedDict[bytes, set[int]] = OrderedDict()
        self._lock = threading.Lock()  # stores on vLLM's thread, lookups on the lookup server's

    def add(self, at: bytes, length: int) -> None:
        """A tail of `length` tokens after the digest `at` (a chunk's, or a prompt's root)."""
        with self._lock:
            self._lengths.setdefault(at, set()).add(length)
            self._lengths.move_to_end(at)
            while len(self._lengths) > self.size:
                self._lengths.popitem(last=False)

    def lengths(self, at: bytes) -> list[int]:
        """The lengths of tails noted after the digest `at`, longest first."""
        with self._lock:
            found = self._lengths.get(at)
            return sorted(found, reverse=True) if found else []

    def clear(self) -> None:
        with self._lock:
            self._lengths.clear()
