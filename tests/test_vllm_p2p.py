"""P2P sharing between two vLLM instances (CPU build): a prompt prefilled on A is a hit on B,
copied out of A's CPU RAM (A's pool, mapped: they share this host) once A's PeerServer lent
the chunks, found in an index kept by a real `kvtier server` that never holds a chunk's bytes;
with A killed, B recomputes and answers the same."""

from __future__ import annotations

import re

import httpx
import pytest
from transformers import AutoTokenizer

from kvtier_tools.dev.demo import vllm_server
from kvtier_tools.dev.localservers import free_port, kvtier_command, kvtier_server
from kvtier_tools.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm

VALUE_BYTES = re.compile(r"^kvtier_server_value_bytes (\S+)$", re.M)


def complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def p2p_env(index_url: str, controller: str, name: str) -> dict[str, str | None]:
    return {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05",
        "LMCACHE_ENABLE_P2P": "true",
        "LMCACHE_P2P_PORT": str(free_port()),
        "LMCACHE_P2P_INDEX_URL": index_url,
        "LMCACHE_ENABLE_CONTROLLER": "true",
        "LMCACHE_CONTROLLER_URL": controller,
        "LMCACHE_LMCACHE_INSTANCE_ID": name,
        "LMCACHE_CONTROLLER_HEARTBEAT_S": "1",
    }


@pytest.mark.timeout(1200)
def test_a_prompt_prefilled_on_a_is_loaded_by_b_from_as_cpu_ram_and_survives_as_death(
    tiny_model, tmp_path
):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = tok.encode(corpus_text())
    prompt, control = text[:2000], text[4000:6000]  # 7 whole chunks of 256 and a partial one
    model = str(tiny_model)
    with (
        kvtier_server(0.0625) as index,
        kvtier_command("controller", "serve") as ctl,
        vllm_server(tiny_model, tmp_path / "a", env=p2p_env(index.url, ctl, "a")) as a,
        vllm_server(tiny_model, tmp_path / "b", env=p2p_env(index.url, ctl, "b")) as b,
    ):
        on_a = complete(a.url, model, prompt)
        assert a.hit_lines()[-1] == (2000, 0, 0)
        on_b = complete(b.url, model, prompt)
        # B computed only the last token: 7 chunks of 256 and the partial one came from A.
        assert b.hit_lines()[-1] == (2000, 1999, 1999)
        assert on_b == on_a
        # A and B share this host: B copied the chunks out of A's pool, no bytes over TCP.
        assert "chunks are copied out of its pool" in b.log_text()
        metrics = httpx.get(f"http://127.0.0.1:{index.manage_port}/metrics").text
        stored = float(VALUE_BYTES.search(metrics).group(1))
        assert 0 < stored < 16 * 1024  # addresses only: one chunk's KV alone is 1 MiB here
        # The controller sees the fleet through the ranks of both vLLMs: A holds the control
        # prompt once it computed it, B none of it (nobody asked B for it yet).
        cold = complete(a.url, model, control)
        found = httpx.post(ctl + "/lookup", json={"tokens": control}, timeout=60).json()
        assert found["layout_info"] == {"a": ["LocalCPUBackend", 2000]}
        assert found["instances"]["b"]["cpu"] == 0
        # A prefills another prompt and dies; the index still names it for those chunks.
        assert complete(a.url, model, control) == cold  # a hit from A's own CPU RAM
        a.kill()
        # The lookup may still count A's chunks (the index names them); their load fails
        # and vLLM recomputes them (its kv_load_failure_policy): the same tokens either way.
        assert complete(b.url, model, control) == cold
        assert re.search(r"P2P: \d+ chunks from \S+ are misses", b.log_text())  # A was gone
