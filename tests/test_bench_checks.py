"""The token checks of the GPU harness (kvtier_tools.bench.vllm), on the tokens of a real run
(H100, vLLM 0.26, 32k tokens, 2026-11-26): plain vLLM's own cold prefill and GPU prefix hit
part at the 4th token, a near-tie in bf16. And the prompts `vllm bench serve` is given."""

import os
from dataclasses import replace

import pytest

from kvtier_tools.bench.vllm_report import agrees, under_the_copy

PLAIN = {
    "cold": [124956, 86041, 56463, 53607, 47691, 48236],
    "gpu_hit": [124956, 86041, 56463, 91666, 19827, 39878],
}


def test_cold_tokens_agree_with_plain_vllm_equal_or_on_its_own_near_tie():
    assert agrees(PLAIN["cold"], PLAIN)
    # layerwise (PIECEWISE graphs) took the GPU hit's side of the tie, then went its own way
    assert agrees([124956, 86041, 56463, 91666, 123492, 69999], PLAIN)


def test_cold_tokens_that_part_from_plain_elsewhere_or_otherwise_disagree():
    assert not agrees([124956, 86041, 1, 53607, 47691, 48236], PLAIN)  # before the tie
    assert not agrees([124956, 86041, 56463, 7, 47691, 48236], PLAIN)  # at it, neither side
    assert not agrees([124956, 86041, 56463, 53607, 47691, 5], PLAIN)  # after it, plain's cold side
    assert not agrees(PLAIN["cold"], {})


def test_pd_tokens_may_part_from_the_decoders_hit_only_at_a_near_tie():
    from kvtier_tools.bench.chat import Result
    from kvtier_tools.bench.pd_vllm import verdict

    def res(ids, tops):
        r = Result(0, 0, 1, 0.0)
        r.output_ids, r.top_logprobs = ids, tops
        return r

    hit = res([5, 6, 7], [{5: -0.1, 9: -3.0}, {6: -0.70, 8: -0.71}, {7: -0.2, 1: -2.0}])
    assert verdict(res([5, 6, 7], hit.top_logprobs), hit) == "equal"
    near = res([5, 8, 2], [{5: -0.105, 9: -3.0}, {8: -0.69, 6: -0.70}, {2: -0.1}])
    assert verdict(near, hit) == "near-tie"
    # the tie in PD's own top two (the hit's top two lack PD's token), as on 2026-11-28 at 4k
    near_pd = res([5, 6, 4], [{5: -0.1, 9: -3.0}, {6: -0.71, 8: -0.72}, {4: -0.45, 7: -0.45}])
    assert verdict(near_pd, hit) == "near-tie"
    wide_pd = res([5, 6, 4], [{5: -0.1, 9: -3.0}, {6: -0.71, 8: -0.72}, {4: -0.1, 7: -2.0}])
    assert verdict(wide_pd, hit) == "differ"
    far = res([5, 9, 7], [{5: -0.1}, {9: -0.2}, {7: -0.2}])  # a token the hit gave no weight
    assert verdict(far, hit) == "differ"
    moved = res([5, 8, 2], [{5: -0.9, 9: -3.0}, {8: -0.69}, {2: -0.1}])  # the logprob before moved
    assert verdict(moved, hit) == "differ"


