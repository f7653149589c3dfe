from pathlib import Path

import pytest
import torch

from kvtier.errors import HugePagesUnavailable
from kvtier.memory import HUGE_PAGE, HostPool, free_huge_pages


def test_pool_is_fixed_and_blocks_are_refcounted():
    pool = HostPool(10 * 1024, 1024)
    blocks = [pool.allocate() for _ in range(10)]
    assert all(b is not None for b in blocks) and pool.allocate() is None  # never grows
    assert pool.used_bytes == 10 * 1024
    b = blocks[0].retain()
    assert b.pinned and b.ref_count == 2
    b.release()
    assert not b.pinned
    b.release()
    assert pool.free_blocks == 1
    with pytest.raises(RuntimeError, match="double release"):
        b.release()
    for blk in blocks[1:]:
        blk.release()
    assert pool.used_bytes == 0


def test_block_views_are_disjoint():
    pool = HostPool(4096, 1024)
    a, b = pool.allocate(), pool.allocate()
    a.view(torch.float32, (2, 128)).fill_(1)
    b.view(torch.float32, (256,)).fill_(2)
    assert a.view(torch.float32, (256,)).sum() == 256
    with pytest.raises(ValueError, match="needs"):
        a.view(torch.float32, (257,))


def test_pool_smaller_than_a_chunk_is_refused():
    with pytest.raises(ValueError, match="cannot hold one chunk"):
        HostPool(1000, 4096)


def test_hugepages_shortfall_says_how_many_and_the_sysctl():
    need = free_huge_pages() + 3
    with pytest.raises(HugePagesUnavailable) as info:
        HostPool(need * HUGE_PAGE, HUGE_PAGE, hugepages=True)
    msg = str(info.value)
    assert f"needs {need} huge pages" in msg and f"sysctl -w vm.nr_hugepages={need}" in msg


def test_hugepages_pool_when_pages_are_reserved():
    knob = Path("/proc/sys/vm/nr_hugepages")
    before = int(knob.read_text())
    try:
        knob.write_text(str(before + 4))
    except OSError:
        pytest.skip("cannot reserve huge pages here (not root)")
    try:
        if free_huge_pages() < 4:
            pytest.skip("the kernel did not grant the huge pages")
        pool = HostPool(4 * HUGE_PAGE, HUGE_PAGE, hugepages=True)
        block = pool.allocate()
        block.view(torch.uint8, (HUGE_PAGE,)).fill_(7)
        assert int(block.data.sum()) == 7 * HUGE_PAGE
        del block, pool
    finally:
        knob.write_text(str(before))


def test_a_shared_pool_is_a_memfd_that_another_mapping_sees_block_by_block():
    import mmap
    import os

    pool = HostPool(4 * 4096, 4096, shared=True)
    arena = pool.shared
    assert arena is not None and arena.pid == os.getpid() and arena.size == pool.capacity
    block = pool.allocate_many(3)[2]
    block.data.fill_(7)
    fd = os.open(arena.path, os.O_RDONLY)  # as a peer on this host opens it
    try:
        st = os.fstat(fd)
        assert (st.st_dev, st.st_ino) == (arena.dev, arena.ino)
        seen = mmap.mmap(fd, arena.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    offset = block.index * pool.block_bytes
    assert seen[offset : offset + 4096] == b"\x07" * 4096 and seen[0:4096] == bytes(4096)
    seen.close()
    assert HostPool(4096, 4096).shared is None  # a private pool by default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pins host memory for a GPU")
def test_on_a_gpu_pinned_mapped_pools_made_and_dropped_in_turn_each_register():
    """A pool's mapping goes with the pool and the next may be mapped at the same addresses:
    CUDA must have let go of the first registration by then."""
    import gc

    for shared in (True, False, True, True):
        for _ in range(3):
            pool = HostPool(8 << 20, 1 << 20, pin=True, shared=shared, hugepages=False)
            pool.allocate().data.fill_(1)
            del pool
            gc.collect()
