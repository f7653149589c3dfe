import gc
import logging
import os

import psutil
import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import Identity, Item, KVFormat
from kvtier.transfer import PagedKV

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("m", "flash_attn", "float32")


def make_engine(chunk=16, pool_mb=1.0, unfull=False, layers=None):
    layers = layers or [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    cfg = KvtierConfig(
        chunk_size=chunk, max_local_cpu_size=pool_mb / 1024, save_unfull_chunk=unfull
    )
    return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def tokens_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def test_store_lookup_retrieve_roundtrip():
    eng, layers = make_engine()
    toks = list(range(100))
    perm = torch.randperm(NB * BS)
    src, dst = perm[:100], perm[100:200]
    assert eng.store(toks, src) == 96  # 6 whole chunks of 16
    assert eng.lookup(toks) == 96 and eng.lookup(toks[:50]) == 48 and eng.lookup([7] * 40) == 0
    mask = eng.retrieve(toks, dst)
    assert mask[:96].all() and not mask[96:].any()
    assert torch.equal(tokens_at(layers, src[:96]), tokens_at(layers, dst[:96]))


def test_layerwise_store_moves_each_layer_when_saved_and_stores_on_finish():
    eng, layers = make_engine()
    toks, perm = list(range(100)), torch.randperm(NB * BS)
    src, dst = perm[:100], perm[100:200]
    storing = eng.start_store(toks, src, layerwise=True)
    assert storing.num_tokens == 96 and eng.lookup(toks) == 0  # nothing visible before finish
    for layer in range(L):
        storing.save(layer)
    assert storing.finish() == 96 and storing.finish() == 0
    assert eng.retrieve(toks, dst)[:96].all()
    assert torch.equal(tokens_at(layers, dst[:96]), tokens_at(layers, src[:96]))


def test_a_layerwise_store_missing_a_layer_is_dropped_not_stored():
    eng, _ = make_engine()
    free = eng.pool.free_blocks
    storing = eng.start_store(list(range(64)), torch.arange(64), layerwise=True)
    storing.save(0)  # the forward stopped before layer 1
    assert storing.finish() == 0
    assert eng.pool.free_blocks == free and eng.lookup(list(range(64))) == 0


def test_a_cancelled_store_gives_its_blocks_back():
    eng, _ = make_engine()
    free = eng.pool.free_blocks
    storing = eng.start_store(list(range(64)), torch.arange(64), layerwise=True)
    assert eng.pool.free_blocks == free - 4
    storing.save(0)
    storing.cancel()
    assert eng.pool.free_blocks == free and eng.lookup(list(range(64))) == 0


def test_store_skips_chunks_already_stored_and_honours_start():
    eng, _ = make_engine()
    toks, slots = list(range(64)), torch.arange(64)
    assert eng.store(toks[:32], slots[:32]) == 32
    assert eng.store(toks, slots, start=0) == 32  # only the two new chunks
    assert eng.store(toks, slots) == 0


def test_retrieve_from_mid_chunk_start_leaves_earlier_slots_alone():
    eng, layers = make_engine()
    toks = list(range(48))
    eng.store(toks, torch.arange(48))
    dst = torch.arange(200, 248)
    before = tokens_at(layers, dst[:20]).clone()
    mask = eng.retrieve(toks, dst, start=20)
    assert not mask[:20].any() and mask[20:].all()
    assert torch.equal(tokens_at(layers, dst[:20]), before)
    assert torch.equal(tokens_at(layers, dst[20:]), tokens_at(layers, torch.arange(20, 48)))


def test_save_unfull_chunk():
    eng, layers = make_engine(unfull=True)
    toks = list(range(40))
    assert eng.store(toks, torch.arange(40)) == 40
    assert eng.lookup(toks) == 40
    mask = eng.retrieve(toks, torch.arange(300, 340))
    assert mask.all()
    assert torch.equal(
        tokens_at(layers, torch.arange(32, 40)), tokens_at(layers, torch.arange(332, 340))
    )


def test_retrieve_stops_at_first_missing_chunk():
    eng, _ = make_engine()
    toks = list(range(64))
    eng.store(toks, torch.arange(64))
    eng.tiers.cpu.delete(eng.spans(toks)[1].key)
    assert eng.lookup(toks) == 16
    assert int(eng.retrieve(toks, torch.arange(64)).sum()) == 16


def test_full_pool_of_pinned_chunks_skips_store_and_logs_once(caplog):
    eng, _ = make_engine(pool_mb=2 * 16 * L * 2 * H * D * 4 / 1e6 * 1.0001 * 1e6 / 1024**2)
    assert eng.pool.num_blocks == 2
    eng.store(list(range(32)), torch.arange(32))
    # in-flight loads pin both
    held = [eng.tiers.cpu.get(s.key) for s in eng.spans(list(range(32)))]
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert eng.store(list(range(100, 164)), torch.arange(64), request_id="r") == 0
        # next prefill step
        assert eng.store(list(range(100, 196)), torch.arange(96), request_id="r") == 0
    warnings = [r for r in caplog.records if "pool full of chunks in use" in r.getMessage()]
    assert len(warnings) == 1 and "64 tokens" in warnings[0].getMessage()
    for chunk in held:
        chunk.block.release()
    assert eng.store(list(range(100, 164)), torch.arange(64)) == 32  # evicts the released two


@pytest.mark.parametrize(
    "tokens, slots, match",
    [
        (list(range(9)), torch.arange(10), "9 tokens but 10 slots"),
        (list(range(10)), torch.arange(10) + NB * BS, "out of range"),
        (list(range(10)), torch.arange(10) - 1, "out of range"),
        (list(range(10)), torch.zeros(10), "integers"),
        (list(range(10)), torch.zeros(2, 5, dtype=torch.long), "1-D"),
    ],
)
def test_bad_input_is_a_clear_value_error_and_cache_keeps_serving(tokens, slots, match):
    eng, layers = make_engine()
    good = list(range(32))
    eng.store(good, torch.arange(32))
    for op in (eng.store, eng.retrieve):
        with pytest.raises(ValueError, match=match):
            op(tokens, slots)
    assert eng.pool.used_bytes == 2 * eng.pool.block_bytes  # nothing leaked
    assert int(eng.retrieve(good, torch.arange(500, 532)).sum()) == 32
    assert eng.store(list(range(50, 82)), torch.arange(32)) == 32


def test_mismatched_kv_shapes_are_refused():
    with pytest.raises(ValueError, match="share shape"):
        PagedKV.wrap([torch.zeros(2, NB, BS, H, D), torch.zeros(2, NB, BS, H, D + 1)], "flash_attn")


def test_memory_stays_flat_over_10000_cycles_with_eviction():
    """10,000 store/retrieve cycles through a 64 MiB pool that keeps evicting."""
    gc.collect()  # earlier tests' engines (their pools) go now, not during the measurement
    layers = [torch.randn(2, 256, 16, 4, 64) for _ in range(4)]  # 32 KiB per token
    cfg = KvtierConfig(chunk_size=16, max_local_cpu_size=64 / 1024)
    eng = CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT)
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    proc = psutil.Process(os.getpid())
    gen = torch.Generator().manual_seed(0)
    rss = []
    try:
        for i in range(10_000):
            toks = torch.randint(0, 50_000, (64,), generator=gen)
            slots = torch.randperm(256 * 16, generator=gen)[:64]
            assert eng.store(toks, slots) == 64
            assert int(eng.retrieve(toks, slots).sum()) == 64
            if i % 500 == 499:
                rss.append(proc.memory_info().rss)
    finally:
        logging.getLogger("kvtier").setLevel(logging.INFO)
    assert eng.tiers.cpu.stats.evictions > 9_000
    warm = rss[2:]  # after warm-up
    assert max(warm) <= min(warm) * 1.05, [r // 2**20 for r in rss]
    eng.clear()
    assert eng.pool.used_bytes == 0


def test_retrieve_part_of_a_chunk_by_slots():
    """All but the last prompt token: keys from the full prompt, slots stop early."""
    eng, layers = make_engine()
    toks = list(range(64))
    eng.store(toks, torch.arange(64))
    dst = torch.arange(300, 363)  # 63 slots
    before = tokens_at(layers, torch.tensor([363])).clone()
    mask = eng.retrieve(toks, dst)
    assert mask.all() and len(mask) == 63
    assert torch.equal(tokens_at(layers, dst), tokens_at(layers, torch.arange(63)))
    assert torch.equal(tokens_at(layers, torch.tensor([363])), before)
    with pytest.raises(ValueError, match="every token needs one slot"):
        eng.retrieve(toks[:10], torch.arange(11))


def test_layerwise_retrieve_loads_layers_in_order_and_unpins_at_finish():
    eng, layers = make_engine()
    toks = list(range(64))
    eng.store(toks, torch.arange(64))
    dst = torch.arange(100, 164)
    load = eng.start_retrieve(toks, dst, start=5, layerwise=True)
    assert load.num_tokens == 59 and load.settled  # blocks of the pool: finish() cannot cut it
    assert all(c.block.pinned for c in eng.tiers.cpu._chunks.values())  # in use until finish
    load.wait(0)
    assert torch.equal(tokens_at(layers[:1], dst[5:]), tokens_at(layers[:1], torch.arange(5, 64)))
    load.finish()
    load.finish()  # idempotent
    assert not any(c.block.pinned for c in eng.tiers.cpu._chunks.values())
    assert torch.equal(tokens_at(layers, dst[5:]), tokens_at(layers, torch.arange(5, 64)))


def test_grouped_kv_moves_each_layer_at_its_own_groups_slots():
    """vLLM's hybrid allocator gives each KV cache group its own pages: layer 1 here (a
    sliding-window group) keeps its tokens at other slots than layers 0 and 2, and no
    longer keeps the first 20 (-1). A store reads each layer at its group's slots; a load
    writes each layer at the loader's slots of that group and skips its -1 tokens."""
    layers = [torch.randn(2, NB, BS, H, D) for _ in range(3)]
    cfg = KvtierConfig(chunk_size=16, max_local_cpu_size=1 / 1024, save_unfull_chunk=False)
    eng = CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn").grouped([0, 1, 0]), FMT)
    toks, perm = list(range(64)), torch.randperm(NB * BS)
    src = torch.stack([perm[:64], perm[64:128]])
    src[1, :20] = -1
    assert eng.store(toks, src) == 64
    dst = torch.stack([perm[200:264], perm[300:364]])
    dst[1, :40] = -1  # the loader's window is shorter: tokens 20..39 are not written either
    before = layers[1].clone()
    assert eng.retrieve(toks, dst).all()
    for layer, row in ((0, 0), (1, 1), (2, 0)):
        keep = dst[row] >= 0
        assert torch.equal(
            tokens_at([layers[layer]], dst[row][keep]), tokens_at([layers[layer]], src[row][keep])
        )
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    untouched[dst[1][40:]] = False
    assert torch.equal(
        tokens_at([layers[1]], untouched.nonzero().flatten()),
        tokens_at([before], untouched.nonzero().flatten()),
    )
    with pytest.raises(ValueError, match=r"\[2, T\] tensor"):
        eng.store(toks, src[0])


def test_a_request_of_another_identity_finds_nothing_and_loads_nothing():
    """KV stored under a LoRA adapter, a cache_salt or an image is that request's: the same
    tokens under another identity (or none) miss, down to a prompt's partial last chunk."""
    eng, layers = make_engine(unfull=True)
    toks = list(range(100))
    perm = torch.randperm(NB * BS)
    tenant_a, tenant_b = Identity.of(salt="a"), Identity.of(salt="b")
    assert eng.store(toks, perm[:100], identity=tenant_a) == 100
    assert eng.lookup(toks) == 0 and eng.lookup(toks, tenant_b) == 0
    assert not eng.retrieve(toks, perm[100:200], identity=tenant_b).any()
    assert eng.lookup(toks + [5, 6], tenant_a) == 100  # a longer prompt finds the tail too
    mask = eng.retrieve(toks, perm[200:300], identity=tenant_a)
    assert mask.all() and torch.equal(
        tokens_at(layers, perm[:100]), tokens_at(layers, perm[200:300])
    )
    image = Identity.of(items=[Item(40, 8, b"i" * 16)])
    assert eng.store(toks, perm[:100]) == 100
    assert eng.lookup(toks, image) == 32  # the two chunks before the image's are shared
