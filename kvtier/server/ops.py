"""The store server's request-reply operations: everything but a PUT over the
byte stream (connection.py) and the handshake (HELLO, AUTH). Each handler
takes the frame's header and meta and answers through the connection's reply."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.server import protocol as p
from kvtier.server.bounds import Holdings
from kvtier.server.index import Entry

if TYPE_CHECKING:
    from kvtier.server.state import ServerState

Handler = Callable[[p.Header, memoryview], None]


class Ops:
    def __init__(
        self,
        state: ServerState,
        holdings: Holdings,
        keys: Callable[..., tuple[list[bytes], list[int]]],
        reply: Callable[..., None],
    ) -> None:
        self.state, self.index, self.pool, self.holdings = state, state.index, state.pool, holdings
        self._keys, self._reply = keys, reply

    def handlers(self) -> dict[int, Handler]:
        return {
            p.Op.GET: self._get,
            p.Op.EXISTS: self._exists,
            p.Op.MATCH_PREFIX: self._match_prefix,
            p.Op.DELETE: self._delete,
            p.Op.STATS: self._stats,
            p.Op.PUT_ALLOC: self._put_alloc,
            p.Op.PUT_COMMIT: self._put_commit,
            p.Op.GET_SHM: self._get_shm,
            p.Op.RELEASE: self._release,
        }

    def _lease(self, h: p.Header, keys: list[bytes]) -> list[Entry | None] | None:
        """Pin each key's value, counted as held; None (and the refusal sent)
        when that would pass --max-held-per-conn."""
        entries = self.holdings.lease(keys)
        if isinstance(entries, str):
            self._reply(h, meta=entries.encode(), status=p.Status.OVER_LIMIT)
            return None
        return entries

    def _get(self, h: p.Header, meta: memoryview) -> None:
        keys, _ = self._keys(meta)
        if (entries := self._lease(h, keys)) is None:
            return
        present = [e for e in entries if e is not None]
        views = [v for e in present for v in self.pool.views(e.pages, e.size)]
        nbytes = sum(e.size for e in present)
        self._reply(
            h,
            meta=p.encode_sizes([p.MISSING if e is None else e.size for e in entries]),
            payload=views,
            payload_len=nbytes,
            pins=present,
        )

    def _exists(self, h: p.Header, meta: memoryview) -> None:
        keys, _ = self._keys(meta)
        self._reply(h, meta=bytes(self.index.exists(keys)))

    def _match_prefix(self, h: p.Header, meta: memoryview) -> None:
        keys, _ = self._keys(meta)
        self._reply(h, meta=p.encode_u32(self.index.match_prefix(keys)))

    def _delete(self, h: p.Header, meta: memoryview) -> None:
        keys, _ = self._keys(meta)
        self._reply(h, meta=p.encode_u32(self.index.delete(keys)))

    def _stats(self, h: p.Header, meta: memoryview) -> None:
        self._reply(h, meta=p.encode_json(self.state.stats()))

    def _put_alloc(self, h: p.Header, meta: memoryview) -> None:
        keys, sizes = self._keys(meta, with_sizes=True)
        put = self.holdings.reserve(keys, sizes)
        if isinstance(put, tuple):
            self._reply(h, meta=put[1].encode(), status=put[0])
            return
        ticket = self.holdings.add_ticket(put, put.nbytes)
        self._reply(
            h,
            meta=p.encode_extents(
                ticket, [(s, self.pool.extents(pages, s)) for pages, s in zip(put.pages, sizes)]
            ),
        )

    def _put_commit(self, h: p.Header, meta: memoryview) -> None:
        # No reply: the client goes on at once. Its later requests on this
        # connection are read after this one, so it always sees its own put.
        self.holdings.commit_ticket(p.decode_u32(meta))

    def _get_shm(self, h: p.Header, meta: memoryview) -> None:
        keys, _ = self._keys(meta)
        if (entries := self._lease(h, keys)) is None:
            return
        lease = [e for e in entries if e is not None]
        ticket = self.holdings.add_ticket(lease, sum(e.size for e in lease))
        self._reply(
            h,
            meta=p.encode_extents(
                ticket,
                [
                    (p.MISSING, []) if e is None else (e.size, self.pool.extents(e.pages, e.size))
                    for e in entries
                ],
            ),
        )

    def _release(self, h: p.Header, meta: memoryview) -> None:
        self.holdings.drop_ticket(p.decode_u32(meta))  # no reply: the client does not wait for it
