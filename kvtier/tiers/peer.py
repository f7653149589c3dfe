"""P2P sharing as a place chunks are read from: other instances' CPU RAM (`enable_p2p`).

Asked after this instance's own tiers. `exists` asks the index (kvtier/fleet/holders.py)
which instance holds each chunk; `get_into` fetches them from those instances' PeerServers
(kvtier/fleet/peers.py), one request per instance: as bytes it checks as the remote tier does,
copied out of the pool of an instance on this host, or read over NIXL from that of an instance
on another host (`transfer_channel: nixl`). Nothing is written anywhere but the
index: the bytes stay in the instance that computed them. A peer that is gone, evicted the
chunk, or ends its reply midway gives misses (the engine recomputes them); a peer that failed
is skipped for a second, then asked again, and one that refused the connection (gone) loses
the index's entries that named it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.codec import Codec
from kvtier.errors import RemoteUnavailable
from kvtier.fleet.holders import Holders
from kvtier.fleet.peer_client import PeerClient
from kvtier.fleet.peer_reads import NixlReader
from kvtier.fleet.peers import PeerDenied, PeerServer
from kvtier.keys import ChunkKey, wire_key
from kvtier.logs import get_logger

log = get_logger(__name__)

PEER_BACKOFF_S = 1.0


@dataclass
class PeerStats:
    hits: int = 0  # chunks loaded from a peer
    misses: int = 0  # chunks the index named and the peer did not give (or gave damaged)
    faults: int = 0  # peer requests that failed on the transport
    index_faults: int = 0  # lookups the index did not answer


class PeerSource:
    """Chunks of other instances, found through `holders`, decoded by `codec` (or lent in
    place by a peer on this host, with `shared_memory`; read over NIXL by `reader` from a
    peer on another host). Owns this instance's `server` and closes it."""

    name = "p2p"

    def __init__(
        self,
        holders: Holders,
        server: PeerServer,
        codec: Codec,
        timeout: float,
        token: str | None,
        shared_memory: bool,
        reader: NixlReader | None = None,
    ) -> None:
        self.holders, self.server, self.codec, self.reader = holders, server, codec, reader
        self._timeout, self._token, self._shared_memory = timeout, token, shared_memory
        self._clients: dict[str, PeerClient] = {}
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self.stats = PeerStats()

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [holder is not None for holder in self._where(keys)]

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        out: list[int | None] = [None] * len(keys)
        by_peer: dict[str, list[int]] = defaultdict(list)
        for i, holder in enumerate(self._where(keys)):
            if holder is not None:
                by_peer[holder].append(i)
        for holder, indices in by_peer.items():
            asked = [keys[i] for i in indices]
            got = self._fetch(holder, asked, [outs[i] for i in indices])
            for i, num_tokens in zip(indices, got):
                out[i] = num_tokens
            self.stats.hits += sum(n is not None for n in got)
            self.stats.misses += sum(n is None for n in got)
        return out

    def close(self) -> None:
        self.server.close()
        self.holders.close()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _where(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        try:
            holders = self.holders.where(keys)
        except RemoteUnavailable as exc:
            self.stats.index_faults += 1
            log.warning("P2P: the index at %s did not answer: %s", self.holders.url, exc)
            return [None] * len(keys)
        now = time.monotonic()
        return [h if h is not None and self._down_until.get(h, 0) <= now else None for h in holders]

    def _fetch(self, holder: str, keys: list[ChunkKey], outs: list[memoryview]) -> list[int | None]:
        with self._lock:
            client = self._clients.get(holder)
            if client is None:
                client = self._clients[holder] = PeerClient(
                    holder,
                    self._timeout,
                    self._token,
                    self.codec,
                    self._shared_memory,
                    self.reader,
                )
        try:
            return client.get_into([wire_key(k) for k in keys], outs)
        except (RemoteUnavailable, PeerDenied) as exc:
            self.stats.faults += 1
            self._down_until[holder] = time.monotonic() + PEER_BACKOFF_S
            log.warning("P2P: %d chunks from %s are misses: %s", len(keys), holder, exc)
            if isinstance(exc.__cause__, ConnectionRefusedError):  # nothing listens: gone
                self.holders.forget(keys, holder)
            return [None] * len(keys)
