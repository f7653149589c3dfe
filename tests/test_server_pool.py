"""The store server's page pool: which byte ranges hold a value."""

from kvtier.server.pool import PagePool

PAGE = 64 << 10


def test_a_value_on_adjacent_pages_is_one_extent_and_split_ones_are_merged_per_run():
    pool = PagePool(16 * PAGE, PAGE)
    assert pool.extents(pool.allocate(3 * PAGE - 5), 3 * PAGE - 5) == [(0, 3 * PAGE - 5)]
    # Out of order and with gaps: one extent per run of adjacent pages, the last one partly used.
    assert pool.extents([7, 8, 2, 3, 4, 11], 6 * PAGE - 1) == [
        (7 * PAGE, 2 * PAGE),
        (2 * PAGE, 3 * PAGE),
        (11 * PAGE, PAGE - 1),
    ]
    # descending is not one run
    assert pool.extents([5, 4], 2 * PAGE) == [
        (5 * PAGE, PAGE),
        (4 * PAGE, PAGE),
    ]
    assert pool.extents([9], 10) == [(9 * PAGE, 10)]


def test_freed_pages_come_back_for_the_next_value():
    pool = PagePool(4 * PAGE, PAGE)
    a, b = pool.allocate(2 * PAGE), pool.allocate(PAGE)
    pool.free(a)
    c = pool.allocate(3 * PAGE)
    assert c is not None and sorted(c) == sorted(a + [3]) and b == [2]
    assert pool.allocate(1) is None and pool.free_pages == 0
