"""CPU RAM, disk and a remote store together, through CacheEngine: the pool is a staging
buffer, hits come from whichever tier holds them, looked-up hits are protected."""

import logging
import os
import signal
import time

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from kvtier.keys import KVFormat
from kvtier.tiers.base import CPU
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import kvtier_server

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("m", "flash_attn", "float32")
CHUNK_BYTES = 16 * L * 2 * H * D * 4  # one 16-token chunk


def engine(chunks=2, disk=None, remote=None, **cfg):
    layers = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    config = KvtierConfig(
        chunk_size=16,
        max_local_cpu_size=chunks * CHUNK_BYTES * 1.001 / 1024**3,
        local_disk=None if disk is None else f"file://{disk}",
        max_local_disk_size=1.0 if disk else 0.0,
        remote_url=remote,
        **cfg,
    )
    eng = CacheEngine(config, PagedKV.wrap(layers, "flash_attn"), FMT)
    assert eng.pool.num_blocks == chunks
    return eng, layers


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def where(eng, tokens):
    return eng.tiers.locate([s.key for s in eng.spans(tokens)])


TOKENS = list(range(5000, 5160))  # 10 chunks of 16
SRC, DST = torch.arange(0, 160), torch.arange(400, 560)


def test_a_store_ten_times_the_pool_streams_to_disk_and_loads_back(tmp_path):
    eng, layers = engine(chunks=2, disk=tmp_path)
    assert eng.store(TOKENS, SRC) == 160 and eng.flush(timeout=10)
    assert eng.stats.skipped_store_tokens == 0 and len(eng.tiers.tier("disk")) == 10
    assert eng.lookup(TOKENS) == 160
    mask = eng.retrieve(TOKENS, DST)  # 8 chunks from disk through a 2-block pool
    assert mask.all() and torch.equal(kv_at(layers, DST), kv_at(layers, SRC))
    # disk hits are promoted to RAM (the last that fit)
    assert where(eng, TOKENS)[-2:] == [
        CPU,
        CPU,
    ]
    assert eng.pool.free_blocks + len(eng.tiers.cpu) == eng.pool.num_blocks  # no block leaked
    eng.close()


def test_a_restarted_engine_still_hits_from_disk(tmp_path):
    a, a_layers = engine(chunks=4, disk=tmp_path)
    a.store(TOKENS, SRC)
    a.close()  # writes what is queued, lets go of the directory
    b, b_layers = engine(chunks=4, disk=tmp_path)
    for layer, src in zip(b_layers, a_layers):
        layer.zero_()
        # b's pages 0-9 hold a's KV for the source slots; the rest is zero
        layer[:, :10] = src[:, :10]
    assert b.lookup(TOKENS) == 160
    assert b.retrieve(TOKENS, DST).all()
    assert torch.equal(kv_at(b_layers, DST), kv_at(a_layers, SRC))
    b.close()


def test_disk_write_filter_waits_for_the_nth_store(tmp_path):
    eng, _ = engine(chunks=16, disk=tmp_path, local_disk_min_stores=2)
    eng.store(TOKENS[:32], SRC[:32])
    eng.flush(timeout=10)
    assert len(eng.tiers.tier("disk")) == 0  # stored once: RAM only
    # the second store of chunks still in RAM writes them from there
    eng.store(TOKENS[:32], SRC[:32])
    eng.flush(timeout=10)
    assert len(eng.tiers.tier("disk")) == 2
    eng.tiers.cpu.clear()
    assert where(eng, TOKENS[:32]) == ["disk", "disk"]
    eng.close()


def test_a_leased_hit_survives_stores_that_evict_everything_else():
    eng, layers = engine(chunks=8)
    eng.store(TOKENS[:32], SRC[:32])
    assert eng.find(TOKENS[:32], hold_for="r").tokens == 32
    other = [t + 100_000 for t in TOKENS]
    for shift in range(0, 400, 50):  # many stores of other prompts, 10 chunks each
        eng.store([t + shift for t in other], SRC)
    assert eng.lookup(TOKENS[:32]) == 32
    assert eng.retrieve(TOKENS[:32], DST[:32], request_id="r").all()
    assert torch.equal(kv_at(layers, DST[:32]), kv_at(layers, SRC[:32]))
    assert not len(eng.holds)  # the retrieve ended the lease
    for shift in range(400, 800, 50):  # unprotected now: evicted like any other chunk
        eng.store([t + shift for t in other], SRC)
    assert eng.lookup(TOKENS[:32]) == 0


