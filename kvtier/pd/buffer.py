"""The decoder's receive buffer for disaggregated prefill: blocks that senders write into.

    PdBuffer     `pd_buffer_size` bytes on `pd_buffer_device`, in chunk-sized
                 blocks. A request's chunks are reserved (Alloc), written by
                 the sender, then committed: from then on they are in
                 `tier`, a CpuTier the decoder's CacheEngine uses as its CPU
                 tier, so its lookups and loads find them like any hit.

Lifetime of a chunk in the buffer: reserved → committed → freed when every
request that owns it is released (the decoder loaded it, or the proxy says
the request ended), or `ttl` seconds after it was committed (its request
never came). The buffer never evicts a committed chunk to make room: a
sender that finds no room waits (bounded, `pd_allocation_timeout_sec`) and
then gives up, and the decoder recomputes. A reserved block is freed
only by its sender (Commit, Abort, or its connection closing) or after `ttl`,
so no block is ever handed to a second request while a sender may still be
writing into it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvtier.keys import ChunkKey, KVFormat
from kvtier.logs import get_logger
from kvtier.memory import HostPool, MemoryBlock
from kvtier.pd import protocol as proto
from kvtier.tiers.cpu import CpuTier

log = get_logger(__name__)


@dataclass
class _Reservation:
    blocks: dict[int, tuple[ChunkKey, int, MemoryBlock]]  # block index -> (key, tokens, block)
    shared: list[ChunkKey]  # keys the buffer held already (owned from the Alloc on)
    deadline: float


@dataclass
class _Owned:
    keys: set[ChunkKey] = field(default_factory=set)
    deadline: float = 0.0


@dataclass
class BufferStats:
    reserved_chunks: int = 0
    committed_chunks: int = 0
    no_room: int = 0
    released: int = 0
    expired: int = 0
    rejected_messages: int = 0


class PdBuffer:
    def __init__(
        self,
        size: int,
        block_bytes: int,
        device: str,
        fmt: KVFormat,
        bytes_per_token: int,
        ttl: float,
    ) -> None:
        self.pool = HostPool(size, block_bytes, device=device)
        self.tier = CpuTier(self.pool)
        self.fmt, self.bytes_per_token, self.ttl = fmt, bytes_per_token, ttl
        self.stats = BufferStats()
        self._lock = threading.Lock()
        self._reserved: dict[str, _Reservation] = {}
        self._owned: dict[str, _Owned] = {}
        self._owners: dict[ChunkKey, set[str]] = {}
        self._released: OrderedDict[str, None] = OrderedDict()  # released while still reserved

    # -- sender operations ---------------------------------------------------------------

    def alloc(self, msg: proto.Alloc, digests: bytes) -> proto.Allocated | proto.NoRoom:
        """Blocks for the chunks of `msg` (their key digests, `DIGEST_BYTES` each) the
        buffer does not hold; all of them or none. A request's reservation grows with
        each Alloc until its Commit."""
        n = proto.DIGEST_BYTES
        if len(digests) != n * len(msg.tokens):
            raise proto.ProtocolError(
                f"Alloc: {len(digests)} bytes of digests for {len(msg.tokens)} chunks"
            )
        keys = [ChunkKey(self.fmt, digests[i : i + n]) for i in range(0, len(digests), n)]
        chunk_tokens = self.pool.block_bytes // self.bytes_per_token
        if any(not 0 < t <= chunk_tokens for t in msg.tokens):
            raise proto.ProtocolError(f"Alloc: chunk token counts must lie in [1, {chunk_tokens}]")
        self.expire()
        with self._lock:
            earlier = self._reserved.get(msg.req_id)
            new = [i for i, k in enumerate(keys) if not self.tier.contains(k)]
            # in address order: chunks that follow each other land in adjacent blocks wherever the
            # free blocks allow, and the sender moves each run in one copy (`contiguous_runs`)
            blocks = self.pool.allocate_many(len(new))
            if blocks is None:
                self.stats.no_room += 1
                return proto.NoRoom(
                    msg.req_id, self.pool.free_blocks, len(new), self.pool.num_blocks
                )
            fresh = set(new)
            shared = [k for i, k in enumerate(keys) if i not in fresh]
            for key in shared:  # owned now, so another request's release cannot free it
                self._own(msg.req_id, key)
            res = earlier or _Reservation({}, [], time.monotonic() + self.ttl)
            res.blocks.update({b.index: (keys[i], msg.tokens[i], b) for i, b in zip(new, blocks)})
            res.shared += shared
            self._reserved[msg.req_id] = res
            self.stats.reserved_chunks += len(blocks)
            out = [-1] * len(keys)
            for i, b in zip(new, blocks):
                out[i] = b.index
            return proto.Allocated(msg.req_id, out)

    def write_target(self, req_id: str, index: int, nbytes: int) -> torch.Tensor:
        """The bytes of reserved block `index` a Write of `nbytes` fills."""
        with self._lock:
            res = self._reserved.get(req_id)
            entry = res.blocks.get(index) if res is not None else None
        if entry is None:
            raise proto.ProtocolError(f"Write: block {index} is not reserved for request {req_id}")
        key, tokens, block = entry
        if nbytes != tokens * self.bytes_per_token:
            raise proto.ProtocolError(
                f"Write: {nbytes} bytes for a chunk of {tokens} tokens "
                f"({tokens * self.bytes_per_token} bytes)"
            )
        return block.data[:nbytes]

    def commit(self, req_id: str) -> int:
        """The reservation's chunks become hits (unless the request was released meanwhile)."""
        with self._lock:
            res = self._reserved.pop(req_id, None)
            if res is None:
                raise proto.ProtocolError(f"Commit: request {req_id} has no reservation")
            if req_id in self._released:
                del self._released[req_id]
                self._free_reservation(res)
                self._drop_owner(req_id)
                return 0
            for key, tokens, block in res.blocks.values():
                self.tier.put(key, block, tokens)  # the tier takes the reservation's reference
                self._own(req_id, key)
            self._owned[req_id].deadline = time.monotonic() + self.ttl
            self.stats.committed_chunks += len(res.blocks)
            return len(res.blocks) + len(res.shared)

    def abort(self, req_id: str) -> None:
        with self._lock:
            res = self._reserved.pop(req_id, None)
            if res is not None:
                self._free_reservation(res)
                if req_id not in self._owned or not self._owned[req_id].keys - set(res.shared):
                    self._drop_owner(req_id)

    # -- decoder / proxy operations ------------------------------------------------------

    def release(self, req_id: str) -> None:
        """The request is done with its chunks: free those no other request owns."""
        with self._lock:
            # its sender may still be writing: free at its Commit/Abort
            if req_id in self._reserved:
                self._released[req_id] = None
                while len(self._released) > 4096:
                    self._released.popitem(last=False)
                return
            if self._drop_owner(req_id):
                self.stats.released += 1

    def expire(self) -> None:
        """Free reservations and committed chunks older than `ttl`."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, res in self._reserved.items() if res.deadline < now]:
                log.warning(
                    "PD buffer: request %s reserved blocks %d s ago and never committed: freed",
                    rid,
                    int(self.ttl),
                )
                self._free_reservation(self._reserved.pop(rid))
                self._drop_owner(rid)
                self.stats.expired += 1
            for rid in [r for r, o in self._owned.items() if o.deadline and o.deadline < now]:
                log.warning(
                    "PD buffer: the KV of request %s waited %d s for its request: freed",
                    rid,
                    int(self.ttl),
                )
                self._drop_owner(rid)
                self.stats.expired += 1

    def held_requests(self) -> int:
        with self._lock:
            return len(self._owned) + len(self._reserved)

    # -- internals (under the lock) ------------------------------------------------------

    def _own(self, req_id: str, key: ChunkKey) -> None:
        self._owned.setdefault(req_id, _Owned()).keys.add(key)
        self._owners.setdefault(key, set()).add(req_id)

    def _drop_owner(self, req_id: str) -> bool:
        owned = self._owned.pop(req_id, None)
        if owned is None:
            return False
        for key in owned.keys:
            owners = self._owners.get(key)
            if owners is None:
                continue
            owners.discard(req_id)
            if not owners:
                del self._owners[key]
                self.tier.delete(key)  # a load still reading the block keeps it until it releases
        return True

    @staticmethod
    def _free_reservation(res: _Reservation) -> None:
        for _, _, block in res.blocks.values():
            block.release()
