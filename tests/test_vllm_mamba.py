"""A Mamba hybrid through vLLM's hybrid KV cache manager, on a GPU (vLLM's CPU build has
none): in `--mamba-cache-mode align` vLLM keeps each Mamba layer's state where a prefill
step ends on a block end, kvtier stores it beside the chunk ending there
(kvtier/engine/states.py), and a hit ends only where such a state is.

A tiny Nemotron-H-style model (four Mamba-2 layers, two attention layers), its prompt
prefilled 320 tokens a step so that states are kept at several block ends: hits loaded
from kvtier's CPU tier, one of the whole prompt and one of a prompt sharing its first 600
tokens, must give plain vLLM's tokens, and a control prompt differing in tokens a hit loads
must not."""

from __future__ import annotations

import re

import pytest
import torch
from vllm_offline import run_vllm

from kvtier_tools.dev.demo import HIT_LINE
from kvtier_tools.dev.tinymodel import TinyNemotronH, corpus_text

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="vLLM's hybrid allocator runs on a GPU"
    ),
]
DTYPE = "bfloat16"
BATCHED = 320
CHUNK_LINE = re.compile(
    r"kept only at vLLM's block ends \((\d+) tokens\): kvtier's chunk_size 256 -> (\d+)"
)


def test_a_mamba_hybrid_loads_hits_with_their_state_and_gives_plain_vllms_tokens(
    nemotron_h, tmp_path
):
    from transformers import AutoTokenizer

    vocab = TinyNemotronH().vocab_size
    prompt = AutoTokenizer.from_pretrained(str(nemotron_h)).encode(corpus_text())[10000:11000]
    shared = prompt[:600] + [(t * 5 + 1) % vocab for t in prompt[600:]]
    control = prompt[:600] + [(t * 7 + 3) % vocab for t in prompt[600:816]] + prompt[816:]
    (plain, _, plain_shared, _, plain_control), _ = run_vllm(
        nemotron_h,
        [prompt, "FORGET", shared, "FORGET", control],
        tmp_path,
        dtype=DTYPE,
        name="plain",
        max_batched=BATCHED,
        mamba_align=True,
    )
    # Tokens a hit loads matter: the control's output is not plain's (by the measure below).
    assert (
        plain["token_ids"] != plain_control["token_ids"]
        or max(abs(x - y) for x, y in zip(plain["logprobs"], plain_control["logprobs"])) > 0.2
    )
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"}
    (cold, _, warm, _, warm_shared), log = run_vllm(
        nemotron_h,
        [prompt, "FORGET", prompt, "FORGET", shared],
        tmp_path,
        "kv_both",
        env,
        name="mamba",
        dtype=DTYPE,
        max_batched=BATCHED,
        mamba_align=True,
    )
    sizes = CHUNK_LINE.search(log)
    assert sizes is not None, log[-3000:]
    block = int(sizes.group(1))
    assert "Mamba layers' state is stored at chunk ends" in log
    hits = [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log)]
    # The whole prompt's state is kept at its last block end; the shared prompt's at the last
    # block end of a step within its first 600 tokens.
    assert hits[0] == (1000, 0, 0) and hits[1] == (
        1000,
        999 // block * block,
        999 // block * block,
    ), hits
    assert hits[2][1] <= 600 and hits[2][1] > 0 and hits[2][1] % block == 0, hits
    said = "\n".join(line for line in log.splitlines() if "kvtier" in line or "Mamba" in line)[
        -6000:
    ]
    assert cold["token_ids"] == plain["token_ids"], f"cold {cold}\nplain {plain}\n{said}"
    assert warm["token_ids"] == plain["token_ids"], f"warm {warm}\nplain {plain}\n{said}"
    assert warm_shared["token_ids"] == plain_shared["token_ids"], (
        f"{warm_shared}\n{plain_shared}\n{said}"
    )
    for got, want in ((warm, plain), (warm_shared, plain_shared)):
        assert max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])) < 0.05
