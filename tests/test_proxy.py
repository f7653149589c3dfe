"""`kvtier proxy` when nodes fail: a clear HTTP error within a bound, never a hang,
and a cancelled request's KV freed on the decoder. The proxy runs as the real
command; the decoder's buffer is a real PdReceiver; the failing prefillers are
real sockets that refuse, or accept and never answer."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from test_pd import Pair

from kvtier_tools.dev.localservers import (
    free_port,
    kvtier_command,
    refusing_ports,
    wait_for_port,
)


def proxy(prefiller_port, decoder_port, alloc_port, notify_port, *extra):
    return kvtier_command(
        "proxy",
        "--host",
        "127.0.0.1",
        "--prefiller-host",
        "127.0.0.1",
        "--prefiller-port",
        str(prefiller_port),
        "--num-prefillers",
        "1",
        "--decoder-host",
        "127.0.0.1",
        "--decoder-port",
        str(decoder_port),
        "--decoder-init-port",
        "1",
        "--decoder-alloc-port",
        str(alloc_port),
        "--proxy-host",
        "127.0.0.1",
        "--proxy-port",
        str(notify_port),
        "--num-decoders",
        "1",
        *extra,
    )


class HungPrefiller:
    """Reads one HTTP request; pushes its KV to the decoder the request names (as a
    prefiller's kvtier does), then never answers."""

    def __init__(self, pair: Pair | None = None):
        self.pair, self.req_ids = pair, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:  # the proxy's probe: a connection opened and closed
                    break
                data += piece
            if b"\r\n\r\n" not in data:
                continue
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            while len(body) < length:
                body += conn.recv(65536)
            spec = json.loads(body)["kv_transfer_params"]["disagg_spec"]
            self.req_ids.append(spec["req_id"])
            if self.pair is not None:
                target = self.pair.target(spec["req_id"])
                self.pair.sender.send(target, list(range(64)), torch.arange(64), start=0, last=True)

    def close(self):
        self.sock.close()
        for conn in self._conns:
            conn.close()


def completion(url, timeout=30):
    return httpx.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 4},
        timeout=timeout,
    )


@pytest.fixture
def down():
    """`down()`: a port whose node is down (it refuses connections) until the test ends."""
    with contextlib.ExitStack() as held:
        yield lambda: held.enter_context(refusing_ports(1))[0].getsockname()[1]


