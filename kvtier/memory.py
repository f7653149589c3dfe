"""The host memory pool: one arena, allocated once, carved into equal blocks.

(A disaggregated-prefill receiver may place its buffer, the same kind of
pool, in GPU memory: `device="cuda"`.)

    arena (max_local_cpu_size bytes, page-locked when CUDA is present)
    ┌──────────┬──────────┬──────────┬─────┬──────────┬──────┐
    │ block 0  │ block 1  │ block 2  │ ... │ block N-1│ tail │
    └──────────┴──────────┴──────────┴─────┴──────────┴──────┘
      block_bytes each = the bytes of one full chunk; a partial chunk
      uses the front of a block.

Ownership: `allocate()` returns a block holding one reference, owned by the
caller. Whoever holds a reference calls `release()` exactly once; the block
returns to the free list when the last reference goes. A tier holds one
reference per stored chunk; a load takes a second one (`retain()`) for as
long as it reads the block, which is what "pinned" means here: a block with
more than one reference is never evicted. The pool never grows.

A shared pool (`shared=True`, P2P sharing) keeps its arena in a memfd: an instance on
the same host maps it read-only through /proc/<pid>/fd/<fd> (`SharedArena`) and copies
the chunks it is lent out of it (kvtier/fleet/peers.py).
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvtier import shm
from kvtier.errors import HugePagesUnavailable
from kvtier.logs import get_logger

log = get_logger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)


class ChunkBytes(Protocol):
    """A chunk's bytes as a load reads them: a block of the engine's pool
    (MemoryBlock), or a chunk the store server lends in place (tiers/remote.py's
    BorrowedBlock, whose `pool` is None)."""

    data: torch.Tensor

    @property
    def pool(self) -> HostPool | None: ...

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...
    def verified(self) -> bool: ...
    def device_check(self, count: int, device: torch.device) -> torch.Tensor | None: ...
    def retain(self) -> ChunkBytes: ...
    def release(self) -> None: ...


class MemoryBlock:
    """A block of the pool: `data` is its uint8 view, `refs` its holders, `digest`
    the KV digest (codec.kv_digest) of the chunk a GPU gathered into it, 0: none."""

    __slots__ = ("pool", "index", "data", "digest", "_refs")

    def __init__(self, pool: HostPool, index: int, data: torch.Tensor) -> None:
        self.pool, self.index, self.data = pool, index, data
        self.digest = 0
        self._refs = 0

    @property
    def ref_count(self) -> int:
        return self._refs

    @property
    def pinned(self) -> bool:
        """True while someone besides the owning tier holds the block."""
        return self._refs > 1

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The front of the block as a contiguous tensor of `shape`."""
        return front_view(self.data, dtype, shape)

    def verified(self) -> bool:
        """Whether the bytes a reader took from this block are known good: a
        pool block always (its chunk was checked when it came in; compare
        remote.BorrowedBlock)."""
        return True

    def device_check(self, count: int, device: torch.device) -> torch.Tensor | None:
        """Where a transfer is to add the KV digests of `count` chunks to be checked on
        the device: never for pool blocks (compare remote.BorrowedBlock)."""
        return None

    def retain(self) -> MemoryBlock:
        with self.pool.lock:
            if self._refs <= 0:
                raise RuntimeError(f"retain of freed block {self.index}")
            self._refs += 1
        return self

    def release(self) -> None:
        self.pool._release(self)


@dataclass(frozen=True)
class SharedArena:
    """Where a process on this host finds a shared pool's arena: /proc/<pid>/fd/<fd>, a
    memfd of `size` bytes whose (st_dev, st_ino) tell it from another file there."""

    pid: int
    fd: int
    size: int
    dev: int
    ino: int

    @property
    def path(self) -> str:
        return shm.proc_path(self.pid, self.fd)


