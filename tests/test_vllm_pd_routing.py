"""KV-aware routing in `kvtier proxy` (`--route kv`, kvtier/fleet/routing.py) with real vLLM
(CPU build): two prefillers, each publishing its KV events on vLLM's ZMQ publisher, and one
decoder. A prompt that extends one a prefiller has already prefilled goes to that prefiller,
where round robin would have sent it to the other; a prompt no one holds goes in turn."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from kvtier_tools.dev.localservers import free_ports
from kvtier_tools.dev.pdcluster import pd_cluster
from kvtier_tools.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm


def requests_served(server_url: str) -> float:
    text = httpx.get(server_url + "/metrics", timeout=30).text
    found = re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)", text, re.M)
    return sum(float(x) for x in found)


def routed(proxy_url: str, how: str) -> float:
    text = httpx.get(proxy_url + "/metrics", timeout=30).text
    found = re.search(rf'^kvtier_proxy_routed_total\{{how="{how}"\}} ([0-9.e+]+)', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_prompt_goes_to_the_prefiller_that_holds_its_prefix(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.encode(corpus_text())
    # Text, as users send it: the proxy asks a prefiller's /tokenize for the token ids.
    first, longer, other = (
        tok.decode(ids[a:b]) for a, b in ((3000, 3400), (3000, 3600), (9000, 9400))
    )
    events = free_ports(2)

    def publisher(i: int) -> list[str]:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events[i]}",
        }
        return ["--kv-events-config", json.dumps(config)]

    with pd_cluster(
        tiny_model,
        tmp_path,
        "tcp",
        prefillers=2,
        prefiller_args=publisher,
        prefiller_prefix_cache=True,  # the prefillers' own GPU-cache blocks: their events
        proxy_args=["--route", "kv", "--prefiller-kv-events-port", f"{events[0]},{events[1]}"],
    ) as c:

        def complete(prompt: str) -> None:
            body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = httpx.post(c.url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text

        complete(first)  # request 0: prefiller 0 in turn, nothing held anywhere
        time.sleep(3)  # its KV events reach the proxy's index
        complete(longer)  # request 1: in turn prefiller 1, but prefiller 0 holds its start
        complete(other)  # request 2: no one holds it: in turn, prefiller 0
        served = [requests_served(p.url) for p in c.prefillers]
        assert routed(c.url, "kv") == 1 and routed(c.url, "round-robin") == 2
        assert served == [3, 0], served
