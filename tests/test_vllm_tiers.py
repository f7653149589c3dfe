"""Real vLLM (CPU build) with a CPU pool smaller than the prompt: disk and remote tiers behind it.

The model runs in float32 here, the dtype CPU hosts with AMX fall back to
(kvtier_tools.dev.cpu_dtype), so every machine runs vLLM + kvtier in it at least here.
"""

from __future__ import annotations

import re

import pytest
from vllm_offline import run_vllm

from kvtier.keys import KVFormat, chunk_spans
from kvtier.tiers.disk import file_name
from kvtier_tools.dev.demo import HIT_LINE
from kvtier_tools.dev.localservers import kvtier_server
from kvtier_tools.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm
DTYPE = "float32"
# The tiny model in float32: 8 layers x K,V x 2 heads x 64 x 4 bytes = 8 KiB per token, 2 MiB
# per chunk.
TWO_CHUNKS, ONE_CHUNK = "0.004", "0.0025"  # GiB of CPU pool: 2 blocks, 1 block
RECOMPUTED = re.compile(r"(\d+) of (\d+) tokens could not be loaded")


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model)).encode(corpus_text())[30000:33000]


@pytest.fixture(scope="module")
def plain(tiny_model, prompt, tmp_path_factory):
    return run_vllm(tiny_model, [prompt], tmp_path_factory.mktemp("plain"), dtype=DTYPE)[0][0]


def hits(log: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log)]


def disk_env(path) -> dict[str, str]:
    return {
        "LMCACHE_MAX_LOCAL_CPU_SIZE": TWO_CHUNKS,
        "LMCACHE_LOCAL_DISK": f"file://{path}",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "1",
    }


