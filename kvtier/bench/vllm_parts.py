"""The parts of `kvtier.bench.vllm` that run inside its vLLM process: the model
(a Llama-3.1-8B shape, seeded weights), the forward's CUDA-event timer, the
host timeline of the warm path, the copy bandwidth, the prompts."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}
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
        gc.callbacks.append(self._gc)

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


def flush_kvtier(model) -> bool:
    """(apply_model) The worker's kvtier writes to disk and remote, landed."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker.engine.flush(120)


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