def test_py_spy_stacks_are_summed_by_thread_and_kvtier_frame(tmp_path):
    """py-spy's raw stacks as `kvtier_tools.bench.serving --profile` writes them: a child's stacks
    name its parents first, and a command line may hold ";" and a newline."""
    from kvtier_tools.bench.stacks import read, read_all, report

    parents = (
        'process 1:"python -m vllm.entrypoints.openai.api_server";'
        'process 2:"python -c from x import y;'
    )
    engine = parents + '\n y(fd=4)";thread (2): MainThread;run_busy_loop (vllm/v1/engine/core.py:9)'
    raw = tmp_path / "stacks.txt"
    raw.write_text(
        f"{engine};wait_for_save (kvtier/integrations/vllm/connector.py:3);"
        "finish (kvtier/transfer/x.py:5) 3\n"
        f"{engine};save_kv_layer (kvtier/integrations/vllm/connector.py:4) 1\n"
        f"{engine};schedule (vllm/v1/core/sched/scheduler.py:7) 6\n"
        'process 1:"python -m vllm";thread (1): MainThread;serve (uvicorn/main.py:1) 10\n'
    )
    threads = read(raw)
    (main,) = [t for (process, thread), t in threads.items() if process.startswith("process 2:")]
    assert main.samples == 10 and sum(main.outer.values()) == 4
    assert main.outer["wait_for_save (connector.py)"] == 3 and main.inner["finish (x.py)"] == 3
    lines = report(threads, min_samples=1)
    assert any("10 samples, 4 (40.0%) in kvtier" in line for line in lines)
    assert main.leaf["schedule (scheduler.py)"] == 6 and main.leaf["finish (x.py)"] == 3
    assert not any("leaf" in line for line in lines)
    assert any(
        "leaf    60.0%  schedule (scheduler.py)" in line for line in report(threads, 8, 1, True)
    )
    (twice,) = [
        t for (process, _), t in read_all([raw, raw]).items() if process.startswith("process 2:")
    ]
    assert twice.samples == 20 and twice.leaf["schedule (scheduler.py)"] == 12
    assert twice.outer["wait_for_save (connector.py)"] == 6 and twice.inner["finish (x.py)"] == 6


def test_serving_rounds_give_each_setups_median_and_its_ratio_to_the_first_in_the_same_round():
    from kvtier_tools.bench.chat import Record
    from kvtier_tools.bench.report_serving import by_round

    means = [
        ("plain", 1, 50.0, 20.0),
        ("kvtier", 1, 40.0, 21.0),
        ("plain", 2, 60.0, 20.0),
        ("kvtier", 2, 45.0, 19.0),
        ("plain", 3, 55.0, 20.0),
        ("kvtier", 3, 55.0, 22.0),
    ]
    records = {
        f"{n}#{r}": Record({}, "", summary={"ttft_mean_ms": m, "requests_per_s": q})
        for n, r, m, q in means
    }
    # vLLM's split, kvtier's
    for r, (queue, prefill) in enumerate([(9.0, 30.0), (11.0, 33.0), (10.0, 40.0)], 1):
        records[f"kvtier#{r}"].summary |= {"queue_ms_mean": queue, "prefill_ms_mean": prefill}
    # kvtier's sends in lockstep (plain's records predate it)
    for r, share in enumerate([0.05, 0.62, 0.1], 1):
        records[f"kvtier#{r}"].summary["sent_bunched"] = share
    lines = by_round(records)
    assert lines[2] == "| plain | 50.0 60.0 55.0 | 55.0 | 1.000 | 1.000 | 0 of 3 | — | — — — |"
    # TTFT 0.8, 0.75, 1.0 and req/s 1.05, 0.95, 1.1, paired (not 45 / 55): ahead on both in
    # round 1 only
    assert lines[3] == (
        "| kvtier | 40.0 45.0 55.0 | 45.0 | 0.800 | 1.050 | 1 of 3 | 10.0 / 33.0 | 0.05 0.62 0.10 |"
    )
    # one round: no table
    assert by_round({"plain": Record({}, "", summary={"ttft_mean_ms": 50.0})}) == []


def test_serving_turns_give_each_setups_mean_by_turn_as_the_median_over_rounds_even_packed():
    """by_turn, from a run packed for results/: per setup each turn's mean TTFT (the median
    over rounds), failed requests left out, and the mean over every turn."""
    from kvtier_tools.bench.chat import Record
    from kvtier_tools.bench.pack import pack
    from kvtier_tools.bench.report_serving import by_turn, unpacked

    def rec(ttfts: list[tuple[int, float]]) -> Record:
        rows = [{"turn": t, "ttft_s": s / 1e3, "error": ""} for t, s in ttfts]
        return Record({}, "", rows + [{"turn": 1, "ttft_s": 9.0, "error": "timed out"}])

    runs = {
        "kvtier#1": rec([(0, 100.0), (1, 30.0), (1, 50.0)]),
        "kvtier#2": rec([(0, 120.0), (1, 20.0), (1, 20.0)]),
        "kvtier#3": rec([(0, 110.0), (1, 60.0), (1, 60.0)]),
        "native#1": rec([(0, 90.0)]),
    }
    packed = pack({k: {"results": r.results, "summary": r.summary} for k, r in runs.items()})
    for records in (runs, unpacked(packed)):
        lines = by_turn(records)
        assert lines[0] == "| setup | turn 0 | turn 1 | all |"
        # turn 1: 40, 20, 60 by round; all: 60, 53.3, 76.7 by round
        assert lines[2] == "| kvtier | 110.0 | 40.0 | 60.0 |"
        assert lines[3] == "| native | 90.0 | — | 90.0 |"


