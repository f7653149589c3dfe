"""`python -m kvtier.bench.vllm`: kvtier inside real vLLM on a GPU, query twice.

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
    forward timed alone (CUDA events around the model's forward in the GPU
    hit's step, paired with each warm run); layerwise: the larger of the two

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
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers, K/V, KV heads, head_dim, bf16

# Offloader setups: the connector and the environment of each.
SETUPS: dict[str, dict] = {
    "plain": {},
    "kvtier": {"connector": "KvtierConnector", "env": {}},
    "kvtier-layerwise": {"connector": "KvtierConnector", "env": {"LMCACHE_USE_LAYERWISE": "true"}},
    # The disk tier: a CPU pool smaller than one prompt (staging only), the chunks from files.
    # Its writes are flushed before each warm run ("flush"): the warm run reads the tier, whole.
    "kvtier-disk": {"connector": "KvtierConnector", "flush": True, "env": {
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_LOCAL_DISK": "file:///tmp/kvtier-bench-disk/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "60"}},
    # `kvtier server` on this host, CPU tier off: lent from its shared memory, or over TCP.
    "kvtier-server": {"connector": "KvtierConnector", "server": "", "flush": True,
                      "env": {"LMCACHE_LOCAL_CPU": "false"}},
    "kvtier-server-tcp": {"connector": "KvtierConnector", "server": "?shm=0", "flush": True,
                          "env": {"LMCACHE_LOCAL_CPU": "false"}},
    "lmcache": {"connector": "LMCacheConnectorV1", "env": {"LMCACHE_LOCAL_CPU": "true"}},
    "native": {"native": True},
}


@dataclass
class Record:
    setup: str
    lengths: dict = field(default_factory=dict)  # str(length) -> runs
    machine: dict = field(default_factory=dict)


def make_model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_8B))
    return path


def seed_weights(model) -> int:
    """vLLM's dummy weights replaced, on the GPU, by N(0, 0.02) linear weights and unit norms."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 0.02)
            n += p.numel()
    return n


class ForwardTimer:
    """CUDA events around each forward of the model (installed by hooks)."""

    def __init__(self) -> None:
        self.events: list = []

    def install(self, model) -> None:
        import torch

        def pre(module, args, kwargs=None):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append([start, None])

        def post(module, args, output):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events[-1][1] = end

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)

    def last_ms(self) -> float:
        import torch

        torch.cuda.synchronize()
        start, end = self.events[-1]
        return start.elapsed_time(end)

    def clear(self) -> None:
        self.events.clear()


# What the warm path's timeline shows (host time, from generate()'s call): vLLM's steps and
# kvtier's calls on the way. "module:Class.method" -> label.
TIMED = {
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": "vllm schedule",
    "vllm.v1.executor.uniproc_executor:UniProcExecutor.execute_model": "vllm execute_model",
    "vllm.v1.executor.uniproc_executor:UniProcExecutor.sample_tokens": "vllm sample_tokens",
    "kvtier.integrations.vllm:KvtierConnector.get_num_new_matched_tokens": "kvtier lookup (scheduler)",
    "kvtier.engine:CacheEngine.find": "kvtier find+lease (worker)",
    "kvtier.engine:CacheEngine.upload_ahead": "kvtier upload_ahead (worker)",
    "kvtier.integrations.vllm:KvtierConnector.build_connector_meta": "kvtier metadata",
    "kvtier.integrations.vllm:KvtierConnector.start_load_kv": "kvtier start_load_kv",
    "kvtier.integrations.vllm:KvtierConnector.wait_for_save": "kvtier wait_for_save",
}


