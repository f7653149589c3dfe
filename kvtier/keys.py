"""Chunk keys: what identifies one chunk of KV cache, in every process.

A prompt is cut into chunks of `chunk_size` tokens. Chunk i's hash covers
all tokens up to the end of chunk i, by chaining:

    h[-1] = SEED_DIGEST
    h[i]  = xxh3_128(h[i-1] || tokens[i*C : (i+1)*C] as little-endian u32)

so two prompts share chunk i's key exactly when they share their first
(i+1)*C tokens. xxh3 is seeded with a constant, never with Python's `hash`,
so every process and machine agrees without PYTHONHASHSEED.

The hash alone is not the key: the same tokens give different KV for
another model, dtype, layout or tensor-parallel shard, so `ChunkKey`
carries those too. Nor do the tokens alone decide a request's KV: a LoRA
adapter, the images behind placeholder tokens and vLLM's per-request
cache_salt change it. A request's `Identity` folds them into the chain, as
vLLM folds them into its block hashes:

    h[-1] = root        SEED_DIGEST, or a hash of it with the adapter and the salt
    h[i]  = xxh3_128(h[i-1] || tokens of chunk i)                       no item in the chunk
    h[i]  = xxh3_128(that || (offset, length, digest) of each item,     a multimodal item's
                     seed=_ITEM_SEED)                                   placeholders in it

so chunks wholly before a request's first item are shared with every request
that has the same text, adapter and salt, and none after it.
"""

from __future__ import annotations

import array
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

_SEED = 0x6B7674696572_0001  # "kvtier" + format version 1
_ITEM_SEED = 0x6B7674696572_1001  # a chunk's multimodal items, after its tokens
_ROOT_SEED = 0x6B7674696572_2001  # an identity's root: adapter and salt
SEED_DIGEST = xxhash.xxh3_128_digest(b"kvtier chunk hash v1", seed=_SEED)
_ITEM = struct.Struct("<II16s")  # an item in a chunk's hash and on the wire: offset, length, digest
_ARRAY_U32 = sys.byteorder == "little" and array.array("I").itemsize == 4


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What, besides the tokens, decides the bytes of a chunk."""

    model: str
    layout: str  # transfer layout name, e.g. "flash_attn", "mla"
    dtype: str  # e.g. "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1

    def tag(self) -> str:
        return f"{self.model}@{self.layout}/{self.dtype}/tp{self.tp_rank}of{self.tp_size}"


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One chunk: its format and the prefix-chained hash of its tokens."""

    fmt: KVFormat
    digest: bytes  # 16 bytes

    def __hash__(self) -> int:
        # The digest alone (bytes cache their hash): the generated hash re-hashed the format's
        # five fields on every dict operation, a third of a PD Commit's time. Keys of two
        # formats with one digest share a bucket and differ by __eq__.
        return hash(self.digest)

    def __str__(self) -> str:
        return f"{self.fmt.tag()}:{self.digest.hex()}"


