"""`kvtier router`: one address in front of a pool of vLLM instances (no disaggregation).

Each completion or chat completion goes to one instance: in turn (the default), or with
`--route kv` to the instance that holds the longest prefix of its prompt, from the instances'
KV events (kvtier/fleet/routing.py, as `kvtier proxy --route kv` picks a prefiller), weighed
against the requests the router has in flight there. An instance that refuses connections is
down until a TCP probe connects again (kvtier/fleet/upstreams.py); a request whose instance
refuses it moves to the next one up (nothing was sent). The answer streams back as it comes.
/health, /v1/models and Prometheus /metrics are served.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvtier.fleet.routing import ROUTES, KvRouter
from kvtier.fleet.upstreams import Upstreams, ports_for
from kvtier.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    host: str
    port: int
    instances: list[str]  # base URLs
    route: str = "round-robin"
    kv_events: list[str] = field(default_factory=list)  # ZMQ endpoints, per instance
    route_load_tokens: int = 2048
    health_interval: float = 0.5
    connect_timeout: float = 5.0
    timeout: float = 600.0  # s an instance may take to answer (and between streamed pieces)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvtier_router_requests",
            "requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.routed = Counter(
            "kvtier_router_routed",
            "requests sent to an instance holding a prefix of them (kv) or in turn (round-robin)",
            ["how", "instance"],
            registry=self.registry,
        )
        self.node_up = Gauge(
            "kvtier_router_node_up",
            "1 while the instance accepts connections",
            ["node", "url"],
            registry=self.registry,
        )


class Router:
    def __init__(self, s: RouterSettings) -> None:
        self.s = s
        self.metrics = RouterMetrics()
        self.nodes = Upstreams(
            "instance", s.instances, s.health_interval, s.connect_timeout, self.metrics.node_up
        )
        self._kv = (
            KvRouter(
                self.nodes, s.instances, dict(zip(s.instances, s.kv_events)), s.route_load_tokens
            )
            if s.route == "kv"
            else None
        )
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._forward)
        app.router.add_post("/v1/chat/completions", self._forward)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._watch = asyncio.create_task(self.nodes.watch())
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.s.host, self.s.port).start()
        log.info(
            "kvtier router on http://%s:%d: instances %s, route %s",
            self.s.host,
            self.s.port,
            self.s.instances,
            self.s.route,
        )

    async def stop(self) -> None:
        self.nodes.stop()
        if self._kv is not None:  # its feed's thread joins: not on the event loop
            await asyncio.to_thread(self._kv.close)
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # -- requests ----------------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        n = next(self._turn)
        i = await self._pick(n, request.path, body)
        outcome = "error"
        try:
            while i is not None:
                if self._kv is not None:
                    self._kv.started(i)
                try:
                    response = await self._send(request, self.s.instances[i], body)
                    outcome = "ok"
                    return response
                except aiohttp.ClientConnectorError as exc:  # nothing was sent: the next one
                    self.nodes.down(i, f"connection failed: {exc}")
                finally:
                    if self._kv is not None:
                        self._kv.ended(i)
                i = await self.nodes.pick_now(n + 1)
            return _error(502, f"no instance is up: {self.nodes.why_down()}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _error(502, f"the instance failed: {exc or type(exc).__name__}")
        finally:
            self.metrics.requests.labels(outcome).inc()

    async def _pick(self, n: int, endpoint: str, body: dict[str, Any]) -> int | None:
        first = await self.nodes.pick_now(n)
        if first is None or self._kv is None or self._session is None:
            how = "round-robin"
            i = first
        else:
            i = await self._kv.pick(n, endpoint, body, self._session)
            how = self._kv.routed_last
        if i is not None:
            self.metrics.routed.labels(how, self.s.instances[i]).inc()
        return i

    async def _send(
        self, request: web.Request, url: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.s.connect_timeout, sock_read=self.s.timeout
        )
        async with self._session.post(url + request.path, json=body, timeout=timeout) as resp:
            if not body.get("stream") or resp.status != 200:
                payload = await resp.read()
                return web.Response(
                    body=payload, status=resp.status, content_type="application/json"
                )
            out = web.StreamResponse(
                status=200,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
            await out.prepare(request)
            async for piece in resp.content.iter_any():
                await out.write(piece)
            await out.write_eof()
            return out

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        i = await self.nodes.pick_now(0)
        if i is None:
            return _error(502, f"no instance is up: {self.nodes.why_down()}")
        async with self._session.get(self.s.instances[i] + "/v1/models") as resp:
            return web.Response(
                body=await resp.read(), status=resp.status, content_type="application/json"
            )

    async def _health(self, request: web.Request) -> web.Response:
        up = [url for i, url in enumerate(self.s.instances) if self.nodes.is_up(i)]
        return web.json_response({"status": "ok", "instances": self.s.instances, "up": up})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


# -- the command --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=9200, help="port to listen on")
    p.add_argument(
        "--instances",
        required=True,
        help="the vLLM instances' URLs, comma separated (http://host:port)",
    )
    p.add_argument(
        "--route",
        choices=ROUTES,
        default="round-robin",
        help="in turn, or to the instance holding the longest prefix of the prompt (from the "
        "instances' KV events), weighed against its load",
    )
    p.add_argument(
        "--kv-events-port",
        default=None,
        help="with --route kv: each instance's KV event publisher port (vLLM's "
        "--kv-events-config endpoint, publisher zmq; on the instance's host): a base port "
        "(instance i on port + i) or one an instance",
    )
    p.add_argument(
        "--route-load-tokens",
        type=int,
        default=2048,
        help="with --route kv: how many held prompt tokens one request in flight is worth",
    )
    p.add_argument("--health-interval", type=float, default=0.5, help="s between node probes")
    p.add_argument("--timeout", type=float, default=600.0, help="s an instance may take")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    from urllib.parse import urlsplit

    instances = [u.strip().rstrip("/") for u in args.instances.split(",") if u.strip()]
    if not instances:
        raise ValueError("--instances: at least one URL")
    events: list[str] = []
    if args.kv_events_port is not None:
        ports = ports_for(args.kv_events_port, len(instances))
        events = [f"tcp://{urlsplit(u).hostname}:{p}" for u, p in zip(instances, ports)]
    elif args.route == "kv":
        raise ValueError(
            "--route kv needs --kv-events-port: where each instance's vLLM publishes its KV "
            "events (--kv-events-config's endpoint)"
        )
    return RouterSettings(
        host=args.host,
        port=args.port,
        instances=instances,
        route=args.route,
        kv_events=events,
        route_load_tokens=args.route_load_tokens,
        health_interval=args.health_interval,
        timeout=args.timeout,
    )


async def serve(settings: RouterSettings) -> None:
    router = Router(settings)
    await router.start()
    try:
        await asyncio.Event().wait()
    finally:
        await router.stop()
