"""Recurrent state beside the attention KV: every Mamba (or linear-attention) layer's
state after a chunk's last token, a *state snapshot*.

A hybrid model (Nemotron-H, Jamba, Falcon-H1, ...) keeps, besides attention KV,
one fixed-size state per recurrent layer that summarises every token before it.
A hit that loads the attention KV of tokens [0, e) is the model's only with the
state after token e-1 too, so on such a model a hit ends where a snapshot is.

    save(chunk_key, blocks)  each layer's state block, device -> pool blocks ("pieces",
                             keyed from the key of the chunk ending there) -> the tiers
    load(chunk_key, blocks)  the pieces from whichever tier holds them -> the layers' blocks

The pieces are pool blocks like chunks: they go to disk and the remote store,
are evicted, counted and checksummed like chunks, and a missing or corrupt
piece is a missing snapshot (the hit ends earlier), never a wrong state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.engine.landing import Landing
from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.logs import get_logger
from kvtier.memory import MemoryBlock
from kvtier.tiers.cpu import StoredChunk
from kvtier.tiers.store import TieredStore
from kvtier.transfer import InFlight

log = get_logger(__name__)


@dataclass(frozen=True)
class StateLayers:
    """The engine's recurrent layers: `pages[l]` is layer l's states as a [num_blocks,
    nbytes_l] uint8 view, block b's state at the front of its page (vLLM's layout)."""

    pages: list[torch.Tensor]

    def __post_init__(self) -> None:
        for p in self.pages:
            if p.dtype != torch.uint8 or p.dim() != 2 or p.stride(1) != 1:
                raise ValueError(
                    f"a recurrent layer's pages must be a [blocks, bytes] uint8 view, got "
                    f"{tuple(p.shape)} {p.dtype} strides {p.stride()}"
                )

    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot: every layer's state."""
        return sum(p.shape[1] for p in self.pages)

    @property
    def device(self) -> torch.device:
        return self.pages[0].device


