"""kvtier's counters in vLLM's own /metrics (real vLLM, CPU build), through vLLM's
connector stats API: after a miss and a hit they equal what the hit-token log says."""

from __future__ import annotations

import contextlib
import json
import re
import time

import httpx
import pytest

from kvtier.fleet.feed import EventFeed
from kvtier.fleet.index import PrefixIndex
from kvtier_tools.dev.demo import vllm_server
from kvtier_tools.dev.localservers import kvtier_server
from kvtier_tools.dev.tinymodel import corpus_text

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
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=300,
                json={
                    "model": str(tiny_model),
                    "prompt": prompt,
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
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
    # its partial last chunk too (the default)
    assert metric(text, "kvtier_stored_tokens_total", "cpu") == total
    assert (
        metric(text, "kvtier_pool_capacity_bytes") > 0
        and metric(text, "kvtier_pool_used_bytes") > 0
    )
    assert re.search(r"kvtier_hit_rate\{[^}]*\} 0\.\d+", text)
    assert metric(text, "kvtier_load_failure_tokens_total") == 0


def test_with_enable_kv_events_vllm_publishes_kvtiers_stores_and_evictions(tiny_model, tmp_path):
    """vLLM's ZMQ event publisher carries BlockStored for each chunk kvtier's CPU tier
    takes (medium CPU, block size = chunk size, token ids, the request's LoRA adapter as
    vLLM's own events name it) and BlockRemoved when one goes; and the disk and remote
    tiers' own, which a router reading the events (the proxy's index, kvtier/fleet/) sees:
    stores in DISK and REMOTE, the disk's eviction."""
    import msgspec
    import zmq
    from transformers import AutoTokenizer
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    from kvtier_tools.dev.localservers import free_port
    from kvtier_tools.dev.tinyvlm import make_lora_adapter

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.encode(corpus_text())
    # two whole chunks each; the pool holds three
    first, second = ids[12000:12600], ids[20000:20600]
    port = free_port()
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    chunk = 256 * 8192  # bytes of a chunk of the tiny model in float32
    stack = contextlib.ExitStack()
    store = stack.enter_context(kvtier_server(0.0625))
    env = {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(3 * chunk / 1024**3),
        "LMCACHE_LOCAL_DISK": str(tmp_path / "disk"),
        "LMCACHE_MAX_LOCAL_DISK_SIZE": str(3.5 * chunk / 1024**3),  # 4 chunks do not fit
        "LMCACHE_REMOTE_URL": store.url,
        "LMCACHE_ENABLE_KV_EVENTS": "true",
        "LMCACHE_SAVE_UNFULL_CHUNK": "false",
    }  # whole chunks: whole blocks
    index = PrefixIndex()  # a router's view: the proxy's --route kv index, fed as it is fed
    stack.enter_context(contextlib.closing(EventFeed({"a": f"tcp://127.0.0.1:{port}"}, index)))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")  # vLLM's publisher binds tcp://*:port
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ours: list = []
    try:
        lora = [
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"A={make_lora_adapter(tmp_path / 'A', seed=1)}",
        ]
        with vllm_server(
            tiny_model,
            tmp_path,
            env=env,
            dtype="float32",
            max_model_len=4096,
            extra_args=["--kv-events-config", json.dumps(events_cfg), *lora],
        ) as server:
            # the second under adapter A
            for prompt, model in (
                (first, str(tiny_model)),
                (second, "A"),
            ):
                r = httpx.post(
                    server.url + "/v1/completions",
                    timeout=300,
                    json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                )
                assert r.status_code == 200, r.text
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                {"CPU", "DISK"} <= {e.medium for e in ours if isinstance(e, BlockRemoved)}
                and index.held_in(second, "DISK", "A") == {"a": 512}
                and index.held_in(second, "REMOTE", "A") == {"a": 512}
            ):
                if sub.poll(500):
                    _, _, payload = sub.recv_multipart()
                    ours += [
                        e
                        for e in decoder.decode(payload).events
                        if getattr(e, "medium", None) in ("CPU", "DISK", "REMOTE")
                    ]
    finally:
        sub.close(0)
        ctx.term()
        stack.close()
    # The router's index: every chunk went to the remote store and the disk; the disk evicted
    # the first prompt's first chunk (LRU) and CPU RAM too, so no instance holds that prompt
    # itself (the remote store is every instance's: not a reason to pick one); the second,
    # (under adapter A) it holds on disk, which the index names as this instance's.
    assert index.held_in(first, "REMOTE") == {"a": 512}
    assert index.held_in(first, "DISK") == {} and index.held_in(first, "CPU") == {}
    assert index.match(first) == {}
    assert index.held_in(second, "DISK", "A") == {"a": 512}
    assert index.match(second, "A") == {"a": 512} and index.match(second) == {}
    disk_removed = [e for e in ours if isinstance(e, BlockRemoved) and e.medium == "DISK"]
    ours = [e for e in ours if e.medium == "CPU"]
    stored = [e for e in ours if isinstance(e, BlockStored)]
    removed = [e for e in ours if isinstance(e, BlockRemoved)]
    assert len(stored) == 4 and all(e.block_size == 256 and len(e.token_ids) == 256 for e in stored)
    assert [e.token_ids for e in stored] == [
        first[:256],
        first[256:512],
        second[:256],
        second[256:512],
    ]
    assert (
        stored[1].parent_block_hash == stored[0].block_hashes[0]
        and stored[0].parent_block_hash is None
    )
    assert [(e.lora_name, e.lora_id is None) for e in stored] == [(None, True)] * 2 + [
        ("A", False)
    ] * 2
    # LRU: the first prompt's first chunk
    assert removed and removed[0].block_hashes == stored[0].block_hashes
    assert disk_removed and disk_removed[0].block_hashes == stored[0].block_hashes
