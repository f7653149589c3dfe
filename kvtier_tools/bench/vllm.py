"""`python -m kvtier_tools.bench.vllm`: kvtier inside real vLLM on a GPU, query twice.

One subprocess per offloader setup (`--setup`), each one vLLM `LLM` with its
engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the model's forward
can be timed by CUDA events and the warm path profiled in one process):

    a Llama-3.1-8B-shaped model, weights made on the GPU: N(0, 0.02), norms 1,
    seeded (vLLM's dummy weights make the output ignore the prompt)
    per prompt length: `pairs` times a new prompt cold, vLLM's prefix cache
    reset, the same prompt warm (its hit can only come from the offloader);
    TTFT = the wall time of generate() with max_tokens=1; between the two, the
    same prompt again at once, a hit in vLLM's own GPU prefix cache (what a
    load that cost nothing would give)
    correctness: the first prompt cold and warm with `check_tokens` greedy
    tokens, and a control prompt with another first chunk; setups compare
    them with plain vLLM's (`compare`)
    the floor of a warm TTFT: KV bytes / pinned H2D copy bandwidth (the best
    of 3 copies of those bytes, timed in the same process) + the one-token
    forward timed alone (CUDA events around vLLM's GPU-hit step, execute_model
    to sampled tokens, paired with each warm run); layerwise: the larger of the two

Each setup writes one JSON record. `compare` reads them all and prints the
table and the token checks.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier_tools.bench.vllm_parts import (
    MODELS,
    ended_on_error,
    engine_ms,
    flush_kvtier,
    h2d_bandwidth,
    install_probes,
    kv_bytes_per_token,
    kvtier_chunking,
    make_model,
    probe_clear,
    probe_forward_ms,
    probe_timeline_start,
    probe_timeline_stop,
    prompt,
    run_setup_process,
    seed_weights,
    traced,
)
from kvtier_tools.bench.vllm_report import compare

# Offloader setups: the connector and the environment of each.
SETUPS: dict[str, dict] = {
    "plain": {},
    "kvtier": {"connector": "KvtierConnector", "env": {}},
    "kvtier-layerwise": {"connector": "KvtierConnector", "env": {"LMCACHE_USE_LAYERWISE": "true"}},
    # gpu_upload other than its default (auto: kernel for layerwise loads, copy engine for whole
    # ones).
    "kvtier-kernel": {"connector": "KvtierConnector", "env": {"KVTIER_GPU_UPLOAD": "kernel"}},
    "kvtier-layerwise-dma": {
        "connector": "KvtierConnector",
        "env": {"LMCACHE_USE_LAYERWISE": "true", "KVTIER_GPU_UPLOAD": "copy_engine"},
    },
    # The disk tier: a CPU pool smaller than one prompt (staging only), the chunks from files.
    # Its writes are flushed before each warm run ("flush"): the warm run reads the tier, whole.
    "kvtier-disk": {
        "connector": "KvtierConnector",
        "flush": True,
        "env": {
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
            "LMCACHE_LOCAL_DISK": "file:///tmp/kvtier-bench-disk/",
            "LMCACHE_MAX_LOCAL_DISK_SIZE": "60",
        },
    },
    # `kvtier server` on this host, CPU tier off: lent from its shared memory, or over TCP.
    "kvtier-server": {
        "connector": "KvtierConnector",
        "server": "",
        "flush": True,
        "env": {"LMCACHE_LOCAL_CPU": "false"},
    },
    "kvtier-server-tcp": {
        "connector": "KvtierConnector",
        "server": "?shm=0",
        "flush": True,
        "env": {"LMCACHE_LOCAL_CPU": "false"},
    },
    # The lossy KV codecs (remote_serde): chunks of int8 or fp8 e4m3 with per-head scales in every
    # tier, half the bytes to copy up, or int4 with a scale per 32 values, 0.28 of them; decoded
    # on the GPU in the scatter (transfer/quant.py).
    "kvtier-int8": {"connector": "KvtierConnector", "env": {"LMCACHE_REMOTE_SERDE": "int8"}},
    "kvtier-int4": {"connector": "KvtierConnector", "env": {"LMCACHE_REMOTE_SERDE": "int4"}},
    "kvtier-fp8": {"connector": "KvtierConnector", "env": {"LMCACHE_REMOTE_SERDE": "fp8"}},
    "kvtier-fp8-layerwise": {
        "connector": "KvtierConnector",
        "env": {"LMCACHE_REMOTE_SERDE": "fp8", "LMCACHE_USE_LAYERWISE": "true"},
    },
    "lmcache": {"connector": "LMCacheConnectorV1", "env": {"LMCACHE_LOCAL_CPU": "true"}},
    "lmcache-layerwise": {
        "connector": "LMCacheConnectorV1",
        "env": {"LMCACHE_LOCAL_CPU": "true", "LMCACHE_USE_LAYERWISE": "true"},
    },
    "native": {"native": True},
}


@dataclass
class Record:
    setup: str
    lengths: dict = field(default_factory=dict)  # str(length) -> runs
    machine: dict = field(default_factory=dict)


def run_setup(args: argparse.Namespace) -> None:
    setup = SETUPS[args.setup]
    os.environ.update(setup.get("env", {}))
    if "server" not in setup:
        _run_setup(args, setup)
        return
    from kvtier_tools.dev.localservers import kvtier_server

    with kvtier_server(args.cpu_gb) as server:
        os.environ["LMCACHE_REMOTE_URL"] = server.url + "/" + setup["server"]
        _run_setup(args, setup)


class _Run:
    """One setup's vLLM in this process: `gen` times a generate(), `flush` lands kvtier's writes."""

    def __init__(self, args: argparse.Namespace, setup: dict) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
        if args.tp > 1 or args.multiprocess:  # apply_model sends its function to the processes
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        import torch
        from vllm import LLM, SamplingParams

        self.args, self.setup = args, setup
        t0 = time.perf_counter()
        self.llm = LLM(
            model=str(make_model(Path(args.model), args.family)),
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            seed=0,
            max_model_len=max(args.lengths) + 64,
            enable_prefix_caching=True,
            enforce_eager=args.eager,
            gpu_memory_utilization=args.gpu_util,
            max_num_batched_tokens=args.batched,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tp,
            **({"mamba_cache_mode": "align"} if args.family == "nemotron_h" else {}),
            **_offloader(args, setup),
        )
        start_s = time.perf_counter() - t0
        self.llm.apply_model(install_probes)
        self.llm.apply_model(seed_weights)
        self.record = Record(
            args.setup,
            machine={
                "gpu": torch.cuda.get_device_name(),
                "start_s": round(start_s, 1),
                "date": time.strftime("%Y-%m-%d"),
                "eager": args.eager,
                "engine": "multiprocess" if args.multiprocess else "in-process",
                "kv_cache_dtype": args.kv_cache_dtype,
                "tp": args.tp,
            },
        )
        if setup.get("connector") == "KvtierConnector":
            self.record.machine["kvtier"] = self.llm.apply_model(kvtier_chunking)[0]
        self.one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        self.check = SamplingParams(
            temperature=0, max_tokens=args.check_tokens, ignore_eos=True, logprobs=0
        )
        self.timelines: list = []

    def gen(self, ids: list[int], sp=None, timed: bool = False):
        if timed:
            self.llm.apply_model(probe_timeline_start)
        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], sp or self.one, use_tqdm=False)[
            0
        ].outputs[0]
        took = time.perf_counter() - t
        if timed:
            self.timelines.append(self.llm.apply_model(probe_timeline_stop)[0])
        return took, out

    def forward_ms(self) -> float:
        """The last model step's GPU time (NaN with TP > 1: the steps run in the workers)."""
        return self.llm.apply_model(probe_forward_ms)[0] if self.args.tp == 1 else float("nan")

    def flush(self) -> None:
        if self.setup.get("flush") and not all(self.llm.apply_model(flush_kvtier)):
            print(f"[{self.args.setup}] kvtier's writes did not land in 120 s", flush=True)

    def tokens(self, length: int) -> dict:
        """Tokens of variant 0: cold; again at once (a hit in vLLM's own GPU prefix cache: the
        computation a warm load must reproduce); warm from the offloader; and a control
        prompt (variant 1: another first chunk) cold. The prompts are `length` + 1 tokens:
        vLLM's own hit and an offloader's load then both cover the first `length` (whole
        blocks and chunks) and both compute the last token alone, the same computation. (With
        `length` tokens vLLM's hit stops a block short, and kvtier recomputes, not loads, what
        is less than a block past it: the GPU hit would compute 16 tokens, the warm run one.)"""
        base, reset = prompt(length + 1, 0, self.args.family), self.llm.reset_prefix_cache
        _, cold = self.gen(base, self.check)
        _, gpu = self.gen(base, self.check)
        reset()
        self.flush()
        _, warm = self.gen(base, self.check)
        reset()
        _, ctrl = self.gen(prompt(length + 1, 1, self.args.family), self.check)
        reset()
        return {
            "cold": list(cold.token_ids),
            "gpu_hit": list(gpu.token_ids),
            "warm": list(warm.token_ids),
            "control": list(ctrl.token_ids),
            "warm_logprob_err": _logprob_err(warm, gpu),
            "cold_vs_gpu_hit_logprob_err": _logprob_err(cold, gpu),
        }

    def pair(self, ids: list[int], last: bool) -> dict:
        """Cold, vLLM's own GPU hit (what a zero-cost load would give), then warm from the
        offloader. With --back-to-back, first a warm run at once after the cold one (its
        prefix's store may still be on its way to CPU RAM)."""
        cold, _ = self.gen(ids)
        back_to_back = {}
        if self.args.back_to_back:
            self.llm.reset_prefix_cache()
            back_to_back["warm_b2b"], _ = self.gen(ids)
        self.llm.apply_model(probe_clear)
        gpu_hit, _ = self.gen(ids, timed=True)
        gpu_hit_fwd = self.forward_ms()
        # the record keeps the last pair's
        spans = self.timelines[-1] if last else self.timelines.pop()
        self.llm.reset_prefix_cache()
        self.flush()
        self.llm.apply_model(probe_clear)
        warm, _ = self.gen(ids, timed=last)
        fwd = self.forward_ms()
        self.llm.reset_prefix_cache()
        return {
            **back_to_back,
            "cold": cold,
            "gpu_hit": gpu_hit,
            "warm": warm,
            "fwd_ms": fwd,
            "gpu_hit_fwd_ms": gpu_hit_fwd,
            "gpu_hit_engine_ms": engine_ms(spans),
        }

    def profiled_pair(self, ids: list[int]) -> None:
        """One more pair (not in the figures), its GPU hit and its warm run under cProfile."""
        self.gen(ids)
        for what in ("GPU hit", "warm"):
            if what == "warm":
                self.llm.reset_prefix_cache()
                self.flush()
            prof = cProfile.Profile()
            prof.enable()
            self.gen(ids)
            prof.disable()
            with open(f"{self.args.out}/{self.args.setup}.prof.txt", "a") as f:
                f.write(f"==== {self.args.setup} {len(ids)} tokens: a {what} run\n")
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(70)
        self.llm.reset_prefix_cache()

    def length(self, length: int) -> dict:
        # the bytes a warm load copies up: kvtier's chunks (a lossy codec's are half the KV's)
        moved = self.record.machine.get("kvtier", {}).get(
            "stored_bytes_per_token"
        ) or kv_bytes_per_token(self.args.family) // (2 if self.args.kv_cache_dtype == "fp8" else 1)
        bw = h2d_bandwidth(length * moved)
        self.timelines = []
        tokens = self.tokens(length)
        runs: dict[str, list] = {
            "cold": [],
            "gpu_hit": [],
            "warm": [],
            "fwd_ms": [],
            "gpu_hit_fwd_ms": [],
            "gpu_hit_engine_ms": [],
            **({"warm_b2b": []} if self.args.back_to_back else {}),
        }
        for i in range(self.args.pairs + 1):  # the first pair warms up
            pair = self.pair(prompt(length, 100 + i, self.args.family), last=i == self.args.pairs)
            for key, value in pair.items() if i else ():
                runs[key].append(value)
        # each rank copies its shard over its own GPU's link: the floor's copy is the shard's
        if self.args.profile:
            self.profiled_pair(prompt(length, 98, self.args.family))
        summary = _summary(runs, length * moved, bw * self.args.tp, tokens, self.timelines)
        if self.args.trace:
            summary["gpu_timeline"] = self._trace(length)
        return summary

    def _trace(self, length: int) -> list[str]:
        """One more pair, its warm run (`--trace warm`) or its GPU prefix hit (`--trace hit`)
        under torch's profiler: the GPU's side of the timeline, and the host's waits for it.
        With --multiprocess, `_spied`."""
        what = self.args.trace
        if self.args.multiprocess:
            return self._spied(length)
        ids = prompt(length, 99, self.args.family)
        self.gen(ids)
        if what == "warm":
            self.llm.reset_prefix_cache()
            self.flush()
        path = Path(self.args.out, f"{self.args.setup}-{length}-{what}.trace.json.gz")
        _, lines = traced(lambda: self.gen(ids), path)
        self.llm.reset_prefix_cache()
        for line in lines:
            print(f"[{self.args.setup}] {length} {what} GPU: {line}", flush=True)
        return lines

    def _spied(self, length: int) -> list[str]:
        """The engine's own process under py-spy (torch's profiler here does not see it) through
        SPIED more pairs' GPU prefix hits (`--trace hit`) or warm runs, sampled only while each
        runs: where each thread's busy time went (its innermost frames, and kvtier's)."""
        from kvtier_tools.bench import stacks
        from kvtier_tools.bench.serving import sampled

        what, ids = self.args.trace, prompt(length, 99, self.args.family)
        paths = []
        for k in range(SPIED):
            self.gen(ids)
            if what == "warm":
                self.llm.reset_prefix_cache()
                self.flush()
            path = Path(self.args.out, f"{self.args.setup}-{length}-{what}-{k}.pyspy.txt")
            with sampled(os.getpid(), path, rate=2000, idle=False):
                time.sleep(1.0)  # py-spy attaches
                self.gen(ids)
            self.llm.reset_prefix_cache()
            paths.append(path)
        lines = stacks.report(stacks.read_all(paths), top=12, min_samples=20, leaves=True)
        for line in lines:
            print(f"[{self.args.setup}] {length} {what} py-spy: {line}", flush=True)
        return lines