def test_the_offloaders_floor_takes_plains_cold_turn_and_the_all_gpu_later_turns():
    """offloader_floor: per round, plain's turn 0 with plain-gpu-all's later turns (failed
    requests left out); each setup's mean TTFT over its round's floor (median); rounds
    without both plains have no floor."""
    from kvtier_tools.bench.chat import Record
    from kvtier_tools.bench.report_serving import offloader_floor

    def rec(ttfts: list[tuple[int, float]], mean: float = 0.0) -> Record:
        rows = [{"turn": t, "ttft_s": s / 1e3, "error": ""} for t, s in ttfts]
        rows.append({"turn": 1, "ttft_s": 0.001, "error": "timed out"})
        return Record({}, "", rows, {"ttft_mean_ms": mean})

    runs = {
        "plain#1": rec([(0, 100.0), (1, 70.0)], 85.0),
        "plain-gpu-all#1": rec([(0, 80.0), (1, 20.0)], 50.0),
        "native#1": rec([], 90.0),
        "plain#2": rec([(0, 120.0), (1, 80.0)], 100.0),
        "plain-gpu-all#2": rec([(0, 90.0), (1, 40.0)], 65.0),
        "native#2": rec([], 80.0),
        "native#3": rec([], 10.0),  # no floor in round 3
    }
    lines = offloader_floor(runs)
    # floors: (100 + 20) / 2 = 60 and (120 + 40) / 2 = 80; native 1.5 and 1.0, median 1.25;
    # plain-gpu-all 50 / 60 and 65 / 80; with plain's turn 0 (20 + 100) / 2 and (40 + 120) / 2
    assert lines[2].endswith("| 1 | 60.0 80.0 ms | |")
    assert "| plain | 1.333 | 2 | 85.0 100.0 |" in lines
    assert "| plain-gpu-all | 0.823 | 2 | 60.0 80.0 |" in lines
    assert offloader_floor({k: v for k, v in runs.items() if k.startswith("native")}) == []


def test_first_turns_are_listed_in_the_order_sent_over_the_rounds_after_the_first():
    """first_turns: per setup, turn 0's TTFT by the order sent (failed ones and later turns
    left out), the mean over rounds 2 on; the first `burst` one by one, then the rest's mean."""
    from kvtier_tools.bench.chat import Record
    from kvtier_tools.bench.report_serving import first_turns

    def rec(rows: list[tuple[int, float, float]]) -> Record:
        out = [{"turn": t, "sent_s": at, "ttft_s": s / 1e3, "error": ""} for t, at, s in rows]
        out.append({"turn": 0, "sent_s": 0.0, "ttft_s": 9.0, "error": "timed out"})
        return Record({}, "", out)

    runs = {
        "kvtier#1": rec([(0, 0.0, 999.0), (0, 0.1, 999.0), (0, 0.2, 999.0)]),
        "kvtier#2": rec([(0, 0.2, 30.0), (0, 0.0, 100.0), (1, 0.05, 5.0), (0, 0.1, 50.0)]),
        "kvtier#3": rec([(0, 0.0, 120.0), (0, 0.1, 70.0), (0, 0.2, 50.0)]),
    }
    lines = first_turns(runs, burst=2)
    assert lines[0] == "| setup | 0 | 1 | the rest | rounds |"
    assert lines[2] == "| kvtier | 110 | 60 | 40.0 | 2 |"
    assert first_turns({"kvtier": runs["kvtier#2"]}) == []  # one round: none after the first


def test_a_servers_warm_up_shares_no_system_prompt_with_any_round():
    """The chat's warm-up request is of a seed no round uses: every round's system prompts are
    cold (round 1 of the same seed had one warm)."""
    from kvtier_tools.bench.chat import Workload
    from kvtier_tools.bench.serving import warm_up

    w = Workload(conversations=8, system_prompts=4, system_tokens=64, turns=2, vocab=1000)
    prompts = warm_up(w).prompts()
    assert len(prompts) == 1 and len(prompts[0]) == 1
    warm = {tuple(prompts[0][0][:64])}
    for r in range(3):
        rounds = {tuple(c[0][:64]) for c in replace(w, seed=w.seed + r).prompts()}
        assert len(rounds) == 4 and not warm & rounds