def test_a_prompt_larger_than_the_pool_hits_from_disk_also_after_a_restart(
    tiny_model, prompt, plain, tmp_path
):
    env = disk_env(tmp_path / "disk")
    results, log = run_vllm(
        tiny_model,
        [prompt, prompt, "RESET", prompt],
        tmp_path,
        "kv_both",
        env,
        name="first",
        dtype=DTYPE,
    )
    # vLLM's reset cleared RAM and disk
    assert hits(log) == [
        (3000, 0, 0),
        (3000, 2816, 2816),
        (3000, 0, 0),
    ]
    assert results[2] == {"reset": True} and "cleared the local tiers (CPU RAM and disk)" in log
    results = results[:2] + results[3:]
    assert (
        "hit tokens 2816, need to load 2816 "
        "(not all in CPU RAM: loading from disk/remote in the background)" in log
    )
    # on disk already
    assert "Storing KV cache for" not in log.split("hit tokens 2816")[1].split("cleared")[0]
    assert "skipping the store" not in log and not RECOMPUTED.search(log)
    # every whole chunk, through a 2-chunk pool
    assert len(list((tmp_path / "disk").glob("*.kvc"))) == 11
    assert [r["token_ids"] for r in results] == [plain["token_ids"]] * 3
    (again,), log = run_vllm(
        tiny_model, [prompt], tmp_path, "kv_both", env, name="restart", dtype=DTYPE
    )
    assert "disk tier: " in log and ", 11 chunks" in log  # the index rebuilt from the directory
    assert hits(log) == [(3000, 2816, 2816)]
    assert again["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(again["logprobs"], plain["logprobs"])) < 0.05


def test_a_pool_of_one_chunk_shares_a_prompt_through_a_kvtier_server(
    tiny_model, prompt, plain, tmp_path
):
    with kvtier_server(0.25) as srv:
        env = {"LMCACHE_REMOTE_URL": srv.url, "LMCACHE_MAX_LOCAL_CPU_SIZE": ONE_CHUNK}
        (a,), log_a = run_vllm(
            tiny_model, [prompt], tmp_path, "kv_both", env, name="a", dtype=DTYPE
        )
        (b,), log_b = run_vllm(
            tiny_model, [prompt], tmp_path, "kv_both", env, name="b", dtype=DTYPE
        )
    assert "CPU pool 1 chunks" in log_a and "skipping the store" not in log_a
    assert hits(log_b) == [(3000, 2816, 2816)]
    assert not RECOMPUTED.search(log_b)
    assert a["token_ids"] == b["token_ids"] == plain["token_ids"]


@pytest.mark.vllm_smoke
def test_a_load_that_fails_after_the_lookup_is_recomputed_under_the_default_policy(
    tiny_model, prompt, plain, tmp_path
):
    env = disk_env(tmp_path / "disk")
    run_vllm(tiny_model, [prompt], tmp_path, "kv_both", env, name="store", dtype=DTYPE)
    # The sixth chunk's file goes bad on disk: the lookup still counts it (the file
    # is there), the load finds it corrupt. vLLM's kv_load_failure_policy is left
    # at its default ("fail").
    bad = tmp_path / "disk" / _chunk_file_names(tiny_model, prompt, tmp_path / "disk")[5]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    (result,), log = run_vllm(
        tiny_model, [prompt], tmp_path, "kv_both", env, name="load", dtype=DTYPE
    )
    assert hits(log) == [(3000, 2816, 2816)]
    assert "is corrupt" in log and RECOMPUTED.search(log).groups() == ("1536", "2816")
    assert "kv_load_failure_policy 'fail' -> 'recompute'" in log and "Failing" not in log
    assert result["token_ids"] == plain["token_ids"]
    assert max(abs(x - y) for x, y in zip(result["logprobs"], plain["logprobs"])) < 0.05


def _chunk_file_names(model, prompt, disk) -> list[str]:
    """The disk file of each chunk of `prompt`, keyed as vLLM's worker keys them (its KV
    layout name depends on the CPU attention kernel vLLM picks here: the one on disk)."""
    for layout in ("vllm-cpu-vec", "vllm"):
        fmt = KVFormat(str(model), layout, DTYPE)
        names = [file_name(s.key) for s in chunk_spans(prompt, fmt, 256, False)]
        if (disk / names[0]).exists():
            return names
    raise AssertionError(f"no chunk file of the prompt in {disk}")


def test_save_decode_cache_stores_generated_tokens_for_a_follow_up(tiny_model, tmp_path):
    """A chat's next turn starts with the previous prompt and answer: with save_decode_cache
    the answer's whole chunks are stored as it is generated, so the next prompt hits past
    the first prompt (here on disk, from a second vLLM process)."""
    from transformers import AutoTokenizer

    first = AutoTokenizer.from_pretrained(str(tiny_model)).encode(corpus_text())[40000:40300]
    env = {**disk_env(tmp_path / "disk"), "LMCACHE_SAVE_DECODE_CACHE": "true"}
    (turn1,), log = run_vllm(
        tiny_model, [first], tmp_path, "kv_both", env, name="turn1", dtype=DTYPE, max_tokens=260
    )
    assert len(turn1["token_ids"]) == 260
    # [256, 512): prompt tail + 212 generated
    assert "Storing KV cache for 256 out of 512 tokens" in log
    follow_up = first + turn1["token_ids"][:250]  # 550 tokens
    _, log = run_vllm(tiny_model, [follow_up], tmp_path, "kv_both", env, name="turn2", dtype=DTYPE)
    # without the decode cache: 256, the prompt's one whole chunk
    assert hits(log) == [(550, 512, 512)]


def test_the_int8_codec_shares_a_prompt_through_a_kvtier_server(
    tiny_model, prompt, plain, tmp_path
):
    """remote_serde int8 with vLLM's CPU backend (the torch codec): half the bytes in
    every tier, the prompt still a hit on another instance."""
    with kvtier_server(0.25) as srv:
        env = {
            "LMCACHE_REMOTE_URL": srv.url,
            "LMCACHE_MAX_LOCAL_CPU_SIZE": ONE_CHUNK,
            "LMCACHE_REMOTE_SERDE": "int8",
        }
        (a,), log_a = run_vllm(
            tiny_model, [prompt], tmp_path, "kv_both", env, name="a", dtype=DTYPE
        )
        (b,), log_b = run_vllm(
            tiny_model, [prompt], tmp_path, "kv_both", env, name="b", dtype=DTYPE
        )
    # float32 KV: a quarter, plus scales
    assert "lossy KV codec int8 (chunks 0.266 of the KV's bytes)" in log_a
    assert hits(log_b) == [(3000, 2816, 2816)]
    assert not RECOMPUTED.search(log_b)
    assert a["token_ids"] == b["token_ids"] == plain["token_ids"]
    # Measured: 0.0006-0.0018 (2026-11-24); the float32 tiny model with lossless KV gives < 1e-4.
    assert max(abs(x - y) for x, y in zip(b["logprobs"], plain["logprobs"])) < 0.05