SPIED = 5  # pairs `--trace` samples with py-spy under --multiprocess


def _offloader(args: argparse.Namespace, setup: dict) -> dict:
    """vLLM's arguments for the setup's offloader."""
    from vllm.config import KVTransferConfig

    kw: dict = {}
    if "connector" in setup:
        kv = {"kv_connector": setup["connector"], "kv_role": "kv_both"}
        if setup["connector"] == "KvtierConnector" and args.module_path:
            kv["kv_connector_module_path"] = "kvtier.integrations.vllm"
        kw["kv_transfer_config"] = KVTransferConfig(**kv)
    if setup.get("native"):
        kw.update(kv_offloading_size=args.cpu_gb, kv_offloading_backend="native")
    return kw


def _summary(runs: dict, nbytes: int, bw: float, tokens: dict, timelines: list) -> dict:
    copy_s = nbytes / bw
    # The forward timed alone: the GPU-hit step's (its own launches paced it, as a
    # forward that waits for nothing runs); the warm step's ran behind its copies.
    alone = [f / 1e3 for f in runs["gpu_hit_fwd_ms"]]
    return {
        **runs,
        "h2d_GBps": bw / 1e9,
        "copy_ms": copy_s * 1e3,
        "tokens": tokens,
        "timeline": dict(zip(("gpu_hit", "warm"), timelines)),
        "cold_median": statistics.median(runs["cold"]),
        "warm_median": statistics.median(runs["warm"]),
        "gpu_hit_median": statistics.median(runs["gpu_hit"]),
        "fwd_median_ms": statistics.median(runs["gpu_hit_fwd_ms"]),
        "gpu_hit_engine_median_ms": statistics.median(runs["gpu_hit_engine_ms"]),
        "warm_over_floor_paired": statistics.median(
            w / (copy_s + f) for w, f in zip(runs["warm"], alone)
        ),
        "warm_over_max_load_fwd_paired": statistics.median(
            w / max(copy_s, f) for w, f in zip(runs["warm"], alone)
        ),
        **_back_to_back(runs),
    }


