"""LMCache's disaggregated-prefill guide (1P1D) with kvtier, on CPU: a prefiller and a
decoder (real vLLM, CPU build) and `kvtier proxy`, started as the guide starts them,
on loopback. Over the guide's channel (nixl where installed, else tcp; cuda_ipc on a GPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from test_pd import channels

from kvtier_tools.dev.pdcluster import on_gpu, pd_cluster, pd_dtype
from kvtier_tools.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm
ON_GPU = on_gpu()
DTYPE = pd_dtype()
SENT_LINE = re.compile(r"PD: sent KV of (\d+) tokens")


# One cluster per run: the guide's channel (cuda_ipc on a GPU, nixl on a CPU where it is
# installed). The tcp channel runs the same proxy flow, a dead decoder included, in
# test_chaos.py's PD part (kvtier bench chaos), and at engine level in test_pd.py.
@pytest.fixture(scope="module", params=["cuda_ipc"] if ON_GPU else channels()[-1:])
def cluster(request, tiny_model, tmp_path_factory):
    with pd_cluster(tiny_model, tmp_path_factory.mktemp(f"pd-{request.param}"), request.param) as c:
        yield c


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    # about 700 tokens: 2 whole chunks and a partial one
    return tok.decode(tok.encode(corpus_text())[5000:5700])


def complete(url, prompt, stream=False, **extra):
    body = {
        "model": extra.pop("model"),
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def new_hits(server, before):
    return server.hit_lines()[before:]


def test_the_guides_1p1d_flow_gives_the_decoder_the_whole_prompt_and_the_same_output(
    cluster, tiny_model, prompt
):
    model = str(tiny_model)
    n = len(cluster.decoder.hit_lines())
    via_proxy = complete(cluster.url, prompt, model=model)
    ((total, hit, need),) = new_hits(cluster.decoder, n)
    # only the last prompt token is computed by the decoder
    assert hit == total - 1 and need == total - 1
    sent = [int(m.group(1)) for m in SENT_LINE.finditer(cluster.prefiller.log_text())]
    # the prefiller pushed every token's KV, the partial last chunk included
    assert sum(sent) == total
    # Streaming through the proxy: the same text.
    assert complete(cluster.url, prompt, stream=True, model=model) == via_proxy
    # Without disaggregation: straight to the decoder, which now has nothing for it and computes
    # it all.
    n = len(cluster.decoder.hit_lines())
    alone = complete(cluster.decoder.url, prompt, model=model)
    assert new_hits(cluster.decoder, n) == [(total, 0, 0)]  # the PD chunks were freed once loaded
    assert alone == via_proxy


def test_chat_completions_go_through_the_proxy(cluster, tiny_model, prompt):
    body = {
        "model": str(tiny_model),
        "messages": [{"role": "user", "content": prompt[:1500]}],
        "max_tokens": 8,
        "temperature": 0,
    }
    n = len(cluster.decoder.hit_lines())
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    ((total, hit, _),) = new_hits(cluster.decoder, n)
    assert hit == total - 1
    direct = httpx.post(cluster.decoder.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert (
        r.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    )


def test_proxy_health_metrics_and_ttft_stats(cluster):
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
    assert re.search(
        r'kvtier_proxy_requests_total\{endpoint="/v1/completions",outcome="ok"\} [1-9]', metrics
    )
    assert "kvtier_proxy_prefill_seconds_count" in metrics


def test_vllm_bench_serve_through_the_proxy_completes_every_request(cluster, tiny_model):
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "vllm",
        "bench",
        "serve",
        "--base-url",
        cluster.url,
        "--model",
        str(tiny_model),
        "--dataset-name",
        "random",
        "--random-input-len",
        "300",
        "--random-output-len",
        "8",
        "--num-prompts",
        "8",
        "--request-rate",
        "4",
        "--burstiness",
        "100",
        "--seed",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"Successful requests:\s+8\b", out.stdout), out.stdout[-3000:]
    assert re.search(r"Failed requests:\s+0\b", out.stdout) or "Failed requests" not in out.stdout


def test_a_dead_decoder_is_a_clear_error_within_a_bound_and_the_prefiller_frees_its_side(
    cluster, tiny_model, prompt
):
    cluster.decoder.kill()
    t0 = time.monotonic()
    r = httpx.post(
        cluster.url + "/v1/completions",
        timeout=120,
        json={"model": str(tiny_model), "prompt": prompt[:800], "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 502 and "decoder" in r.json()["error"]["message"]
    # The proxy's probe finds the decoder gone within 0.5 s: a prefill begun for it is dropped.
    assert time.monotonic() - t0 < 10
    # A prefiller asked to send to the dead decoder (a proxy that has not seen it die yet)
    # answers, says the KV was not sent, and still serves.
    init, alloc = cluster.decoder_ports
    spec = {
        "req_id": "pd-to-a-dead-decoder",
        "receiver_host": "127.0.0.1",
        "receiver_init_port": [init],
        "receiver_alloc_port": [alloc],
    }
    r = httpx.post(
        cluster.prefiller.url + "/v1/completions",
        timeout=120,
        json={
            "model": str(tiny_model),
            "prompt": prompt[:800],
            "max_tokens": 1,
            "kv_transfer_params": {"disagg_spec": spec},
        },
    )
    assert r.status_code == 200
    log = cluster.prefiller.log_text()
    assert "KV not sent" in log and "the decoder will recompute it" in log
    r = httpx.post(
        cluster.prefiller.url + "/v1/completions",
        timeout=120,
        json={"model": str(tiny_model), "prompt": "hello", "max_tokens": 2},
    )
    assert r.status_code == 200