class Decoder:
    """An HTTP node that answers every completion with 200 and keeps the bodies it got;
    `before()` runs as a request comes, `after(body)` once it is answered. On `sock` (a
    bound socket, from `refusing_ports`) where given: a node that comes up."""

    def __init__(self, before=lambda: None, after=lambda body: None, sock=None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                before()
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                answer = json.dumps({"choices": [{"text": "ok"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                after(bodies[-1])

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=sock is None)
        if sock is not None:
            self.server.socket.close()
            self.server.socket = sock
            self.server.server_address = sock.getsockname()
            self.server.server_activate()
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_prefiller_that_is_down_costs_the_disaggregation_not_the_request(down):
    decoder = Decoder()
    try:
        with proxy(down(), decoder.port, down(), free_port()) as url:
            t0 = time.monotonic()
            r = completion(url)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
            assert time.monotonic() - t0 < 10
            # The decoder got the client's request as it was: no KV to wait for.
            assert decoder.bodies == [{"model": "m", "prompt": "hi", "max_tokens": 4}]
            metrics = httpx.get(url + "/metrics").text
            # the request's own connection failed, or the proxy's probe had found it down first
            assert re.search(
                r'upstream_errors_total\{kind="(down|unreachable)",node="prefiller"\} 1\.0', metrics
            )
            assert "kvtier_proxy_prefill_fallbacks_total 1.0" in metrics
            assert httpx.get(url + "/health").status_code == 200
    finally:
        decoder.close()


def test_prefiller_and_decoder_down_is_a_502_at_once(down):
    with proxy(down(), down(), down(), free_port()) as url:
        t0 = time.monotonic()
        r = completion(url)
        assert r.status_code == 502 and "decoder" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10


def test_nodes_that_come_up_between_two_probes_get_the_next_request():
    """As a script starts vLLM, waits for its /health and asks at once: the proxy's watch
    last saw the nodes down (its next round is 60 s away), and still the request is
    disaggregated and answered."""
    with (
        refusing_ports(3) as (prefiller, decoder_sock, alloc),
        proxy(
            *(s.getsockname()[1] for s in (prefiller, decoder_sock, alloc)),
            free_port(),
            "--health-interval",
            "60",
        ) as url,
    ):
        metrics = httpx.get(url + "/metrics").text
        assert 'kvtier_proxy_node_up{node="decoder",' in metrics
        assert "} 0.0" in metrics  # the first round found them down
        decoder = Decoder(sock=decoder_sock)
        try:
            r = completion(url)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
            assert len(decoder.bodies) == 1
        finally:
            decoder.close()


def test_a_decoder_that_is_down_gets_no_request_while_another_is_up(down):
    live = Decoder()
    dead = down()
    try:
        with proxy(
            down(), f"{dead},{live.port}", down(), free_port(), "--num-decoders", "2"
        ) as url:
            for _ in range(4):  # round robin would send two of them to the dead one
                assert completion(url).status_code == 200
            assert len(live.bodies) == 4
            metrics = httpx.get(url + "/metrics").text
            assert (
                f'kvtier_proxy_node_up{{node="decoder",url="http://127.0.0.1:{dead}"}} 0.0'
                in metrics
            )
            assert (
                f'kvtier_proxy_node_up{{node="decoder",url="http://127.0.0.1:{live.port}"}} 1.0'
                in metrics
            )
    finally:
        live.close()


@pytest.mark.parametrize("decoders", [1, 2])
def test_a_decoder_lost_while_its_request_prefills_is_left_at_once(decoders, down):
    """The prefill never ends; the decoder it pushes to goes away meanwhile: the prefill is
    dropped within the probe's interval, and the request goes to the other decoder as it
    came (that one prefills it itself), or, with none up, ends in a 502 at once."""
    hung = HungPrefiller()
    nodes = [Decoder() for _ in range(decoders)]
    ports = ",".join(str(d.port) for d in nodes)
    try:
        with proxy(hung.port, ports, down(), free_port(), "--num-decoders", str(decoders)) as url:
            answer: list[httpx.Response] = []
            client = threading.Thread(target=lambda: answer.append(completion(url)))
            client.start()
            deadline = time.monotonic() + 10
            while not hung.req_ids and time.monotonic() < deadline:
                time.sleep(0.02)
            assert hung.req_ids
            t0 = time.monotonic()
            nodes[0].close()
            client.join(30)
            # the probe runs every 0.5 s; the prefill would take 300 s
            assert time.monotonic() - t0 < 3
            if decoders == 1:
                assert (
                    answer[0].status_code == 502
                    and "no decoder is up" in answer[0].json()["error"]["message"]
                )
            else:
                assert answer[0].status_code == 200
                assert nodes[1].bodies == [{"model": "m", "prompt": "hi", "max_tokens": 4}]
            assert "kvtier_proxy_prefill_fallbacks_total 1.0" in httpx.get(url + "/metrics").text
    finally:
        hung.close()
        for node in nodes[1:]:
            node.close()


def test_a_prefiller_that_never_answers_is_left_after_the_timeout(down):
    hung, decoder = HungPrefiller(), Decoder()
    try:
        with proxy(hung.port, decoder.port, down(), free_port(), "--prefill-timeout", "1") as url:
            t0 = time.monotonic()
            r = completion(url)
            assert r.status_code == 200 and decoder.bodies[0].get("kv_transfer_params") is None
            assert 1 <= time.monotonic() - t0 < 10
            assert (
                'kvtier_proxy_upstream_errors_total{kind="timeout",node="prefiller"} 1.0'
                in httpx.get(url + "/metrics").text
            )
    finally:
        hung.close()
        decoder.close()


@pytest.mark.parametrize("how", ["client gives up", "prefill times out"])
def test_a_request_that_ends_early_frees_its_reservation_on_the_decoder(how):
    pair = Pair()
    hung, decoder = HungPrefiller(pair), Decoder()
    extra = ["--prefill-timeout", "1.5"] if how == "prefill times out" else []
    try:
        with proxy(hung.port, decoder.port, pair.alloc_port, free_port(), *extra) as url:
            with pytest.raises(httpx.TimeoutException) if not extra else contextlib.nullcontext():
                completion(url, timeout=1.5 if not extra else 30)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (not hung.req_ids or pair.buffer.held_requests()):
                time.sleep(0.05)
            assert hung.req_ids and pair.buffer.held_requests() == 0  # the proxy released it
            assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
    finally:
        hung.close()
        decoder.close()
        pair.close()


def test_garbage_on_the_notification_port_does_not_stop_the_proxy(down):
    notify = free_port()
    with proxy(down(), down(), down(), notify) as url:
        for junk in (b"\x00" * 64, b"KP" + b"\xff" * 30, b"GET / HTTP/1.1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", notify)) as s:
                s.sendall(junk)
        assert httpx.get(url + "/health").status_code == 200
        assert completion(url).status_code == 502  # still answering requests


class LmcachePrefiller(Decoder):
    """A prefiller as LMCache 0.5.x's PD backend behaves towards its proxy: it answers the
    prefill request, and tells the proxy that the request's KV is in the decoder's buffer
    when its (NIXL) writes complete, here `delay` s after the answer: a ProxyNotif (msgspec
    struct tagged "type"), msgpack over a ZMQ PUSH socket connected to pd_proxy_port. A
    `junk` message goes before it. LMCache itself needs a GPU: the GPU script runs it
    (kvtier_tools.bench.pd_vllm --engine lmcache)."""

    def __init__(self, notify_port: int, delay: float, junk: list[bytes] = ()):
        import msgspec
        import zmq

        class ProxyNotif(msgspec.Struct, tag=True):
            req_id: str

        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{notify_port}")
        self.notified_at = []

        def notify(req_id):
            time.sleep(delay)
            for msg in junk:
                self.push.send(msg)
            self.notified_at.append(time.monotonic())
            self.push.send(msgspec.msgpack.encode(ProxyNotif(req_id=req_id)))

        def answered(body):  # after the HTTP answer, as LMCache's writes finish after the step
            threading.Thread(
                target=notify,
                args=(body["kv_transfer_params"]["disagg_spec"]["req_id"],),
                daemon=True,
            ).start()

        super().__init__(after=answered)

    def close(self):
        super().close()
        self.push.close(linger=0)
        self.ctx.term()


class TimedDecoder(Decoder):
    def __init__(self):
        self.got_at = []
        super().__init__(before=lambda: self.got_at.append(time.monotonic()))


@pytest.mark.parametrize(
    "junk", [[], [b"\x00\xff not msgpack", b"\x82\xa4type\xa9AllocResp\xa6req_id\xa1x"]]
)
def test_with_lmcache_nodes_the_decoder_is_asked_after_lmcaches_proxynotif_and_as_the_client_asked(
    junk,
):
    notify = free_port()
    # the decoder's alloc port: the proxy must not Release there
    alloc = socket.create_server(("127.0.0.1", 0))
    alloc.settimeout(0.01)
    prefiller, decoder = LmcachePrefiller(notify, delay=0.6, junk=junk), TimedDecoder()
    try:
        with proxy(
            prefiller.port, decoder.port, alloc.getsockname()[1], notify, "--pd-engine", "lmcache"
        ) as url:
            for _ in range(2):
                r = completion(url)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
            spec = prefiller.bodies[0]["kv_transfer_params"]["disagg_spec"]
            assert prefiller.bodies[0]["max_tokens"] == 1
            assert set(spec) >= {
                "req_id",
                "receiver_host",
                "receiver_init_port",
                "receiver_alloc_port",
            }
            assert isinstance(spec["receiver_alloc_port"], list)  # LMCache indexes it by TP rank
            # the decoder was asked once the KV was there, with the client's request as it came
            assert len(decoder.got_at) == len(prefiller.notified_at) == 2
            assert all(d >= n for d, n in zip(decoder.got_at, prefiller.notified_at))
            assert decoder.bodies == [{"model": "m", "prompt": "hi", "max_tokens": 4}] * 2
            metrics = httpx.get(url + "/metrics").text
            assert "kvtier_proxy_kv_not_ready_total 0.0" in metrics
            with pytest.raises(TimeoutError):
                alloc.accept()
    finally:
        prefiller.close()
        decoder.close()
        alloc.close()


def test_with_lmcache_nodes_a_missing_proxynotif_costs_the_kv_ready_timeout_not_the_request(
    down,
):
    notify = free_port()
    prefiller, decoder = Decoder(), Decoder()  # a prefiller that answers and never notifies
    try:
        with proxy(
            prefiller.port,
            decoder.port,
            down(),
            notify,
            "--pd-engine",
            "lmcache",
            "--kv-ready-timeout",
            "0.5",
        ) as url:
            t0 = time.monotonic()
            assert completion(url).status_code == 200
            assert 0.5 <= time.monotonic() - t0 < 10
            assert "kvtier_proxy_kv_not_ready_total 1.0" in httpx.get(url + "/metrics").text
    finally:
        prefiller.close()
        decoder.close()


def test_lmcache_senders_at_a_kvtier_mode_proxy_are_named_once_with_the_flag_to_use():
    """LMCache's PD sender connects to pd_proxy_port over ZMQ and waits for a greeting; a
    proxy in kvtier mode would leave it there unheard (every request waiting out
    --kv-ready-timeout): it says what is connected and which flag takes it."""
    import zmq

    notify = free_port()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-port",
        str(free_port()),
        "--decoder-port",
        str(free_port()),
        "--proxy-host",
        "127.0.0.1",
        "--proxy-port",
        str(notify),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        wait_for_port(port, 60, proc)
        push.connect(f"tcp://127.0.0.1:{notify}")
        time.sleep(1.5)  # ZMQ reconnects every 0.1 s
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        push.close(linger=0)
        ctx.term()
        proc.terminate()
        out = proc.communicate(timeout=10)[0].decode()
    assert out.count("--pd-engine lmcache") == 1, out


def test_the_node_probes_stop_even_when_a_probe_swallows_its_cancellation():
    """Python 3.11's wait_for drops a cancellation that comes as the connection it waits for
    ends, and the probe then returns as if not cancelled; a probe loop stopped by cancellation
    alone ran on, and a proxy whose --port was taken hung at exit (1 start in 4 here,
    2026-11-29). The probe below always swallows it."""
    import asyncio

    from prometheus_client import CollectorRegistry, Gauge

    from kvtier.fleet.upstreams import Upstreams

    async def main() -> None:
        gauge = Gauge("up", "up", ["node", "url"], registry=CollectorRegistry())
        nodes = Upstreams("decoder", ["http://127.0.0.1:2"], 0.01, 0.1, gauge)

        async def swallowing_probe(node) -> str:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass
            return "connection failed"

        nodes._probe = swallowing_probe
        watch = asyncio.create_task(nodes.watch())
        await asyncio.sleep(0.05)
        nodes.stop()
        watch.cancel()
        await asyncio.wait_for(asyncio.gather(watch, return_exceptions=True), 2)

    asyncio.run(main())
