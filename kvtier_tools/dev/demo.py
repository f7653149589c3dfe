"""The two-query TTFT demo of LMCache's CPU offload guide, on CPU.

Starts vLLM's OpenAI-compatible server with kvtier on a small Llama-shaped
model made locally, sends one long prompt twice through a streaming OpenAI
client, and prints cold TTFT, warm TTFT, the speedup and the server's
hit-token log line. vLLM's own prefix caching is off, so the second query
is fast only because kvtier loads the prompt's KV from CPU RAM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier_tools.dev.cpu_dtype import model_dtype
from kvtier_tools.dev.localservers import free_port
from kvtier_tools.dev.tinymodel import corpus_text, make_tiny_llama

HIT_LINE = re.compile(r"Reqid: \S+, Total tokens (\d+), hit tokens (\d+), need to load (\d+)")
CONNECTOR = {
    "kv_connector": "KvtierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
}


@dataclass
class Server:
    """vLLM's OpenAI server as a process group; `kill` and `start` keep its port (fault runs)."""

    url: str
    log_path: Path
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 900) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        _wait_healthy(self, timeout)

    def kill(self) -> None:
        """SIGKILL to the API server and its engine core: no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def hit_lines(self) -> list[tuple[int, int, int]]:
        return [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(self.log_text())]


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    workdir: Path,
    *,
    env: dict[str, str | None] | None = None,
    kv_connector: dict | None = CONNECTOR,
    max_model_len: int = 16384,
    dtype: str = "auto",
    startup_timeout: float = 900,
    extra_args: Sequence[str] = (),
    gpu_memory_utilization: float = 0.4,
    prefix_caching: bool = False,
    eager: bool = True,
) -> Iterator[Server]:
    """Run vLLM's OpenAI server on a free loopback port until the block exits.

    `dtype` "auto" is the one models run in here (kvtier_tools.dev.cpu_dtype.model_dtype). On a
    GPU the server takes `gpu_memory_utilization` of it (two may share one). With `eager`
    it runs eager: no graphs to capture on a GPU, and on CPU no torch.compile at start
    (half a minute of a 2-core host's start for each server). vLLM's own prefix cache is off
    unless `prefix_caching` (so that a fast second query is the offloader's doing).
    """
    if dtype == "auto":
        dtype = model_dtype().dtype
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"vllm-{port}.log"
    # STEP_TRACE=1: the server's engine steps recorded in its folder (bench/step_trace.py)
    traced = os.environ.get("STEP_TRACE") == "1"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if kv_connector:
        cmd += ["--kv-transfer-config", json.dumps(kv_connector)]
    if model_dtype().device == "cuda":
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if eager:
        cmd += ["--enforce-eager"]
    cmd += list(extra_args)
    full_env = {
        k: v
        for k, v in {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "2",
            **({"STEP_TRACE_DIR": str(workdir)} if traced else {}),
            **(env or {}),
        }.items()
        if v is not None
    }  # None in `env`: unset
    log_path.write_bytes(b"")
    server = Server(f"http://127.0.0.1:{port}", log_path, cmd, full_env)
    try:
        server.start(startup_timeout)
        yield server
    finally:
        server.stop()


def start_side_by_side(
    stack: contextlib.ExitStack, servers: Sequence[contextlib.AbstractContextManager[Server]]
) -> list[Server]:
    """Enter each `vllm_server` on a thread of its own, the starts overlapping (each is mostly
    one thread: on 2 cores two starts side by side took 114 s, one after the other 195,
    2026-11-29). Each one started is stopped with `stack`, also if another failed; the first
    failure is raised."""
    with ThreadPoolExecutor(len(servers)) as pool:
        starts = [pool.submit(cm.__enter__) for cm in servers]
    started = []
    for cm, start in zip(servers, starts):
        if start.exception() is None:
            started.append(start.result())
            stack.push(cm.__exit__)
    failed = [s.exception() for s in starts if s.exception() is not None]
    if failed:
        raise failed[0]  # type: ignore[misc]
    return started


def _wait_healthy(server: Server, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    assert server.proc is not None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"vLLM server exited with code {server.proc.returncode}; its log ends:\n"
                + server.log_text()[-4000:]
            )
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)  # a test waits for each start: ~0.4 s saved a start against 1 s
    raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s; log: {server.log_path}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def long_prompt(tokenizer_dir: Path, num_tokens: int) -> str:
    """Stdlib text cut to about `num_tokens` tokens, then a question."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.encode(corpus_text(min_chars=num_tokens * 8))[:num_tokens]
    return tok.decode(ids) + "\n\nSummarize this code in 2 sentences."


def query_ttft(url: str, model: str, prompt: str, max_tokens: int = 32) -> tuple[float, str]:
    """Stream one chat completion (OpenAI's API, server-sent events); returns (time to
    first token, text). httpx alone: the GPU machine's vLLM bundle has no OpenAI client."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    ttft, parts = None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(
                f"chat completion failed: HTTP {r.status_code}: {r.read().decode()[:500]}"
            )
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta", {}).get("content")
            if delta:
                ttft = ttft or time.perf_counter() - start
                parts.append(delta)
    if ttft is None:
        raise RuntimeError("the server streamed no tokens")
    return ttft, "".join(parts)


def complete_ids(
    url: str, model: str, prompt: list[int], max_tokens: int = 16
) -> tuple[list[int], list[float]]:
    """Greedy completion of a prompt given as token ids (OpenAI's completions API): the
    output's token ids and their logprobs, for comparing two runs token by token."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"completion failed: HTTP {r.status_code}: {r.text[:500]}")
    logprobs = r.json()["choices"][0]["logprobs"]
    return [int(t.rsplit(":", 1)[1]) for t in logprobs["tokens"]], [
        float(x) for x in logprobs["token_logprobs"]
    ]


@dataclass
class DemoResult:
    prompt_tokens: int
    cold_ttft: float
    warm_ttft: float
    hit_lines: list[tuple[int, int, int]]
    dtype: str

    @property
    def speedup(self) -> float:
        return self.cold_ttft / self.warm_ttft


def run_demo(
    workdir: Path, prompt_tokens: int = 8000, chunk_size: int = 256, dtype: str = "auto"
) -> DemoResult:
    if dtype == "auto":
        choice = model_dtype()
        dtype = choice.dtype
        print(choice.line(), flush=True)
    else:
        print(f"CPU model dtype: {dtype} (set by --dtype)", flush=True)
    model_dir = make_tiny_llama(workdir / "tiny-llama")
    config_file = workdir / "cpu-offload.yaml"
    config_file.write_text(f"chunk_size: {chunk_size}\nlocal_cpu: true\nmax_local_cpu_size: 2.0\n")
    prompt = long_prompt(model_dir, prompt_tokens)
    print(f"Starting vLLM with kvtier (model {model_dir}, config {config_file}) ...", flush=True)
    with vllm_server(
        model_dir, workdir, env={"LMCACHE_CONFIG_FILE": str(config_file)}, dtype=dtype
    ) as server:
        model = str(model_dir)
        query_ttft(server.url, model, "Hello", max_tokens=2)  # warm up the server, not the cache
        print("Querying vLLM server with cold kvtier CPU offload", flush=True)
        cold, text = query_ttft(server.url, model, prompt)
        print(f"{text!r}\nCold TTFT: {cold:.3f} seconds\n", flush=True)
        print("Querying vLLM server with warm kvtier CPU offload", flush=True)
        warm, text = query_ttft(server.url, model, prompt)
        print(f"{text!r}\nWarm TTFT: {warm:.3f} seconds\n", flush=True)
        time.sleep(0.5)  # let the server flush its log
        hits = [h for h in server.hit_lines() if h[0] > 100]
    result = DemoResult(hits[0][0] if hits else 0, cold, warm, hits, dtype)
    print(
        f"TTFT Improvement: {cold - warm:.3f} seconds "
        f"({result.speedup:.1f}x faster, model in {dtype})"
    )
    for total, hit, load in hits:
        print(f"server log: Total tokens {total}, hit tokens {hit}, need to load {load}")
    return result
