import pytest

from kvtier.keys import ChunkKey, KVFormat
from kvtier.memory import HostPool
from kvtier.tiers.cpu import CpuTier

FMT = KVFormat("m", "l", "d")


def key(i: int) -> ChunkKey:
    return ChunkKey(FMT, i.to_bytes(16, "little"))


def fill(tier: CpuTier, ids):
    for i in ids:
        block = tier.allocate()
        assert block is not None
        tier.put(key(i), block, 1)


def test_lru_evicts_least_recently_used():
    tier = CpuTier(HostPool(3 * 64, 64))
    fill(tier, [1, 2, 3])
    tier.get(key(1)).block.release()  # touch 1
    fill(tier, [4])
    assert not tier.contains(key(2)) and all(tier.contains(key(i)) for i in (1, 3, 4))
    assert tier.stats.evictions == 1


def test_pinned_blocks_are_never_evicted():
    tier = CpuTier(HostPool(2 * 64, 64))
    fill(tier, [1, 2])
    c1, c2 = tier.get(key(1)), tier.get(key(2))  # both pinned by "loads"
    assert tier.allocate() is None  # nothing evictable: no wait, no busy loop
    c1.block.release()
    assert tier.allocate() is not None  # 1 was evictable once its load ended
    assert tier.contains(key(2)) and not tier.contains(key(1))
    c2.block.release()


def test_prefix_hits_and_miss_is_none():
    tier = CpuTier(HostPool(4 * 64, 64))
    fill(tier, [1, 2, 4])
    assert tier.prefix_hits([key(1), key(2), key(3), key(4)]) == 2
    assert tier.get(key(3)) is None


def test_clear_and_delete_return_memory():
    pool = HostPool(4 * 64, 64)
    tier = CpuTier(pool)
    fill(tier, [1, 2, 3])
    assert tier.delete(key(1)) and not tier.delete(key(1))
    held = tier.get(key(2))
    tier.clear()
    assert len(tier) == 0 and pool.used_bytes == 64  # the reader still holds block 2
    held.block.release()
    assert pool.used_bytes == 0


def test_put_same_key_replaces_without_leak():
    pool = HostPool(4 * 64, 64)
    tier = CpuTier(pool)
    fill(tier, [1, 1, 1])
    assert len(tier) == 1 and pool.used_bytes == 64


@pytest.mark.parametrize("policy, evicted", [("LRU", 1), ("FIFO", 0), ("MRU", 2), ("LFU", 1)])
def test_cache_policy_picks_the_chunk_to_evict(policy, evicted):
    """Chunks 0, 1, 2 stored in that order, then 0 read twice and 2 once; a fourth evicts
    one: LRU the least recently used (1), FIFO the oldest (0), MRU the most recently
    used (2), LFU the least read (1, never read)."""
    fmt = KVFormat("m", "flash_attn", "float32")
    keys = [ChunkKey(fmt, bytes([i]) * 16) for i in range(4)]
    tier = CpuTier(HostPool(3 * 64, 64, pin=False), policy)
    for k in keys[:3]:
        tier.put(k, tier.allocate(), 1)
    for k in (keys[0], keys[0], keys[2]):
        tier.get(k).block.release()
    tier.put(keys[3], tier.allocate(), 1)
    assert [i for i in range(3) if not tier.contains(keys[i])] == [evicted]