def test_rounds_are_fitted_to_their_steps_past_512_tokens_per_setup():
    """by_steps: per setup over its rounds (of any runs), the line of mean TTFT on steps past
    512 tokens, their correlation and mean count; rounds without the count, and setups of too
    few rounds, left out."""
    from kvtier_tools.bench.report_serving import by_steps

    def s(steps: float | None, ttft: float) -> dict:
        return {"steps_over_512_tokens": steps, "ttft_mean_ms": ttft}

    rounds = [
        ("kvtier#1", s(5, 50.0)),
        ("kvtier#2", s(10, 60.0)),
        ("kvtier#1", s(15, 70.0)),  # the same name in another run: one more round
        ("kvtier#3", s(None, 999.0)),  # an older record that does not count them
        ("native#1", s(4, 60.0)),
        ("native#2", s(8, 72.0)),
        ("native#3", s(12, 80.0)),
        ("plain#1", s(5, 40.0)),
        ("plain#2", s(6, 41.0)),
    ]
    lines = by_steps(rounds)
    assert lines[2] == "| kvtier | 3 | 40.0 + 2.00 x | 1.00 | 10.0 |"
    assert lines[3] == "| native | 3 | 50.7 + 2.50 x | 0.99 | 8.0 |"
    assert len(lines) == 4  # plain: two rounds


def test_a_warm_run_faster_than_the_copy_of_its_kv_is_not_a_load():
    # LMCache 0.5.6 under vLLM 0.26's V2 model runner, 2026-11-27: 19.2 ms warm with a 39.2 ms copy
    assert under_the_copy("lmcache", {"warm_median": 0.0192, "copy_ms": 39.2})
    assert not under_the_copy("kvtier", {"warm_median": 0.0552, "copy_ms": 39.0})
    # plain loads nothing
    assert not under_the_copy("plain", {"warm_median": 0.0192, "copy_ms": 39.2})


def test_bench_serve_prompts_random_or_over_shared_prefixes():
    from kvtier_tools.bench.stores_vllm import Workload

    assert Workload(input_len=512).dataset_args()[:2] == ["--dataset-name", "random"]
    args = Workload(input_len=768, num_prefixes=2, prefix_len=512).dataset_args()
    assert args[args.index("--prefix-repetition-suffix-len") + 1] == "256"
    with pytest.raises(ValueError, match="prefix_len"):
        Workload(input_len=512, num_prefixes=2, prefix_len=512)


def test_a_traces_host_waits_are_summed_per_thread_and_call():
    from kvtier_tools.bench.vllm_parts import host_waits

    def ev(name, tid, dur, cat="cuda_runtime"):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "tid": tid,
            "dur": dur,
        }

    lines = host_waits(
        [
            ev("cudaStreamSynchronize", 1, 2000),
            ev("cudaStreamSynchronize", 1, 1500),
            ev("cudaMemcpyAsync", 2, 40),
            ev("cudaLaunchKernel", 1, 9000),
            ev("cudaEventSynchronize", 2, 800),
            ev("aten::copy_", 1, 5000, cat="cpu_op"),
        ]
    )
    assert lines == [
        "host thread 1 cudaStreamSynchronize: 2 calls, 3.50 ms in all, longest 2.00 ms",
        "host thread 2 cudaEventSynchronize: 1 calls, 0.80 ms in all, longest 0.80 ms",
    ]


def test_a_runs_engine_time_leaves_out_the_front_end_before_the_scheduler():
    import math

    from kvtier_tools.bench.vllm_parts import engine_ms

    spans = [
        ("vllm add_request", 0.1, 6.0),
        ("vllm schedule", 6.2, 7.0),
        ("vllm execute_model", 7.1, 20.0),
        ("kvtier wait_for_save", 20.5, 22.0),
        ("vllm update_from_output", 22.5, 23.0),
        ("vllm schedule", 23.1, 23.4),
        ("vllm update_from_output", 23.5, 24.25),
    ]
    assert engine_ms(spans) == pytest.approx(24.25 - 6.2)
    # vLLM's methods not wrapped: unknown
    assert math.isnan(engine_ms([("vllm execute_model", 7.1, 20.0)]))


