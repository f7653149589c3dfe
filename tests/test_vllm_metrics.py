"""kvtier's counters in vLLM's own /metrics (real vLLM, CPU build), through vLLM's
connector stats API: after a miss and a hit they equal what the hit-token log says."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from kvtier.demo import vllm_server
from kvtier.tinymodel import corpus_text

pytestmark = pytest.mark.vllm


def metric(text: str, name: str, tier: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if tier is not None and f'tier="{tier}"' not in line:
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def test_vllm_metrics_show_kvtier_lookups_hits_stores_and_loads(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt = tok.encode(corpus_text())[9000:9600]
    env = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1"}
    with vllm_server(tiny_model, tmp_path, env=env, dtype="float32", max_model_len=4096) as server:
        for _ in range(2):  # a miss, then a hit
            r = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        (_, miss, _), (total, hit, load) = server.hit_lines()
        assert miss == 0 and hit > 0
        deadline = time.monotonic() + 30  # stats reach the API server with the next engine steps
        while True:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            if metric(text, "kvtier_loaded_tokens_total", "cpu") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert metric(text, "kvtier_lookups_total") == 2
    assert metric(text, "kvtier_lookup_tokens_total") == 2 * total
    assert metric(text, "kvtier_hit_tokens_total") == hit  # the log line's hit tokens
    assert metric(text, "kvtier_loaded_tokens_total", "cpu") == load
    assert metric(text, "kvtier_stored_tokens_total", "cpu") == total - total % 256
    assert metric(text, "kvtier_pool_capacity_bytes") > 0 and metric(text, "kvtier_pool_used_bytes") > 0
    assert re.search(r"kvtier_hit_rate\{[^}]*\} 0\.\d+", text)
    assert metric(text, "kvtier_load_failure_tokens_total") == 0
