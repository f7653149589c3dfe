"""The index's feed: a subscriber to each instance's KV event publisher (vLLM's
`--kv-events-config`, publisher "zmq"), on a thread of its own.

vLLM's ZMQ publisher sends (topic, sequence number, msgpack payload) on a PUB socket; the
payload is a KVEventBatch: [timestamp, events, data-parallel rank], each event a map whose
"type" names its class. Decoded generically (no vLLM import): fields vLLM adds later are
ignored. A batch missed (the subscriber joined late, a slow consumer) is not replayed: the
index is a hint, and the next events of those blocks correct it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import msgspec
import zmq

from kvtier.fleet.index import PrefixIndex
from kvtier.logs import get_logger

log = get_logger(__name__)

POLL_MS = 100  # how long a poll waits before the thread looks at its stop flag


class EventFeed:
    """Subscribes to `endpoints` (instance name -> ZMQ endpoint, e.g. tcp://10.0.0.5:5557)
    and applies what they publish to `index`."""

    def __init__(self, endpoints: Mapping[str, str], index: PrefixIndex) -> None:
        self.index = index
        self.batches = 0  # applied so far
        self.errors = 0  # payloads that did not decode as a batch
        self._ctx = zmq.Context()
        self._sockets: dict[zmq.Socket, str] = {}
        for instance, endpoint in endpoints.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(endpoint)
            self._sockets[sub] = instance
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-event-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._sockets:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(POLL_MS):
                self._take(sub, self._sockets[sub])

    def _take(self, sub: zmq.Socket, instance: str) -> None:
        parts = sub.recv_multipart()
        try:
            batch = msgspec.msgpack.decode(parts[-1])
            events = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError) as e:
            self.errors += 1
            log.warning("KV events from %s: a payload that is no event batch (%s)", instance, e)
            return
        self.index.apply(instance, [e for e in events if isinstance(e, dict)])
        self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sub in self._sockets:
            sub.close()
        self._ctx.term()