def _back_to_back(runs: dict) -> dict:
    """The warm run right after the cold one against the warm run with the store landed
    (paired), where the bench ran both."""
    if not runs.get("warm_b2b"):
        return {}
    return {
        "warm_b2b_median": statistics.median(runs["warm_b2b"]),
        "warm_b2b_over_warm_paired": statistics.median(
            b / w for b, w in zip(runs["warm_b2b"], runs["warm"])
        ),
    }


def _print(setup: str, length: int, r: dict) -> None:
    print(
        f"[{setup}] {length}: cold {r['cold_median'] * 1e3:.1f} ms, "
        f"warm {r['warm_median'] * 1e3:.1f} ms, "
        f"vLLM's own GPU prefix hit {r['gpu_hit_median'] * 1e3:.1f} ms (its engine step "
        f"{r['gpu_hit_engine_median_ms']:.1f}), "
        f"copy {r['copy_ms']:.1f} ms ({r['h2d_GBps']:.1f} GB/s) + fwd {r['fwd_median_ms']:.1f} ms, "
        f"warm/floor {r['warm_over_floor_paired']:.3f}, warm/max(load,fwd) "
        f"{r['warm_over_max_load_fwd_paired']:.3f}",
        flush=True,
    )
    if "warm_b2b_median" in r:
        print(
            f"[{setup}] {length}: back to back warm {r['warm_b2b_median'] * 1e3:.1f} ms, "
            f"{r['warm_b2b_over_warm_paired']:.3f}x the warm run with the store landed",
            flush=True,
        )
    for name, spans in r["timeline"].items():  # the record keeps them all; here the longer ones
        print(
            f"[{setup}] {length} {name} timeline (ms from generate(), calls over 0.5 ms): "
            + "; ".join(f"{label} {a:.1f}-{b:.1f}" for label, a, b in spans if b - a > 0.5),
            flush=True,
        )


