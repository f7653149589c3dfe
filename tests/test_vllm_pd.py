"""LMCache's disaggregated-prefill guide (1P1D) with kvtier, on CPU: a prefiller and a
decoder (real vLLM, CPU build) and `kvtier proxy`, started as the guide starts them,
on loopback. Once per transfer channel (tcp, and nixl where installed)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from test_pd import channels

from kvtier.dev.demo import vllm_server
from kvtier.dev.localservers import free_port, wait_for_port
from kvtier.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm
# On a GPU (scripts/gpu_vllm.sh): both servers share it, the decoder's buffer is GPU
# memory the prefiller writes over CUDA IPC. On CPU: float32 (vLLM's CPU attention kernel
# then keeps tokens one by one: hits need not end on a block boundary), CPU buffers.
ON_GPU = torch.cuda.is_available()
DTYPE = "bfloat16" if ON_GPU else "float32"
BUFFER_DEVICE = "cuda" if ON_GPU else "cpu"
SENT_LINE = re.compile(r"PD: sent KV of (\d+) tokens")


def connector(role: str, rpc: str) -> dict:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role, "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": rpc}}


class Cluster:
    def __init__(self, prefiller, decoder, proxy_url, proxy_proc):
        self.prefiller, self.decoder, self.url, self.proxy = prefiller, decoder, proxy_url, proxy_proc


@contextlib.contextmanager
def pd_cluster(tiny_model, tmp, channel: str, tp: int = 1):
    """The guide's 1P1D on loopback: decoder, prefiller (each with `tp` ranks) and `kvtier proxy`."""
    init, alloc, notify, port = free_port(), free_port(), free_port(), free_port()
    # The guide's two config files (on CPU: the buffer in CPU RAM).
    (tmp / "prefiller.yaml").write_text(
        f'local_cpu: False\nenable_pd: True\ntransfer_channel: "{channel}"\npd_role: "sender"\n'
        f'pd_proxy_host: "127.0.0.1"\npd_proxy_port: {notify}\npd_buffer_size: 67108864\npd_buffer_device: "{BUFFER_DEVICE}"\n'
        "chunk_size: 256\nmax_local_cpu_size: 0.05\n")
    (tmp / "decoder.yaml").write_text(
        f'local_cpu: False\nenable_pd: True\ntransfer_channel: "{channel}"\npd_role: "receiver"\n'
        f'pd_peer_host: "127.0.0.1"\npd_peer_init_port: {init}\npd_peer_alloc_port: {alloc}\n'
        f'pd_buffer_size: 67108864\npd_buffer_device: "{BUFFER_DEVICE}"\nchunk_size: 256\nmax_local_cpu_size: 0.05\n')
    env = {"UCX_TLS": "tcp,self,sm", "VLLM_CPU_KVCACHE_SPACE": "1"}
    args: list[str] = []
    if tp > 1:  # decoder rank r listens on the init and alloc ports + r; the sender's rank r finds it there
        args = ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % 2) for r in range(tp))
    with vllm_server(tiny_model, tmp / "decoder", env={**env, "LMCACHE_CONFIG_FILE": str(tmp / "decoder.yaml")},
                     kv_connector=connector("kv_consumer", "consumer1"), dtype=DTYPE, max_model_len=4096,
                     extra_args=args) as dec, \
         vllm_server(tiny_model, tmp / "prefiller", env={**env, "LMCACHE_CONFIG_FILE": str(tmp / "prefiller.yaml")},
                     kv_connector=connector("kv_producer", "producer1"), dtype=DTYPE, max_model_len=4096,
                     extra_args=args) as pre:
        cmd = [sys.executable, "-m", "kvtier.cli", "proxy", "--host", "127.0.0.1", "--port", str(port),
               "--prefiller-host", "127.0.0.1", "--prefiller-port", pre.url.rsplit(":", 1)[1],
               "--num-prefillers", "1", "--decoder-host", "127.0.0.1", "--decoder-port", dec.url.rsplit(":", 1)[1],
               "--decoder-init-port", str(init), "--decoder-alloc-port", str(alloc), "--proxy-host", "127.0.0.1",
               "--proxy-port", str(notify), "--num-decoders", "1"]
        log = open(tmp / "proxy.log", "wb")
        proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(port, 60, proxy)
            yield Cluster(pre, dec, f"http://127.0.0.1:{port}", proxy)
        finally:
            proxy.send_signal(signal.SIGINT)
            try:
                proxy.wait(10)
            except subprocess.TimeoutExpired:
                proxy.kill()
            log.close()


