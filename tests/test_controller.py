"""`kvtier controller`: every verb against a running fleet of two engines (each rank's API,
kvtier/fleet/worker.py) registered with the real controller process, asked through its CLI
verbs and its HTTP API; P2P between the two through a real `kvtier server` index."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time

import httpx
import pytest
import torch

from kvtier.cli import main
from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import kvtier_command, kvtier_server

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("m", "flash_attn", "bfloat16")
TOKEN = "fleet-token-0123456789abcdef"
TOKENS = list(range(2000, 2100))  # 6 whole chunks of 16, then 4 tokens


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    serve = ("controller", "serve", "--auth-token", TOKEN, "--worker-timeout", "5")
    with (
        kvtier_command(*serve) as url,
        kvtier_server(0.0625, "--auth-token", TOKEN) as index,
    ):
        a = node("a", url, index.url, tmp_path_factory.mktemp("disk-a"))
        b = node("b", url, index.url, None)
        try:
            wait_registered(url, {"a", "b"})
            yield url, a, b
        finally:
            a[0].close()
            b[0].close()


def node(name, controller, index, disk):
    layers = [torch.randn(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    cfg = KvtierConfig(
        save_unfull_chunk=False,
        chunk_size=16,
        max_local_cpu_size=1 / 1024,
        local_disk=None if disk is None else str(disk),
        max_local_disk_size=0.01,
        enable_p2p=True,
        p2p_port=0,
        p2p_index_url=index,
        remote_auth_token=TOKEN,
        enable_controller=True,
        controller_url=controller,
        instance_id=name,
        controller_heartbeat_s=0.5,
    )
    return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def wait_registered(url, names, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ask(url, "GET", "/health").json()["instances"]
        if names <= set(got):
            return
        time.sleep(0.1)
    raise AssertionError(f"instances {names} never registered")


def ask(url, method, path, body=None, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, url + path, json=body, headers=headers, timeout=30)


def cli(url, *args):
    """`kvtier controller VERB ...` as the command runs it (its main, in this process: a
    process a call would spend seconds importing), with the fleet's token in its variable."""
    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as env,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        env.setenv("KVTIER_SERVER_TOKEN", TOKEN)
        rc = main(["controller", *args, "--url", url])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def ids(tokens):
    return ",".join(map(str, tokens))


def test_a_request_without_the_token_is_refused(fleet):
    url, _, _ = fleet
    for method, path in (("GET", "/health"), ("POST", "/lookup"), ("POST", "/v1/workers")):
        r = ask(url, method, path, {"tokens": [1]}, token=None)
        assert r.status_code == 401, (path, r.text)
    assert ask(url, "GET", "/health", token="wrong-token-0123456789").status_code == 401
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "controller", "totals", "--url", url],
        capture_output=True,
        text=True,
        env={k: v for k, v in __import__("os").environ.items() if k != "KVTIER_SERVER_TOKEN"},
    )
    assert done.returncode == 1 and "HTTP 401" in done.stderr


def test_health_and_totals(fleet):
    url, (a, _), _ = fleet
    health = cli(url, "health")
    assert health["instances"]["a"]["0"]["alive"] and health["instances"]["b"]["0"]["alive"]
    assert cli(url, "health", "--instance", "a")["error_codes"] == {"0": 0}
    a.store(TOKENS, torch.randperm(NB * BS)[:100])
    totals = cli(url, "totals")
    assert totals["instances"]["a"]["cpu"] >= 6 and totals["chunks"]["cpu"] >= 6
    assert "disk" in totals["instances"]["a"] and "disk" not in totals["instances"]["b"]


def test_lookup_says_which_instance_holds_how_many_tokens_where(fleet):
    url, (a, _), _ = fleet
    tokens = [t + 500 for t in TOKENS]
    a.store(tokens, torch.randperm(NB * BS)[:100])
    a.flush(timeout=10)
    found = cli(url, "lookup", "--tokens", ids(tokens))
    assert found["instances"]["a"]["cpu"] == 96 and found["instances"]["a"]["disk"] == 96
    assert found["instances"]["b"]["cpu"] == 0
    assert found["layout_info"] == {"a": ["LocalCPUBackend", 96]}  # LMCache's shape
    # LMCache's request shape over HTTP, a prompt nobody holds
    r = ask(url, "POST", "/lookup", {"tokens": list(range(5, 50))})
    assert r.status_code == 200 and r.json()["layout_info"] == {}


def test_lookup_of_a_prompts_text_by_the_models_tokenizer(fleet, tmp_path):
    """`lookup --prompt TEXT --tokenizer MODEL`: the ids vLLM's completions endpoint would
    make of the text (special tokens added); without --tokenizer, one line and exit 1."""
    from transformers import AutoTokenizer

    from kvtier_tools.dev.tinymodel import make_tiny_llama

    url, (a, _), _ = fleet
    model = make_tiny_llama(tmp_path / "model")
    text = " ".join(f"w{i % 7} x{i}" for i in range(40))
    tokens = AutoTokenizer.from_pretrained(model).encode(text)
    assert 32 < len(tokens) < NB * BS
    a.store(tokens, torch.randperm(NB * BS)[: len(tokens)])
    found = cli(url, "lookup", "--prompt", text, "--tokenizer", str(model))
    assert found["instances"]["a"]["cpu"] == len(tokens) // BS * BS
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["controller", "lookup", "--prompt", text, "--url", url]) == 1
    assert "--prompt needs --tokenizer" in err.getvalue()


