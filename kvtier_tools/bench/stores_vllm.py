"""`python -m kvtier_tools.bench.stores_vllm`: two vLLM instances sharing KV through each
remote store.

For each store (`kvtier server`, Mooncake Store, redis-server; and `lmcache`:
LMCache's own `lm://` server with LMCache's connector, where LMCache is
installed, as on the GPU machine), on free loopback ports, with vLLM's OpenAI
server and the tiny Llama of kvtier_tools/dev/tinymodel.py (seeded N(0, 0.02)
weights: its output follows the context; `--model` another shape), the
connector's local CPU tier off (every hit comes from the store; vLLM's own
prefix cache is on, but the bench's random prompts share no prefix):

    instance A: `vllm bench serve` (random prompts, a fixed seed): every
                prompt cold, its KV stored in the store; then the token
                check's prompt (token ids, whole chunks and one token) greedy
                cold, the same again (a hit in vLLM's own GPU prefix cache,
                the reference), and a control prompt whose first chunk differs
    instance B: a new vLLM process, the same `vllm bench serve` (the same
                prompts): each a hit from the store; the check's prompt (its
                KV from the store) must give the reference's tokens

It is the InfiniStore guide's `vllm bench serve` run twice, with the second
run on another instance, as a cluster shares a store. Reported per store:
B's median and mean TTFT against A's (`warm_vs_cold`, A's cold prefill
being the limit the store is measured against), failed requests, hit tokens
from kvtier's log lines, and whether B's greedy tokens equal A's GPU prefix
hit's (both compute only the last token on the same KV; a whole prefill may
differ from either in bf16 near-ties), with the largest logprob difference,
and whether the control's differ. One JSON record per run, and a table.

LMCache's instances get PYTHONHASHSEED=0: LMCache's default chunk hash is
Python's, salted per process unless it is set (LMCache's docs require it), so
without it instance B finds nothing instance A stored. kvtier's keys need no
such setting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier_tools.bench.server import host
from kvtier_tools.dev.tinymodel import TinyLlama

STORES = ("kvtier", "mooncake", "redis", "lmcache")
LMCACHE_CONNECTOR = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_role": "kv_both",
}  # LMCache 0.5.6's, in vLLM
LMCACHE_HIT = re.compile(
    r"Reqid: \S+, Total tokens (\d+), Inference Engine computed tokens: \d+, "
    r"LMCache hit tokens: (\d+), need to load: (\d+)"
)
FIGURES = re.compile(
    r"^(Successful requests|Failed requests|Median TTFT \(ms\)|Mean TTFT \(ms\)|"
    r"P99 TTFT \(ms\)|Benchmark duration \(s\)|Request throughput \(req/s\)):\s+([\d.]+)",
    re.M,
)


@dataclass(frozen=True)
class Workload:
    """`vllm bench serve`'s prompts: random ones of `input_len` tokens, or with `num_prefixes`
    its prefix_repetition dataset (each prompt one of `num_prefixes` shared prefixes of
    `prefix_len` tokens, then its own tokens up to `input_len`). `max_concurrency` 0: every
    request at once (vLLM's default)."""

    num_prompts: int = 8
    input_len: int = 2048
    output_len: int = 4
    seed: int = 42
    num_prefixes: int = 0
    prefix_len: int = 0
    max_concurrency: int = 0

    def __post_init__(self) -> None:
        if self.num_prefixes and not 0 < self.prefix_len < self.input_len:
            raise ValueError(
                f"prefix_len {self.prefix_len} must be above 0 and under input_len {self.input_len}"
            )

    def dataset_args(self) -> list[str]:
        if not self.num_prefixes:
            return [
                "--dataset-name",
                "random",
                "--random-input-len",
                str(self.input_len),
                "--random-output-len",
                str(self.output_len),
            ]
        return [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(self.prefix_len),
            "--prefix-repetition-suffix-len",
            str(self.input_len - self.prefix_len),
            "--prefix-repetition-num-prefixes",
            str(self.num_prefixes),
            "--prefix-repetition-output-len",
            str(self.output_len),
        ]


def bench_serve(url: str, model: str, work: Workload, save: Path | None = None) -> dict[str, float]:
    """`vllm bench serve` against the server at `url`, greedy (its default sampling is the
    server's since vLLM 0.11): its summary figures. With `save`, its per-request record
    (outputs in the prompts' order, TTFTs) is written there (`served_outputs` reads it)."""
    port = url.rsplit(":", 1)[1]
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "vllm",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--model",
        model,
        "--num-prompts",
        str(work.num_prompts),
        "--port",
        port,
        "--host",
        "127.0.0.1",
        *work.dataset_args(),
        "--seed",
        str(work.seed),
        "--temperature",
        "0",
        *(["--max-concurrency", str(work.max_concurrency)] if work.max_concurrency else []),
    ]
    if save is not None:
        cmd += [
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(save.parent),
            "--result-filename",
            save.name,
        ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    return {k: float(v) for k, v in FIGURES.findall(out.stdout)}


def served_outputs(save: Path) -> list[str]:
    """The texts a `bench_serve(..., save=save)` run generated, in its prompts' order."""
    return [str(t) for t in json.loads(save.read_text()).get("generated_texts", [])]


@dataclass(frozen=True)
class Instances:
    """How each vLLM instance runs: its share of a GPU, eager or with CUDA graphs, the CPU
    memory its connector stages through (GB), its context length (0: the workload's); and
    the memory `kvtier server` preallocates (GB; LMCache's server allocates as it goes)."""

    gpu_util: float = 0.4
    eager: bool = True
    cpu_gb: float = 0.25
    max_model_len: int = 0
    store_gb: float = 1.0


@contextlib.contextmanager
def _store(name: str, how: Instances):
    from kvtier_tools.dev.localservers import (
        kvtier_server,
        lmcache_server,
        mooncake_store,
        redis_server,
    )

    start = {
        "kvtier": lambda: kvtier_server(how.store_gb),
        "mooncake": lambda: mooncake_store(2, 512),
        "redis": redis_server,
        "lmcache": lmcache_server,
    }[name]
    with start() as srv:
        yield srv


CHUNK = 256  # both connectors' chunk size here
# the check's prompt: 6 chunks and a token (vocab 4096)
CHECK = [(7919 * i) % 3800 + 100 for i in range(6 * CHUNK + 1)]
CONTROL = [t + 1 for t in CHECK[:CHUNK]] + CHECK[CHUNK:]  # its first chunk changed


def _instance(
    model_dir: Path, workdir: Path, store: str, srv, work: Workload, how: Instances, first: bool
) -> dict:
    """One instance's run. kvtier reads LMCache's variables, so every store but LMCache's own
    server is reached by kvtier's connector; LMCache's by LMCache's (its `naive` serde).
    vLLM's prefix cache is on: the bench's prompts share no prefix, and the check's prompt
    run twice on the first instance gives the reference (vLLM's own KV, the last token computed)."""
    from kvtier_tools.dev.demo import CONNECTOR, complete_ids, vllm_server

    env = {
        "LMCACHE_REMOTE_URL": srv.url,
        "LMCACHE_LOCAL_CPU": "false",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(how.cpu_gb),
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    connector = CONNECTOR
    if store == "lmcache":
        env.update(LMCACHE_REMOTE_SERDE="naive", PYTHONHASHSEED="0")
        connector = LMCACHE_CONNECTOR
    else:
        env["LMCACHE_EXTRA_CONFIG"] = json.dumps(srv.extra_config)
    with vllm_server(
        model_dir,
        workdir,
        env=env,
        kv_connector=connector,
        max_model_len=how.max_model_len or max(4096, work.input_len + 512),
        gpu_memory_utilization=how.gpu_util,
        eager=how.eager,
        prefix_caching=True,
    ) as vllm:
        model = str(model_dir)
        figures = bench_serve(vllm.url, model, work)
        hits = (
            vllm.hit_lines()
            if store != "lmcache"
            else [tuple(map(int, m.groups())) for m in LMCACHE_HIT.finditer(vllm.log_text())]
        )
        out = {
            "bench": figures,
            "hits": hits[-work.num_prompts :],
            "check": complete_ids(vllm.url, model, CHECK),
        }
        if first:
            out["gpu_hit"] = complete_ids(vllm.url, model, CHECK)
            out["control"] = complete_ids(vllm.url, model, CONTROL)
        time.sleep(1.0)  # the last stores land before the instance goes
    return out


def _logprob_err(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> float:
    """The largest logprob difference over the tokens two outputs share from the start (inf if
    the first differs)."""
    err = 0.0
    for ta, tb, la, lb in zip(a[0], b[0], a[1], b[1]):
        if ta != tb:
            return err if err else float("inf")
        err = max(err, abs(la - lb))
    return err


def run(
    stores: tuple[str, ...],
    work: Workload,
    progress=print,
    *,
    spec: TinyLlama = TinyLlama(),
    how: Instances = Instances(),
) -> dict:
    from kvtier_tools.dev.tinymodel import make_tiny_llama

    record: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": host(),
        "workload": work.__dict__,
        "model": asdict(spec),
        "instances": asdict(how),
        "stores": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-stores-vllm-") as tmp:
        model_dir = make_tiny_llama(Path(tmp) / "tiny-llama", spec)
        for name in stores:
            with _store(name, how) as srv:
                a = _instance(model_dir, Path(tmp) / f"{name}-a", name, srv, work, how, first=True)
                b = _instance(model_dir, Path(tmp) / f"{name}-b", name, srv, work, how, first=False)
            row = {
                "a": a,
                "b": b,
                "warm_vs_cold_median": round(
                    b["bench"]["Median TTFT (ms)"] / a["bench"]["Median TTFT (ms)"], 3
                ),
                "warm_vs_cold_mean": round(
                    b["bench"]["Mean TTFT (ms)"] / a["bench"]["Mean TTFT (ms)"], 3
                ),
                "failed": a["bench"].get("Failed requests", 0)
                + b["bench"].get("Failed requests", 0),
                "same_tokens": b["check"][0] == a["gpu_hit"][0],
                "logprob_err": _logprob_err(b["check"], a["gpu_hit"]),
                "cold_equals_gpu_hit": a["check"][0] == a["gpu_hit"][0],
                "control_differs": a["control"][0] != a["check"][0],
                "b_hit_tokens": sum(hit for _, hit, _ in b["hits"]),
                "b_prompt_tokens": sum(total for total, _, _ in b["hits"]),
            }
            record["stores"][name] = row
            progress(
                f"{name}: median TTFT A {a['bench']['Median TTFT (ms)']:.1f} ms (cold) -> "
                f"B {b['bench']['Median TTFT (ms)']:.1f} ms (from the store): "
                f"{row['warm_vs_cold_median']:.2f}; "
                f"hits {row['b_hit_tokens']}/{row['b_prompt_tokens']}, failed {row['failed']:.0f}, "
                f"B's tokens = A's GPU hit's {row['same_tokens']} "
                f"(logprob err {row['logprob_err']:.3g}), "
                f"control differs {row['control_differs']}"
            )
    return record


def table(record: dict) -> str:
    rows = [
        "| store | A cold median / mean TTFT | B from the store median / mean | B / A (median) | "
        "B's hit tokens | failed | B's tokens = A's |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in record["stores"].items():
        a, b = r["a"]["bench"], r["b"]["bench"]
        rows.append(
            f"| {name} | {a['Median TTFT (ms)']:.1f} / {a['Mean TTFT (ms)']:.1f} ms | "
            f"{b['Median TTFT (ms)']:.1f} / {b['Mean TTFT (ms)']:.1f} ms | "
            f"{r['warm_vs_cold_median']:.2f} | "
            f"{r['b_hit_tokens']} of {r['b_prompt_tokens']} | {r['failed']:.0f} | "
            f"{r['same_tokens']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvtier_tools.bench.stores_vllm", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--stores",
        nargs="+",
        default=list(STORES[:3]),
        choices=STORES,
        help="lmcache: LMCache's lm:// server and connector (where LMCache is installed)",
    )
    p.add_argument("--workload", type=json.loads, default={}, help="Workload fields (JSON)")
    p.add_argument("--model", type=json.loads, default={}, help="TinyLlama fields (JSON)")
    p.add_argument("--gpu-util", type=float, default=Instances.gpu_util)
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=Instances.eager)
    p.add_argument(
        "--cpu-gb", type=float, default=Instances.cpu_gb, help="the connector's local CPU staging"
    )
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument(
        "--store-gb", type=float, default=Instances.store_gb, help="kvtier server's --prealloc-size"
    )
    p.add_argument("--output", help="write the JSON record here")
    args = p.parse_args(argv)
    record = run(
        tuple(args.stores),
        Workload(**args.workload),
        spec=TinyLlama(**args.model),
        how=Instances(args.gpu_util, args.eager, args.cpu_gb, args.max_model_len, args.store_gb),
    )
    record["command"] = "python -m kvtier_tools.bench.stores_vllm " + " ".join(argv or sys.argv[1:])
    print(table(record))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