def test_the_chat_workload_reports_how_many_requests_were_in_flight():
    """Little's law over the run, the most at once, and the share sent while another ran:
    a rate the server keeps up with serves one request at a time (2026-11-28: 0.9 in flight
    at 4 req/s with up to 12 allowed)."""
    from kvtier_tools.bench.chat import Result, in_flight

    def res(sent, latency):
        return Result(0, 0, 1, sent, 0.01, latency)

    alone = [res(0.25 * k, 0.2) for k in range(8)]
    mean, most, joined = in_flight(alone, 2.0)
    assert abs(mean - 0.8) < 1e-9 and most == 1 and joined == 0
    # a request that never ended: left out
    crowded = [res(0.05 * k, 0.2) for k in range(8)] + [res(0.0, None)]
    mean, most, joined = in_flight(crowded, 0.55)
    assert abs(mean - 1.6 / 0.55) < 1e-9 and most == 4 and joined == 7 / 8


def test_the_chat_workloads_output_lengths_spread_around_max_tokens_alike_in_every_run():
    from kvtier_tools.bench.chat import Workload

    w = Workload(conversations=32, turns=6, max_tokens=48, output_spread=0.5)
    lengths = w.output_lengths()
    flat = [n for turns in lengths for n in turns]
    assert (
        len(lengths) == 32
        and all(len(t) == 6 for t in lengths)
        and 24 <= min(flat) < max(flat) <= 72
    )
    assert len(set(flat)) > 20 and abs(sum(flat) / len(flat) - 48) < 4
    assert (
        lengths
        == Workload(conversations=32, turns=6, max_tokens=48, output_spread=0.5).output_lengths()
    )
    # the prompts unchanged
    assert w.prompts() == Workload(conversations=32, turns=6, max_tokens=48).prompts()
    assert {n for t in Workload(turns=3, max_tokens=16).output_lengths() for n in t} == {
        16
    }  # no spread: fixed


