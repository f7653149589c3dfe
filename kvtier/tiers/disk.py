"""The local disk tier: one file per chunk under `local_disk`, LRU by size.

    <local_disk>/                       (tp_size > 1: <local_disk>/tp<rank>of<size>/)
      .lock                             flock of the one kvtier process using it
      <32 hex>.kvc                      a chunk: codec header (40 B), then its bytes
      <32 hex>.kvc.<pid>.<thread>.tmp   a write in progress

A file's name is the xxh3-128 of its chunk key. A write goes to a temporary
name and is renamed over the final one only when whole, so a reader never
sees half a chunk; a crash leaves at most a `.tmp`, removed at the next
start. No fsync: a file cut short by a power loss fails its length or
checksum check when read, and a chunk that fails is a miss (and is
deleted), never wrong KV.

Why one file per chunk, not segment files: a chunk of a real model is tens
of MB (Llama-3.1-8B: 32 MiB per 256 tokens), so a file's open, rename and
unlink cost well under 1% of its bytes; eviction is an unlink, and the
index rebuilds from a directory listing. `kvtier bench disk` measures the
tier against one sequential file of the same bytes (results/gpu-h100-2026-11-23/README.md).

The index (name → size, in LRU order) is rebuilt at start from the
directory, oldest modification first; a read touches the file's mtime so
the order survives restarts. One process owns a directory at a time: a
second one gets `DiskTierInUse` at start (two writers' LRU accounting
would disagree). A chunk leased by a lookup (`pin`) is never evicted.

Faults: a file that fails its checks is a logged, counted miss and is
removed. A write that fails (disk full, read-only, I/O error) is logged
once with its cause; the tier then stops writing and keeps serving what it
has, and kvtier goes on from CPU RAM and the remote tier. Every
`retry_s` (WRITE_RETRY_S) one write is tried again: once one succeeds (not
one in flight before the stop) the tier writes again and says so."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtier.codec import HEADER, Codec
from kvtier.errors import CorruptPayload, DiskTierInUse
from kvtier.keys import ChunkKey, wire_key
from kvtier.logs import get_logger
from kvtier.tiers.base import LocalTier, PinningTier, Tier
from kvtier.tiers.policy import EvictionOrder

log = get_logger(__name__)

SUFFIX = ".kvc"
# Reads and writes in flight at once: they wait on the device, not on a core
# (the measurements that chose them: results/README.md, "Figures behind constants").
READ_THREADS = 4
WRITE_THREADS = 2
WRITE_RETRY_S = 10.0  # after a failed write, how long the tier writes nothing before it tries one


@dataclass
class DiskStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0  # files that failed their checks (removed)
    write_errors: int = 0
    too_large: int = 0  # chunks larger than the whole tier
    bytes_written: int = 0
    bytes_read: int = 0


def file_name(key: ChunkKey) -> str:
    return xxhash.xxh3_128_hexdigest(wire_key(key)) + SUFFIX


class DiskTier(LocalTier, PinningTier):
    name = Tier.DISK
    min_stores: int

    def __init__(
        self,
        root: Path,
        capacity: int,
        codec: Codec,
        policy: str = "LRU",
        retry_s: float = WRITE_RETRY_S,
        min_stores: int = 1,
    ) -> None:
        self.root, self.capacity, self.codec, self.retry_s = Path(root), capacity, codec, retry_s
        self.min_stores = min_stores  # local_disk_min_stores: the write filter
        self.stats = DiskStats()
        self.writable = True
        # while not writable: when one write is tried again; stops so far
        self._retry_at, self._outages = 0.0, 0
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}  # file name -> bytes
        # cache_policy (a restart keeps mtime order)
        self._order: EvictionOrder[str] = EvictionOrder(policy)
        self._pins: Counter[str] = Counter()
        self._digests: dict[str, bytes] = {}  # file name -> key digest, of the files written here
        self.on_removed: Callable[[bytes], None] | None = None  # KV events: each chunk removed
        self._used = 0  # bytes of the index plus writes in progress
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvtier-disk-read")
        self._writers = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kvtier-disk-write")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(
                e.errno, f"local_disk {self.root}: cannot create the directory ({e.strerror})"
            ) from None
        self._lock_fd, cause = self._take_lock()
        self._rebuild()
        if cause is not None:
            self._stop_writing(cause)
        log.info(
            "disk tier: %s, %d chunks (%.2f of %.2f GB)%s",
            self.root,
            len(self._index),
            self._used / 1e9,
            capacity / 1e9,
            "" if self.writable else ", read-only",
        )

    # -- start -------------------------------------------------------------------------

    def _take_lock(self) -> tuple[int, OSError | None]:
        """The directory's flock, and why it cannot be written (None if it can). The lock is
        held on a read-only descriptor: no file stays open for writing between writes, so
        an administrator can remount the file system read-only under a running tier."""
        path = self.root / ".lock"
        cause = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as e:  # read-only directory: serve what is there, write nothing
            fd = os.open(path, os.O_RDONLY) if path.exists() else os.open(self.root, os.O_RDONLY)
            cause, self.writable = e, False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() if path.is_file() else "?"
            os.close(fd)
            raise DiskTierInUse(self.root, holder) from None
        if cause is None:
            try:
                path.write_text(f"{os.getpid()}\n")  # who holds it, for the next one's error
            except OSError as e:
                cause, self.writable = e, False
        return fd, cause

    def _rebuild(self) -> None:
        """The index from the directory: chunks oldest-touched first; leftovers of crashed
        writes removed."""
        found = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp") and self.writable:
                    _unlink(Path(entry.path))  # a write cut short: never renamed, never valid
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._order.add(name)
            self._used += size
        if self._used > self.capacity:
            self._evict(0)  # max_local_disk_size shrank since the last run

    # -- reads -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [file_name(k) in self._index for k in keys]

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        """Read each chunk into `outs[i]` (exactly its size): num_tokens, or None for a miss.

        Several chunks are read at once (READ_THREADS): a device serves a
        deeper queue faster, and checksums run beside the reads.
        """
        if len(keys) < 2:
            return [self._read(key, out) for key, out in zip(keys, outs)]
        return list(self._readers.map(self._read, keys, outs))

    def _read(self, key: ChunkKey, out: memoryview) -> int | None:
        name = file_name(key)
        with self._lock:
            if name not in self._index:
                self.stats.misses += 1
                return None
            self._order.touch(name)
        path = self.root / name
        try:
            num_tokens = read_chunk_file(path, out, self.codec)
        except FileNotFoundError:  # removed behind our back
            self._forget(name)
            self._count(misses=1)
            return None
        except CorruptPayload as e:
            self._count(corrupt=1)
            log.warning("disk tier: %s is corrupt (%s); removed, treated as a miss", path, e)
            self._forget(name, unlink=True)
            return None
        except OSError as e:  # an I/O error reading: a miss, and not promised again
            self._count(misses=1)
            log.warning(
                "disk tier: reading %s failed (%s); treated as a miss and forgotten", path, e
            )
            self._forget(name)
            return None
        self._touch(path)
        self._count(hits=1, bytes_read=HEADER.size + len(out))
        return num_tokens

    def _touch(self, path: Path) -> None:
        """The file's mtime: LRU order that survives a restart. A read-only file system
        stops the writes (a read it served stays a hit)."""
        if not self.writable:
            return
        try:
            os.utime(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._stop_writing(e)

    def _count(self, **deltas: int) -> None:
        """Stats from the reader threads."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- writes ------------------------------------------------------------------------

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[tuple[memoryview, int, int]]) -> bool:
        """Write each (bytes, num_tokens[, KV digest]) chunk not on disk yet, WRITE_THREADS at
        a time; False once the tier stopped writing."""
        if len(keys) < 2:
            return all(self._write(k, c) for k, c in zip(keys, chunks))
        return all(list(self._writers.map(self._write, keys, chunks)))

    def _write(self, key: ChunkKey, chunk: tuple[memoryview, int, int]) -> bool:
        admitted = self._may_write()  # the stops so far when it was let through, or None
        if admitted is None:
            return False
        name = file_name(key)
        parts = self.codec.encode(*chunk)
        size = sum(len(p) for p in parts)
        if not self._reserve(name, size):
            return True
        tmp = self.root / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            _write_file(tmp, parts)
            os.rename(tmp, self.root / name)
        except OSError as e:
            _unlink(tmp)
            with self._lock:
                self._used -= size
            self._stop_writing(e)
            return False
        with self._lock:
            self._index[name] = size
            self._digests[name] = key.digest
            self._order.add(name)
            self.stats.puts += 1
            self.stats.bytes_written += size
            # not one in flight before the stop
            again = not self.writable and admitted == self._outages
            self.writable = self.writable or again
        if again:
            log.warning(
                "disk tier: writing to %s works again; the disk tier writes again", self.root
            )
        return True

    def _may_write(self) -> int | None:
        """The stops so far where writable or (every `retry_s`) for the write that tries
        again; else None."""
        with self._lock:
            now = time.monotonic()
            if not self.writable:
                if now < self._retry_at:
                    return None
                self._retry_at = now + self.retry_s
            return self._outages

    def _reserve(self, name: str, size: int) -> bool:
        """Room for `size` bytes, evicting in `cache_policy` order; False if the chunk is there
        or can never fit."""
        with self._lock:
            if name in self._index:
                self._order.touch(name)
                return False
            if size > self.capacity:
                self.stats.too_large += 1
                return False
        return self._evict(size, reserve=True)

    def _evict(self, size: int, reserve: bool = False) -> bool:
        """Remove unpinned chunks, in `cache_policy` order, until `size` more bytes fit; with
        `reserve`, take them in the same hold of the lock (two writer threads each making room
        and then reserving apart could both find the room one eviction made, and the tier
        went past its size by a chunk)."""
        victims = []
        with self._lock:
            for name in list(self._order.victims()):
                if self._used + size <= self.capacity:
                    break
                if self._pins[name]:
                    continue
                self._used -= self._index.pop(name)
                self._order.discard(name)
                self.stats.evictions += 1
                victims.append(name)
            fits = self._used + size <= self.capacity
            if fits and reserve:
                self._used += size
            gone = [self._digests.pop(name, None) for name in victims]
        for name in victims:
            _unlink(self.root / name)
        self._removed(gone)
        return fits

    def _removed(self, digests: Sequence[bytes | None]) -> None:
        if self.on_removed is None:
            return
        for digest in digests:
            if digest is not None:
                self.on_removed(digest)

    def _stop_writing(self, e: OSError) -> None:
        """Logged once per outage; writes are tried again after `retry_s`."""
        with self._lock:
            self.stats.write_errors += 1
            # a read-only start is not writable yet
            first = self.writable or self.stats.write_errors == 1
            self.writable, self._outages = False, self._outages + (1 if self.writable else 0)
            self._retry_at = max(self._retry_at, time.monotonic() + self.retry_s)
        if not first:
            return
        reasons = {
            errno.ENOSPC: "the disk is full",
            errno.EROFS: "the file system is read-only",
            errno.EACCES: "no permission",
            errno.EDQUOT: "the disk quota is used up",
        }
        why = reasons.get(e.errno or 0, e.strerror or str(e))
        log.error(
            "disk tier: writing to %s failed: %s (%s). The disk tier stops writing; it keeps "
            "serving the %d chunks it has, and kvtier goes on from CPU RAM; it tries again in "
            "%g s",
            self.root,
            why,
            e,
            len(self._index),
            self.retry_s,
        )

    # -- leases and housekeeping -------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey]) -> list[str]:
        """Protect the chunks of `keys` that are on disk from eviction; the names to `unpin`."""
        with self._lock:
            names = [n for n in map(file_name, keys) if n in self._index]
            self._pins.update(names)
        return names

    def unpin(self, handles: Sequence[str]) -> None:
        with self._lock:
            self._pins.subtract(handles)
            self._pins = +self._pins  # drop zeros

    def delete(self, key: ChunkKey) -> bool:
        return self._forget(file_name(key), unlink=True)

    def _forget(self, name: str, unlink: bool = False) -> bool:
        with self._lock:
            size = self._index.pop(name, None)
            self._order.discard(name)
            digest = self._digests.pop(name, None)
            if size is not None:
                self._used -= size
        if unlink and size is not None:  # also while not writable: a full disk gets room back
            _unlink(self.root / name)
        if size is not None:
            self._removed([digest])
        return size is not None

    def clear(self) -> None:
        with self._lock:
            names = [n for n in self._index if not self._pins[n]]
        for name in names:
            self._forget(name, unlink=True)

    @property
    def evictions(self) -> int:
        return self.stats.evictions

    @property
    def used_bytes(self) -> int:
        return self._used

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1


def read_chunk_file(path: Path, out: memoryview, codec: Codec) -> int:
    """A chunk file checked into `out` (the chunk's size): num_tokens; or OSError,
    CorruptPayload."""
    header = bytearray(HEADER.size)
    with open(path, "rb", buffering=0) as f:
        if (size := os.fstat(f.fileno()).st_size) != HEADER.size + len(out):
            raise CorruptPayload(f"file of {size} bytes, the chunk needs {HEADER.size + len(out)}")
        _read_exactly(f, [memoryview(header), memoryview(out).cast("B")])
        return codec.check_in_place(header, out)


def _write_file(path: Path, parts: Sequence[memoryview | bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
    finally:
        os.close(fd)


def _read_exactly(f, views: list[memoryview]) -> None:
    for view in views:
        while len(view):
            n = f.readinto(view)
            if not n:
                raise CorruptPayload("file ended early")
            view = view[n:]


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:  # read-only since: the index forgets it all the same
        log.debug("disk tier: cannot remove %s: %s", path, e)
