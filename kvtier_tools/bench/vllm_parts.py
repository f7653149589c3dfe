"""The parts of `kvtier_tools.bench.vllm` that run inside its vLLM process: the model
(a Llama-3.1-8B shape, seeded weights), the forward's CUDA-event timer, the
host timeline of the warm path, the copy bandwidth, the prompts."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A Gemma-3-style model with the same KV per token as LLAMA_8B (32 layers, 8 KV heads of
# 128): five of six layers attend to the last 1024 tokens only. With kvtier (SupportsHMA)
# vLLM's hybrid allocator keeps those layers' tokens in blocks of their own.
GEMMA3_8B = {
    **{
        k: LLAMA_8B[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "torch_dtype",
            "bos_token_id",
            "eos_token_id",
        )
    },
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "sliding_window": 1024,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(32)
    ],
    "query_pre_attn_scalar": 128,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}
# gpt-oss's attention pattern (every other layer attends to the last 128 tokens, less than
# kvtier's chunk of 256: kvtier's chunk becomes 128) on the dense GEMMA3_8B, which the GPU
# bundle runs (gpt-oss's MoE kernels are not in it).
GPTOSS_DENSE_8B = {
    **GEMMA3_8B,
    "sliding_window": 128,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(32)],
}
# Nemotron-H-8B's shape: 24 Mamba-2 layers, 4 attention layers (KV 16 KiB a token), 24 MLPs.
# With kvtier (SupportsHMA, --mamba-cache-mode align) vLLM keeps each Mamba layer's state
# at prefill steps' block ends, and kvtier stores it beside the chunk ending there.
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_n_groups": 8,
    "ssm_state_size": 128,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 131072,
    "mlp_hidden_act": "relu2",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# DeepSeek-V2-Lite's attention (multi-head latent attention: a 512 + 64 latent row a token and
# layer, 31 KB a token over 27 layers, a quarter of LLAMA_8B's) with dense MLPs in every layer
# (the GPU bundle has no MoE kernels).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 27,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 2,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODELS = {
    "llama": LLAMA_8B,
    "gemma3": GEMMA3_8B,
    "gptoss_dense": GPTOSS_DENSE_8B,
    "nemotron_h": NEMOTRON_H_8B,
    "deepseek_v2": DEEPSEEK_V2_LITE,
}


def kv_bytes_per_token(family: str) -> int:
    """Bytes of KV a token (bf16) that a warm hit of the family's model moves: an MLA model's
    latent rows; the others' that of LLAMA_8B (whose KV a token each of them has, or, for
    nemotron_h, is measured against)."""
    config = MODELS[family]
    if "kv_lora_rank" in config:
        return (
            config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
        )
    return (
        LLAMA_8B["num_hidden_layers"]
        * 2
        * LLAMA_8B["num_key_value_heads"]
        * LLAMA_8B["head_dim"]
        * 2
    )


def make_model(path: Path, family: str = "llama") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[family]))
    return path


def seed_weights(model) -> int:
    """vLLM's dummy weights replaced, on the GPU, by N(0, 0.02) linear weights and unit norms;
    a Mamba layer's decay A = -(1..heads) and its step dt = 0.01 (a unit A would grow its state
    without bound)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(".A"):
                p.copy_(
                    -torch.arange(1, p.numel() + 1, device=p.device, dtype=torch.float32).view(
                        p.shape
                    )
                )
            elif name.endswith(".dt_bias"):
                p.fill_(-4.6)  # softplus(-4.6) = 0.01
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(
                    torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 0.02
                )
            n += p.numel()
    return n


class ForwardTimer:
    """CUDA events around each model step, from vLLM's execute_model to the end of its
    sample_tokens (wrapped at class level: with CUDA graphs the model's own module
    hooks do not run). A GPU-hit step waits for nothing: its time is the forward's."""

    def __init__(self) -> None:
        self.events: list = []

    def install(self) -> None:
        import torch

        def start(*_):
            self.events.append([torch.cuda.Event(enable_timing=True), None])
            self.events[-1][0].record()

        def end(*_):
            if self.events and self.events[-1][1] is None:
                self.events[-1][1] = torch.cuda.Event(enable_timing=True)
                self.events[-1][1].record()

        wrap_method(EXECUTOR + ".execute_model", before=start)
        wrap_method(EXECUTOR + ".sample_tokens", after=end)

    def last_ms(self) -> float:
        import torch

        torch.cuda.synchronize()
        start, end = next((e for e in reversed(self.events) if e[1] is not None), (None, None))
        # TP > 1: steps in the workers
        return start.elapsed_time(end) if start is not None else float("nan")

    def clear(self) -> None:
        self.events.clear()


EXECUTOR = "vllm.v1.executor.uniproc_executor:UniProcExecutor"