class Timeline:
    """Host time stamps of the TIMED calls during one generate() (bench instrumentation:
    methods wrapped at class level, in this process where vLLM's engine runs)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.spans: list[tuple[str, float, float]] = []
        self.on = False

    def install(self) -> None:
        import functools
        import importlib

        for where, label in TIMED.items():
            module, attr = where.split(":")
            cls_name, method = attr.split(".")
            try:
                cls = getattr(importlib.import_module(module), cls_name)
                fn = getattr(cls, method)
            except (ImportError, AttributeError):
                continue  # another vLLM: that step is not shown

            def timed(*a, _fn=fn, _label=label, **k):
                if not self.on:
                    return _fn(*a, **k)
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.spans.append((_label, round((t - self.t0) * 1e3, 2),
                                       round((time.perf_counter() - self.t0) * 1e3, 2)))

            setattr(cls, method, functools.wraps(fn)(timed))

    def start(self) -> None:
        self.spans, self.on, self.t0 = [], True, time.perf_counter()

    def stop(self) -> list[tuple[str, float, float]]:
        self.on = False
        return sorted(self.spans, key=lambda x: x[1])


def flush_kvtier(model) -> bool:
    """(apply_model) The worker's kvtier writes to disk and remote, landed."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().engine.flush(120)


def h2d_bandwidth(nbytes: int) -> float:
    """Pinned host -> GPU copy bandwidth (bytes/s): the best of 3 copies of `nbytes`."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del host, dev
    return nbytes / best


def prompt(length: int, variant: int, vocab: int = 128000) -> list[int]:
    """A deterministic prompt; `variant` changes its first 256 tokens only (so variants share
    everything after the first chunk, which still changes every key)."""
    import random

    body = random.Random(length).choices(range(100, vocab), k=length)
    head = random.Random(1_000_003 * (variant + 1) + length).choices(range(100, vocab), k=256)
    return head + body[256:]


def run_setup(args: argparse.Namespace) -> None:
    setup = SETUPS[args.setup]
    os.environ.update(setup.get("env", {}))
    if "server" not in setup:
        _run_setup(args, setup)
        return
    from kvtier.localservers import kvtier_server

    with kvtier_server(args.cpu_gb) as server:
        os.environ["LMCACHE_REMOTE_URL"] = server.url + "/" + setup["server"]
        _run_setup(args, setup)


def _run_setup(args: argparse.Namespace, setup: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict = {}
    if "connector" in setup:
        kv = {"kv_connector": setup["connector"], "kv_role": "kv_both"}
        if setup["connector"] == "KvtierConnector" and args.module_path:
            kv["kv_connector_module_path"] = "kvtier.integrations.vllm"
        kw["kv_transfer_config"] = KVTransferConfig(**kv)
    if setup.get("native"):
        kw.update(kv_offloading_size=args.cpu_gb, kv_offloading_backend="native")
    model = make_model(Path(args.model))
    timeline = Timeline()
    timeline.install()
    t0 = time.perf_counter()
    llm = LLM(model=str(model), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
              max_model_len=max(args.lengths) + 64, enable_prefix_caching=True, enforce_eager=args.eager,
              gpu_memory_utilization=args.gpu_util, max_num_batched_tokens=args.batched, **kw)
    start_s = time.perf_counter() - t0
    timer = ForwardTimer()
    llm.apply_model(seed_weights)
    llm.apply_model(timer.install)
    rec = Record(args.setup, machine={"gpu": torch.cuda.get_device_name(), "start_s": round(start_s, 1),
                                       "date": time.strftime("%Y-%m-%d"), "eager": args.eager})
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    check = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True, logprobs=0)

    def gen(ids: list[int], sp=one, timed: bool = False):
        if timed:
            timeline.start()
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
        took = time.perf_counter() - t
        if timed:
            timelines.append(timeline.stop())
        return took, out

    def flush() -> None:
        if setup.get("flush") and not all(llm.apply_model(flush_kvtier)):
            print(f"[{args.setup}] kvtier's writes did not land in 120 s", flush=True)

    for length in args.lengths:
        bw = h2d_bandwidth(length * KV_BYTES_PER_TOKEN)
        runs = {"cold": [], "gpu_hit": [], "warm": [], "fwd_ms": [], "gpu_hit_fwd_ms": []}
        # Tokens of variant 0: cold; again at once (a hit in vLLM's own GPU prefix cache: the
        # computation a warm load must reproduce); warm from the offloader; and a control
        # prompt (variant 1: another first chunk) cold.
        base = prompt(length, 0)
        timelines: list = []
        _, cold_out = gen(base, check)
        _, gpu_out = gen(base, check)
        llm.reset_prefix_cache()
        flush()
        _, warm_out = gen(base, check)
        llm.reset_prefix_cache()
        _, ctrl_out = gen(prompt(length, 1), check)
        llm.reset_prefix_cache()
        tokens = {"cold": list(cold_out.token_ids), "gpu_hit": list(gpu_out.token_ids),
                  "warm": list(warm_out.token_ids), "control": list(ctrl_out.token_ids),
                  "warm_logprob_err": _logprob_err(warm_out, gpu_out),
                  "cold_vs_gpu_hit_logprob_err": _logprob_err(cold_out, gpu_out)}
        for i in range(args.pairs + 1):  # the first pair warms up
            ids = prompt(length, 100 + i)
            cold, _ = gen(ids)
            timer.clear()
            last = i == args.pairs
            gpu_hit, _ = gen(ids, timed=last)  # vLLM's own prefix cache: what a zero-cost load would give
            gpu_hit_fwd = timer.last_ms()
            llm.reset_prefix_cache()
            flush()
            timer.clear()
            profiled = args.profile and last
            prof = cProfile.Profile() if profiled else None
            if prof is not None:
                prof.enable()
            warm, _ = gen(ids, timed=last and not profiled)
            if prof is not None:
                prof.disable()
                with open(f"{args.out}/{args.setup}.prof.txt", "a") as f:
                    f.write(f"==== {args.setup} {length} tokens: the last warm run\n")
                    pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(70)
            fwd = timer.last_ms()
            llm.reset_prefix_cache()
            if i:
                for key, value in (("cold", cold), ("gpu_hit", gpu_hit), ("warm", warm), ("fwd_ms", fwd),
                                   ("gpu_hit_fwd_ms", gpu_hit_fwd)):
                    runs[key].append(value)
        copy_s = length * KV_BYTES_PER_TOKEN / bw
        # The forward timed alone: the GPU-hit step's (its own launches paced it, as a
        # forward that waits for nothing runs); the warm step's ran behind its copies.
        alone = [f / 1e3 for f in runs["gpu_hit_fwd_ms"]]
        rec.lengths[str(length)] = {
            **runs, "h2d_GBps": bw / 1e9, "copy_ms": copy_s * 1e3, "tokens": tokens,
            "timeline": dict(zip(("gpu_hit", "warm"), timelines)),
            "cold_median": statistics.median(runs["cold"]), "warm_median": statistics.median(runs["warm"]),
            "gpu_hit_median": statistics.median(runs["gpu_hit"]),
            "fwd_median_ms": statistics.median(runs["gpu_hit_fwd_ms"]),
            "warm_over_floor_paired": statistics.median(w / (copy_s + f) for w, f in zip(runs["warm"], alone)),
            "warm_over_max_load_fwd_paired": statistics.median(
                w / max(copy_s, f) for w, f in zip(runs["warm"], alone)),
        }
        r = rec.lengths[str(length)]
        print(f"[{args.setup}] {length}: cold {r['cold_median']*1e3:.1f} ms, warm {r['warm_median']*1e3:.1f} ms, "
              f"vLLM's own GPU prefix hit {r['gpu_hit_median']*1e3:.1f} ms, "
              f"copy {r['copy_ms']:.1f} ms ({r['h2d_GBps']:.1f} GB/s) + fwd {r['fwd_median_ms']:.1f} ms, "
              f"warm/floor {r['warm_over_floor_paired']:.3f}, warm/max(load,fwd) "
              f"{r['warm_over_max_load_fwd_paired']:.3f}", flush=True)
        for name, spans in r["timeline"].items():  # the record keeps them all; here the longer ones
            print(f"[{args.setup}] {length} {name} timeline (ms from generate(), calls over 0.5 ms): "
                  + "; ".join(f"{label} {a:.1f}-{b:.1f}" for label, a, b in spans if b - a > 0.5), flush=True)
    Path(args.out, f"{args.setup}.json").write_text(json.dumps(rec.__dict__, indent=1))


def _logprob_err(a, b) -> float:
    """The largest difference of two outputs' logprobs of the tokens both sampled, up to
    where they first differ (inf where the first token differs)."""
    err = 0.0
    for la, lb, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
        if ta != tb:
            return err if err else float("inf")
        err = max(err, abs(la[ta].logprob - lb[tb].logprob))
    return err


def compare(out: Path) -> int:
    """The table of every setup's record, and the token checks against plain vLLM."""
    recs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    plain = recs.get("plain")
    bad = 0
    for name, rec in recs.items():
        for length, r in rec["lengths"].items():
            t = r["tokens"]
            # Loaded KV computes what vLLM's own cached KV does; plain vLLM recomputes "warm" (a
            # prefix-cache hit and a whole prefill may differ in the last bits of bf16).
            same_warm = t["warm"] == (t["cold"] if name == "plain" else t["gpu_hit"])
            same_plain = plain is None or plain["lengths"].get(length, {}).get("tokens", {}).get("cold") == t["cold"]
            control_differs = t["control"] != t["cold"]
            ok = same_warm and same_plain and control_differs
            bad += not ok
            print(f"{name:18s} {length:>6s}  cold {r['cold_median']*1e3:7.1f}  warm {r['warm_median']*1e3:7.1f} ms"
                  f"  (GPU hit {r['gpu_hit_median']*1e3:6.1f})"
                  f"  floor ratio {r['warm_over_floor_paired']:.3f}  max(load,fwd) ratio "
                  f"{r['warm_over_max_load_fwd_paired']:.3f}  tokens {'OK' if ok else 'DIFFER'}"
                  f" (warm=GPU hit {same_warm}, cold=plain {same_plain}, control differs {control_differs},"
                  f" logprob err {t['warm_logprob_err']:.3g}, cold vs GPU hit {t['cold_vs_gpu_hit_logprob_err']:.3g})")
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=SETUPS, help="run one setup (in this process)")
    p.add_argument("--setups", nargs="*", default=[], help="run these, one subprocess each, then compare")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--model", default="/tmp/kvtier-llama8b")
    p.add_argument("--out", default="results/gpu-vllm")
    p.add_argument("--cpu-gb", type=float, default=20.0, help="CPU memory each offloader gets (GB)")
    p.add_argument("--gpu-util", type=float, default=0.85)
    p.add_argument("--batched", type=int, default=8192)
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--setup-timeout", type=float, default=300, help="seconds a setup may take")
    p.add_argument("--profile", action="store_true", help="cProfile the last warm run of each length")
    p.add_argument("--module-path", action=argparse.BooleanOptionalAction, default=False,
                   help="name kvtier's module in the config (default: by name, through vLLM's plugin)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.setup:
        run_setup(args)
        return
    rc = 0
    for name in args.setups:
        cmd = [sys.executable, "-m", "kvtier.bench.vllm", "--setup", name, *_passthrough(args)]
        env = {**os.environ, "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.cpu_gb), "LMCACHE_CHUNK_SIZE": "256"}
        try:
            rc |= subprocess.run(cmd, env=env, timeout=args.setup_timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"[{name}] did not finish in {args.setup_timeout} s", flush=True)
            rc = 1
    sys.exit(rc or compare(Path(args.out)))


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--lengths", *map(str, args.lengths), "--pairs", str(args.pairs), "--check-tokens",
           str(args.check_tokens), "--model", args.model, "--out", args.out, "--cpu-gb", str(args.cpu_gb),
           "--gpu-util", str(args.gpu_util), "--batched", str(args.batched)]
    out.append("--eager" if args.eager else "--no-eager")
    out += ["--profile"] if args.profile else []
    out += ["--module-path"] if args.module_path else []
    return out


if __name__ == "__main__":
    main()
