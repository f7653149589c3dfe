"""Which of the proxy's nodes answer.

A node is down from a failed connection (a request's, or the watch's) until the watch
connects to it again. The watch opens and closes a TCP connection to every node each
`interval` s: no HTTP, so nothing lands in the nodes' access logs. The proxy picks among
the nodes up, round robin, and hears when one it is waiting on goes down: a request is
never prefilled for a decoder that is gone, and moves to another decoder where one is up.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client import Gauge

from kvtier.logs import get_logger

log = get_logger(__name__)


@dataclass
class Node:
    url: str
    host: str
    port: int
    up: bool = True
    reason: str = ""  # why it is down
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set while it is down


class Upstreams:
    """The nodes of one kind ("prefiller", "decoder") and whether each is up."""

    def __init__(
        self, kind: str, urls: list[str], interval: float, connect_timeout: float, gauge: Gauge
    ) -> None:
        self.kind = kind
        self.nodes = [_node(u) for u in urls]
        self.interval = interval
        self.connect_timeout = connect_timeout
        self._gauge = gauge
        self._stopped = asyncio.Event()
        for node in self.nodes:
            gauge.labels(kind, node.url).set(1)

    def pick(self, n: int) -> int | None:
        """The index of the first node up from n (round robin), or None when all are down."""
        count = len(self.nodes)
        for k in range(count):
            if self.nodes[(n + k) % count].up:
                return (n + k) % count
        return None

    async def pick_now(self, n: int) -> int | None:
        """`pick(n)`, where every node is marked down probing them all first: a node can
        answer before the watch's next round, and a request arriving in that interval
        (a script that starts the nodes, waits for their /health, then asks at once)
        would be refused, or lose its disaggregation, for nothing."""
        picked = self.pick(n)
        if picked is not None:
            return picked
        reasons = await asyncio.gather(*(self._probe(node) for node in self.nodes))
        for i, reason in enumerate(reasons):
            self._mark(i, reason)
        return self.pick(n)

    def is_up(self, i: int) -> bool:
        return self.nodes[i].up

    async def lost(self, i: int) -> None:
        """Returns when node i is down."""
        await self.nodes[i].lost.wait()

    def why_down(self) -> str:
        return "; ".join(f"{n.url}: {n.reason}" for n in self.nodes if not n.up)

    def down(self, i: int, reason: str) -> None:
        node = self.nodes[i]
        if node.up:
            log.warning(
                "proxy: %s %s is down (%s): requests go to the others until it answers",
                self.kind,
                node.url,
                reason,
            )
        node.up = False
        node.reason = reason
        node.lost.set()
        self._gauge.labels(self.kind, node.url).set(0)

    def _mark(self, i: int, reason: str) -> None:
        """Node i down for `reason`, or up where `reason` is ''."""
        if reason:
            self.down(i, reason)
        else:
            self._back(i)

    def _back(self, i: int) -> None:
        node = self.nodes[i]
        if not node.up:
            log.info("proxy: %s %s answers again", self.kind, node.url)
        node.up = True
        node.reason = ""
        node.lost.clear()
        self._gauge.labels(self.kind, node.url).set(1)

    async def watch(self) -> None:
        """Probe every node each `interval` s until `stop()`.

        Stopped by a flag, not only by cancelling the task: Python 3.11's `wait_for` drops a
        cancellation that comes as the connection it waits for ends (the probe then returns
        as if not cancelled), and a loop stopped by cancellation alone then ran for ever
        (a proxy whose --port was taken hung at exit in 1 start of 4, 2026-11-29)."""
        while not self._stopped.is_set():
            for i, node in enumerate(self.nodes):
                reason = await self._probe(node)
                if self._stopped.is_set():
                    return
                self._mark(i, reason)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.interval)

    def stop(self) -> None:
        """End `watch()` (at once if it sleeps, else after the probe it runs)."""
        self._stopped.set()

    async def _probe(self, node: Node) -> str:
        """'' when a TCP connection to the node opens, else why not."""
        try:
            opening = asyncio.open_connection(node.host, node.port)
            _, writer = await asyncio.wait_for(opening, self.connect_timeout)
        except TimeoutError:
            return f"no connection within {self.connect_timeout:g} s"
        except OSError as exc:
            return f"connection failed: {exc.strerror or exc}"
        writer.close()
        return ""


def _node(url: str) -> Node:
    parts = urlsplit(url)
    default = 443 if parts.scheme == "https" else 80
    return Node(url, parts.hostname or "localhost", parts.port or default)


def ports_for(value: str, count: int) -> list[int]:
    """A flag's ports for `count` nodes: "p" (node i on p + i) or "p0,p1,..." (one a node)."""
    ports = csv_ints(value)
    if len(ports) == 1:
        return [ports[0] + i for i in range(count)]
    if len(ports) != count:
        raise ValueError(f"{len(ports)} ports given for {count} nodes")
    return ports


def csv_ints(value: str | int) -> list[int]:
    return [int(x) for x in str(value).split(",") if x.strip()]
