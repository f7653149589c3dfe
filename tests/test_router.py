"""`kvtier router` run as the real command in front of HTTP instances on loopback sockets
(each answers with its own name), with KV events from real ZMQ publishers in vLLM's format:
in turn, streaming through, a dead instance skipped, and `--route kv` to the holder."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
import zmq

from kvtier_tools.dev.localservers import free_ports, kvtier_command, refusing_ports


class Instance:
    """An OpenAI-style server that answers every completion with its name (streamed when
    asked) and keeps the prompts it got."""

    def __init__(self, name: str):
        prompts = self.prompts = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompts.append(body.get("prompt"))
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for piece in (name[:1], name[1:]):
                        data = f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                answer = json.dumps({"choices": [{"text": name}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def router(urls, *extra):
    return kvtier_command("router", "--instances", ",".join(urls), *extra)


def complete(url, prompt, stream=False):
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.fixture
def pool():
    instances = [Instance(name) for name in ("alpha", "beta")]
    yield instances
    for instance in instances:
        instance.close()


def test_requests_go_in_turn_and_stream_through(pool):
    with router([i.url for i in pool]) as url:
        answers = [complete(url, "hi") for _ in range(4)]
        assert sorted(answers) == ["alpha", "alpha", "beta", "beta"]
        assert complete(url, "hi", stream=True) in ("alpha", "beta")
        assert httpx.get(url + "/health").json()["up"] == [i.url for i in pool]
        metrics = httpx.get(url + "/metrics").text
        assert 'kvtier_router_requests_total{outcome="ok"} 5.0' in metrics


def test_a_dead_instance_gets_no_request_and_none_up_is_a_502(pool):
    with refusing_ports(1) as (sock,):
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with router([dead, pool[0].url]) as url:
            assert [complete(url, "hi") for _ in range(4)] == ["alpha"] * 4
        with router([dead]) as url:
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert r.status_code == 502 and "no instance is up" in r.json()["error"]["message"]


def test_route_kv_sends_a_prompt_to_the_instance_holding_its_prefix(pool):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    ports = free_ports(2)
    ctx = zmq.Context()
    pubs = []
    for port in ports:
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(pub)
    prompt = list(range(100, 164))  # four blocks of 16
    held = KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[1000 + b],
                parent_block_hash=None if b == 0 else 1000 + b - 1,
                token_ids=prompt[16 * b : 16 * b + 16],
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
            for b in range(4)
        ],
    )
    encoder = msgspec.msgpack.Encoder()
    try:
        with router(
            [i.url for i in pool], "--route", "kv", "--kv-events-port", f"{ports[0]},{ports[1]}"
        ) as url:
            deadline = time.monotonic() + 20
            routed = []
            while time.monotonic() < deadline and routed[-2:] != ["beta", "beta"]:
                # beta (instance 1) holds the prompt; a SUB misses what came before it joined
                pubs[1].send_multipart((b"", b"\0" * 8, encoder.encode(held)))
                time.sleep(0.1)
                routed.append(complete(url, prompt))
            assert routed[-2:] == ["beta", "beta"]
            # a prompt nobody holds goes in turn; the held one still to beta
            others = {complete(url, list(range(500, 564))) for _ in range(4)}
            assert others == {"alpha", "beta"}
            assert complete(url, prompt + [7, 8]) == "beta"
            metrics = httpx.get(url + "/metrics").text
            assert f'kvtier_router_routed_total{{how="kv",instance="{pool[1].url}"}}' in metrics
    finally:
        for pub in pubs:
            pub.close(0)
        ctx.term()