def wrap_method(where: str, before=None, after=None) -> bool:
    """Wrap "module:Class.method" at class level: before(t) and after(t), t the call's
    start (perf_counter), around each call. False where this vLLM has no such method."""
    import functools
    import importlib

    module, attr = where.split(":")
    cls_name, method = attr.split(".")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
        fn = getattr(cls, method)
    except (ImportError, AttributeError):
        return False

    def wrapped(*a, **k):
        t = time.perf_counter()
        if before is not None:
            before(t)
        try:
            return fn(*a, **k)
        finally:
            if after is not None:
                after(t)

    setattr(cls, method, functools.wraps(fn)(wrapped))
    return True


# What the warm path's timeline shows (host time, from generate()'s call): vLLM's steps and
# kvtier's calls on the way. "module:Class.method" -> label.
TIMED = {
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": "vllm schedule",
    EXECUTOR + ".execute_model": "vllm execute_model",
    EXECUTOR + ".sample_tokens": "vllm sample_tokens",
    "kvtier.integrations.vllm:KvtierConnector.get_num_new_matched_tokens": (
        "kvtier lookup (scheduler)"
    ),
    "kvtier.engine:CacheEngine.find": "kvtier find+hold (worker)",
    "kvtier.engine:CacheEngine.upload_ahead": "kvtier upload_ahead (worker)",
    "kvtier.integrations.vllm:KvtierConnector.build_connector_meta": "kvtier metadata",
    "kvtier.integrations.vllm:KvtierConnector.start_load_kv": "kvtier start_load_kv",
    "kvtier.integrations.vllm:KvtierConnector.wait_for_save": "kvtier wait_for_save",
    "kvtier.integrations.vllm:KvtierConnector.get_finished": "kvtier get_finished",
    "kvtier.integrations.vllm:KvtierConnector.request_finished": "kvtier request_finished",
    "vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output": "vllm sampled tokens to host",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": "vllm update_from_output",
    "vllm.v1.engine.output_processor:OutputProcessor.process_outputs": "vllm process_outputs",
}


class Timeline:
    """Host time stamps of the TIMED calls during one generate() (bench instrumentation:
    methods wrapped at class level, in this process where vLLM's engine runs)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.spans: list[tuple[str, float, float]] = []
        self.on = False
        self._gc_start = 0.0

    def install(self) -> None:
        for where, label in TIMED.items():
            wrap_method(where, after=lambda t, _label=label: self._span(_label, t))
        gc.callbacks.append(self._gc)

    def _span(self, label: str, t: float) -> None:
        if self.on:
            self.spans.append(
                (
                    label,
                    round((t - self.t0) * 1e3, 2),
                    round((time.perf_counter() - self.t0) * 1e3, 2),
                )
            )

    def _gc(self, phase: str, info: dict) -> None:
        """Python's garbage collections, as spans too (one can stall a step)."""
        if not self.on:
            return
        now = round((time.perf_counter() - self.t0) * 1e3, 2)
        if phase == "start":
            self._gc_start = now
        else:
            self.spans.append((f"python gc gen{info['generation']}", self._gc_start, now))

    def start(self) -> None:
        self.spans, self.on, self.t0 = [], True, time.perf_counter()

    def stop(self) -> list[tuple[str, float, float]]:
        self.on = False
        return sorted(self.spans, key=lambda x: x[1])


# The probes of the engine's process (install_probes): a ForwardTimer and a Timeline there.
# The bench reaches them through LLM.apply_model, the same call in-process and with the
# multiprocess engine (where the engine core, scheduler and worker run in a process of their
# own: apply_model sends these functions there).
_PROBES: dict = {}


def install_probes(model) -> bool:
    """(apply_model) A ForwardTimer and a Timeline in the engine's process, installed once."""
    if not _PROBES:
        _PROBES["timer"], _PROBES["timeline"] = ForwardTimer(), Timeline()
        _PROBES["timer"].install()
        _PROBES["timeline"].install()
    return True


def probe_clear(model) -> None:
    """(apply_model) Forget the steps timed so far."""
    _PROBES["timer"].clear()


def probe_forward_ms(model) -> float:
    """(apply_model) The last model step's GPU time."""
    return _PROBES["timer"].last_ms()


def probe_timeline_start(model) -> None:
    """(apply_model) Start a run's timeline."""
    _PROBES["timeline"].start()


def probe_timeline_stop(model) -> list[tuple[str, float, float]]:
    """(apply_model) The run's spans, in ms from its start."""
    return _PROBES["timeline"].stop()


def engine_ms(spans: list[tuple[str, float, float]]) -> float:
    """A run's time inside vLLM's engine: from its scheduler's first look at the request to
    the end of its last update_from_output (leaves out generate()'s front end, request
    hashing and setup, which varies by several ms run to run and is no connector's)."""
    starts = [a for label, a, _ in spans if label == "vllm schedule"]
    ends = [b for label, _, b in spans if label == "vllm update_from_output"]
    # nan: vLLM's methods not wrapped
    return max(ends) - min(starts) if starts and ends else float("nan")