def _run_setup(args: argparse.Namespace, setup: dict) -> None:
    run = _Run(args, setup)
    for length in args.lengths:
        run.record.lengths[str(length)] = r = run.length(length)
        _print(args.setup, length, r)
    Path(args.out, f"{args.setup}.json").write_text(json.dumps(run.record.__dict__, indent=1))


def _logprob_err(a, b) -> float:
    """The largest difference of two outputs' logprobs of the tokens both sampled, up to
    where they first differ (inf where the first token differs)."""
    err = 0.0
    for la, lb, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
        if ta != tb:
            return err if err else float("inf")
        err = max(err, abs(la[ta].logprob - lb[tb].logprob))
    return err


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setup", choices=SETUPS, help="run one setup (in this process)")
    p.add_argument(
        "--setups", nargs="*", default=[], help="run these, one subprocess each, then compare"
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument(
        "--model",
        default="",
        help="the model's folder (made here; default /tmp/kvtier-<family>-8b)",
    )
    p.add_argument(
        "--family",
        choices=tuple(MODELS),
        default="llama",
        help="llama: Llama-3.1-8B's shape; gemma3: the same KV, five of six layers sliding-window; "
        "gptoss_dense: the same, every other layer a window of 128 (gpt-oss's); "
        "nemotron_h: Nemotron-H-8B's, Mamba-2 layers and four attention layers; "
        "deepseek_v2: DeepSeek-V2-Lite's multi-head latent attention, dense MLPs",
    )
    p.add_argument("--out", default="results/gpu-vllm")
    p.add_argument("--cpu-gb", type=float, default=20.0, help="CPU memory each offloader gets (GB)")
    p.add_argument("--gpu-util", type=float, default=0.85)
    p.add_argument("--batched", type=int, default=8192)
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size (one GPU a rank; the forward is not "
        "timed alone then: the ranks' steps run in their own processes)",
    )
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's multiprocess engine, as `vllm serve` runs it (the engine core in a process "
        "of its own, its steps timed there through apply_model); default: in this process",
    )
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="each pair also times a warm run right after its cold one (the prefix cache reset "
        "between), its store maybe still landing",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's KV cache dtype (fp8: its fp8 e4m3 KV, a byte a value, for every setup)",
    )
    p.add_argument("--setup-timeout", type=float, default=300, help="seconds a setup may take")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more pair per length, its GPU hit and warm run under cProfile (<setup>.prof.txt)",
    )
    p.add_argument(
        "--trace",
        nargs="?",
        const="warm",
        choices=("warm", "hit"),
        help="one more warm run (or GPU prefix hit: --trace hit) per length under torch's "
        "profiler: its GPU timeline, the host's waits for the GPU, and the trace; with "
        "--multiprocess 5 more under py-spy (on PATH) in the engine's process: its threads' "
        "busy time by innermost frame",
    )
    p.add_argument(
        "--module-path",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="name kvtier's module in the config (default: by name, through vLLM's plugin)",
    )
    args = p.parse_args()
    if args.multiprocess and args.profile:
        p.error("--profile profiles this process: not with --multiprocess (--trace samples it)")
    args.model = args.model or f"/tmp/kvtier-{args.family}-8b"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.setup:
        return ended_on_error(run_setup, args)
    rc = 0
    for name in args.setups:
        cmd = [
            sys.executable,
            "-m",
            "kvtier_tools.bench.vllm",
            "--setup",
            name,
            *_passthrough(sys.argv[1:]),
        ]
        env = {
            **os.environ,
            "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.cpu_gb),
            "LMCACHE_CHUNK_SIZE": "256",
        }
        rc |= run_setup_process(name, cmd, env, Path(args.out, f"{name}.json"), args.setup_timeout)
    sys.exit(rc or compare(Path(args.out)))


def _passthrough(argv: list[str]) -> list[str]:
    """This command's arguments for each setup's process: all but `--setups` and its names
    (a list kept by hand forgot the flags added after it)."""
    out: list[str] = []
    skipping = False
    for arg in argv:
        if arg == "--setups":
            skipping = True
            continue
        if skipping and not arg.startswith("-"):
            continue
        skipping = False
        if not arg.startswith("--setups="):
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