def front_view(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The front of the uint8 buffer `data` as a contiguous tensor of `shape`."""
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    if nbytes > data.numel():
        raise ValueError(f"shape {shape} of {dtype} needs {nbytes} bytes, block has {data.numel()}")
    return data[:nbytes].view(dtype).view(shape)


class HostPool:
    """Fixed arena of `capacity` bytes split into blocks of `block_bytes`."""

    def __init__(
        self,
        capacity: int,
        block_bytes: int,
        *,
        hugepages: bool = False,
        pin: bool | None = None,
        device: str = "cpu",
        shared: bool = False,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if capacity < block_bytes:
            raise ValueError(
                f"the CPU pool ({capacity / 1e9:.3f} GB) cannot hold one chunk of "
                f"{block_bytes / 1e6:.1f} MB: raise max_local_cpu_size or lower chunk_size"
            )
        self.device = torch.device(device)
        on_host = self.device.type == "cpu"
        self.pin = on_host and (torch.cuda.is_available() if pin is None else pin)
        self.hugepages = hugepages and on_host
        self.block_bytes = block_bytes
        self._mmap: mmap.mmap | None = None
        self.shared: SharedArena | None = None  # set by a shared pool's arena
        self.arena = self._allocate_arena(capacity, shared and on_host)
        self.num_blocks = capacity // block_bytes
        self.capacity = self.num_blocks * block_bytes
        self.lock = threading.Lock()
        self._blocks = [
            MemoryBlock(self, i, self.arena[i * block_bytes : (i + 1) * block_bytes])
            for i in range(self.num_blocks)
        ]
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() gives block 0 first

    # -- arena ---------------------------------------------------------------

    def _allocate_arena(self, capacity: int, shared: bool) -> torch.Tensor:
        if self.device.type != "cpu":  # a PD receive buffer in GPU memory, shareable over CUDA IPC
            from kvtier.transfer.cudart import device_buffer

            return device_buffer(capacity, self.device)
        if not self.hugepages and not shared:
            return torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
        size = -(-capacity // HUGE_PAGE) * HUGE_PAGE if self.hugepages else capacity
        needed = size // HUGE_PAGE
        if self.hugepages:  # /proc/meminfo is read only where huge pages are asked for
            free = free_huge_pages()
            if free < needed:
                raise HugePagesUnavailable(needed, free)
        try:
            self._mmap = self._map(size, shared)
        except OSError:
            if not self.hugepages:
                raise
            # Another process took the pages between the check and the map.
            raise HugePagesUnavailable(needed, free_huge_pages()) from None
        arena = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if self.pin:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(arena.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the CPU pool's arena failed: {err}")
            # Unregistered when the pool goes (its mapping still there then): a later pool
            # mapped at the same addresses could not register them otherwise.
            unpin = weakref.finalize(self, cudart.cudaHostUnregister, arena.data_ptr())
            unpin.atexit = False  # at exit the CUDA context may be gone first
        if self.hugepages:
            log.info("CPU pool: %d huge pages of 2 MiB", needed)
        return arena

    def _map(self, size: int, shared: bool) -> mmap.mmap:
        """The arena's mapping: private and anonymous, or a memfd's (shared) that peers map."""
        if not shared:
            huge = _MAP_HUGETLB if self.hugepages else 0
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | huge)
        fd, mapping = shm.create("kvtier-cpu-pool", size, self.hugepages)
        st = os.fstat(fd)  # the fd stays open for the pool's life: peers open it by its number
        self.shared = SharedArena(os.getpid(), fd, size, st.st_dev, st.st_ino)
        return mapping

    # -- blocks --------------------------------------------------------------

    def allocate(self) -> MemoryBlock | None:
        """A free block with one reference (the caller's), or None when full."""
        with self.lock:
            if not self._free:
                return None
            return self._taken(self._free.pop())

    def allocate_many(self, count: int) -> list[MemoryBlock] | None:
        """The `count` free blocks of lowest address, in address order, each with one
        reference, or None (and none taken) when fewer are free: chunks that follow each
        other then sit in adjacent blocks wherever the free blocks allow, also after
        releases in any order."""
        with self.lock:
            if count > len(self._free):
                return None
            self._free.sort(reverse=True)  # nearly sorted already: a linear pass
            taken = self._free[len(self._free) - count :][::-1]
            del self._free[len(self._free) - count :]
            return [self._taken(i) for i in taken]

    def _taken(self, index: int) -> MemoryBlock:
        """Block `index`, just taken off the free list: one reference (the caller's), no digest."""
        block = self._blocks[index]
        block._refs = 1
        block.digest = 0
        return block

    def _release(self, block: MemoryBlock) -> None:
        with self.lock:
            if block._refs <= 0:
                raise RuntimeError(f"double release of block {block.index}")
            block._refs -= 1
            if block._refs == 0:
                self._free.append(block.index)

    @property
    def used_bytes(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)


def free_huge_pages(meminfo: Path = Path("/proc/meminfo")) -> int:
    """HugePages_Free of 2 MiB pages, or 0 where the kernel reports none."""
    try:
        text = meminfo.read_text()
    except OSError:
        return 0
    size = re.search(r"Hugepagesize:\s+(\d+) kB", text)
    free = re.search(r"HugePages_Free:\s+(\d+)", text)
    if not size or not free or int(size.group(1)) * 1024 != HUGE_PAGE:
        return 0
    return int(free.group(1))
