"""`kvtier controller serve`: the fleet's cache seen and managed in one place (HTTP/JSON).

Instances with `enable_controller` register each rank's API (kvtier/fleet/worker.py) here, and
again every heartbeat; a rank not heard from for --worker-timeout s is left out until it
registers again. Each call fans out to the ranks of the instances it names, and a rank's
answer counts for its instance only where every rank agrees (a chunk is held where every
rank holds its share). LMCache's controller request shapes are accepted where it has the
verb; its locations (LocalCPUBackend, LocalDiskBackend, RemoteBackend) name kvtier's tiers.

    GET  /health                fleet: instances, their ranks, alive or not
    GET  /totals                chunks per tier summed over the fleet, and per instance
    POST /health                {"instance_id"} -> {"error_codes": {rank: 0 | -1}}  (LMCache)
    POST /lookup                {"tokens"} -> {"layout_info": {id: [location, tokens]},
                                               "instances": {id: {tier: tokens}}}
    POST /clear                 {"instance_id", "location"?, "tokens"?} -> {"num_chunks"}
    POST /pin, /unpin           {"instance_id", "tokens"} -> {"num_tokens"}
    POST /move                  {"old_position": [id, location], "new_position": [id, location],
                                 "tokens", "should_copy"?} -> {"num_tokens"}
    POST /query_worker_info     {"instance_id": id | "all"} -> {"worker_infos": [...]}
    POST /v1/workers            a rank registering: {"instance_id", "rank", "url"}

A call with "tokens" may also give "identity": the hex root of the prompt's chunk keys where it
had a LoRA adapter or a cache_salt (keys.Identity; `kvtier controller --lora-name/--cache-salt`
makes it), without which the default identity's chunks are meant.

With --auth-token (or $KVTIER_SERVER_TOKEN; required on a non-loopback --host) every route
wants `Authorization: Bearer <token>`, and the controller calls the ranks with it: one token
for the fleet, the instances' `remote_auth_token`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.errors import KvtierError
from kvtier.keys import Identity
from kvtier.logs import get_logger
from kvtier.tiers.base import Tier

log = get_logger(__name__)

# LMCache's location names -> kvtier's tier names (kvtier's own names are accepted too)
LOCATIONS = {
    "LocalCPUBackend": Tier.CPU.value,
    "LocalDiskBackend": Tier.DISK.value,
    "RemoteBackend": Tier.REMOTE.value,
}
BACKENDS = {tier: location for location, tier in LOCATIONS.items()}
CALL_TIMEOUT_S = 30.0


class CallError(KvtierError):
    """A request the controller refuses, or a rank's failure (its HTTP status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Rank:
    url: str
    seen: float  # time.monotonic() of its last registration
    registered: float = field(default_factory=time.time)


