"""The controller's hands in one instance: each rank's engine answers `kvtier controller`.

With `enable_controller`, each tensor-parallel rank serves a small JSON API on
`controller_worker_host`:`controller_worker_port` + rank and registers it with the
controller at `controller_url` (again every `controller_heartbeat_s`, so a restarted
controller learns the fleet back). Each call names a prompt by its token ids and, where it had
a LoRA adapter or a cache_salt, its "identity" (the hex root of its chunk keys,
keys.Identity.root); the rank hashes them as its lookups do.

    GET  /state    this rank's tiers: chunks and bytes in each, pinned chunks
    POST /lookup   {"tokens"} -> {"tiers": {tier: leading tokens held}}
    POST /clear    {"tier"?, "tokens"?} -> {"cleared": chunks}  (CPU RAM and local tiers)
    POST /pin      {"tokens"} -> {"pinned", "refused"}   held in CPU RAM, never evicted
    POST /unpin    {"tokens"} -> {"unpinned"}
    POST /move     {"tokens", "tier"} -> {"queued"}      CPU RAM's chunks to a lower tier
    POST /fetch    {"tokens", "peer"} -> {"fetched"}     from a peer's CPU RAM into this one
                                                         (P2P: the peer's PeerServer address)

Pins are bounded: at most half of CPU RAM's blocks, so the tier keeps room to store. With a
token (`remote_auth_token`) every call wants `Authorization: Bearer <token>`; without one the
API binds only a loopback host.
"""

from __future__ import annotations

import hmac
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvtier.codec import Codec
from kvtier.config import KvtierConfig
from kvtier.errors import KvtierError, RemoteUnavailable
from kvtier.fleet.affinity import unpin_this_thread
from kvtier.fleet.peer_client import PeerClient
from kvtier.fleet.peers import PeerDenied, token_or_loopback
from kvtier.keys import PLAIN, ChunkKey, ChunkSpan, Identity, KVFormat, wire_key
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.tiers.base import CPU
from kvtier.tiers.peer import PeerSource
from kvtier.tiers.store import TieredStore

log = get_logger(__name__)


class BadCall(KvtierError):
    """A call the worker cannot do as asked (HTTP 400, with this message)."""


class Engine(Protocol):
    """What the worker uses of a rank's CacheEngine (kvtier/engine/facade.py)."""

    config: KvtierConfig
    fmt: KVFormat
    tiers: TieredStore
    peers: PeerSource | None

    def spans(
        self, tokens: Sequence[int], request_id: str = "", identity: Identity = PLAIN
    ) -> list[ChunkSpan]: ...