def test_leases_hold_at_most_half_the_pool_and_expire(caplog):
    eng, _ = engine(chunks=8, pin_timeout_sec=1)
    eng.store(TOKENS[:96], SRC[:96])  # 6 chunks
    eng.find(TOKENS[:96], hold_for="a")
    assert sum(c.block.pinned for c in eng.tiers.cpu._chunks.values()) == 4  # half of 8
    time.sleep(1.1)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        eng.find(TOKENS[:16], hold_for="b")
    assert eng.holds.expired == 1 and "pin_timeout_sec" in caplog.text
    assert sum(c.block.pinned for c in eng.tiers.cpu._chunks.values()) == 1  # b's only
    eng.release_hold("b")
    assert not any(c.block.pinned for c in eng.tiers.cpu._chunks.values())


def test_prefetch_brings_disk_chunks_up_and_a_retrieve_waits_for_it(tmp_path):
    eng, layers = engine(chunks=8, disk=tmp_path)
    eng.store(TOKENS, SRC)
    eng.flush(timeout=10)
    eng.tiers.cpu.clear()
    assert where(eng, TOKENS) == ["disk"] * 10
    hit = eng.find(TOKENS, hold_for="r")
    assert (hit.tokens, hit.in_cpu) == (160, 0)
    eng.start_prefetch(TOKENS, "r")
    assert eng.retrieve(TOKENS, DST, request_id="r").all()
    assert torch.equal(kv_at(layers, DST), kv_at(layers, SRC))
    assert eng.stats.prefetched_tokens == 4 * 16  # the lease budget: half the pool
    assert not len(eng.holds) and not any(c.block.pinned for c in eng.tiers.cpu._chunks.values())
    eng.close()


def test_a_disk_tier_too_small_for_one_chunk_fails_at_start(tmp_path):
    layers = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]
    config = KvtierConfig(
        chunk_size=16, local_disk=str(tmp_path), max_local_disk_size=CHUNK_BYTES / 2 / 1024**3
    )
    with pytest.raises(
        ConfigError, match=r"max_local_disk_size = .* at least one chunk file \(0.02 MB\)"
    ):
        CacheEngine(config, PagedKV.wrap(layers, "flash_attn"), FMT)


def test_reset_clears_cpu_and_disk(tmp_path):
    eng, _ = engine(chunks=4, disk=tmp_path)
    eng.store(TOKENS, SRC)
    eng.flush(timeout=10)
    eng.clear()
    assert eng.lookup(TOKENS) == 0 and len(eng.tiers.tier("disk")) == 0
    assert not list(tmp_path.glob("*.kvc"))
    eng.close()


def test_a_pool_of_one_chunk_streams_to_and_from_a_kvtier_server():
    with kvtier_server(0.0625) as srv:
        a, a_layers = engine(chunks=1, remote=srv.url)
        assert a.store(TOKENS, SRC) == 160 and a.flush(timeout=10)
        assert a.stats.skipped_store_tokens == 0 and a.tiers.writers["remote"].stats.dropped == 0
        b, b_layers = engine(chunks=1, remote=srv.url)
        assert b.lookup(TOKENS) == 160
        assert b.retrieve(TOKENS, DST).all()
        assert torch.equal(kv_at(b_layers, DST), kv_at(a_layers, SRC))
        a.close(), b.close()


def test_a_stalled_remote_store_makes_stores_wait_bounded_and_counts_what_it_drops(caplog):
    with kvtier_server(0.0625) as srv:
        eng, _ = engine(chunks=4, remote=srv.url, blocking_timeout_secs=0.5)
        eng.store(TOKENS[:16], SRC[:16])
        assert eng.flush(timeout=10)  # connected and working
        os.kill(srv.procs[0].pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="kvtier"):
                t0 = time.monotonic()
                assert eng.store(TOKENS[16:], SRC[16:]) == 144  # RAM takes them all; queue of 2
                took = time.monotonic() - t0
                assert eng.flush(timeout=30)
        finally:
            os.kill(srv.procs[0].pid, signal.SIGCONT)
        stats = eng.tiers.writers["remote"].stats
        assert stats.waits >= 1 and took < 10  # waited for room, within bounds
        assert stats.written + stats.dropped == 10  # every chunk accounted for
        assert eng.tiers.tier("remote").stats.faults >= 1 and "remote" in caplog.text
        eng.close()
