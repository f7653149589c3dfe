"""What one connection of the store server holds, against its bounds.

A connection counts the bytes it holds (a put's reservation while its values
arrive, same-host puts until PUT_COMMIT and leases until RELEASE, both as
tickets, and values pinned by replies still in the transport) against
`--max-held-per-conn`. `check` runs on the connection's timer: it drops
leases older than `--lease-timeout`, and says when the connection is to be
closed (a put past `--put-deadline`, replies not drained by the lease
timeout, `--idle-timeout` of silence).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.server import protocol as p
from kvtier.server.index import Entry, PoolFull, TooLarge

if TYPE_CHECKING:
    from kvtier.server.state import ServerState


@dataclass
class PendingPut:
    keys: list[bytes]
    sizes: list[int]
    pages: list[list[int]]
    since: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass
class Ticket:
    """A same-host put's reservation (until PUT_COMMIT) or a GET_SHM lease (until RELEASE)."""

    held: PendingPut | list[Entry]
    nbytes: int
    since: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Expiry:
    """Why `check` wants the connection closed: the bound and the message to log."""

    bound: str  # put-deadline, lease-timeout, idle-timeout
    message: str


Refusal = tuple[p.Status, str]


class Holdings:
    def __init__(self, state: ServerState) -> None:
        self.state, self.index = state, state.index
        self.peer_host = "?"
        self.bytes = 0  # leased, reserved or pinned (--max-held-per-conn)
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count(1)
        self._pins: list[Entry] = []  # pinned by replies still in the transport
        self._pins_since = 0.0

    def over(self, nbytes: int) -> str | None:
        """Why holding `nbytes` more would pass --max-held-per-conn, or None."""
        if self.bytes + nbytes <= self.state.max_held:
            return None
        message = (
            f"a request for {nbytes} bytes while holding {self.bytes} passes --max-held-per-conn "
            f"({self.state.max_held} bytes): release leases first or use smaller batches"
        )
        self.index.count(over_limit=1)
        self.state.note(self.peer_host, "max-held", message)
        return message

    # -- puts ---------------------------------------------------------------------------

    def reserve(self, keys: list[bytes], sizes: list[int]) -> PendingPut | Refusal:
        # (a value larger than the whole pool is refused as that, below)
        if (
            max(sizes, default=0) <= self.state.pool.capacity
            and (over := self.over(sum(sizes))) is not None
        ):
            return p.Status.OVER_LIMIT, over
        try:
            put = PendingPut(keys, sizes, self.index.reserve(sizes))
        except TooLarge as e:
            return p.Status.TOO_LARGE, str(e)
        except PoolFull as e:
            return p.Status.POOL_FULL, str(e)
        self.bytes += put.nbytes
        return put

    def commit(self, put: PendingPut) -> None:
        self.bytes -= put.nbytes
        self.index.commit(put.keys, put.pages, put.sizes)

    def abort(self, put: PendingPut) -> None:
        """A put cut off mid-value is never seen (its bytes go with the connection)."""
        self.index.abort(put.pages)

    # -- leases ---------------------------------------------------------------------------

    def lease(self, keys: list[bytes]) -> list[Entry | None] | str:
        """Pin each key's value, counted as held; or why not (it would pass --max-held-per-conn)."""
        entries = self.index.lease(keys)
        present = [e for e in entries if e is not None]
        if (over := self.over(sum(e.size for e in present))) is not None:
            self.index.release(present)
            return over
        self.bytes += sum(e.size for e in present)
        return entries

    # -- tickets (same-host puts and leases) ----------------------------------------------

    def add_ticket(self, held: PendingPut | list[Entry], nbytes: int) -> int:
        ticket = next(self._ids)
        self._tickets[ticket] = Ticket(held, nbytes)
        return ticket

    def commit_ticket(self, ticket_id: int) -> None:
        ticket = self._tickets.pop(ticket_id, None)
        if ticket is None or not isinstance(ticket.held, PendingPut):
            raise p.ProtocolError("PUT_COMMIT of a ticket that is not a pending put")
        self.commit(ticket.held)

    def drop_ticket(self, ticket_id: int) -> None:
        ticket = self._tickets.pop(ticket_id, None)
        if ticket is None:  # already expired (or never was): nothing to give back
            return
        self.bytes -= ticket.nbytes
        if isinstance(ticket.held, PendingPut):
            self.index.abort(ticket.held.pages)
        else:
            self.index.release(ticket.held)

    # -- values pinned by replies in the transport ----------------------------------------

    def pin(self, entries: list[Entry]) -> None:
        if entries and not self._pins:
            self._pins_since = time.monotonic()
        self._pins.extend(entries)

    def unpin(self) -> None:
        pins, self._pins = self._pins, []
        if pins:
            self.bytes -= sum(e.size for e in pins)
            self.index.release(pins)

    def release_all(self) -> None:
        for ticket in list(self._tickets):
            self.drop_ticket(ticket)
        self.unpin()

    # -- the timer ------------------------------------------------------------------------

    def check(self, put: PendingPut | None, last_rx: float) -> Expiry | None:
        """Expire what outlived its bound; what closes the connection, if anything."""
        opts, now = self.state.opts, time.monotonic()
        if put is not None and now - put.since > opts.put_deadline:
            return Expiry(
                "put-deadline",
                f"a put's values did not arrive within --put-deadline "
                f"{opts.put_deadline:g} s: reservation freed, connection closed",
            )
        for ticket_id, ticket in list(self._tickets.items()):
            if isinstance(ticket.held, PendingPut) and now - ticket.since > opts.put_deadline:
                return Expiry(
                    "put-deadline",
                    f"a shared-memory put was not committed within --put-deadline "
                    f"{opts.put_deadline:g} s: reservation freed, connection closed",
                )
            if not isinstance(ticket.held, PendingPut) and now - ticket.since > opts.lease_timeout:
                self.drop_ticket(ticket_id)
                self.index.count(lease_timeouts=1)
                self.state.note(
                    self.peer_host,
                    "lease-timeout",
                    f"a lease held past --lease-timeout {opts.lease_timeout:g} s was dropped",
                )
        if self._pins and now - self._pins_since > opts.lease_timeout:
            return Expiry(
                "lease-timeout",
                f"replies not read within --lease-timeout {opts.lease_timeout:g} s: "
                "connection closed, their values unpinned",
            )
        if now - last_rx > opts.idle_timeout and put is None and not self._pins:
            return Expiry("idle-timeout", "")
        return None
