"""Two vLLM instances (CPU build) sharing one remote store; and the store dying under vLLM."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time

import pytest
import torch
from vllm_offline import run_vllm

from kvtier_tools.bench.stores_vllm import Workload, bench_serve
from kvtier_tools.dev.demo import HIT_LINE, query_ttft, vllm_server
from kvtier_tools.dev.localservers import kvtier_server, mooncake_store, redis_server
from kvtier_tools.dev.tinymodel import corpus_text

# scripts/gpu_vllm.sh: real vLLM on a GPU (no redis-server there)
ON_GPU = torch.cuda.is_available()

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


@pytest.mark.parametrize(
    "start_store",
    [
        lambda: kvtier_server(0.25),
        pytest.param(
            redis_server,
            marks=pytest.mark.skipif(
                ON_GPU and not shutil.which("redis-server"),
                reason="no redis-server on the GPU machine",
            ),
        ),
        pytest.param(
            lambda: mooncake_store(2, 256),
            marks=pytest.mark.skipif(
                importlib.util.find_spec("mooncake") is None,
                reason="Mooncake's wheel is not installed",
            ),
        ),
    ],
    ids=["kvtier", "redis", "mooncake"],
)
def test_a_prompt_prefilled_on_instance_a_is_a_hit_on_instance_b(
    tiny_model, prompt, plain, tmp_path, start_store
):
    with start_store() as store:
        env = {
            "LMCACHE_REMOTE_URL": store.url,
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05",
            "LMCACHE_EXTRA_CONFIG": json.dumps(store.extra_config),
        }
        (a,), log_a = run_vllm(tiny_model, [prompt], tmp_path, "kv_both", env, name="a")
        (b,), log_b = run_vllm(tiny_model, [prompt], tmp_path, "kv_both", env, name="b")
    assert hits(log_a) == [(3000, 0, 0)]
    assert hits(log_b) == [(3000, 2816, 2816)]  # B computed nothing it could load from A's chunks
    assert a["token_ids"] == plain["token_ids"] and b["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(b["logprobs"], plain["logprobs"])) < 0.05


def query_until_hit(
    vllm, model: str, prompt: str, min_hit: int, tries: int = 10, pause: float = 0.5
) -> str:
    """Query until the prompt is a hit of at least `min_hit` tokens; its text ("" if never).
    A remote store's writes land asynchronously: on a GPU the next query can come first."""
    for _ in range(tries):
        _, text = query_ttft(vllm.url, model, prompt, max_tokens=16)
        if hits(vllm.log_text())[-1][1] >= min_hit:
            return text
        time.sleep(pause)
    return ""


