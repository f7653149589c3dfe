"""The remote tier: chunks in a store shared by the cluster, through a codec.

Every fault of the store (unreachable, reset, no answer within
blocking_timeout_secs) becomes a logged, counted miss here, and the tier
then stays quiet for a back-off period (1 s, doubling to 30 s) so that a
dead server costs one timeout, not one per request. The first call after
the back-off reconnects; the store clients reconnect by themselves.
Same host, CPU tier off: `borrow` lends chunks in place from the store
server's pool (KVClient.borrow), so they go from there straight to the
engine's KV (by DMA once the pool is registered with CUDA) with no copy
into a staging block. A GPU reader checks them by their KV digests
(codec.kv_digest, written by a GPU storer), summed on the device as they
cross; otherwise their xxh3 checksums run on the copy threads meanwhile. A
chunk that fails, or whose lease ran out, reads as not loaded
(`BorrowedBlock.verified`), and the engine recomputes it.

A payload that fails its checksum or header checks is a miss as well (and
is removed from the store, which may keep a key's first value), and so is
a read the store refuses (a bound of the server). A wrong or missing token
(RemoteAuthFailed) is a fault: logged, with the back-off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvtier.buffers import parallel, start_parallel
from kvtier.codec import HEADER, U64, Codec, checksum
from kvtier.errors import CorruptPayload, RemoteRefused, RemoteUnavailable
from kvtier.keys import ChunkKey, wire_key
from kvtier.logs import get_logger
from kvtier.memory import front_view
from kvtier.remote import KVStore, LendingStore
from kvtier.tiers.base import LendingTier, Tier

log = get_logger(__name__)
T = TypeVar("T")

BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0


@dataclass
class RemoteStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    faults: int = 0  # calls that failed on the transport
    skipped: int = 0  # calls not made during a back-off
    corrupt: int = 0  # payloads that failed their checks
    refused: int = 0  # puts (full, too large) and reads (over a server bound) the store refused
    lent: int = 0  # hits read in place from the store server's pool (no staging copy)


class _LentBatch:
    """Chunks of one lease, and how they are checked; the lease is given back
    when the last block is released.

    With `digests` (every chunk carries one, and the reader moves chunks on a
    GPU), the transfer that moves them sums their KV digests on the device
    (`device_check`) and those are compared on the first `good`. Otherwise
    their xxh3 checksums begin over the copy threads as soon as they are lent
    (a batch read ahead is hashed while the one before it crosses)."""

    def __init__(
        self,
        lease,
        payloads: list[tuple[int, int]],
        checksums: list[int],
        digests: list[int] | None,
    ) -> None:
        self.lease, self._left = lease, len(payloads)
        self._payloads = payloads  # (offset, bytes)
        self._checksums = checksums
        self._digests = digests
        self._device_sums: torch.Tensor | None = None
        self._sums = None if digests else self._start_checksums()
        self._good: int | None = None  # leading chunks whose check holds
        self._lock = threading.Lock()

    def _start_checksums(self) -> Callable[[], list[int]]:
        pool = self.lease.pool
        return start_parallel(
            checksum,
            [pool[o : o + n] for o, n in self._payloads],
            sum(n for _, n in self._payloads),
        )

    def device_check(self, count: int, device: torch.device) -> torch.Tensor | None:
        if self._digests is None:
            return None
        if count != len(self._digests) or self._device_sums is not None:
            raise RuntimeError(
                "a lent batch is checked on the device in one transfer of all its chunks"
            )
        self._device_sums = torch.zeros(count, dtype=torch.int64, device=device)
        return self._device_sums

    def good(self, i: int) -> bool:
        if self._good is None:
            # on the reader's stream
            if self._digests is not None and self._device_sums is not None:
                bad = [
                    got & U64 != want
                    for got, want in zip(self._device_sums.tolist(), self._digests)
                ]
            else:  # no digests, or a reader that did not take them: the checksums
                if self._sums is None:
                    self._sums = self._start_checksums()
                bad = [s != c for s, c in zip(self._sums(), self._checksums)]
            self._good = bad.index(True) if True in bad else len(bad)
        return self._good > i and self.lease.in_time()

    def release_one(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            if self._sums is not None:
                self._sums()  # no thread still reads the pages when they go back (or are unmapped)
            self.lease.release()


class BorrowedBlock:
    """A chunk in the store server's pool, lent in place: reads like a MemoryBlock
    (`view`, `release`), is never kept (`retain` refuses), and its bytes count
    only once `verified()` (checksum and lease) says so."""

    __slots__ = ("data", "_batch", "_i")
    pool = None  # no block of the engine's pool

    def __init__(self, data: torch.Tensor, batch: _LentBatch, i: int) -> None:
        self.data, self._batch, self._i = data, batch, i

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return front_view(self.data, dtype, shape)

    def verified(self) -> bool:
        return self._batch.good(self._i)

    def device_check(self, count: int, device: torch.device) -> torch.Tensor | None:
        """Where the transfer of this chunk's whole batch (`count` chunks, in order)
        adds their KV digests; None: checked by xxh3 on the CPU instead."""
        return self._batch.device_check(count, device)

    def retain(self) -> BorrowedBlock:
        raise RuntimeError("a borrowed chunk is not kept: it belongs to the store server's pool")

    def release(self) -> None:
        self._batch.release_one()


class RemoteTier(LendingTier):
    name = Tier.REMOTE
    min_stores = 1  # every stored chunk is written to the remote store

    def __init__(self, store: KVStore, codec: Codec, url: str) -> None:
        self.store, self.codec, self.url = store, codec, url
        # the reader moves lent chunks on a GPU, which checks their digests
        self.digests_on_device = False
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_FIRST

    # -- reads ---------------------------------------------------------------------

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self._guard(
            "exists", lambda: self.store.exists([wire_key(k) for k in keys]), [False] * len(keys)
        )

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        """Load each chunk's bytes into `outs[i]` (exactly the chunk's size).

        Per key its num_tokens, or None for a miss, a fault or a payload
        that fails its checks (then `outs[i]` holds nothing usable). With the
        naive serde the payload lands in `outs[i]` directly, no copy.
        """
        wire = [wire_key(k) for k in keys]
        if self.codec.in_place:
            headers = [bytearray(HEADER.size) for _ in keys]
            filled = self._guard(
                "get",
                lambda: self.store.get_into(wire, [[h, o] for h, o in zip(headers, outs)]),
                [False] * len(keys),
            )

            def decode(i: int) -> int:
                return self.codec.check_in_place(headers[i], outs[i])
        else:
            missing: list[memoryview | bytes | None] = [None] * len(keys)
            values = self._guard("get", lambda: self.store.get(wire), missing)
            filled = [v is not None for v in values]

            def decode(i: int) -> int:
                value = values[i]
                assert value is not None  # decoded only where filled[i]
                return self.codec.decode_into(value, outs[i])

        def check(i: int) -> int | CorruptPayload | None:
            try:
                return decode(i) if filled[i] else None
            except CorruptPayload as e:
                return e

        # Checksums (and lz4) read every byte once more: over the copy threads for a large batch.
        out: list[int | None] = []
        corrupt: list[bytes] = []
        for key, result in zip(keys, parallel(check, range(len(keys)), sum(len(o) for o in outs))):
            if isinstance(result, CorruptPayload):
                self.stats.corrupt += 1
                corrupt.append(wire_key(key))
                log.warning(
                    "remote %s: chunk %s is corrupt (%s); treated as a miss and removed",
                    self.url,
                    key,
                    result,
                )
                result = None
            elif result is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            out.append(result)
        # so that the next store of these chunks lands (a store may keep a key's first value)
        if corrupt:
            self._guard("delete", lambda: self.store.delete(corrupt), 0)
        return out

    def can_borrow(self) -> bool:
        return self.codec.in_place and isinstance(self.store, LendingStore)

    def max_held(self) -> float:
        """Bytes the server lets one connection hold (leases included); 0 while it is down."""
        store = self.store
        if not isinstance(store, LendingStore):
            return 0.0
        info = self._guard("get", store.server_info, None)
        if info is None:  # down (or backing off): the borrow that follows will say so
            return 0.0
        return (info.get("bounds") or {}).get("max_held", float("inf"))

    def borrow(
        self, keys: Sequence[ChunkKey], raw_sizes: Sequence[int], *, whole: bool = False
    ) -> list[tuple[BorrowedBlock, int]] | None:
        """The leading chunks of `keys` lent in place, each (block, num_tokens);
        it stops at the first one absent, split over pages or with a bad header,
        which the copying path (`get_into`) then reads, counts and logs as what
        it is. None: not one lent (another host, a refusal, a fault, or the
        first chunk is such a one), or with `whole` not every chunk the server
        holds before the first it does not: copy instead."""
        store = self.store
        if not isinstance(store, LendingStore):
            return None
        lease = self._guard("get", lambda: store.borrow([wire_key(k) for k in keys]), None)
        if lease is None:
            return None
        wanted = lease.leading if whole else len(keys)
        pool = memoryview(lease.pool)
        # ((payload offset, bytes), tokens, checksum, digest)
        lent: list[tuple[tuple[int, int], int, int, int]] = []
        for place, raw in zip(lease.places[:wanted], raw_sizes):
            if place is None:
                break
            at, size = place
            try:
                n, stored, digest = self.codec.check_header(
                    pool[at : at + HEADER.size], size - HEADER.size, raw
                )
            except CorruptPayload:
                break
            lent.append(((at + HEADER.size, size - HEADER.size), n, stored, digest))
        if not lent or (whole and len(lent) < wanted):
            lease.release()
            return None
        self.stats.hits += len(lent)
        self.stats.lent += len(lent)
        digests = (
            [d for *_, d in lent] if self.digests_on_device and all(d for *_, d in lent) else None
        )
        batch = _LentBatch(lease, [p for p, *_ in lent], [c for _, _, c, _ in lent], digests)
        # Slices of one tensor over the pool: chunks that are neighbours there cross to the GPU
        # as one run.
        pages = torch.from_numpy(lease.pool)
        return [
            (BorrowedBlock(pages[at : at + size], batch, i), n)
            for i, ((at, size), n, *_) in enumerate(lent)
        ]

    # -- writes --------------------------------------------------------------------

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[tuple[memoryview, int, int]]) -> bool:
        """Chunks as (bytes, num_tokens, KV digest or 0), as the CPU tier's writers hand them
        over."""
        values = parallel(
            lambda chunk: self.codec.encode(*chunk), chunks, sum(len(c[0]) for c in chunks)
        )

        def put() -> bool:
            try:
                self.store.put([wire_key(k) for k in keys], values)
            except (RemoteRefused, ValueError) as e:  # full or too large: this put only
                self.stats.refused += len(keys)
                log.warning("remote %s refused %d chunks: %s", self.url, len(keys), e)
                return False
            self.stats.puts += len(keys)
            return True

        return self._guard("put", put, False)

    def close(self) -> None:
        self.store.close()

    # -- faults --------------------------------------------------------------------

    def _guard(self, what: str, call: Callable[[], T], default: T) -> T:
        with self._lock:
            if time.monotonic() < self._down_until:
                self.stats.skipped += 1
                return default
        try:
            result = call()
        except (
            RemoteRefused
        ) as e:  # a bound of the server (bytes held by one connection): this call only
            self.stats.refused += 1
            log.warning("remote %s refused a %s: %s; a miss", self.url, what, e)
            return default
        except RemoteUnavailable as e:
            with self._lock:
                self.stats.faults += 1
                self._down_until = time.monotonic() + self._backoff
                log.warning(
                    "remote %s: %s failed (%s); a miss, next try in %.0f s",
                    self.url,
                    what,
                    e,
                    self._backoff,
                )
                self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return default
        with self._lock:
            if self._backoff != BACKOFF_FIRST:
                log.info("remote %s is back", self.url)
                self._backoff = BACKOFF_FIRST
        return result
