"""`kvtier proxy`: the disaggregated-prefill proxy, with LMCache's proxy flags.

Per request (/v1/completions or /v1/chat/completions, streaming or not):

    1. pick a prefiller and a decoder, round robin; make an id for the request
    2. POST it to the prefiller with max_tokens=1 and kv_transfer_params.disagg_spec
       naming the decoder (host, init and alloc ports): its kvtier sender pushes
       the KV into that decoder's buffer while it prefills
    3. wait (bounded) for the sender's PrefillDone on --proxy-port
    4. POST the original request to the decoder with kv_transfer_params.pd_req_id:
       its kvtier finds the prompt's KV as a hit; stream or return its answer
    5. Release the request's chunks on the decoder (done, failed or cancelled)

With `--pd-engine lmcache` the nodes run LMCache's PD backend instead: step 3 hears its
ProxyNotif over ZMQ (kvtier.pd.notify), step 4 sends the request as it came, and step 5
is left out (LMCache's decoder keeps what it received, within its own buffer).

Every wait is bounded. A prefiller that is down, fails (5xx) or is slower
than --prefill-timeout costs the request its disaggregation, not its answer:
the decoder prefills it itself (counted in kvtier_proxy_prefill_fallbacks).
A node that refuses connections is down until a TCP probe (every --health-interval s)
connects again (kvtier.fleet.upstreams): no request goes to it meanwhile. A decoder that
goes down while its request prefills, or refuses the connection, costs the request
only its disaggregation where another decoder is up (that one prefills it itself), and
a 502 at once where none is; a slow one answers 504 after its timeout, and a missing
PrefillDone only costs the decoder a recompute.
Prefill TTFT statistics are printed every few seconds, as LMCache's proxy
does; /health and Prometheus /metrics are served.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from kvtier.errors import port_taken
from kvtier.fleet.routing import KvRouter
from kvtier.fleet.upstreams import Upstreams
from kvtier.logs import get_logger
from kvtier.pd import protocol as proto
from kvtier.pd.notify import Notifications, notifications
from kvtier.pd.proxy_settings import Decoder, ProxyMetrics, ProxySettings, TtftStats

log = get_logger(__name__)

RELEASE_TIMEOUT = 2.0


class UpstreamError(Exception):
    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status, self.message, self.body = status, message, body


class Unreachable(UpstreamError):
    """No connection to the node: nothing of the request reached it."""


class Proxy:
    def __init__(self, settings: ProxySettings) -> None:
        if not settings.prefillers or not settings.decoders:
            raise ValueError("the proxy needs at least one prefiller and one decoder")
        self.s = settings
        self.stats = TtftStats(settings.stats_interval)
        self.metrics = ProxyMetrics()
        self._rr = itertools.count()
        self._waiters: dict[str, asyncio.Future[proto.PrefillDone]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._notify: Notifications = notifications(
            settings.pd_engine, settings.proxy_host, settings.proxy_port, self._prefill_done
        )
        self._background: set[asyncio.Task] = set()
        # else LMCache's nodes: no pd_req_id, no Release
        self._kvtier = settings.pd_engine == "kvtier"
        interval, connect = settings.health_interval, settings.connect_timeout
        self._prefillers = Upstreams(
            "prefiller", settings.prefillers, interval, connect, self.metrics.node_up
        )
        self._decoders = Upstreams(
            "decoder", [d.url for d in settings.decoders], interval, connect, self.metrics.node_up
        )
        self._watches: list[asyncio.Task] = []
        self._router = (
            KvRouter(
                self._prefillers,
                settings.prefillers,
                dict(zip(settings.prefillers, settings.prefiller_kv_events)),
                settings.route_load_tokens,
            )
            if settings.route == "kv"
            else None
        )

    # -- lifecycle ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._watches = [asyncio.create_task(u.watch()) for u in (self._prefillers, self._decoders)]
        try:
            await _listening(
                self._notify.start(),
                "kvtier proxy: --proxy-port",
                self.s.proxy_host,
                self.s.proxy_port,
            )
            self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
            await self._runner.setup()
            await _listening(
                web.TCPSite(self._runner, self.s.host, self.s.port).start(),
                "kvtier proxy: --port",
                self.s.host,
                self.s.port,
            )
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kvtier proxy on http://%s:%d: prefillers %s, decoders %s (%s's PD); "
            "their notifications on %s:%d",
            self.s.host,
            self.s.port,
            self.s.prefillers,
            [d.url for d in self.s.decoders],
            self.s.pd_engine,
            self.s.proxy_host,
            self.s.proxy_port,
        )

    async def stop(self) -> None:
        for upstreams in (self._prefillers, self._decoders):
            upstreams.stop()
        if self._router is not None:  # its feed's thread joins: not on the event loop
            await asyncio.to_thread(self._router.close)
        for watch in self._watches:
            watch.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self._notify.close()
        for task in list(self._background):
            await asyncio.wait([task], timeout=RELEASE_TIMEOUT)
        if self._session is not None:
            await self._session.close()

    # -- notifications from senders ------------------------------------------------------

    def _prefill_done(self, msg: proto.PrefillDone) -> None:
        waiter = self._waiters.get(msg.req_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)

    # -- HTTP ----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "prefillers": self.s.prefillers,
                "decoders": [d.url for d in self.s.decoders],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        url = self.s.decoders[0].url + "/v1/models"
        try:
            async with self._session.get(
                url, timeout=self._timeout(self.s.connect_timeout + 5)
            ) as resp:
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type="application/json"
                )
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _error(502, f"decoder {url} unreachable: {exc}")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def _handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        n = next(self._rr)
        d = await self._decoders.pick_now(n)
        if d is None:
            self.metrics.upstream_errors.labels("decoder", "down").inc()
            return _error(502, f"no decoder is up: {self._decoders.why_down()}")
        req_id = f"pd-{uuid.uuid4().hex}"
        waiter: asyncio.Future[proto.PrefillDone] = asyncio.get_running_loop().create_future()
        self._waiters[req_id] = waiter
        self.metrics.inflight.inc()
        outcome = "error"
        try:
            decode_body = await self._disaggregate(n, d, endpoint, body, req_id, waiter)
            response = await self._decode_on_one_up(request, n, d, endpoint, body, decode_body)
            outcome = "ok"
            return response
        except UpstreamError as exc:
            log.warning("proxy: request %s: %s", req_id, exc.message)
            if exc.body is not None:
                return web.json_response(exc.body, status=exc.status)
            return _error(exc.status, exc.message)
        except asyncio.CancelledError:
            outcome = "cancelled"
            log.info("proxy: request %s cancelled by its client", req_id)
            raise
        finally:
            self._waiters.pop(req_id, None)
            self.metrics.inflight.dec()
            self.metrics.requests.labels(endpoint, outcome).inc()
            self._release_later(self.s.decoders[d], req_id)

    async def _disaggregate(
        self,
        n: int,
        d: int,
        endpoint: str,
        body: dict[str, Any],
        req_id: str,
        waiter: asyncio.Future[proto.PrefillDone],
    ) -> dict[str, Any]:
        """Prefill on a prefiller, its KV pushed to decoder d; the body to send decoder d.
        Where that fails, the request as it came: the decoder prefills it itself."""
        p = await self._pick_prefiller(n, endpoint, body)
        if p is None:
            self.metrics.upstream_errors.labels("prefiller", "down").inc()
            return self._fallback(
                req_id, f"no prefiller is up: {self._prefillers.why_down()}", body
            )
        t0 = time.perf_counter()
        prefill = asyncio.ensure_future(
            self._prefill_on(p, endpoint, body, req_id, self.s.decoders[d])
        )
        lost = asyncio.ensure_future(self._decoders.lost(d))
        try:
            await asyncio.wait({prefill, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not prefill.done():  # the decoder went down: its KV has nowhere to go
                prefill.cancel()
                await asyncio.wait({prefill})
        if prefill.cancelled():
            return self._fallback(req_id, f"decoder {self.s.decoders[d].url} went down", body)
        try:
            prefill.result()
        except UpstreamError as exc:
            if exc.status < 500:  # the request itself was refused: the decoder would refuse it too
                raise
            return self._fallback(req_id, exc.message, body)
        seconds = time.perf_counter() - t0
        self.stats.add(seconds * 1e3)
        self.metrics.prefill.observe(seconds)
        await self._wait_kv(waiter, req_id)
        return dict(body, kv_transfer_params={"pd_req_id": req_id}) if self._kvtier else body

    async def _pick_prefiller(self, n: int, endpoint: str, body: dict[str, Any]) -> int | None:
        if self._router is None or self._session is None:
            return await self._prefillers.pick_now(n)
        if await self._prefillers.pick_now(n) is None:
            return None
        p = await self._router.pick(n, endpoint, body, self._session)
        held = p is not None and self._router.routed_last == "kv"
        self.metrics.routed.labels("kv" if held else "round-robin").inc()
        return p

    async def _prefill_on(
        self, p: int, endpoint: str, body: dict[str, Any], req_id: str, decoder: Decoder
    ) -> None:
        """The prefill on prefiller p, counted in flight there while it runs (--route kv)."""
        if self._router is not None:
            self._router.started(p)
        try:
            await self._prefill(self.s.prefillers[p], endpoint, body, req_id, decoder)
        finally:
            if self._router is not None:
                self._router.ended(p)

    def _fallback(self, req_id: str, why: str, body: dict[str, Any]) -> dict[str, Any]:
        self.metrics.prefill_fallbacks.inc()
        log.warning("proxy: request %s: %s; the decoder prefills it itself", req_id, why)
        return body

    async def _decode_on_one_up(
        self,
        request: web.Request,
        n: int,
        d: int,
        endpoint: str,
        body: dict[str, Any],
        decode_body: dict[str, Any],
    ) -> web.StreamResponse:
        """Decode on decoder d, or on the next one up where d is down or refuses the
        connection (nothing was sent to it): the request as it came, prefilled there."""
        while True:
            if not self._decoders.is_up(d):
                moved = await self._decoders.pick_now(n + 1)
                if moved is None:
                    raise UpstreamError(502, f"no decoder is up: {self._decoders.why_down()}")
                d, decode_body = moved, body
            try:
                return await self._decode(request, self.s.decoders[d], endpoint, decode_body)
            except Unreachable as exc:
                self._decoders.down(d, exc.message)

    async def _prefill(
        self, url: str, endpoint: str, body: dict[str, Any], req_id: str, decoder: Decoder
    ) -> None:
        assert self._session is not None
        pre = dict(body, max_tokens=1, stream=False)
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre["kv_transfer_params"] = {
            "disagg_spec": {
                "req_id": req_id,
                "receiver_host": decoder.host,
                "receiver_init_port": decoder.init_ports,
                "receiver_alloc_port": decoder.alloc_ports,
            }
        }
        try:
            async with self._session.post(
                url + endpoint, json=pre, timeout=self._timeout(self.s.prefill_timeout)
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    self.metrics.upstream_errors.labels("prefiller", f"http_{resp.status}").inc()
                    raise UpstreamError(
                        resp.status,
                        f"prefiller {url} answered {resp.status}",
                        _json_or_none(payload),
                    )
        except TimeoutError:
            self.metrics.upstream_errors.labels("prefiller", "timeout").inc()
            raise UpstreamError(
                504,
                f"prefiller {url} did not answer within {self.s.prefill_timeout:g} s "
                "(--prefill-timeout)",
            ) from None
        except aiohttp.ClientConnectorError as exc:
            self.metrics.upstream_errors.labels("prefiller", "unreachable").inc()
            self._prefillers.down(self.s.prefillers.index(url), str(exc))
            raise UpstreamError(502, f"prefiller {url} unreachable: {exc}") from None
        except aiohttp.ClientError as exc:
            self.metrics.upstream_errors.labels("prefiller", "broken").inc()
            raise UpstreamError(502, f"prefiller {url} failed: {exc}") from None

    async def _wait_kv(self, waiter: asyncio.Future[proto.PrefillDone], req_id: str) -> None:
        t0 = time.perf_counter()
        try:
            done = await asyncio.wait_for(asyncio.shield(waiter), self.s.kv_ready_timeout)
        except TimeoutError:
            self.metrics.kv_not_ready.inc()
            log.warning(
                "proxy: no PrefillDone for %s within %g s: "
                "the decoder will recompute what is missing",
                req_id,
                self.s.kv_ready_timeout,
            )
            return
        self.metrics.kv_wait.observe(time.perf_counter() - t0)
        if not done.ok:
            self.metrics.kv_not_ready.inc()
            log.warning(
                "proxy: the KV of %s was not sent (%s): the decoder will recompute it",
                req_id,
                done.detail,
            )

    async def _decode(
        self, request: web.Request, decoder: Decoder, endpoint: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        assert self._session is not None
        url = decoder.url + endpoint
        try:
            resp = await self._session.post(
                url,
                json=body,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.s.connect_timeout, sock_read=self.s.decode_timeout
                ),
            )
        except TimeoutError:
            self.metrics.upstream_errors.labels("decoder", "timeout").inc()
            raise UpstreamError(
                504, f"decoder {url} did not answer within {self.s.decode_timeout:g} s"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            self.metrics.upstream_errors.labels("decoder", "unreachable").inc()
            raise Unreachable(502, f"decoder {url} unreachable: {exc}") from None
        except aiohttp.ClientError as exc:
            self.metrics.upstream_errors.labels("decoder", "broken").inc()
            raise UpstreamError(502, f"decoder {url} failed: {exc}") from None
        async with resp:
            if resp.status != 200 or not body.get("stream"):
                try:
                    payload = await resp.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.metrics.upstream_errors.labels("decoder", "broken").inc()
                    raise UpstreamError(502, f"decoder {url} failed mid-answer: {exc}") from None
                if resp.status != 200:
                    self.metrics.upstream_errors.labels("decoder", f"http_{resp.status}").inc()
                return web.Response(
                    body=payload, status=resp.status, content_type="application/json"
                )
            out = web.StreamResponse(
                status=200,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
            await out.prepare(request)
            try:
                async for piece in resp.content.iter_any():
                    await out.write(piece)
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.metrics.upstream_errors.labels("decoder", "broken").inc()
                log.warning("proxy: decoder %s failed mid-stream: %s", url, exc)
                error = {
                    "error": {
                        "code": 502,
                        "type": "proxy_error",
                        "message": f"decoder {url} failed mid-stream: {exc}",
                    }
                }
                await out.write(f"data: {json.dumps(error)}\n\n".encode())
            await out.write_eof()
            return out

    def _release_later(self, decoder: Decoder, req_id: str) -> None:
        if not self._kvtier:  # LMCache's decoder has no Release: it keeps what it received
            return
        task = asyncio.get_running_loop().create_task(self._release(decoder, req_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, decoder: Decoder, req_id: str) -> None:
        """Free the request's chunks on every TP rank of the decoder (idempotent, best effort)."""
        for port in decoder.alloc_ports:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(decoder.host, port), RELEASE_TIMEOUT
                )
                try:
                    writer.write(proto.encode(proto.Release(req_id)))
                    await writer.drain()
                    await asyncio.wait_for(reader.readexactly(proto.FRAME.size), RELEASE_TIMEOUT)
                finally:
                    writer.close()
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                log.debug(
                    "proxy: release of %s on %s:%d failed: %s", req_id, decoder.host, port, exc
                )

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.s.connect_timeout)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"code": status, "type": "proxy_error", "message": message}}
    return web.json_response(body, status=status)


def _json_or_none(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


async def _listening(opening: Awaitable[None], what: str, host: str, port: int) -> None:
    """Await a listener's start: a port another process holds is a PortInUse naming `what`."""
    try:
        await opening
    except Exception as e:  # noqa: BLE001 - a socket's OSError, or ZMQ's ZMQError (LMCache's PD)
        raise port_taken(e, what, host, port) from None


async def serve(settings: ProxySettings) -> None:
    proxy = Proxy(settings)
    await proxy.start()
    try:
        await asyncio.Event().wait()
    finally:
        proxy.stats.report()
        await proxy.stop()
