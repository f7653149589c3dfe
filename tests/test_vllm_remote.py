"""Two vLLM instances (CPU build) sharing one remote store; and the store dying under vLLM."""

from __future__ import annotations

import time

import pytest
from vllm_offline import run_vllm

from kvtier.demo import HIT_LINE, query_ttft, vllm_server
from kvtier.localservers import kvtier_server, redis_server
from kvtier.tinymodel import corpus_text

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model)).encode(corpus_text())[:3000]


@pytest.fixture(scope="module")
def plain(tiny_model, prompt, tmp_path_factory):
    return run_vllm(tiny_model, [prompt], tmp_path_factory.mktemp("plain"))[0][0]


def hits(log: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log)]


@pytest.mark.parametrize("start_store", [lambda: kvtier_server(0.25), redis_server], ids=["kvtier", "redis"])
def test_a_prompt_prefilled_on_instance_a_is_a_hit_on_instance_b(tiny_model, prompt, plain, tmp_path, start_store):
    with start_store() as store:
        env = {"LMCACHE_REMOTE_URL": store.url, "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05"}
        (a,), log_a = run_vllm(tiny_model, [prompt], tmp_path, "kv_both", env, name="a")
        (b,), log_b = run_vllm(tiny_model, [prompt], tmp_path, "kv_both", env, name="b")
    assert hits(log_a) == [(3000, 0, 0)]
    assert hits(log_b) == [(3000, 2816, 2816)]  # B computed nothing it could load from A's chunks
    assert a["token_ids"] == plain["token_ids"] and b["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(b["logprobs"], plain["logprobs"])) < 0.05


def test_a_store_killed_while_vllm_serves_means_misses_then_reuse_once_it_is_back(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = corpus_text()
    prompt = tok.decode(tok.encode(text)[:1500])
    other = tok.decode(tok.encode(text)[4000:5500])
    model = str(tiny_model)
    timeout = 2.0
    with kvtier_server(0.25) as store:
        env = {"LMCACHE_REMOTE_URL": store.url, "LMCACHE_LOCAL_CPU": "false",
               "LMCACHE_BLOCKING_TIMEOUT_SECS": str(timeout), "VLLM_CPU_KVCACHE_SPACE": "1"}
        with vllm_server(tiny_model, tmp_path, env=env, max_model_len=4096) as vllm:
            query_ttft(vllm.url, model, prompt, max_tokens=4)  # stored remotely
            query_ttft(vllm.url, model, prompt, max_tokens=4)  # loaded back from the store
            assert hits(vllm.log_text())[-1][1] > 1000
            store.kill()
            t0 = time.monotonic()
            _, text_dead = query_ttft(vllm.url, model, prompt, max_tokens=4)  # a miss, computed
            query_ttft(vllm.url, model, other, max_tokens=4)
            assert time.monotonic() - t0 < 2 * timeout + 30  # nothing waits past the timeout
            assert [h[1] for h in hits(vllm.log_text())[-2:]] == [0, 0]
            store.start()  # empty; the client reconnects after its back-off
            time.sleep(2)
            for _ in range(5):
                query_ttft(vllm.url, model, prompt, max_tokens=4)
                if hits(vllm.log_text())[-1][1] > 1000:
                    break
                time.sleep(2)
            assert hits(vllm.log_text())[-1][1] > 1000
            assert "a miss, next try in" in vllm.log_text()
