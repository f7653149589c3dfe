"""P2P sharing's index: which instance holds a chunk in CPU RAM, kept in a store of the fleet.

The index is any remote store kvtier speaks (`p2p_index_url`: a `kvtier server`, Redis, ...):
an entry per chunk, `kvtier-p2p/<wire key>` -> the address of the PeerServer that holds it.
Each instance feeds it from its CPU tier's own events: a chunk stored there is announced, a
chunk evicted or removed is withdrawn (its entry deleted where it still names this
instance). A writer thread sends them in batches, so a store never waits on the index.

The index may be stale: an instance that died, or evicted a chunk since, is still named
until another instance announces the chunk. The asker then gets a miss from that peer (or
no connection) and recomputes: a stale entry costs time, never a wrong chunk (the value's
checks and its key guard that). An asker whose connection a peer refused (nothing listens
there: the instance is gone) deletes the entries it asked for that still name that peer
(`forget`), so that the next asker does not try it again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvtier.errors import RemoteRefused, RemoteUnavailable
from kvtier.fleet.affinity import unpin_this_thread
from kvtier.keys import ChunkKey, wire_key
from kvtier.logs import get_logger
from kvtier.remote import KVStore

log = get_logger(__name__)

PREFIX = b"kvtier-p2p/"
BATCH = 256  # announcements sent in one call to the index


Update = tuple[bool, ChunkKey, bytes]  # stored?, the chunk, the holder's address


def index_key(key: ChunkKey) -> bytes:
    return PREFIX + wire_key(key)


class Holders:
    """The index seen from one instance (its PeerServer at `me`)."""

    def __init__(self, store: KVStore, url: str, me: str) -> None:
        self.store, self.url, self.me = store, url, me
        self._me = me.encode()
        # (stored?, key, the holder it is about): announced, or deleted where it names him
        self._queue: queue.SimpleQueue[Update | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="kvtier-p2p-index", daemon=True)
        self._thread.start()
        self.faults = 0  # index calls that failed (their announcements are lost)

    # -- this instance's chunks (from the CPU tier's events) ---------------------------

    def announce(self, key: ChunkKey) -> None:
        self._queue.put((True, key, self._me))

    def withdraw(self, key: ChunkKey) -> None:
        self._queue.put((False, key, self._me))

    def forget(self, keys: Sequence[ChunkKey], holder: str) -> None:
        """Delete the entries of `keys` that still name `holder` (an instance found gone)."""
        for key in keys:
            self._queue.put((False, key, holder.encode()))

    # -- other instances' chunks --------------------------------------------------------

    def where(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """Per key the address of an instance other than this one that announced it, or None.
        Raises what the store raises (RemoteUnavailable) when the index cannot be asked."""
        values = self.store.get([index_key(k) for k in keys])
        out: list[str | None] = []
        for value in values:
            holder = bytes(value) if value is not None else None
            out.append(holder.decode() if holder and holder != self._me else None)
        return out

    def close(self) -> None:
        """Send what is queued, then close the store."""
        self._queue.put(None)
        self._thread.join()
        self.store.close()

    def _write(self) -> None:
        unpin_this_thread()
        while True:
            item = self._queue.get()
            batch: list[Update] = []
            while item is not None:
                batch.append(item)
                if len(batch) >= BATCH or self._queue.empty():
                    break
                item = self._queue.get()
            if batch:
                self._send(batch)
            if item is None:
                return

    def _send(self, batch: list[Update]) -> None:
        latest = {key: (stored, who) for stored, key, who in batch}  # a key's last word counts
        stored = [index_key(k) for k, (s, _) in latest.items() if s]
        removed = [(index_key(k), who) for k, (s, who) in latest.items() if not s]
        try:
            if stored:
                self.store.put(stored, [self._me] * len(stored))
            if removed:
                named = self.store.get([k for k, _ in removed])
                theirs = [
                    k for (k, who), v in zip(removed, named) if v is not None and bytes(v) == who
                ]
                if theirs:
                    self.store.delete(theirs)
        except (RemoteUnavailable, RemoteRefused, ValueError) as exc:
            # the index is advice: its faults cost hits, never requests
            self.faults += 1
            log.warning("P2P: the index at %s missed %d updates: %s", self.url, len(batch), exc)
