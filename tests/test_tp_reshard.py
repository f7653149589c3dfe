"""share_across_tp: KV stored by the ranks of one tensor-parallel size is a hit for the
ranks of another, through the disk tier and the store server (kvtier/tiers/reshard.py).
Real engines (CPU), real files, a real `kvtier server`; each rank's KV is its slice of
one model's KV heads, as vLLM shards them."""

import dataclasses

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from kvtier.keys import KVFormat
from kvtier.tiers.disk import file_name
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import kvtier_server

L, NB, BS, H, D = 2, 64, 16, 4, 8  # H: the model's KV heads
FMT = KVFormat("m", "flash_attn", "float32")
TOKENS = list(range(7000, 7096))  # 6 chunks of 16
SRC, DST = torch.arange(0, 96), torch.arange(200, 296)


@pytest.fixture(scope="module")
def full():
    torch.manual_seed(0)
    return [torch.randn(2, NB, BS, H, D) for _ in range(L)]


def shard(full, rank, size):
    """Rank `rank` of `size`: its KV heads of the model's, as its own tensors."""
    per = H // size
    return [x[..., rank * per : (rank + 1) * per, :].clone() for x in full]


def engine(layers, rank, size, tmp_path, remote=None, share=True):
    config = KvtierConfig(
        chunk_size=16,
        max_local_cpu_size=0.01,
        local_disk=None if remote else f"file://{tmp_path}",
        max_local_disk_size=0.0 if remote else 1.0,
        remote_url=remote,
        share_across_tp=share,
    )
    return CacheEngine(
        config,
        PagedKV.wrap(layers, "flash_attn"),
        dataclasses.replace(FMT, tp_rank=rank, tp_size=size),
    )


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def store(full, size, tmp_path, remote):
    for rank in range(size):
        eng = engine(shard(full, rank, size), rank, size, tmp_path, remote)
        assert eng.store(TOKENS, SRC) == 96 and eng.flush(timeout=10)
        eng.close()


@pytest.fixture(params=["disk", "server"])
def remote(request):
    if request.param == "disk":
        yield None
    else:
        with kvtier_server(0.05) as srv:
            yield srv.url


@pytest.mark.parametrize("stored, loads", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_kv_stored_at_one_tp_size_loads_at_another(full, tmp_path, remote, stored, loads):
    store(full, stored, tmp_path, remote)
    for rank in range(loads):
        want = shard(full, rank, loads)
        eng = engine([torch.zeros_like(x) for x in want], rank, loads, tmp_path, remote)
        assert eng.lookup(TOKENS) == 96
        assert eng.retrieve(TOKENS, DST).all()
        assert torch.equal(kv_at(eng.kv.layers, DST), kv_at(want, SRC))
        # promoted to RAM under this rank's own keys: found there without the other size
        assert all(w == "cpu" for w in eng.tiers.locate([s.key for s in eng.spans(TOKENS)]))
        eng.close()


def test_without_share_across_tp_another_sizes_chunks_are_not_found(full, tmp_path):
    store(full, 2, tmp_path, None)
    eng = engine([torch.zeros_like(x) for x in full], 0, 1, tmp_path, share=False)
    assert eng.lookup(TOKENS) == 0
    eng.close()


def test_a_hit_joined_from_several_ranks_ends_where_one_of_them_misses(full, tmp_path):
    store(full, 2, tmp_path, None)
    probe = engine(shard(full, 1, 2), 1, 2, tmp_path / "probe")
    fourth = probe.spans(TOKENS)[3].key  # rank 1's key of the fourth chunk
    probe.close()
    (tmp_path / "tp1of2" / file_name(fourth)).unlink()
    eng = engine([torch.zeros_like(x) for x in full], 0, 1, tmp_path)
    assert eng.lookup(TOKENS) == 48  # three chunks: the fourth lacks rank 1's heads
    eng.close()


def test_a_lossy_codec_and_share_across_tp_are_refused_together():
    with pytest.raises(ConfigError, match="share_across_tp"):
        KvtierConfig(share_across_tp=True, remote_serde="int8")
