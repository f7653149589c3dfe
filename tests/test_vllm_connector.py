"""kvtier inside real vLLM (CPU build): hits, chunked prefill, identical output."""

import re

import pytest
from vllm_offline import hit_granularity, run_vllm

from kvtier_tools.dev.demo import HIT_LINE as HIT
from kvtier_tools.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm
STORE = re.compile(r"Storing KV cache for (\d+) out of (\d+) tokens")


@pytest.fixture(scope="module")
def prompts(tiny_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(corpus_text())
    a = ids[:3000]  # not a chunk multiple: 11 whole chunks, 3 prefill steps of 1024
    b = ids[5000:7048]  # exactly 8 chunks: the whole prompt is stored
    c = ids[20000:20256] + a[256:]  # a's prompt with another first chunk
    d = a + ids[30000:30300]  # a's next turn: a, then an answer and a question
    return {"a": a, "b": b, "c": c, "d": d}


@pytest.fixture(scope="module")
def runs(tiny_model, prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    order = [prompts[k] for k in ("a", "a", "b", "b", "c", "d")]
    # As users run it: the engine core in a process of its own, the connector found by name.
    # kvtier's default
    with_kv, log = run_vllm(
        tiny_model,
        order,
        tmp,
        kv_role="kv_both",
        engine_process=True,
        by_name=True,
        env={"LMCACHE_SAVE_UNFULL_CHUNK": "true"},
    )
    plain, _ = run_vllm(tiny_model, [prompts[k] for k in ("a", "b", "c", "d")], tmp)
    return with_kv, plain, log


@pytest.mark.vllm_smoke
def test_second_request_hits_the_whole_prompt_and_the_next_turn_its_partial_chunk(runs):
    _, _, log = runs
    hits = [tuple(map(int, m)) for m in HIT.findall(log)]
    g = hit_granularity()
    assert hits[0] == (3000, 0, 0)
    # its partial last chunk too: all but the last token
    assert hits[1] == (
        3000,
        2999 - 2999 % g,
        2999 - 2999 % g,
    )
    assert hits[2] == (2048, 0, 0)
    last = 2047 - 2047 % g  # all stored: vLLM computes the last token itself
    assert hits[3] == (2048, last, last)
    assert hits[4] == (3000, 0, 0)  # different first chunk: no key matches
    # a's tail found inside the longer prompt
    assert hits[5] == (
        3300,
        3000 - 3000 % g,
        3000 - 3000 % g,
    )


def test_stores_follow_chunked_prefill(runs):
    _, _, log = runs
    stores = [tuple(map(int, m)) for m in STORE.findall(log)]
    # the partial last chunk too (save_unfull_chunk)
    assert stores[:3] == [
        (1024, 1024),
        (1024, 2048),
        (952, 3000),
    ]
    assert stores[3:5] == [(1024, 1024), (1024, 2048)]  # b: whole chunks, step by step


@pytest.mark.vllm_smoke
def test_output_equals_vllm_without_kvtier(runs):
    with_kv, plain, _ = runs
    cold_a, warm_a, cold_b, warm_b, c, d = with_kv
    for got, ref in [
        (cold_a, plain[0]),
        (warm_a, plain[0]),
        (cold_b, plain[1]),
        (warm_b, plain[1]),
        (c, plain[2]),
        (d, plain[3]),
    ]:
        assert got["token_ids"] == ref["token_ids"]
    warm_err = max(
        abs(x - y)
        for x, y in zip(
            warm_a["logprobs"] + warm_b["logprobs"] + d["logprobs"],
            plain[0]["logprobs"] + plain[1]["logprobs"] + plain[3]["logprobs"],
        )
    )
    # Control: the output does depend on the early context, so loading wrong
    # KV for it would show: changing only the first chunk moves the logprobs
    # far more than loading it from kvtier does.
    context_effect = max(abs(x - y) for x, y in zip(plain[2]["logprobs"], plain[0]["logprobs"]))
    assert warm_err < 0.05 and context_effect > 10 * max(warm_err, 1e-3), (warm_err, context_effect)


@pytest.mark.vllm_smoke
def test_the_connector_is_found_by_name_through_vllms_plugin(runs):
    """ "kv_connector": "KvtierConnector" with no kv_connector_module_path (the entry point):
    the main runs name it so (vLLM would refuse an unknown name at start); the other tests'
    runs name the module as well."""
    _, _, log = runs
    assert HIT.findall(log) and STORE.findall(log)


def test_producer_stores_but_never_loads_and_consumer_never_stores(tiny_model, prompts, tmp_path):
    _, log = run_vllm(tiny_model, [prompts["b"], prompts["b"]], tmp_path, kv_role="kv_producer")
    assert STORE.findall(log) and not HIT.findall(log)
    _, log = run_vllm(tiny_model, [prompts["b"], prompts["b"]], tmp_path, kv_role="kv_consumer")
    assert not STORE.findall(log)
    assert [tuple(map(int, m)) for m in HIT.findall(log)] == [(2048, 0, 0), (2048, 0, 0)]


@pytest.mark.parametrize("in_step", ["1024", None])
def test_a_hit_that_joins_a_running_request_loads_beside_its_steps_unless_small(
    tiny_model, prompts, runs, tmp_path, in_step
):
    """async_loading busy (the default): b's hit, looked up while a's prefill runs (a took the
    first steps' whole token budget), loads beside a's steps when larger than
    in_step_load_tokens (1024), on the worker's thread, and b joins a later step; under the
    default (4096) it loads in b's own step. Both give plain vLLM's tokens."""
    _, plain, _ = runs
    results, log = run_vllm(
        tiny_model,
        [prompts["b"], {"together": [prompts["a"], prompts["b"]]}],
        tmp_path,
        kv_role="kv_both",
        env={"KVTIER_IN_STEP_LOAD_TOKENS": in_step} if in_step else None,
        name=f"beside-{in_step}",
    )
    last = 2047 - 2047 % hit_granularity()
    assert [tuple(map(int, m)) for m in HIT.findall(log)] == [
        (2048, 0, 0),
        (3000, 0, 0),
        (2048, last, last),
    ]
    beside = in_step is not None
    assert log.count("(loading beside the running requests' steps)") == beside
    loaded = (
        rf"{last} of {last} tokens loaded beside the steps: .*reported to vLLM at [0-9.]+ ms"
        if beside
        else rf"Retrieved KV cache for {last} out of {last} tokens"
    )
    assert re.search(loaded, log)
    assert not re.search(r"tokens could not be loaded", log)
    _, a, b = results
    assert a["token_ids"] == plain[0]["token_ids"] and b["token_ids"] == plain[1]["token_ids"]
    assert max(abs(x - y) for x, y in zip(b["logprobs"], plain[1]["logprobs"])) < 0.05


def test_with_vllms_prefix_cache_a_turn_it_holds_is_not_looked_up_and_one_kvtier_extends_is(
    tiny_model, prompts, runs, tmp_path
):
    """vLLM's own prefix cache on (as `vllm serve` runs): d, a's next turn, right after a is
    vLLM's own hit up to a's last whole block, and what kvtier saved of a ends there, so the
    scheduler does not ask the worker (stored.py). Once vLLM's cache holds only a shorter
    prompt's blocks, d is asked, kvtier loads the rest, and both d's give plain vLLM's tokens."""
    _, plain, _ = runs
    shorter = prompts["a"][:1500]
    results, log = run_vllm(
        tiny_model,
        [prompts["a"], prompts["d"], "FORGET", shorter, prompts["d"]],
        tmp_path,
        kv_role="kv_both",
        env={"LMCACHE_SAVE_UNFULL_CHUNK": "true"},
        prefix_caching=True,
        name="prefix-caching",
    )
    g = hit_granularity()
    computed = 1500 - 1500 % 128  # vLLM's own hit on d: the shorter prompt's whole blocks
    hit = 3299 - 3299 % g
    assert [tuple(map(int, m)) for m in HIT.findall(log)] == [
        (3000, 0, 0),
        (1500, 1280, 1280),  # kvtier's 5 chunks of a (vLLM's cache forgot them)
        (3300, hit, hit - computed),
    ]
    assert not re.search(r"tokens could not be loaded", log)
    first_d, second_d = results[1], results[4]
    assert first_d["token_ids"] == plain[3]["token_ids"] == second_d["token_ids"]


def test_layerwise_loading_gives_the_same_output(tiny_model, prompts, runs, tmp_path):
    """use_layerwise: vLLM's wait_for_layer_load drives the load layer by layer, across
    chunked-prefill steps; each step's store is whole, after its forward."""
    with_kv, _, _ = runs
    results, log = run_vllm(
        tiny_model,
        [prompts["a"], prompts["a"]],
        tmp_path,
        kv_role="kv_both",
        env={"LMCACHE_USE_LAYERWISE": "true"},
    )
    assert [tuple(map(int, m)) for m in HIT.findall(log)][1] == (3000, 2816, 2816)
    stores = STORE.findall(log)
    assert [tuple(map(int, m)) for m in stores] == [(1024, 1024), (1024, 2048), (768, 3000)]
    assert results[1]["token_ids"] == with_kv[1]["token_ids"]
    assert max(abs(x - y) for x, y in zip(results[1]["logprobs"], with_kv[1]["logprobs"])) < 0.05


def test_lmcache_prefixed_extra_config_keys_set_the_config_and_layerwise_asks_for_piecewise_graphs(
    monkeypatch,
):
    """LMCache users set config keys in kv_connector_extra_config as "lmcache.<key>"; with
    use_layerwise on, vLLM must capture CUDA graphs piecewise (a full graph would replay
    the forward without the layers' waits): requires_piecewise_for_cudagraph says so."""
    from kvtier.integrations.vllm import KvtierConnector
    from kvtier.integrations.vllm.spec import config_with_extra

    monkeypatch.delenv("LMCACHE_USE_LAYERWISE", raising=False)
    config = config_with_extra(
        {
            "lmcache.chunk_size": 512,
            "lmcache.use_layerwise": True,
            "discard_partial_chunks": True,
            "lmcache_rpc_port": 7,
        }
    )
    assert (config.chunk_size, config.use_layerwise, config.save_unfull_chunk) == (512, True, False)
    assert KvtierConnector.requires_piecewise_for_cudagraph({"lmcache.use_layerwise": "true"})
    assert not KvtierConnector.requires_piecewise_for_cudagraph({})
    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "true")
    assert KvtierConnector.requires_piecewise_for_cudagraph({})
    with pytest.raises(ValueError, match="unknown key 'use_layerwis'"):
        config_with_extra({"use_layerwis": True})
    with pytest.raises(Exception, match="chunk_sise"):
        config_with_extra({"lmcache.chunk_sise": 512})
