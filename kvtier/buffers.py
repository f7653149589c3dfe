"""Values as lists of byte buffers, so a header and a payload travel without being joined.

A remote value is either one bytes-like object or a list/tuple of them,
meant back to back (e.g. a codec header, then a view of a pool block).
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]
Value = Union[Buffer, Sequence[Buffer]]


def as_parts(value: Value) -> list[memoryview]:
    if isinstance(value, (list, tuple)):
        return [_bytes_view(v) for v in value]
    return [_bytes_view(value)]


def _bytes_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def joined(value: Value) -> bytes | memoryview:
    """One buffer: the value itself when it is one part, else the parts joined (a copy)."""
    parts = as_parts(value)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def copy_into_extents(dst: np.ndarray, extents: Sequence[tuple[int, int]], parts: Sequence[memoryview]) -> None:
    """Copy the concatenation of `parts` into the byte ranges `extents` of `dst`."""
    srcs = iter(parts)
    src, pos = np.frombuffer(next(srcs, b""), np.uint8), 0
    for off, n in extents:
        while n:
            while pos == len(src):
                src, pos = np.frombuffer(next(srcs), np.uint8), 0
            k = min(n, len(src) - pos)
            dst[off : off + k] = src[pos : pos + k]
            off, n, pos = off + k, n - k, pos + k


def gather_extents(src: np.ndarray, extents: Sequence[tuple[int, int]], size: int) -> memoryview:
    """A new buffer of `size` bytes holding the byte ranges `extents` of `src`."""
    out = np.empty(size, np.uint8)
    pos = 0
    for off, n in extents:
        out[pos : pos + n] = src[off : off + n]
        pos += n
    return memoryview(out)
