"""Values as lists of byte buffers, so a header and a payload travel without being joined.

A remote value is either one bytes-like object or a list/tuple of them,
meant back to back (e.g. a codec header, then a view of a pool block).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

Buffer = bytes | bytearray | memoryview | np.ndarray
T = TypeVar("T")
R = TypeVar("R")
Value = Buffer | Sequence[Buffer]


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


IOV_MAX = 1024  # the most buffers one sendmsg takes


def unsent(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of `views` (bytes, back to back) after a send took the first `sent` bytes."""
    i = 0
    while i < len(views) and sent >= len(views[i]):
        sent -= len(views[i])
        i += 1
    rest = views[i:]
    if sent:
        rest[0] = rest[0][sent:]
    return rest


Copy = list[tuple[np.ndarray, np.ndarray]]  # (destination, source) byte ranges of equal length


def into_extents(
    dst: np.ndarray, extents: Sequence[tuple[int, int]], parts: Sequence[memoryview]
) -> Copy:
    """The copy of the concatenation of `parts` into the byte ranges `extents` of `dst`."""
    return _pairs([dst[off : off + n] for off, n in extents], parts)


def from_extents(
    src: np.ndarray, extents: Sequence[tuple[int, int]], parts: Sequence[memoryview]
) -> Copy:
    """The copy filling `parts`, in order, from the byte ranges `extents` of `src`."""
    return _pairs(parts, [src[off : off + n] for off, n in extents])


def _pairs(dst: Sequence[Buffer], src: Sequence[Buffer]) -> Copy:
    """Match the concatenation of `src` with the concatenation of `dst` (equal totals)."""
    pairs = []
    srcs = iter(src)
    cur, pos = np.empty(0, np.uint8), 0
    for d in dst:
        d = np.frombuffer(d, np.uint8) if not isinstance(d, np.ndarray) else d
        at = 0
        while at < len(d):
            while pos == len(cur):
                nxt = next(srcs)
                cur, pos = (nxt if isinstance(nxt, np.ndarray) else np.frombuffer(nxt, np.uint8)), 0
            k = min(len(d) - at, len(cur) - pos)
            pairs.append((d[at : at + k], cur[pos : pos + k]))
            at, pos = at + k, pos + k
    return pairs


# Large copies (a batch of chunks through the same-host shared pool) and
# checksums are split over threads: one thread's memcpy or xxh3 is far below
# what a server's memory system moves (numpy and codec.checksum release the
# GIL): results/README.md, "Figures behind constants" (scripts/gpu_checksum_threads.py, at
# d755a8a).
COPY_THREADS = max(1, min(16, os.cpu_count() or 1))
PARALLEL_FROM = 64 << 20
_PIECE = 8 << 20
_pool: ThreadPoolExecutor | None = None


def run_copy(pairs: Copy) -> None:
    """Do a copy: in this thread, or in pieces over the copy threads when it is large."""
    nbytes = sum(len(a) for a, _ in pairs)
    if nbytes >= PARALLEL_FROM:
        pairs = [
            (a[i : i + _PIECE], b[i : i + _PIECE])
            for a, b in pairs
            for i in range(0, len(a), _PIECE)
        ]
    parallel(_copy_piece, pairs, nbytes)


def parallel(fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> list[R]:
    """`fn` over `items`, on the copy threads when they touch `nbytes` >= PARALLEL_FROM
    in all (checksums, codecs: work that releases the GIL while it reads memory)."""
    return start_parallel(fn, items, nbytes)()


def start_parallel(fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> Callable[[], list[R]]:
    """`parallel`, begun now on the copy threads; the returned function waits
    for the results. Small work runs on the first caller of that function."""
    if COPY_THREADS == 1 or nbytes < PARALLEL_FROM or len(items) < 2:
        results: list[R] = []

        def here() -> list[R]:
            if len(results) < len(items):
                results[:] = [fn(x) for x in items]
            return results

        return here
    futures = [_executor().submit(fn, x) for x in items]
    return lambda: [f.result() for f in futures]


def _copy_piece(pair: tuple[np.ndarray, np.ndarray]) -> None:
    pair[0][:] = pair[1]


# Copy threads run at a lower priority (Linux nice, per thread): when every core
# hashes a lent batch, the thread driving the GPU (and a host-bound forward pass)
# still gets its core at once.
COPY_NICE = 5


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPY_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the same priority as the caller
        pass


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(
            COPY_THREADS,
            thread_name_prefix="kvtier-copy",
            initializer=_lower_priority if COPY_NICE else None,
        )
    return _pool


def fill(dest: Value, value: Buffer | None) -> bool:
    """Copy `value` into `dest` (a buffer or parts) if it has exactly dest's size."""
    parts = as_parts(dest)
    if value is None or len(value) != sum(len(x) for x in parts):
        return False
    run_copy(_pairs(parts, [value]))
    return True