class Controller:
    def __init__(self, token: str | None, worker_timeout: float) -> None:
        self.token = token
        self.worker_timeout = worker_timeout
        self.instances: dict[str, dict[int, Rank]] = {}
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self._fleet_health)
        app.router.add_post("/health", self._health)
        app.router.add_get("/totals", self._totals)
        app.router.add_post("/lookup", self._lookup)
        app.router.add_post("/clear", self._clear)
        app.router.add_post("/pin", self._pin)
        app.router.add_post("/unpin", self._unpin)
        app.router.add_post("/move", self._move)
        app.router.add_post("/query_worker_info", self._worker_info)
        app.router.add_post("/v1/workers", self._register)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return web.json_response({"detail": "a missing or wrong token"}, status=401)
        try:
            return await handler(request)
        except CallError as exc:
            return web.json_response({"detail": str(exc)}, status=exc.status)

    # -- the fleet ------------------------------------------------------------------------

    async def _register(self, request: web.Request) -> web.Response:
        body = await _body(request)
        instance, rank, url = body.get("instance_id"), body.get("rank"), body.get("url")
        if not isinstance(instance, str) or not isinstance(rank, int) or not isinstance(url, str):
            raise CallError(400, "a registration names instance_id (str), rank (int), url (str)")
        ranks = self.instances.setdefault(instance, {})
        known = ranks.get(rank)
        if known is None or known.url != url:
            log.info("controller: instance %s rank %d answers on %s", instance, rank, url)
            ranks[rank] = Rank(url, time.monotonic())
        else:
            known.seen = time.monotonic()
        return web.json_response({"ok": True})

    def _alive(self, rank: Rank) -> bool:
        return time.monotonic() - rank.seen <= self.worker_timeout

    def _ranks(self, instance: str) -> dict[int, Rank]:
        ranks = self.instances.get(instance)
        if ranks is None:
            known = sorted(self.instances)
            raise CallError(404, f"no instance {instance!r} registered; known: {known}")
        alive = {r: rank for r, rank in ranks.items() if self._alive(rank)}
        if not alive:
            raise CallError(
                503,
                f"instance {instance!r}: no rank registered in the last {self.worker_timeout:g} s",
            )
        return alive

    def _live_instances(self) -> list[str]:
        return [i for i, ranks in self.instances.items() if any(map(self._alive, ranks.values()))]

    async def _call_ranks(
        self, instance: str, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[int, dict[str, Any]]:
        ranks = self._ranks(instance)
        answers = await asyncio.gather(
            *(self._call(rank.url, method, path, body) for rank in ranks.values())
        )
        return dict(zip(ranks, answers))

    async def _call(
        self, url: str, method: str, path: str, body: dict[str, Any] | None
    ) -> dict[str, Any]:
        assert self._session is not None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with self._session.request(method, url + path, json=body, headers=headers) as r:
                answer = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: not JSON
            raise CallError(502, f"{url}{path}: {exc or type(exc).__name__}") from exc
        if not isinstance(answer, dict):
            raise CallError(502, f"{url}{path}: an answer that is not a JSON object")
        if r.status != 200:
            raise CallError(r.status, f"{url}{path}: {answer.get('error', answer)}")
        return answer

    # -- the verbs ------------------------------------------------------------------------

    async def _fleet_health(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        instances = {
            instance: {
                str(r): {"url": rank.url, "alive": self._alive(rank), "seen_s_ago": now - rank.seen}
                for r, rank in sorted(ranks.items())
            }
            for instance, ranks in self.instances.items()
        }
        return web.json_response({"status": "ok", "instances": instances})

    async def _health(self, request: web.Request) -> web.Response:
        instance = _field(await _body(request), "instance_id", str)
        ranks = self.instances.get(instance)
        if ranks is None:
            raise CallError(404, f"no instance {instance!r} registered")
        codes = {}
        for r, rank in ranks.items():
            try:
                await self._call(rank.url, "GET", "/state", None)
                codes[str(r)] = 0
            except CallError:
                codes[str(r)] = -1
        return web.json_response({"event_id": _event("Health"), "error_codes": codes})

    async def _totals(self, request: web.Request) -> web.Response:
        per: dict[str, dict[str, int]] = {}
        total: dict[str, int] = {}
        for instance in self._live_instances():
            states = await self._call_ranks(instance, "GET", "/state")
            tiers: dict[str, int] = {}
            for state in states.values():
                for tier, info in state["tiers"].items():
                    tiers[tier] = tiers.get(tier, 0) + info["chunks"]
                    total[tier] = total.get(tier, 0) + info["chunks"]
            tiers["pinned"] = sum(s["pinned_chunks"] for s in states.values())
            per[instance] = tiers
        return web.json_response({"chunks": total, "instances": per})

    async def _lookup(self, request: web.Request) -> web.Response:
        prompt = _prompt(await _body(request))
        instances: dict[str, dict[str, int]] = {}
        layout: dict[str, list[Any]] = {}
        for instance in self._live_instances():
            answers = await self._call_ranks(instance, "POST", "/lookup", prompt)
            held = _every_rank([a["tiers"] for a in answers.values()])
            instances[instance] = held
            tier, most = max(held.items(), key=lambda kv: kv[1], default=("", 0))
            if most > 0:
                layout[instance] = [BACKENDS.get(tier, tier), most]
        return web.json_response(
            {"event_id": _event("Lookup"), "layout_info": layout, "instances": instances}
        )

    async def _clear(self, request: web.Request) -> web.Response:
        body = await _body(request)
        instance = _field(body, "instance_id", str)
        call: dict[str, Any] = {}
        if body.get("location") is not None:
            call["tier"] = _tier(body["location"])
        if "tokens" in body:
            call |= _prompt(body)
        answers = await self._call_ranks(instance, "POST", "/clear", call)
        cleared = sum(a["cleared"] for a in answers.values())
        return web.json_response({"event_id": _event("Clear"), "num_chunks": cleared})

    async def _pin(self, request: web.Request) -> web.Response:
        return await self._pinning(request, "/pin", "pinned")

    async def _unpin(self, request: web.Request) -> web.Response:
        return await self._pinning(request, "/unpin", "unpinned")

    async def _pinning(self, request: web.Request, path: str, counted: str) -> web.Response:
        body = await _body(request)
        instance, prompt = _field(body, "instance_id", str), _prompt(body)
        location = body.get("location")
        if location is not None and _tier(location) != Tier.CPU.value:
            raise CallError(400, f"location {location!r}: chunks are pinned in CPU RAM only")
        answers = await self._call_ranks(instance, "POST", path, prompt)
        return web.json_response(
            {
                "event_id": _event(path.strip("/").title()),
                "num_chunks": min(a[counted] for a in answers.values()),
                "num_tokens": min(a["tokens"] for a in answers.values()),
            }
        )

    async def _move(self, request: web.Request) -> web.Response:
        body = await _body(request)
        src, src_loc = _position(body, "old_position")
        dst, dst_loc = _position(body, "new_position")
        prompt, copy = _prompt(body), bool(body.get("should_copy", body.get("copy", False)))
        if src == dst and src_loc == dst_loc:
            raise CallError(400, "old_position and new_position are the same")
        if src != dst:
            await self._fetch(src, dst, prompt)
        if dst_loc != Tier.CPU.value:
            await self._call_ranks(dst, "POST", "/move", {**prompt, "tier": dst_loc})
        held = _every_rank(
            [a["tiers"] for a in (await self._call_ranks(dst, "POST", "/lookup", prompt)).values()]
        )
        moved = held.get(dst_loc, 0)
        if not copy and moved:
            await self._call_ranks(src, "POST", "/clear", {**prompt, "tier": src_loc})
        return web.json_response({"event_id": _event("Move"), "num_tokens": moved})

    async def _fetch(self, src: str, dst: str, prompt: dict[str, Any]) -> None:
        """dst's ranks pull the chunks from src's ranks of the same rank, over P2P."""
        states = await self._call_ranks(src, "GET", "/state")
        dst_ranks = self._ranks(dst)
        calls = []
        for r, rank in dst_ranks.items():
            peer = states.get(r, {}).get("p2p")
            if peer is None:
                raise CallError(
                    400,
                    f"instance {src!r} rank {r}: P2P is off (enable_p2p), "
                    "a move between instances reads from its P2P server",
                )
            calls.append(self._call(rank.url, "POST", "/fetch", {**prompt, "peer": peer}))
        await asyncio.gather(*calls)

    async def _worker_info(self, request: web.Request) -> web.Response:
        wanted = _field(await _body(request), "instance_id", str)
        infos = [
            {
                "instance_id": instance,
                "worker_id": r,
                "url": rank.url,
                "registration_time": rank.registered,
                "alive": self._alive(rank),
            }
            for instance, ranks in self.instances.items()
            if wanted in ("all", instance)
            for r, rank in sorted(ranks.items())
        ]
        return web.json_response({"event_id": _event("QueryWorkerInfo"), "worker_infos": infos})


def _event(kind: str) -> str:
    return f"{kind}{uuid.uuid4().hex}"


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise CallError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise CallError(400, "the body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind):
        raise CallError(400, f"{name}: a {kind.__name__} is required")
    return value


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    """A call's prompt as the ranks take it: its token ids, and its identity where it has one
    (the hex root of its chunk keys: an adapter or a cache_salt, keys.Identity)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise CallError(400, "tokens: a list of token ids")
    identity = body.get("identity")
    if identity is None:
        return {"tokens": tokens}
    try:
        Identity.from_root_hex(identity)
    except ValueError as exc:
        raise CallError(400, f"identity: the hex root of the prompt's chunk keys, {exc}") from exc
    return {"tokens": tokens, "identity": identity}


def _tier(location: Any) -> str:
    if not isinstance(location, str):
        raise CallError(400, f"location {location!r}: a tier name")
    return LOCATIONS.get(location, location)


def _position(body: dict[str, Any], name: str) -> tuple[str, str]:
    value = body.get(name)
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise CallError(400, f"{name}: [instance_id, location]")
    return value[0], _tier(value[1])


def _every_rank(answers: list[dict[str, int]]) -> dict[str, int]:
    """Per tier, the tokens every rank holds (the least of the ranks')."""
    tiers = set.intersection(*(set(a) for a in answers)) if answers else set()
    return {tier: min(a[tier] for a in answers) for tier in sorted(tiers)}