def test_a_run_that_fell_into_lockstep_shows_in_its_bunched_sends():
    """Sends within 10 ms of the one before (H200, 2026-11-28: rounds at 0.04-0.08 had a mean
    TTFT of 58-70 ms, a round at 0.65 one of 215 ms)."""
    from kvtier_tools.bench.chat import Result, bunched

    spread = [Result(0, 0, 1, 0.04 * k) for k in range(10)]
    assert bunched(spread) == 0
    convoy = [Result(0, 0, 1, 0.2 * (k // 4) + 0.001 * (k % 4)) for k in range(12)]  # 3 bursts of 4
    assert bunched(convoy) == 9 / 11
    assert bunched([Result(0, 0, 1, 0.0)]) == 0


def test_the_base_setup_runs_kvtier_from_an_earlier_tree_first_on_the_path(tmp_path, monkeypatch):
    """kvtier-base: a server that imports kvtier from BENCH_BASE_TREE before this tree's, and
    a clear stop where the variable is missing or names no tree."""
    import subprocess
    import sys
    from pathlib import Path

    from kvtier_tools.bench.serving import KVTIER, setup

    monkeypatch.delenv("BENCH_BASE_TREE", raising=False)
    with pytest.raises(SystemExit, match="BENCH_BASE_TREE"):
        setup("kvtier-base", 20)
    monkeypatch.setenv("BENCH_BASE_TREE", str(tmp_path))
    with pytest.raises(SystemExit, match="holds kvtier/"):
        setup("kvtier-base", 20)
    (tmp_path / "kvtier").mkdir()
    (tmp_path / "kvtier" / "__init__.py").write_text("BASE = True\n")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "which_kvtier.py").write_text("import kvtier\nprint(kvtier.__file__)\n")
    monkeypatch.setenv("PYTHONPATH", str(probe))
    connector, env, extra = setup("kvtier-base", 20)
    assert connector == KVTIER and extra == [] and env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "20"
    assert env["PYTHONPATH"] == f"{tmp_path}:{probe}"
    # run as the servers are: `python -m`, from the repository (this tree's kvtier/ in it)
    repository = Path(__file__).resolve().parents[1]
    assert (repository / "kvtier").is_dir()
    found = subprocess.run(
        [sys.executable, "-m", "which_kvtier"],
        cwd=repository,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == str(tmp_path / "kvtier" / "__init__.py")


def test_the_gpu_kv_cache_for_a_share_of_the_chats_conversations():
    from kvtier_tools.bench.chat import Workload
    from kvtier_tools.bench.serving import gpu_kv_bytes
    from kvtier_tools.dev.tinymodel import TinyLlama

    # 128 KiB of KV a token
    llama8b = TinyLlama(num_hidden_layers=32, num_key_value_heads=8, head_dim=128)
    w = Workload(
        conversations=32,
        system_tokens=4096,
        turns=6,
        user_tokens=256,
        answer_tokens=128,
        max_tokens=48,
    )
    last_turn = 4096 + 6 * 256 + 5 * 128 + 48  # 6,320 tokens
    # 6.17 GiB: 8 of the 32
    assert gpu_kv_bytes(llama8b, w, 0.25, 8192) == 8 * last_turn * 128 * 1024
    # never below one whole request and vLLM's null block
    assert gpu_kv_bytes(llama8b, w, 0.01, 8192) == (8192 + 256) * 128 * 1024


def test_the_all_on_gpu_setup_gets_a_gpu_kv_cache_for_every_conversation(tmp_path, monkeypatch):
    """plain-gpu-all, the floor of the turns an offloader serves: vLLM alone, its GPU KV cache
    the whole workload's; every other setup gets the share's."""
    from kvtier_tools.bench import serving

    asked: dict[str, list[str]] = {}
    monkeypatch.setattr(
        serving, "vllm_server", lambda model, workdir, **kw: asked.setdefault(workdir.name, kw)
    )
    spec = serving.ServerSpec(gpu_kv_bytes=1 << 30, gpu_kv_all_bytes=4 << 30)
    for name in ("plain-gpu-all", "plain", "kvtier"):
        serving.served(tmp_path, name, tmp_path / name, spec)
    kv = {
        n: kw["extra_args"][kw["extra_args"].index("--kv-cache-memory-bytes") + 1]
        for n, kw in asked.items()
    }
    assert kv == {"plain-gpu-all": str(4 << 30), "plain": str(1 << 30), "kvtier": str(1 << 30)}
    assert asked["plain-gpu-all"]["kv_connector"] is None


def test_the_consumer_setup_is_kvtier_that_never_stores():
    """kvtier-consumer: kvtier as a kv_consumer (loads, never stores), with kvtier's CPU RAM:
    beside kvtier, what its stores cost the requests around them."""
    from kvtier_tools.bench import serving

    connector, env, _ = serving.setup("kvtier-consumer", 20.0)
    mine, mine_env, _ = serving.setup("kvtier", 20.0)
    assert connector == {**mine, "kv_role": "kv_consumer"} and env == mine_env


def test_a_serving_runs_records_packed_lean_for_results(tmp_path, monkeypatch):
    import json
    import sys

    from kvtier_tools.bench import pack

    rec = {
        "workload": {"rate": 24.0},
        "url": "u",
        "summary": {"ttft_mean_ms": 61.6},
        "results": [
            {
                "conversation": 1,
                "turn": 0,
                "prompt_tokens": 4352,
                "sent_s": 0.123456789,
                "ttft_s": 0.05,
                "latency_s": 0.5,
                "output_ids": [5] * 48,
                "top_logprobs": [],
                "output_tokens": 48,
                "error": "",
            }
        ],
    }
    (tmp_path / "runs").mkdir()
    for name in ("native#2", "kvtier#10", "kvtier#2"):
        (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(rec))
    (tmp_path / "note.txt").write_text("slow call ...")
    out = tmp_path / "packed.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["pack", str(out), str(tmp_path / "runs"), f"slow_calls={tmp_path / 'note.txt'}"],
    )
    pack.main()
    packed = json.loads(out.read_text())
    # rounds in their order
    assert list(packed) == [
        "kvtier#2",
        "kvtier#10",
        "native#2",
        "_slow_calls",
    ]
    assert packed["kvtier#2"]["summary"] == {"ttft_mean_ms": 61.6} and packed["kvtier#2"][
        "workload"
    ] == {"rate": 24.0}
    row = dict(zip(packed["kvtier#2"]["request_fields"], packed["kvtier#2"]["requests"][0]))
    assert row == {
        "conversation": 1,
        "turn": 0,
        "prompt_tokens": 4352,
        "sent_s": 0.12346,
        "ttft_s": 0.05,
        "latency_s": 0.5,
        "output_tokens": 48,
        "error": "",
    }
    assert packed["_slow_calls"] == "slow call ..."


def test_the_host_time_bench_times_each_call_kind_of_a_chat_turn_on_this_machine():
    import argparse

    from kvtier_tools.bench.host_time import run

    args = argparse.Namespace(
        layers=2,
        heads=2,
        head_size=16,
        blocks=200,
        chunk=64,
        history=512,
        turn=96,
        requests=4,
        cpu_gb=0.05,
        top=30,
        out="",
        step_ms=1.0,
        piece_mb=32,
    )
    out = run(args)
    kinds = {"store", "lookup", "load_queue", "load_finish", "store_cpu", "lookup_cpu"}
    assert set(out["calls"]) == kinds
    assert all(c["n"] == 4 and c["median_us"] > 0 for c in out["calls"].values())
    # the lookup finds the stored history: 512 tokens, all but the last token of the 608 a turn
    # later being new (a lookup leaves the prompt's last token to compute)
    assert out["hit_tokens_median"] == 512
    assert any("(store)" in line for line in out["profile_turn"])
    assert any("start_retrieve" in line for line in out["profile_turn"])
    # the stores alone: a store's own calls, no lookup's
    assert any("start_store" in line for line in out["profile_store"])
    assert not any("start_retrieve" in line for line in out["profile_store"])


def test_a_setup_whose_engine_died_ends_at_once_with_its_traceback(tmp_path):
    """LMCache's layerwise setup raised at its first request on vLLM 0.26 (2026-11-29), and its
    process then held its exit for the setup's whole time limit: threads of the dead engine.
    A setup that raises ends now, non-zero, with the traceback, whatever threads are left."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, threading, time
        import kvtier_tools.bench.vllm as bench
        def dies(args):
            threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: holds the exit
            raise AssertionError("the engine's KV format")
        bench.run_setup = dies
        sys.argv = ["bench", "--setup", "plain", "--out", sys.argv[1]]
        bench.main()
    """)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "AssertionError: the engine's KV format" in done.stderr


def test_a_serving_run_cut_by_its_limit_is_reported_from_the_records_it_left(tmp_path):
    """Call 16 of 2026-11-29 was cut before native's fifth run: its records were there, its
    tables were not. `--report` reads them back, each round in the order of --setups."""
    import json

    from kvtier_tools.bench.report_serving import by_round
    from kvtier_tools.bench.serving import report

    def record(ttft_ms: float, rps: float) -> dict:
        summary = {"ttft_mean_ms": ttft_ms, "requests_per_s": rps}
        return {
            "workload": {"rate": 24.0},
            "url": "u",
            "summary": summary,
            "results": [{"sent_s": 0.1, "ttft_s": ttft_ms / 1e3, "error": ""}],
        }

    # native#3: cut
    for key, ttft, rps in (
        ("native#1", 66.8, 22.3),
        ("kvtier#1", 73.1, 22.5),
        ("kvtier#2", 67.7, 23.0),
        ("native#2", 74.1, 23.2),
        ("kvtier#3", 84.4, 22.3),
    ):
        (tmp_path / f"{key}.json").write_text(json.dumps(record(ttft, rps)))
    (tmp_path / "serving.log").write_text("not a record")
    records = report(tmp_path, ["kvtier", "lmcache", "native"])
    assert list(records) == ["kvtier#1", "native#1", "kvtier#2", "native#2", "kvtier#3"]
    assert (tmp_path / "serving.svg").read_text().startswith("<svg")
    lines = by_round(records)
    assert lines[2].startswith("| kvtier | 73.1 67.7 84.4 | 73.1 | 1.000 |")
    # its two rounds, paired with kvtier's
    assert lines[3].startswith("| native | 66.8 74.1 | 70.4 | 1.004 |")


def test_each_setups_process_gets_every_flag_of_the_command_but_the_setups():
    """`bench vllm --setups a b ...` runs each setup in a process of its own with this
    command's other flags: a list kept by hand had dropped --back-to-back."""
    from kvtier_tools.bench.vllm import _passthrough

    argv = "--setups native kvtier --lengths 1024 4096 --no-eager --back-to-back --trace".split()
    assert _passthrough(argv) == "--lengths 1024 4096 --no-eager --back-to-back --trace".split()
    assert _passthrough(["--setups=a,b", "--pairs", "3"]) == ["--pairs", "3"]


def test_the_back_to_back_table_pairs_each_warm_run_after_cold_with_the_landed_one(tmp_path):
    """`vllm_report --back-to-back`: per setup and length, the landed warm TTFT, the one right
    after the cold run, and the paired ratio the bench computed."""
    import json

    from kvtier_tools.bench.vllm import _back_to_back
    from kvtier_tools.bench.vllm_report import back_to_back_markdown

    runs = {"warm": [0.050, 0.052, 0.060], "warm_b2b": [0.055, 0.052, 0.063]}
    r = {"warm_median": 0.052, **_back_to_back(runs)}
    assert r["warm_b2b_median"] == 0.055 and r["warm_b2b_over_warm_paired"] == pytest.approx(1.05)
    r["warm"] = runs["warm"]
    record = {"setup": "kvtier", "lengths": {"16384": r}, "machine": {"date": "2026-11-30"}}
    (tmp_path / "kvtier.json").write_text(json.dumps(record))
    table = back_to_back_markdown(tmp_path, ["kvtier"])
    assert "| kvtier | 16,384 | 52.0 | 55.0 | 1.050 |" in table


def test_steps_are_read_from_the_traced_calls_of_a_servers_log_round_by_round(tmp_path):
    """kvtier's own tracer at 0 ms (every call logged) and store lines, written by kvtier's
    logger as a server writes them: steps from each start_load_kv to the next, rounds parted by
    an idle spell, kvtier's calls and the stores counted into the step they fall in."""
    import logging
    import time

    from kvtier.logs import get_logger
    from kvtier.stalls import Stalls
    from kvtier_tools.bench.steps import by_call, read, report, rounds, steps

    log_path = tmp_path / "vllm-1.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(
        logging.Formatter("(EngineCore pid=7) kvtier %(levelname)s %(asctime)s: %(message)s")
    )
    kvtier_log = get_logger("kvtier")
    kvtier_log.addHandler(handler)
    stalls = Stalls(0)

    @stalls.traced("start_load_kv")
    def start_load_kv():
        time.sleep(0.001)

    @stalls.traced("wait_for_save")
    def wait_for_save(stores: int):
        for _ in range(stores):
            get_logger("kvtier.engine").info(
                "Storing KV cache for 256 out of 4352 tokens for request r (33.6 MB)"
            )
        time.sleep(0.004)

    try:
        for round_steps in ([2, 0, 1], [0, 3]):
            for stores in round_steps:
                start_load_kv()
                time.sleep(0.02)  # the forward
                wait_for_save(stores)
            time.sleep(0.3)
    finally:
        kvtier_log.removeHandler(handler)
        handler.close()
    calls, stores = read(log_path)
    assert [c.name for c in calls[:2]] == ["start_load_kv", "wait_for_save"] and len(stores) == 6
    parted = rounds(calls, idle=0.2)
    assert [len(r) for r in parted] == [6, 4]
    first = steps(parted[0], stores)
    assert [s.stores for s in first] == [2, 0, 1] and first[0].stored_tokens == 512
    assert first[0].begin == 0.0 and first[-1].length is None
    assert all(0.02 <= s.length < 0.2 for s in first[:-1])  # ms stamps: a step is 25 ms or so
    assert all(0.004 <= s.kvtier < 0.02 for s in first)
    assert [s.stores for s in steps(parted[1], stores)] == [0, 3]
    lines = report([log_path, log_path], window=1.0, idle=0.2)
    assert sum(line.startswith("round ") for line in lines) == 2
    assert sum(line.startswith("  vllm-1.log: 3 steps, kvtier's calls") for line in lines) == 2
    assert sum(line.startswith("  vllm-1.log: 2 steps") for line in lines) == 2
    assert all(0 <= c.cpu <= c.seconds + 0.001 for c in calls)  # sleeps are not CPU
    table = by_call([log_path])
    assert table[0] == "vllm-1.log: 10 calls, 0 lookups"
    (row,) = [line for line in table if line.startswith("| wait_for_save |")]
    count, total, mean, cpu_share, per_lookup = row.strip("| ").split(" | ")[1:]
    assert count == "5" and 20 <= float(total) < 100 and 4 <= float(mean) < 20
    assert float(cpu_share) < 0.5 and per_lookup == "-"
