"""The server's value memory: one arena of `--prealloc-size` bytes, in pages.

    arena (memfd, mapped once at start)
    +--------+--------+--------+--------+-----+--------+
    | page 0 | page 1 | page 2 | page 3 | ... | page N |     page_size each
    +--------+--------+--------+--------+-----+--------+
      value A: pages [0, 1, 2] (A's last page partly used)
      value B: pages [3, 7]    (a value need not be contiguous)

A value is a list of pages, so freeing never fragments the arena and any
free page serves any value. Adjacent pages are merged into one extent when
a value is sent or handed to a same-host client, so a fresh pool serves
most values as one contiguous range.

The arena is a memfd: same-host clients map it through
/proc/<server pid>/fd/<fd> and copy values in and out directly (the
shared-memory fast path), and the kernel frees it when the server exits,
even on SIGKILL, once no client maps it any more.
"""

from __future__ import annotations

import mmap
import os

from kvtier import shm

Extents = list[tuple[int, int]]


def _available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB (what a new mapping can take without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class PagePool:
    def __init__(self, capacity: int, page_size: int = 256 << 10) -> None:
        if page_size <= 0 or page_size % mmap.PAGESIZE:
            raise ValueError(
                f"page size {page_size} must be a positive multiple of {mmap.PAGESIZE}"
            )
        if capacity < page_size:
            raise ValueError(f"pool of {capacity} bytes is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = capacity // page_size
        self.capacity = self.num_pages * page_size
        try:  # every page touched now, not at its first put
            self.fd, self.arena = shm.create("kvtier-server-pool", self.capacity, populate=True)
        except OSError as e:
            raise ValueError(
                f"a pool of {self.capacity / 2**30:.2f} GiB cannot be mapped ({e.strerror}); "
                f"this machine has {_available_gib():.2f} GiB of memory available"
            ) from None
        self.view = memoryview(self.arena)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: low pages come out first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_size

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    def allocate(self, nbytes: int) -> list[int] | None:
        """Pages for `nbytes`, or None when fewer are free (nothing is taken then)."""
        n = self.pages_for(nbytes)
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        pages.reverse()
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def extents(self, pages: list[int], nbytes: int) -> Extents:
        """The (offset, length) ranges holding a value's `nbytes`, adjacent pages merged."""
        if (
            pages
            and pages[-1] - pages[0] == len(pages) - 1
            and pages == list(range(pages[0], pages[-1] + 1))
        ):
            # one run (most values): no walk page by page
            return [(pages[0] * self.page_size, nbytes)]
        out: Extents = []
        left = nbytes
        for page in pages:
            n = min(self.page_size, left)
            off = page * self.page_size
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((off, n))
            left -= n
        return out

    def views(self, pages: list[int], nbytes: int) -> list[memoryview]:
        return [self.view[off : off + n] for off, n in self.extents(pages, nbytes)]

    def close(self) -> None:
        self.view.release()
        self.arena.close()
        os.close(self.fd)
