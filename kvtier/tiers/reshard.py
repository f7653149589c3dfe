"""Chunks stored at another tensor-parallel size, read as this rank's (`share_across_tp`).

With TP=n, rank r keeps the KV of KV heads [r*H/n, (r+1)*H/n) of the model's H, so its
chunk [L, K, T, H/n, HS] has the same tokens and layers as every other rank's and
another slice of the heads. A rank of size m reads heads [s*H/m, (s+1)*H/m):

    n > m   n/m source chunks (ranks s*n/m ...), joined along the head axis
    n < m   one source chunk (rank s*n/m), this rank's heads cut out of it
    MLA     one latent for all heads, the same on every rank: rank 0's chunk as it is

A `ReshardedSource` is a read-only `ChunkSource` in front of a lower tier (the
remote store, or the disk directories of the other size's ranks): `locate` asks it
for the chunks this rank's own keys miss, and `fetch` reads them into pool blocks
under this rank's keys, where they are promoted to the CPU tier as any disk or
remote hit. A size whose shards do not divide H is not offered; where vLLM
replicates KV heads (more ranks than H) the vLLM connector refuses the key at
start. Lossless chunks only: a lossy codec's rows carry per-head scales (the
config refuses the two together).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvtier.codec import Codec
from kvtier.errors import CorruptPayload
from kvtier.keys import ChunkKey, KVFormat
from kvtier.logs import get_logger
from kvtier.tiers.base import ChunkSource
from kvtier.tiers.disk import file_name, read_chunk_file

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class HeadGeometry:
    """One rank's chunk rows: layers × (K, V), then per token `heads` heads of `head_bytes`."""

    layers: int
    kv: int
    heads: int  # this rank's KV heads
    head_bytes: int
    mla: bool = False  # heads are not sharded (the same latent on every rank)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv * self.heads * self.head_bytes


def share_sizes(fmt: KVFormat, geometry: HeadGeometry, most: int = 8) -> list[int]:
    """The other tensor-parallel sizes (powers of two up to `most`) whose chunks map
    onto this rank's exactly."""
    sizes = [n for n in (1, 2, 4, 8) if n <= most and n != fmt.tp_size]
    total = geometry.heads * fmt.tp_size
    return sizes if geometry.mla else [n for n in sizes if total % n == 0]


class ReshardedSource:
    def __init__(
        self,
        fmt: KVFormat,
        size: int,
        geometry: HeadGeometry,
        source_of_rank: Callable[[int], ChunkSource],
        name: str,
    ) -> None:
        self.fmt, self.size, self.geo, self.name = fmt, size, geometry, name
        m, s, h = fmt.tp_size, fmt.tp_rank, geometry.heads
        # Per source rank: which of its heads are this rank's [lo, hi), and where they go (at).
        if geometry.mla:
            self.source_heads, pieces = h, [(0, 0, h, 0)]
        elif size > m:  # smaller shards: join size/m of them
            per = size // m
            self.source_heads = h // per
            pieces = [(s * per + j, 0, h // per, j * (h // per)) for j in range(per)]
        else:  # a larger shard: cut this rank's heads out of it
            per = m // size
            self.source_heads, pieces = h * per, [(s // per, (s % per) * h, (s % per + 1) * h, 0)]
        b = geometry.head_bytes
        # in bytes of a token's row
        self._pieces = [(r, lo * b, hi * b, at * b) for r, lo, hi, at in pieces]
        self.ranks = [r for r, *_ in pieces]
        self._sources = {r: source_of_rank(r) for r in self.ranks}

    def _key(self, key: ChunkKey, rank: int) -> ChunkKey:
        """Rank `rank` of the other size's key for the tokens of `key`."""
        return ChunkKey(dataclasses.replace(self.fmt, tp_rank=rank, tp_size=self.size), key.digest)

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        found = [True] * len(keys)
        for r in self.ranks:
            got = self._sources[r].exists([self._key(k, r) for k in keys])
            found = [a and b for a, b in zip(found, got)]
        return found

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        g = self.geo
        # one source rank's heads of one (layer, K|V, token)
        src_row = self.source_heads * g.head_bytes
        tokens = [len(out) // g.bytes_per_token for out in outs]
        parts = {r: [bytearray(g.layers * g.kv * t * src_row) for t in tokens] for r in self.ranks}
        got: list[int | None] = list(tokens)
        for r in self.ranks:
            read = self._sources[r].get_into(
                [self._key(k, r) for k in keys], [memoryview(b) for b in parts[r]]
            )
            got = [None if a is None or b != a else a for a, b in zip(got, read)]
        for i, out in enumerate(outs):
            if got[i] is None:
                continue
            dst = np.frombuffer(out, np.uint8).reshape(
                g.layers, g.kv, tokens[i], g.heads * g.head_bytes
            )
            for r, lo, hi, at in self._pieces:
                src = np.frombuffer(parts[r][i], np.uint8).reshape(
                    g.layers, g.kv, tokens[i], src_row
                )
                dst[..., at : at + hi - lo] = src[..., lo:hi]
        return got


class DiskFiles:
    """Another instance's disk tier directory, read only (no index, lock or eviction: that
    instance owns them): the chunks a tensor-parallel rank of another size wrote there."""

    def __init__(self, root: Path, codec: Codec) -> None:
        self.name, self.root, self.codec = f"disk-{root.name}", root, codec

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [(self.root / file_name(k)).is_file() for k in keys]

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        return [self._read(k, out) for k, out in zip(keys, outs)]

    def _read(self, key: ChunkKey, out: memoryview) -> int | None:
        path = self.root / file_name(key)
        try:
            return read_chunk_file(path, out, self.codec)
        except FileNotFoundError:  # evicted by its owner
            return None
        except (CorruptPayload, OSError) as e:
            log.warning("disk tier: %s could not be read (%s); treated as a miss", path, e)
            return None
