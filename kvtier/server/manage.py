"""The store server's management HTTP API, on --manage-port, in the server's main loop.

    GET  /health      {"status": "ok", ...}
    GET  /metrics     Prometheus text: keys, bytes, hits/misses, evictions,
                      bytes in/out, connections
    POST /purge       drop every value; {"purged": n}
    GET  /kvmap_len   {"len": n}  (InfiniStore's name)

With --auth-token (or $KVTIER_SERVER_TOKEN; a token is required when the
server binds a non-loopback address), every route wants
`Authorization: Bearer <token>`. Tenants' tokens (--tenants) do not open it:
purge and the server-wide counters are the operator's.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.errors import port_taken

if TYPE_CHECKING:
    from kvtier.server.state import ServerState

_GAUGES = {
    "keys": "values stored",
    "value_bytes": "bytes of stored values",
    "used_bytes": "pool bytes in use (pages)",
    "capacity_bytes": "pool size",
    "connections": "open client connections",
}
_COUNTERS = {
    "hits": "GET keys found",
    "misses": "GET keys not found",
    "evictions": "values evicted",
    "puts": "values stored",
    "rejected_puts": "values refused (too large or pool full)",
    "bytes_in": "value bytes received",
    "bytes_out": "value bytes sent",
    "accepted_connections": "client connections accepted",
    "protocol_errors": "connections closed for protocol errors",
    "auth_failures": "connections refused for a missing or wrong token",
    "refused_connections": "connections refused past --max-connections",
    "idle_closed": "connections closed past --idle-timeout",
    "lease_timeouts": "leases dropped past --lease-timeout",
    "put_deadlines": "puts aborted past --put-deadline",
    "over_limit": "requests refused past --max-held-per-conn",
}


class _StatsCollector:
    """Reads the server's counters at scrape time: one source of truth."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self):
        stats = self.state.stats()
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"kvtier_server_{name}", doc, value=stats[name])
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"kvtier_server_{name}", doc, value=stats[name])


def make_app(state: ServerState, token: str | None) -> web.Application:
    registry = CollectorRegistry()
    registry.register(_StatsCollector(state))

    @web.middleware
    async def auth(request: web.Request, handler):
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "keys": len(state.index), "transport": "tcp", "rdma": state.rdma_note}
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), content_type="text/plain", charset="utf-8"
        )

    async def purge(request: web.Request) -> web.Response:
        return web.json_response({"purged": state.index.purge()})

    async def kvmap_len(request: web.Request) -> web.Response:
        return web.json_response({"len": len(state.index)})

    app = web.Application(middlewares=[auth])
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/metrics", metrics),
            web.post("/purge", purge),
            web.get("/kvmap_len", kvmap_len),
        ]
    )
    return app


async def start_management(
    state: ServerState, host: str, port: int, token: str | None
) -> web.AppRunner:
    runner = web.AppRunner(make_app(state, token), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except OSError as e:
        await runner.cleanup()
        raise port_taken(e, "kvtier server: --manage-port", host, port) from None
    return runner
