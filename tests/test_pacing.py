"""A store's copies down cut into pieces (kvtier/transfer/pacing.py): the arithmetic, on CPU."""

import pytest

from kvtier.transfer.pacing import BAND_ALIGN, pieces

MIB = 1 << 20


def covered(cut) -> list[tuple[int, int, int]]:
    """(device offset, host offset, bytes) of every row segment the pieces copy."""
    out = []
    for p in cut:
        host, dev, host_pitch, dev_pitch, width, rows = p.run
        out += [(dev + r * dev_pitch, host + r * host_pitch, width) for r in range(rows)]
    return sorted(out)


@pytest.mark.parametrize(
    ("width", "rows", "piece"),
    [
        (32 * MIB, 17, 32 * MIB),
        (32 * MIB, 3, 8 * MIB),
        (16 * MIB, 5, 32 * MIB),
        (32 * MIB + 12288, 2, 8 * MIB),
        (3 * MIB, 4, 0),
    ],
)
def test_pieces_copy_every_byte_once_in_order_and_none_is_larger_than_a_piece(width, rows, piece):
    host, dev, host_pitch, dev_pitch = 1 << 40, 1 << 32, 64 * MIB, width
    cut = pieces((host, dev, host_pitch, dev_pitch, width, rows), None, piece)
    sizes = [p.run[4] * p.run[5] for p in cut]
    assert all(s <= (piece or width * rows) for s in sizes)
    # in the order of the run: row by row, and within a row from its start
    segments = [(p.run[1], p.run[0], p.run[4] * p.run[5]) for p in cut]
    assert segments == sorted(segments)
    # the bytes of row r: [dev + r * dev_pitch, + width), each once, in pieces that start at a
    # multiple of BAND_ALIGN, host at the same offsets
    ends = {}
    for dev_at, host_at, n in covered(cut):
        row, offset = divmod(dev_at - dev, dev_pitch)
        assert host_at == host + row * host_pitch + offset and offset % BAND_ALIGN == 0
        assert ends.get(row, 0) == offset  # contiguous, no gap, no overlap
        ends[row] = offset + n
    assert ends == {r: width for r in range(rows)}