class ControlWorker:
    """The API of one rank's `engine`; registered as `instance_id` rank `rank`."""

    def __init__(
        self,
        engine: Engine,
        instance_id: str,
        host: str,
        port: int,
        token: str | None,
    ) -> None:
        token_or_loopback(
            token, host, "controller_worker_host", "anyone could call the controller's API"
        )
        self.engine, self.instance_id, self.rank = engine, instance_id, engine.fmt.tp_rank
        self._token = token
        self._pins: dict[ChunkKey, MemoryBlock] = {}
        self._lock = threading.Lock()
        self._routes: dict[tuple[str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {
            ("GET", "/state"): lambda _: self.state(),
            ("POST", "/lookup"): self.lookup,
            ("POST", "/clear"): self.clear,
            ("POST", "/pin"): self.pin,
            ("POST", "/unpin"): self.unpin,
            ("POST", "/move"): self.move,
            ("POST", "/fetch"): self.fetch,
        }
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="kvtier-ctl", daemon=True)]
        self._threads[0].start()

    def register_with(self, controller_url: str, every_s: float) -> None:
        """Tell the controller where this rank answers, now and every `every_s` s."""
        beat = threading.Thread(
            target=self._heartbeat, args=(controller_url, every_s), name="kvtier-ctl-beat"
        )
        beat.daemon = True
        beat.start()
        self._threads.append(beat)

    def _accept(self) -> None:
        unpin_this_thread()
        self._server.serve_forever()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join()
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for block in pins:
            block.release()

    # -- the calls ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        tiers = self.engine.tiers
        cpu = tiers.cpu
        out: dict[str, Any] = {
            CPU: {
                "chunks": len(cpu),
                "capacity_chunks": cpu.pool.num_blocks,
                "chunk_bytes": cpu.pool.block_bytes,
            }
        }
        for tier in tiers.local:
            out[tier.name] = {"chunks": len(tier)}
        with self._lock:
            pinned = len(self._pins)
        return {
            "instance_id": self.instance_id,
            "rank": self.rank,
            "tiers": out,
            "pinned_chunks": pinned,
            "p2p": self.engine.peers.server.address if self.engine.peers else None,
        }

    def lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        spans = self._spans(body)
        keys = [s.key for s in spans]
        tiers = self.engine.tiers
        held: dict[str, int] = {CPU: _tokens(spans, tiers.cpu.prefix_hits(keys))}
        for tier in tiers.lower:
            found = tier.exists(keys)
            n = found.index(False) if False in found else len(found)
            held[tier.name] = _tokens(spans, n)
        return {"tiers": held, "tokens": len(body["tokens"])}

    def clear(self, body: dict[str, Any]) -> dict[str, Any]:
        tier = body.get("tier")
        if (
            tier is not None
            and tier != CPU
            and tier not in [t.name for t in self.engine.tiers.local]
        ):
            raise BadCall(
                f"tier {tier!r}: this instance clears CPU RAM ({CPU!r}) and its local tiers "
                f"{[t.name for t in self.engine.tiers.local]}; a shared store is cleared at the "
                "store"
            )
        if "tokens" not in body:
            before = self._count(tier)
            if tier is None:
                self.engine.tiers.clear()
            else:
                self.engine.tiers.delete(self._all_keys(tier), tier)
            return {"cleared": before - self._count(tier)}
        keys = [s.key for s in self._spans(body)]
        with self._lock:
            for key in keys:
                block = self._pins.pop(key, None)
                if block is not None:
                    block.release()
        return {"cleared": self.engine.tiers.delete(keys, tier)}

    def pin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Hold the chunks in CPU RAM; "tokens": the leading tokens now pinned."""
        cpu = self.engine.tiers.cpu
        quota = cpu.pool.num_blocks // 2
        spans = self._spans(body)
        held = []
        for span in spans:
            with self._lock:
                if span.key not in self._pins and len(self._pins) < quota:
                    chunk = cpu.get(span.key)
                    if chunk is not None:
                        assert isinstance(chunk.block, MemoryBlock)  # CPU RAM keeps pool blocks
                        self._pins[span.key] = chunk.block
                held.append(span.key in self._pins)
        pinned = sum(held)
        leading = held.index(False) if False in held else len(held)
        return {"pinned": pinned, "refused": len(held) - pinned, "tokens": _tokens(spans, leading)}

    def unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        spans = self._spans(body)
        freed = []
        for span in spans:
            with self._lock:
                block = self._pins.pop(span.key, None)
            if block is not None:
                block.release()
            freed.append(block is not None)
        leading = freed.index(False) if False in freed else len(freed)
        return {"unpinned": sum(freed), "tokens": _tokens(spans, leading)}

    def move(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("tier")
        names = [t.name for t in self.engine.tiers.lower]
        if name not in names:
            raise BadCall(f"tier {name!r}: this instance's tiers below CPU RAM are {names}")
        keys = [s.key for s in self._spans(body)]
        queued = self.engine.tiers.copy_to(name, keys)
        self.engine.tiers.flush(timeout=self.engine.config.blocking_timeout_secs)
        return {"queued": queued}

    def fetch(self, body: dict[str, Any]) -> dict[str, Any]:
        peer = body.get("peer")
        if not isinstance(peer, str) or ":" not in peer:
            raise BadCall("peer: the address (host:port) of the source instance's P2P server")
        tiers = self.engine.tiers
        spans = [s for s in self._spans(body) if not tiers.cpu.contains(s.key)]
        blocks: list[MemoryBlock] = []
        while len(blocks) < len(spans) and (block := tiers.allocate(wait=False)) is not None:
            blocks.append(block)
        spans = spans[: len(blocks)]  # as many as CPU RAM has room for now
        if not spans:
            return {"fetched": 0}
        try:
            got = self._from_peer(peer, spans, blocks)
        except (RemoteUnavailable, PeerDenied) as exc:
            for block in blocks:
                block.release()
            raise BadCall(f"peer {peer}: {exc}") from exc
        for span, block, num_tokens in zip(spans, blocks, got):
            if num_tokens is None:
                block.release()
            else:  # CPU RAM keeps it (and the lower tiers' queues)
                tiers.put(span.key, block, num_tokens)
        return {"fetched": sum(n is not None for n in got)}

    # -- helpers --------------------------------------------------------------------------

    def _from_peer(
        self, peer: str, spans: list[ChunkSpan], blocks: list[MemoryBlock]
    ) -> list[int | None]:
        """Each span's chunk from `peer`'s P2P server, written into its block."""
        config = self.engine.config
        client = PeerClient(
            peer,
            config.blocking_timeout_secs,
            self._token,
            Codec("naive"),
            config.p2p_shared_memory,
        )
        per_token = self.engine.tiers.bytes_per_token
        outs = [b.data[: s.num_tokens * per_token].numpy().data for s, b in zip(spans, blocks)]
        try:
            return client.get_into([wire_key(s.key) for s in spans], outs)
        finally:
            client.close()

    def _spans(self, body: dict[str, Any]) -> list[ChunkSpan]:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BadCall("tokens: a list of token ids")
        return self.engine.spans(tokens, identity=_identity(body.get("identity")))

    def _count(self, tier: str | None) -> int:
        tiers = self.engine.tiers
        counts = {CPU: len(tiers.cpu), **{t.name: len(t) for t in tiers.local}}
        return sum(n for name, n in counts.items() if tier in (None, name))

    def _all_keys(self, tier: str) -> list[ChunkKey]:
        if tier == CPU:
            return self.engine.tiers.cpu.keys()
        raise BadCall(f"tier {tier!r}: clear it whole with no tier named, or by tokens")

    def _heartbeat(self, controller_url: str, every_s: float) -> None:
        unpin_this_thread()
        said = False
        body = json.dumps({"instance_id": self.instance_id, "rank": self.rank, "url": self.url})
        while not self._stop.is_set():
            request = urllib.request.Request(
                controller_url.rstrip("/") + "/v1/workers",
                data=body.encode(),
                headers={"Content-Type": "application/json", **self._auth()},
            )
            try:
                urllib.request.urlopen(request, timeout=every_s).close()
                said = False
            except (urllib.error.URLError, OSError) as exc:
                if not said:
                    log.warning("controller %s: not reached (%s); trying on", controller_url, exc)
                    said = True
            self._stop.wait(every_s)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._call("GET")

            def do_POST(self) -> None:
                self._call("POST")

            def _call(self, method: str) -> None:
                unpin_this_thread()
                route = worker._routes.get((method, self.path))
                if not worker._authorized(self.headers.get("Authorization", "")):
                    self._answer(401, {"error": "a missing or wrong token"})
                elif route is None:
                    self._answer(404, {"error": f"no {method} {self.path}"})
                else:
                    try:
                        length = int(self.headers.get("Content-Length") or 0)
                        body = json.loads(self.rfile.read(length) or b"{}")
                        if not isinstance(body, dict):
                            raise BadCall("the body must be a JSON object")
                        self._answer(200, route(body))
                    except (BadCall, json.JSONDecodeError) as exc:
                        self._answer(400, {"error": str(exc)})

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def _authorized(self, header: str) -> bool:
        if self._token is None:
            return True
        return hmac.compare_digest(header.encode(), f"Bearer {self._token}".encode())


def _identity(root: Any) -> Identity:
    """A call's identity: the hex root of its prompt's chunk keys, or the default."""
    if root is None:
        return PLAIN
    try:
        return Identity.from_root_hex(root)
    except ValueError as exc:
        raise BadCall(f"identity: the hex root of the chunk keys, {exc}") from exc


def _tokens(spans: list[ChunkSpan], chunks: int) -> int:
    """Tokens covered by the first `chunks` chunks of `spans`."""
    return spans[chunks - 1].end if chunks else 0