@pytest.fixture(scope="module", params=["cuda_ipc"] if ON_GPU else channels())
def cluster(request, tiny_model, tmp_path_factory):
    with pd_cluster(tiny_model, tmp_path_factory.mktemp(f"pd-{request.param}"), request.param) as c:
        yield c


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    return tok.decode(tok.encode(corpus_text())[5000:5700])  # about 700 tokens: 2 whole chunks and a partial one


def complete(url, prompt, stream=False, **extra):
    body = {"model": extra.pop("model"), "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": stream,
            **extra}
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


def test_the_guides_1p1d_flow_gives_the_decoder_the_whole_prompt_and_the_same_output(cluster, tiny_model, prompt):
    model = str(tiny_model)
    n = len(cluster.decoder.hit_lines())
    via_proxy = complete(cluster.url, prompt, model=model)
    (total, hit, need), = new_hits(cluster.decoder, n)
    assert hit == total - 1 and need == total - 1  # only the last prompt token is computed by the decoder
    sent = [int(m.group(1)) for m in SENT_LINE.finditer(cluster.prefiller.log_text())]
    assert sum(sent) == total  # the prefiller pushed every token's KV, the partial last chunk included
    # Streaming through the proxy: the same text.
    assert complete(cluster.url, prompt, stream=True, model=model) == via_proxy
    # Without disaggregation: straight to the decoder, which now has nothing for it and computes it all.
    n = len(cluster.decoder.hit_lines())
    alone = complete(cluster.decoder.url, prompt, model=model)
    assert new_hits(cluster.decoder, n) == [(total, 0, 0)]  # the PD chunks were freed once loaded
    assert alone == via_proxy


def test_chat_completions_go_through_the_proxy(cluster, tiny_model, prompt):
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": prompt[:1500]}],
            "max_tokens": 8, "temperature": 0}
    n = len(cluster.decoder.hit_lines())
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    (total, hit, _), = new_hits(cluster.decoder, n)
    assert hit == total - 1
    direct = httpx.post(cluster.decoder.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert r.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]


def test_proxy_health_metrics_and_ttft_stats(cluster):
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
    assert re.search(r'kvtier_proxy_requests_total\{endpoint="/v1/completions",outcome="ok"\} [1-9]', metrics)
    assert "kvtier_proxy_prefill_seconds_count" in metrics


def test_vllm_bench_serve_through_the_proxy_completes_every_request(cluster, tiny_model):
    cmd = [sys.executable, "-m", "kvtier.cli", "vllm", "bench", "serve", "--base-url", cluster.url,
           "--model", str(tiny_model), "--dataset-name", "random", "--random-input-len", "300",
           "--random-output-len", "8", "--num-prompts", "8", "--request-rate", "4", "--burstiness", "100",
           "--seed", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"Successful requests:\s+8\b", out.stdout), out.stdout[-3000:]
    assert re.search(r"Failed requests:\s+0\b", out.stdout) or "Failed requests" not in out.stdout


def test_a_dead_decoder_is_a_clear_error_within_a_bound_and_the_prefiller_frees_its_side(cluster, tiny_model,
                                                                                          prompt):
    if cluster.decoder.proc.poll() is None:
        import os

        os.killpg(cluster.decoder.proc.pid, signal.SIGKILL)
        cluster.decoder.proc.wait(30)
    t0 = time.monotonic()
    r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                   json={"model": str(tiny_model), "prompt": prompt[:800], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 502 and "decoder" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60
    log = cluster.prefiller.log_text()
    assert "KV not sent" in log and "the decoder will recompute it" in log
    # The prefiller still serves.
    r = httpx.post(cluster.prefiller.url + "/v1/completions", timeout=120,
                   json={"model": str(tiny_model), "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200