@pytest.mark.parametrize(
    "start_store",
    [
        lambda: kvtier_server(0.25),
        # The master and its segment clients killed and restarted on the same ports. A call
        # into a dead master waits Mooncake's own RPC timeout (about 4 s), not kvtier's.
        pytest.param(
            lambda: mooncake_store(2, 128),
            marks=pytest.mark.skipif(
                importlib.util.find_spec("mooncake") is None,
                reason="Mooncake's wheel is not installed",
            ),
        ),
    ],
    ids=["kvtier", "mooncake"],
)
def test_a_store_killed_while_vllm_serves_means_misses_then_reuse_once_it_is_back(
    tiny_model, tmp_path, start_store
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = corpus_text()
    prompt = tok.decode(tok.encode(text)[:1500])
    other = tok.decode(tok.encode(text)[4000:5500])
    model = str(tiny_model)
    timeout = 2.0
    with start_store() as store:
        env = {
            "LMCACHE_REMOTE_URL": store.url,
            "LMCACHE_LOCAL_CPU": "false",
            "LMCACHE_BLOCKING_TIMEOUT_SECS": str(timeout),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "LMCACHE_EXTRA_CONFIG": json.dumps(store.extra_config),
        }
        with vllm_server(tiny_model, tmp_path, env=env, max_model_len=4096) as vllm:
            query_ttft(vllm.url, model, prompt, max_tokens=4)  # stored remotely
            assert query_until_hit(vllm, model, prompt, 1000)  # loaded back from the store
            store.kill()
            t0 = time.monotonic()
            _, text_dead = query_ttft(vllm.url, model, prompt, max_tokens=4)  # a miss, computed
            query_ttft(vllm.url, model, other, max_tokens=4)
            assert time.monotonic() - t0 < 2 * timeout + 30  # nothing waits past the timeout
            assert [h[1] for h in hits(vllm.log_text())[-2:]] == [0, 0]
            store.start()  # empty; the client reconnects after its back-off
            time.sleep(2)
            assert query_until_hit(vllm, model, prompt, 1000, tries=5, pause=2)
            assert "a miss, next try in" in vllm.log_text()


# LMCache's InfiniStore guide: the store server started with InfiniStore's flags, vLLM
# with the guide's config file, `vllm bench serve` twice with the guide's arguments (on
# CPU: fewer and shorter prompts). The second run's prompts must all come from the store.
BENCH = (
    Workload(num_prompts=50, input_len=8192, output_len=128)
    if ON_GPU
    else Workload(num_prompts=6, input_len=1024, output_len=8)
)


def test_the_infinistore_guide_vllm_bench_serve_twice(tiny_model, tmp_path):
    model = str(tiny_model)
    with kvtier_server(
        4.0 if ON_GPU else 0.5, "--dev-name", "mlx5_0", "--link-type", "Ethernet"
    ) as store:
        port = store.url.rsplit(":", 1)[1]
        config = tmp_path / "infinistore-config.yaml"
        config.write_text(
            f'chunk_size: 256\nremote_url: "infinistore://127.0.0.1:{port}/?device=mlx5_1"\n'
            'remote_serde: "naive"\nlocal_cpu: False\nmax_local_cpu_size: 0.5\n'
        )
        with vllm_server(
            tiny_model,
            tmp_path,
            env={"LMCACHE_CONFIG_FILE": str(config)},
            max_model_len=max(4096, BENCH.input_len + BENCH.output_len + 64),
        ) as vllm:
            first = bench_serve(vllm.url, model, BENCH)
            stored = len(vllm.hit_lines())
            second = bench_serve(vllm.url, model, BENCH)
            served = len(vllm.hit_lines())
            # One prompt cold, again warm (from the store), and a control with another first chunk.
            text = corpus_text()
            _, cold = query_ttft(vllm.url, model, text[:6000], max_tokens=16)
            warm = query_until_hit(vllm, model, text[:6000], 1000)
            _, control = query_ttft(
                vllm.url, model, "A different opening. " + text[400:6000], max_tokens=16
            )
            hits = vllm.hit_lines()
    n = BENCH.num_prompts
    for run in (first, second):
        assert run["Successful requests"] == n and run.get("Failed requests", 0) == 0
    # vllm bench serve sends one warm-up request first: the second run's prompts, every one
    # a hit of all but its partial last chunk (and the last token).
    again = hits[stored:served][-n:]
    assert len(again) == n and all(hit >= total - 256 for total, hit, _ in again), hits[
        stored:served
    ]
    assert warm == cold and control != cold
    print(
        f"bench serve twice through infinistore:// ({n} prompts of {BENCH.input_len} tokens): "
        f"median TTFT {first['Median TTFT (ms)']:.1f} -> {second['Median TTFT (ms)']:.1f} ms, "
        f"mean {first['Mean TTFT (ms)']:.1f} -> {second['Mean TTFT (ms)']:.1f} ms",
        flush=True,
    )


@pytest.mark.parametrize(
    "store",
    [
        "kvtier",
        pytest.param(
            "lmcache",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("lmcache") is None,
                reason="LMCache is installed on the GPU machine only",
            ),
        ),
    ],
)
def test_the_shared_store_bench_serves_instance_bs_prompts_from_the_store(store):
    """`python -m kvtier_tools.bench.stores_vllm` (issue 27's remote path): instance A serves the
    prompts cold, instance B, a new process, serves them again from the project's own store
    server (`kvtier server`; LMCache's lm:// server where LMCache is installed): B hits the
    prompts, its greedy tokens on KV from the store equal A's on its own (a GPU prefix hit), a
    control prompt's differ, nothing fails."""
    from kvtier_tools.bench.stores_vllm import Instances, run

    how = Instances(gpu_util=0.2, cpu_gb=1.0, store_gb=2.0) if ON_GPU else Instances()
    record = run(
        (store,), Workload(num_prompts=4, input_len=1024, output_len=4), progress=print, how=how
    )
    row = record["stores"][store]
    assert row["failed"] == 0 and row["same_tokens"] and row["control_differs"], row
    assert row["b_hit_tokens"] >= 0.75 * row["b_prompt_tokens"] > 0, row