def wire_key(key: ChunkKey) -> bytes:
    """A chunk key as the disk tier names its file and a remote store its entry."""
    return str(key).encode()


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Token range [start, end) of a prompt that one chunk key covers."""

    key: ChunkKey
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Item:
    """A multimodal input (an image, an audio clip) behind the placeholder tokens
    [offset, offset + length) of a prompt; `digest`: 16 bytes that identify its content."""

    offset: int
    length: int
    digest: bytes

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length


@dataclass(frozen=True, slots=True)
class Identity:
    """What, besides its tokens and the engine's format, decides a request's KV.

    `root` starts the chain of its chunk hashes (SEED_DIGEST when the request has no LoRA
    adapter and no cache_salt); `items` are its multimodal inputs, by position. `lora` (vLLM's
    id and name of the adapter) is a label for KV events only: the adapter's part of the key
    is in `root`."""

    root: bytes = SEED_DIGEST
    items: tuple[Item, ...] = ()
    lora: tuple[int, str] | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        adapter: bytes = b"",
        salt: str = "",
        items: Sequence[Item] = (),
        lora: tuple[int, str] | None = None,
    ) -> Identity:
        """The identity of a request with this adapter (the bytes that identify its weights),
        cache_salt and items; PLAIN when it has none of them."""
        root = SEED_DIGEST
        if adapter or salt:
            parts = [SEED_DIGEST, b"adapter", adapter, b"salt", salt.encode()]
            root = xxhash.xxh3_128_digest(
                b"".join(struct.pack("<I", len(p)) + p for p in parts), seed=_ROOT_SEED
            )
        return cls(root, tuple(sorted(items, key=lambda i: i.offset)), lora)

    @classmethod
    def from_root_hex(cls, text: object) -> Identity:
        """The identity whose chunk keys start from the root `text` names in hex (how the
        controller's calls name a prompt's adapter and cache_salt); ValueError for anything
        else."""
        root = bytes.fromhex(text) if isinstance(text, str) else b""
        if len(root) != len(SEED_DIGEST):
            raise ValueError(f"{text!r}: not {len(SEED_DIGEST)} bytes of hex")
        return cls(root)

    def items_in(self, start: int, end: int) -> bytes:
        """The items whose placeholders overlap tokens [start, end), as hashed after them."""
        return b"".join(
            _ITEM.pack(i.offset, i.length, i.digest) for i in self.items if i.overlaps(start, end)
        )

    def wire(self) -> bytes:
        """As a lookup message carries it: the root, a u32 count of items, the items."""
        return (
            self.root
            + struct.pack("<I", len(self.items))
            + b"".join(_ITEM.pack(i.offset, i.length, i.digest) for i in self.items)
        )

    @classmethod
    def from_wire(cls, data: bytes | memoryview) -> tuple[Identity, int]:
        """(the identity, bytes it took) at the start of `data`; ValueError if it is cut short."""
        if len(data) < 20:
            raise ValueError("an identity of fewer than 20 bytes")
        (n,) = struct.unpack_from("<I", data, 16)
        size = 20 + n * _ITEM.size
        if len(data) < size:
            raise ValueError(f"an identity of {n} items cut short")
        items = tuple(Item(*_ITEM.unpack_from(data, 20 + i * _ITEM.size)) for i in range(n))
        return cls(bytes(data[:16]), items), size


PLAIN = Identity()


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The tokens as a numpy array. A list (vLLM's prompt) goes through array.array as
    u32, 7x faster than numpy's conversion of a list (0.15 against 1.0 ms at 16k tokens
    on a 2-core VM): every store, load and lookup of a request converts its prompt."""
    if isinstance(tokens, list) and _ARRAY_U32:
        try:
            return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
    return np.asarray(tokens)


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The tokens as little-endian u32."""
    arr = token_array(tokens)
    if arr.dtype != np.uint32 and arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def _chained(prev: bytes, data: bytes, items: bytes = b"") -> bytes:
    """A chunk's digest: its tokens' bytes after its predecessor's digest, then the items
    whose placeholders are among them (one rule for every key: a tail's must equal the
    partial last chunk's a prompt was stored with)."""
    digest = xxhash.xxh3_128_digest(prev + data, seed=_SEED)
    return xxhash.xxh3_128_digest(digest + items, seed=_ITEM_SEED) if items else digest


def chunk_spans(
    tokens: Sequence[int] | np.ndarray,
    fmt: KVFormat,
    chunk_size: int,
    save_unfull_chunk: bool,
    known: Sequence[ChunkSpan] = (),
    identity: Identity = PLAIN,
) -> list[ChunkSpan]:
    """Keys of every chunk of `tokens`, in order, for a request of this `identity`.

    The partial last chunk (fewer than `chunk_size` tokens) is included only
    when `save_unfull_chunk` is true. `known`: the spans of the first whole
    chunks of these tokens, hashed by an earlier call: the hashing goes on
    after them.
    """
    first = len(known) * chunk_size
    data = token_bytes(tokens[first:])
    n = first + len(data) // 4
    end_limit = n if save_unfull_chunk else n - n % chunk_size
    spans = list(known)
    prev = known[-1].key.digest if known else identity.root
    for start in range(first, end_limit, chunk_size):
        end = min(start + chunk_size, end_limit)
        chunk = data[4 * (start - first) : 4 * (end - first)]
        prev = _chained(prev, chunk, identity.items_in(start, end) if identity.items else b"")
        spans.append(ChunkSpan(ChunkKey(fmt, prev), start, end))
    return spans


def tail_span(
    tokens: Sequence[int] | np.ndarray,
    before: ChunkSpan | None,
    length: int,
    fmt: KVFormat,
    identity: Identity = PLAIN,
) -> ChunkSpan:
    """The span of the `length` tokens after `before` (None: the prompt's first), keyed as
    `chunk_spans` keys a prompt's partial last chunk: a prompt that ended there."""
    start = before.end if before is not None else 0
    data = token_bytes(tokens[start : start + length])
    prev = before.key.digest if before is not None else identity.root
    digest = _chained(prev, data, identity.items_in(start, start + length))
    return ChunkSpan(ChunkKey(fmt, digest), start, start + length)


class SpanMemo:
    """The chunk spans of a few recent requests, so that a request's lookup, load and
    store hash its tokens once (from an array on a 2-core VM: 167 us at 32k tokens, 43 us at
    a chat turn's 4.7k). A later call of the request reuses the spans of the whole chunks its
    tokens share with the ones hashed, and hashes only what follows: a partial last chunk (a
    prompt's end, `save_unfull_chunk`), or tokens beyond (its output)."""

    def __init__(
        self, fmt: KVFormat, chunk_size: int, save_unfull_chunk: bool, size: int = 64
    ) -> None:
        self.fmt = fmt
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.size = size
        # request id -> its identity, the longest tokens hashed, their spans
        self._memo: OrderedDict[str, tuple[Identity, np.ndarray, list[ChunkSpan]]] = OrderedDict()
        self._lock = threading.Lock()  # lookups come on the lookup server's thread

    def spans(
        self, tokens: np.ndarray, request_id: str = "", identity: Identity = PLAIN
    ) -> list[ChunkSpan]:
        size = self.chunk_size
        known: list[ChunkSpan] = []
        entry = None
        if request_id:
            with self._lock:
                entry = self._memo.get(request_id)
            # a request id used again, for another request
            if entry is not None and entry[0] != identity:
                entry = None
            if entry is not None:  # the whole chunks before the first token that differs
                both = min(len(tokens), len(entry[1]))
                differ = np.flatnonzero(tokens[:both] != entry[1][:both])
                known = entry[2][: (int(differ[0]) if differ.size else both) // size]
        spans = chunk_spans(tokens, self.fmt, size, self.save_unfull_chunk, known, identity)
        covered = (
            entry is not None and len(tokens) <= len(entry[1]) and len(known) == len(tokens) // size
        )
        if request_id and not covered:  # the longest tokens of the request stay
            with self._lock:
                self._memo[request_id] = (identity, np.array(tokens, copy=True), spans)
                self._memo.move_to_end(request_id)
                while len(self._memo) > self.size:
                    self._memo.popitem(last=False)
        return spans