def traced(call, path: Path):
    """`call()` under torch's profiler (host and CUDA), its trace written to `path`
    (gzipped chrome trace); returns call's result and the GPU's timeline in lines."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("generate"):
            out = call()
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    raw.unlink()
    return out, gpu_timeline(trace["traceEvents"]) + host_waits(trace["traceEvents"])


def gpu_timeline(events: list[dict]) -> list[str]:
    """Per CUDA stream and kind of work (copies by direction, kvtier's kernels, attention,
    the rest of the model): count, first start and last end in ms from generate()'s
    start, and busy ms."""
    t0 = next(e["ts"] for e in events if e.get("name") == "generate" and e.get("ph") == "X")
    groups: dict[tuple, list] = {}
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or e.get("ph") != "X":
            continue
        name = e["name"]
        kind = (
            name.split(" (")[0]
            if cat != "kernel"
            else "kvtier kernels"
            if any(k in name for k in ("kv_copy", "kv_quant", "digest", "host_words"))
            else "attention"
            if "flash" in name.lower()
            else "model kernels"
        )
        g = groups.setdefault(
            (e.get("args", {}).get("stream", "?"), kind), [0, float("inf"), 0.0, 0.0]
        )
        start, end = (e["ts"] - t0) / 1e3, (e["ts"] + e.get("dur", 0) - t0) / 1e3
        g[0] += 1
        g[1], g[2], g[3] = min(g[1], start), max(g[2], end), g[3] + e.get("dur", 0) / 1e3
    return [
        f"stream {stream} {kind}: {n} ops, {first:.1f}-{last:.1f} ms, busy {busy:.1f} ms"
        for (stream, kind), (n, first, last, busy) in sorted(
            groups.items(), key=lambda kv: kv[1][1]
        )
    ]


# CUDA runtime calls a host may block in
WAITS = "Synchronize", "cudaMemcpy", "cudaStreamWaitEvent"


def host_waits(events: list[dict]) -> list[str]:
    """The host's CUDA runtime calls that can block it (synchronizations, copies): per
    thread and call, count and total ms, the ones over 0.05 ms in all."""
    groups: dict[tuple, list] = {}
    for e in events:
        if (
            e.get("cat") != "cuda_runtime"
            or e.get("ph") != "X"
            or not any(w in e["name"] for w in WAITS)
        ):
            continue
        g = groups.setdefault((e.get("tid", "?"), e["name"]), [0, 0.0, 0.0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + e.get("dur", 0) / 1e3, max(g[2], e.get("dur", 0) / 1e3)
    return [
        f"host thread {tid} {name}: {n} calls, {ms:.2f} ms in all, longest {top:.2f} ms"
        for (tid, name), (n, ms, top) in sorted(groups.items(), key=lambda kv: -kv[1][1])
        if ms > 0.05
    ]


def flush_kvtier(model) -> bool:
    """(apply_model) The worker's kvtier writes to disk and remote, landed."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker.engine.flush(120)


def kvtier_chunking(model) -> dict:
    """(apply_model) The worker's kvtier chunk: its size in tokens (after the model's rules,
    integrations/vllm/groups.py) and the bytes it stores a token."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().worker.engine
    return {"chunk_size": engine.chunk_size, "stored_bytes_per_token": engine.mover.bytes_per_token}


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


def prompt(length: int, variant: int, family: str = "llama") -> list[int]:
    """A deterministic prompt of ids in [100, min(128000, the family's vocabulary)); `variant`
    changes its first 256 tokens only (so variants share everything after the first chunk,
    which still changes every key)."""
    import random

    vocab = min(128000, MODELS[family]["vocab_size"])
    body = random.Random(length).choices(range(100, vocab), k=length)
    head = random.Random(1_000_003 * (variant + 1) + length).choices(range(100, vocab), k=256)
    return head + body[256:]


def ended_on_error(fn: Callable[..., object], *args: object) -> None:
    """`fn(*args)` in a setup's process; if it raises, the traceback and the process's end at
    once: a vLLM engine that died leaves threads (LMCache's among them) that hold the
    interpreter's exit until the setup's time limit."""
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def run_setup_process(
    name: str, cmd: list[str], env: dict, record: Path, timeout: float, grace: float = 20.0
) -> int:
    """One setup's process; killed at `timeout`, or `grace` s after it wrote its record
    (LMCache's process has hung at exit for minutes after its last request)."""
    record.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, env=env)
    deadline, written = time.monotonic() + timeout, None
    while proc.poll() is None:
        now = time.monotonic()
        if written is None and record.exists():
            written = now
        if now > deadline or (written is not None and now - written > grace):
            proc.kill()
            proc.wait()
            if written is None:
                print(f"[{name}] did not finish in {timeout} s", flush=True)
                return 1
            print(
                f"[{name}] wrote its record but had not exited {grace:.0f} s later: killed",
                flush=True,
            )
            return 0
        time.sleep(0.5)
    return proc.returncode
