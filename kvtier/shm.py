"""Memory shared by processes of one host: a memfd its owner makes and keeps open, which
another process maps through /proc/<pid>/fd/<fd>. The store server's pool (server/pool.py,
mapped by its clients in server/link.py) and an instance's CPU pool lent to its P2P peers
(memory.py, mapped by them in fleet/peer_client.py) are made and mapped here. No torch: the
store server imports this.
"""

from __future__ import annotations

import mmap
import os

# touch every page at the map, not at its first use
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def proc_path(pid: int, fd: int) -> str:
    """Where another process of this host opens the memfd `fd` of process `pid`."""
    return f"/proc/{pid}/fd/{fd}"


def create(
    name: str, size: int, hugepages: bool = False, populate: bool = False
) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes (of 2 MiB huge pages with `hugepages`) and its shared mapping.
    The fd is the caller's, to keep open while peers may open it by number (OSError: none)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_HUGETLB if hugepages else 0))
    try:
        os.ftruncate(fd, size)
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        return fd, mmap.mmap(fd, size, flags=flags)
    except OSError:
        os.close(fd)
        raise


def open_mapped(
    path: str,
    size: int,
    writable: bool,
    expect: tuple[int, int] | None = None,
    populate: bool = False,
) -> tuple[tuple[int, int], mmap.mmap] | None:
    """Another process's memfd at `path` mapped here, shared, with its (st_dev, st_ino); None
    where it is not the file `expect` names (another process's file under that number). Raises
    OSError where this process cannot open it (another PID namespace, no permission)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        st = os.fstat(fd)
        file = (st.st_dev, st.st_ino)
        if expect is not None and (file != expect or st.st_size != size):
            return None
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        return file, mmap.mmap(fd, size, flags=flags, prot=prot)
    finally:
        os.close(fd)
