"""Which instance holds which prefix, from KV events in vLLM's format.

A BlockStored event names blocks by hash, each with its parent's hash and its token ids;
kvtier's chunks (block_size = chunk_size, medium CPU / DISK / REMOTE) and vLLM's own GPU
blocks (block_size = vLLM's, medium GPU) both come that way. The index keeps, per block,
the chain link (parent hash, block size, its tokens, its LoRA adapter) -> hashes, and which
instance holds it in which medium. A prompt's match walks its tokens down those links from
the root, block by block, for each block size seen: no hash function of kvtier's or vLLM's
is needed, only the token ids the events carry. One link may have several hashes: vLLM seeds
its block hashes per process (unless PYTHONHASHSEED is set), so two instances name the same
tokens differently; the walk follows every chain at once.

What an index cannot see: what else folds into a block's hash (images, cache_salt), so a
match is a routing hint that the instance's own lookup confirms, never a promise of KV.
Blocks in the REMOTE medium sit in a store every instance of the fleet reads: they make no
instance a better choice, and `match` leaves them out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BlockHash = bytes | int
Link = tuple[BlockHash | None, int, tuple[int, ...], str | None]  # parent, size, tokens, lora
SHARED_MEDIA = frozenset({"REMOTE"})  # read by every instance: no reason to pick one
GPU = "GPU"  # vLLM's events without a medium are its GPU prefix cache's


@dataclass
class _Block:
    link: Link
    holders: dict[str, set[str]] = field(default_factory=dict)  # instance -> media


class PrefixIndex:
    """Blocks by hash, their chain links, and who holds them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[BlockHash, _Block] = {}
        self._links: dict[Link, set[BlockHash]] = {}
        self._sizes: set[int] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, instance: str, events: Iterable[Mapping[str, Any]]) -> None:
        """Events of one instance, decoded from msgpack (dicts with vLLM's field names and
        "type": the event's class name)."""
        with self._lock:
            for event in events:
                kind = event.get("type")
                if kind == "BlockStored":
                    self._stored(instance, event)
                elif kind == "BlockRemoved":
                    medium = event.get("medium") or GPU
                    for block in event.get("block_hashes") or []:
                        self._drop(instance, _hashable(block), {medium})
                elif kind == "AllBlocksCleared":  # vLLM's prefix cache was reset
                    self._forget(instance, {GPU})

    def forget(self, instance: str) -> None:
        """Drop every block of `instance` (it went away)."""
        with self._lock:
            self._forget(instance, None)

    def match(self, tokens: Sequence[int], lora: str | None = None) -> dict[str, int]:
        """Per instance, the tokens of the longest prefix of `tokens` it holds itself (any
        medium but a shared store's), at any block size seen."""
        return self.held_in(tokens, None, lora)

    def held_in(
        self, tokens: Sequence[int], medium: str | None, lora: str | None = None
    ) -> dict[str, int]:
        """`match` in one medium ("CPU", "DISK", "REMOTE", "GPU"; None: any but a shared
        store's): per instance, the tokens of the longest prefix of `tokens` it holds there."""
        best: dict[str, int] = {}
        with self._lock:
            for size in sorted(self._sizes):
                for instance, n in self._walk(tokens, size, lora, medium).items():
                    best[instance] = max(best.get(instance, 0), n)
        return best

    def _walk(
        self, tokens: Sequence[int], size: int, lora: str | None, medium: str | None
    ) -> dict[str, int]:
        held: dict[str, int] = {}
        alive: set[str] | None = None  # instances holding every block so far
        parents: set[BlockHash | None] = {None}  # the previous block's hashes, every chain's
        for start in range(0, len(tokens) - size + 1, size):
            chunk = tuple(tokens[start : start + size])
            hashes: set[BlockHash] = set()
            for parent in parents:
                hashes |= self._links.get((parent, size, chunk, lora), set())
            local = {
                instance
                for h in hashes
                for instance, media in self._blocks[h].holders.items()
                if (medium in media if medium is not None else media - SHARED_MEDIA)
            }
            alive = local if alive is None else alive & local
            if not alive:
                break
            for instance in alive:
                held[instance] = start + size
            parents = set(hashes)
        return held

    def _stored(self, instance: str, event: Mapping[str, Any]) -> None:
        size = int(event["block_size"])
        tokens = list(event.get("token_ids") or [])
        parent = event.get("parent_block_hash")
        parent = None if parent is None else _hashable(parent)
        medium = event.get("medium") or GPU
        lora = event.get("lora_name")
        self._sizes.add(size)
        for i, raw in enumerate(event.get("block_hashes") or []):
            block_hash = _hashable(raw)
            link: Link = (parent, size, tuple(tokens[i * size : (i + 1) * size]), lora)
            block = self._blocks.get(block_hash)
            if block is None:
                block = self._blocks[block_hash] = _Block(link)
                self._links.setdefault(link, set()).add(block_hash)
            block.holders.setdefault(instance, set()).add(medium)
            parent = block_hash

    def _drop(self, instance: str, block_hash: BlockHash, media: set[str] | None) -> None:
        block = self._blocks.get(block_hash)
        if block is None or instance not in block.holders:
            return
        left = set() if media is None else block.holders[instance] - media
        if left:
            block.holders[instance] = left
            return
        del block.holders[instance]
        if not block.holders:
            del self._blocks[block_hash]
            same = self._links.get(block.link, set())
            same.discard(block_hash)
            if not same:
                self._links.pop(block.link, None)

    def _forget(self, instance: str, media: set[str] | None) -> None:
        for block_hash in [h for h, b in self._blocks.items() if instance in b.holders]:
            self._drop(instance, block_hash, media)


def _hashable(value: Any) -> BlockHash:
    """A block hash as msgpack decodes it: bytes, an int, or (from some encoders) a list."""
    if isinstance(value, (bytes, int)):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return bytes(value)