def test_a_prompt_with_a_cache_salt_is_named_by_its_salt(fleet):
    """A prompt stored under a cache_salt (or an adapter) has other chunk keys: the verbs find
    it with --cache-salt (the identity's root, sent as "identity"), not without."""
    from kvtier.adapters import identity_of

    url, (a, _), _ = fleet
    tokens = [t + 900 for t in TOKENS]
    a.store(tokens, torch.randperm(NB * BS)[:100], identity=identity_of(cache_salt="tenant-1"))
    assert cli(url, "lookup", "--tokens", ids(tokens))["instances"]["a"]["cpu"] == 0
    salted = cli(url, "lookup", "--tokens", ids(tokens), "--cache-salt", "tenant-1")
    assert salted["instances"]["a"]["cpu"] == 96
    other = cli(url, "lookup", "--tokens", ids(tokens), "--cache-salt", "tenant-2")
    assert other["instances"]["a"]["cpu"] == 0
    assert (
        cli(url, "pin", "--instance", "a", "--tokens", ids(tokens), "--cache-salt", "tenant-1")[
            "num_tokens"
        ]
        == 96
    )
    r = ask(url, "POST", "/lookup", {"tokens": tokens, "identity": "not hex"})
    assert r.status_code == 400 and "identity" in r.text, r.text
    cli(url, "unpin", "--instance", "a", "--tokens", ids(tokens), "--cache-salt", "tenant-1")


def test_pin_keeps_chunks_through_evictions_and_unpin_lets_them_go(fleet):
    url, (a, _), _ = fleet
    tokens = [t + 1000 for t in TOKENS]
    a.store(tokens, torch.randperm(NB * BS)[:100])
    pinned = cli(url, "pin", "--instance", "a", "--tokens", ids(tokens))
    assert pinned["num_tokens"] == 96 and pinned["num_chunks"] == 6
    for k in range(40):  # far more than CPU RAM holds (64 chunks): everything else is evicted
        a.store([t + 3000 + 200 * k for t in TOKENS], torch.randperm(NB * BS)[:100])
    assert a.tiers.cpu.prefix_hits([s.key for s in a.spans(tokens)]) == 6
    assert cli(url, "unpin", "--instance", "a", "--tokens", ids(tokens))["num_chunks"] == 6
    for k in range(40):
        a.store([t + 20000 + 200 * k for t in TOKENS], torch.randperm(NB * BS)[:100])
    assert a.tiers.cpu.prefix_hits([s.key for s in a.spans(tokens)]) == 0


def test_clear_by_prompt_by_tier_and_whole(fleet):
    url, (a, _), _ = fleet
    tokens = [t + 40000 for t in TOKENS]
    a.store(tokens, torch.randperm(NB * BS)[:100])
    a.flush(timeout=10)
    keys = [s.key for s in a.spans(tokens)]
    out = cli(url, "clear", "--instance", "a", "--tier", "LocalCPUBackend", "--tokens", ids(tokens))
    assert out["num_chunks"] == 6
    assert a.tiers.cpu.prefix_hits(keys) == 0 and all(a.tiers.tier("disk").exists(keys))
    assert cli(url, "clear", "--instance", "a", "--tokens", ids(tokens))["num_chunks"] == 6
    assert not any(a.tiers.tier("disk").exists(keys))
    a.store(tokens, torch.randperm(NB * BS)[:100])
    assert cli(url, "clear", "--instance", "a")["num_chunks"] >= 6
    assert len(a.tiers.cpu) == 0
    r = ask(url, "POST", "/clear", {"instance_id": "a", "location": "RemoteBackend"})
    assert r.status_code == 400 and "shared store" in r.json()["detail"]
    r = ask(url, "POST", "/clear", {"instance_id": "nobody"})
    assert r.status_code == 404 and "nobody" in r.json()["detail"]


def test_move_to_another_instance_and_to_a_tier(fleet):
    url, (a, a_kv), (b, b_kv) = fleet
    tokens = [t + 60000 for t in TOKENS]
    src = torch.randperm(NB * BS)[:100]
    a.store(tokens, src)
    keys = [s.key for s in a.spans(tokens)]
    out = cli(url, "move", "--from", "a", "--to", "b", "--tokens", ids(tokens), "--copy")
    assert out["num_tokens"] == 96
    assert b.tiers.cpu.prefix_hits(keys) == 6 and a.tiers.cpu.prefix_hits(keys) == 6
    dst = torch.randperm(NB * BS)[:100]
    assert b.retrieve(tokens, dst)[:96].all()  # from b's own CPU RAM now: the same KV
    assert torch.equal(
        torch.stack([x[:, dst[:96] // BS, dst[:96] % BS] for x in b_kv]),
        torch.stack([x[:, src[:96] // BS, src[:96] % BS] for x in a_kv]),
    )
    out = cli(url, "move", "--from", "a:cpu", "--to", "a:disk", "--tokens", ids(tokens))
    assert out["num_tokens"] == 96  # written to a's disk, then dropped from its CPU RAM
    assert all(a.tiers.tier("disk").exists(keys)) and a.tiers.cpu.prefix_hits(keys) == 0
    r = ask(
        url,
        "POST",
        "/move",
        {"old_position": ["a", "cpu"], "new_position": ["a", "cpu"], "tokens": tokens},
    )
    assert r.status_code == 400