@dataclass
class StateLoad:
    """A snapshot's copies to the device, queued on the caller's stream; `finish()` waits
    for them and lets go of the pieces."""

    pieces: list[StoredChunk] = field(default_factory=list)
    done: torch.cuda.Event | None = None

    def finish(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        for chunk in self.pieces:
            chunk.block.release()
        self.pieces = []


class StatePath:
    def __init__(self, layers: StateLayers, tiers: TieredStore, chunk_bytes: int) -> None:
        self.layers, self.tiers = layers, tiers
        # A piece is one pool block, a chunk's size: it travels wherever chunks do.
        self.piece_tokens = chunk_bytes // tiers.bytes_per_token
        self.piece_bytes = self.piece_tokens * tiers.bytes_per_token
        self.num_pieces = -(-layers.nbytes // self.piece_bytes)
        # (layer, from byte, piece, to byte, length): where each layer's state lies in the pieces
        self._runs = _runs([p.shape[1] for p in layers.pages], self.piece_bytes)
        self._stream = torch.cuda.Stream(layers.device) if layers.device.type == "cuda" else None
        # Snapshots copying to the host: put in the tiers once their copy has ended (`settle`),
        # so that a step's save does not wait on the host for that step's forward.
        self.landing = Landing()

    def keys(self, chunk_key: ChunkKey) -> list[ChunkKey]:
        """The keys of the pieces of the snapshot taken where `chunk_key`'s chunk ends."""
        return [
            ChunkKey(
                chunk_key.fmt,
                hashlib.blake2b(
                    b"kvtier-state/%d/" % i + chunk_key.digest, digest_size=16
                ).digest(),
            )
            for i in range(self.num_pieces)
        ]

    def save(self, chunk_key: ChunkKey, blocks: Sequence[int]) -> bool:
        """Store each layer's state block `blocks[l]` as the snapshot of `chunk_key`'s end.
        The copies follow the caller's stream (the forward that wrote the states), and the
        caller's later work follows them (a later step may reuse those blocks); the snapshot
        goes into the tiers once they have ended (`settle`, at the next save, load or lookup:
        the host does not wait for the forward here). False where
        the pool had no blocks for it (every block held by readers): nothing is stored."""
        self.settle()
        keys = self.keys(chunk_key)
        if self.landing.holds(keys[0]) or len(self.tiers.locate(keys)) == len(keys):
            return True
        pieces: list[MemoryBlock] = []
        for _ in keys:
            block = self.tiers.allocate()
            if block is None:
                for b in pieces:
                    b.release()
                log.warning("no free CPU block for a recurrent-state snapshot: not stored")
                return False
            pieces.append(block)
        dst = [b.data[: self.piece_bytes] for b in pieces]
        src = [page[b] for page, b in zip(self.layers.pages, blocks)]
        if self._stream is None:
            _copy(self._runs, src, dst)
            self._put(keys, pieces)
            return True
        main = torch.cuda.current_stream(self.layers.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            _copy(self._runs, src, dst)
        done = self._stream.record_event()
        main.wait_event(done)  # the blocks are read before anything later writes them
        self.landing.add(InFlight(done), keys, lambda: self._put(keys, pieces))
        return True

    def settle(self, wait: bool = False) -> None:
        """Put the snapshots whose copies to the host have ended in the tiers (with `wait`,
        every one, waiting for its copy)."""
        self.landing.settle(wait)

    def _put(self, keys: Sequence[ChunkKey], pieces: Sequence[MemoryBlock]) -> None:
        for key, block in zip(keys, pieces):
            self.tiers.put(key, block, self.piece_tokens)

    def load(
        self, chunk_key: ChunkKey, blocks: Sequence[int], also: Sequence[int] | None = None
    ) -> StateLoad | None:
        """Copy the snapshot of `chunk_key`'s end into each layer's state block `blocks[l]`
        (and `also[l]`), queued on the caller's stream (so its forward reads them after).
        None where a piece could not be read (evicted, corrupt, a fault): nothing was written."""
        self.settle()
        keys = self.keys(chunk_key)
        where = self.tiers.locate(keys)
        if len(where) < len(keys):
            return None
        spans = [ChunkSpan(k, 0, self.piece_tokens) for k in keys]
        got: list[StoredChunk] = []
        for batch in self.tiers.fetch(spans, where):
            got.extend(chunk for _, chunk in batch)
        load = StateLoad(got)
        if len(got) < len(keys) or not all(c.block.verified() for c in got):
            load.finish()
            return None
        src = [c.block.view(torch.uint8, (self.piece_bytes,)) for c in got]
        for targets in (blocks, also or ()):
            if targets:
                dst = [page[b] for page, b in zip(self.layers.pages, targets)]
                _copy(self._runs, src, dst, into_pieces=False)
        if self._stream is not None:
            load.done = torch.cuda.current_stream(self.layers.device).record_event()
        return load


def _runs(sizes: Sequence[int], piece_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """Each layer's bytes laid end to end over pieces of `piece_bytes`, as runs that cross
    no piece's end: (layer, offset in the layer, piece, offset in the piece, length)."""
    runs, at = [], 0
    for layer, size in enumerate(sizes):
        done = 0
        while done < size:
            piece, off = divmod(at, piece_bytes)
            n = min(size - done, piece_bytes - off)
            runs.append((layer, done, piece, off, n))
            done, at = done + n, at + n
    return runs


def _copy(
    runs: Sequence[tuple[int, int, int, int, int]],
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    into_pieces: bool = True,
) -> None:
    """Layers' bytes into pieces (`into_pieces`), or pieces' bytes into layers."""
    for layer, lo, piece, po, n in runs:
        if into_pieces:
            dst[piece][po : po + n].copy_(src[layer][lo : lo + n], non_blocking=True)
        else:
            dst[layer][lo : lo + n].copy_(src[piece][po : po + n], non_blocking=True)
