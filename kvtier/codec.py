"""Chunk ⇄ bytes for the remote tier (`remote_serde`), with a checksum.

    +-------+---------+-------+-------+------------+---------+---------+----------+
    | magic | version | serde | shuf  | num_tokens | raw_len | enc_len | checksum |   40-byte header
    | KVC1  |   u8    |  u8   |  u16  |    u32     |   u64   |   u64   | u64      |
    +-------+---------+-------+-------+------------+---------+---------+----------+
    | encoded payload (enc_len bytes)                                               |
    +-------------------------------------------------------------------------------+

Version 2 (naive serde only): enc_len, which naive makes equal to raw_len,
carries instead the chunk's KV digest (`kv_digest`), written by a storer
that gathered the chunk on a GPU. The digest is a sum a GPU computes in
parallel, slice by slice, from the copy it holds: a GPU reader of chunks
lent in place checks that instead of hashing them on the CPU (where those
checksums competed with the load and the forward for the host). Every
other reader checks the xxh3 as before; version 1 values read as before.

checksum = xxh3-64 of the encoded payload, so corruption is caught before
anything is decompressed. It is computed by the xxhash package's own C
function called through ctypes, which lets go of the GIL (the package's
Python API holds it), so chunks are hashed in parallel on the copy
threads. Decoding checks every field against what the reader expects (the
key already names model, layout, dtype and TP rank; the reader knows the
chunk's byte size) and raises CorruptPayload on any mismatch: the remote
tier turns that into a miss, never wrong KV.

Serdes:
- naive: the chunk's bytes as they are (the payload is sent as a view of
  the pool block, no copy).
- (remote_serde int8 and fp8 are not serdes of this module: they quantize
  the KV where it leaves the engine, kvtier/transfer/quant.py, and their
  chunks are stored naive.)
- lz4: byte-plane shuffle, then LZ4. KV in 16-bit floats compresses poorly
  byte by byte; grouping all high bytes (sign, exponent) apart from the low
  bytes (mantissa) gives LZ4 runs to find. `shuf` records the element size.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.errors import CorruptPayload

MAGIC = b"KVC1"
VERSION = 1
VERSION_DIGEST = 2  # naive, enc_len carrying the KV digest
HEADER = struct.Struct("<4sBBHIQQQ")
SERDES = {"naive": 0, "lz4": 1}
KV_CODECS = ("int8", "fp8", "int4")  # lossy, on the GPU before any tier: kvtier/transfer/quant.py


@dataclass(frozen=True)
class Codec:
    serde: str = "naive"
    itemsize: int = 2  # element size of the KV dtype, for the byte-plane shuffle

    def __post_init__(self) -> None:
        if self.serde not in SERDES:
            raise ValueError(f"remote_serde {self.serde!r}: expected one of {', '.join(SERDES)}")
        if self.serde == "lz4":
            import lz4.block  # noqa: F401  (fail at start, not at the first store)

    def encode(
        self, chunk: memoryview, num_tokens: int, digest: int = 0
    ) -> list[memoryview | bytes]:
        """Header and payload, as parts of one value (naive: the payload is `chunk` itself);
        `digest`: the chunk's KV digest, 0 where none was computed."""
        raw = memoryview(chunk).cast("B")
        if self.serde == "naive":
            payload: memoryview | bytes = raw
        else:
            import lz4.block

            payload = lz4.block.compress(_shuffle(raw, self.itemsize), store_size=False)
        with_digest = bool(digest) and self.serde == "naive"
        header = HEADER.pack(
            MAGIC,
            VERSION_DIGEST if with_digest else VERSION,
            SERDES[self.serde],
            self.itemsize,
            num_tokens,
            len(raw),
            digest if with_digest else len(payload),
            checksum(payload),
        )
        return [header, payload]

    @property
    def in_place(self) -> bool:
        """Stored values are the codec header, then the chunk's bytes as they
        are: a reader can receive the payload straight into the chunk's block."""
        return self.serde == "naive"

    def check_in_place(self, header: bytes | bytearray | memoryview, payload: memoryview) -> int:
        """num_tokens of a value received as [header, payload] (naive serde), or CorruptPayload."""
        serde, _, num_tokens = self._check(
            memoryview(header), memoryview(payload).cast("B"), len(payload)
        )
        if serde != SERDES["naive"]:
            raise CorruptPayload(f"serde id {serde} where naive was expected")
        return num_tokens

    def decode_into(self, value: bytes | memoryview, out: memoryview) -> int:
        """Write the chunk held in `value` into `out` (exactly its size); num_tokens, or
        CorruptPayload."""
        value = memoryview(value).cast("B")
        out = memoryview(out).cast("B")
        payload = value[HEADER.size :]
        serde, shuf, num_tokens = self._check(value[: HEADER.size], payload, len(out))
        if serde == SERDES["naive"]:
            out[:] = payload
        elif serde == SERDES["lz4"]:
            import lz4.block

            try:
                shuffled = lz4.block.decompress(payload, uncompressed_size=len(out))
            except lz4.block.LZ4BlockError as e:
                raise CorruptPayload(f"lz4: {e}") from None
            _unshuffle_into(shuffled, shuf, out)
        else:
            raise CorruptPayload(f"unknown serde id {serde}")
        return num_tokens

    def decode(self, value: bytes | memoryview, raw_len: int) -> tuple[int, memoryview]:
        """(num_tokens, the chunk's bytes in a new buffer), or CorruptPayload."""
        out = memoryview(bytearray(raw_len))
        return self.decode_into(value, out), out

    def check_header(
        self, header: bytes | memoryview, payload_len: int, raw_len: int
    ) -> tuple[int, int, int]:
        """(num_tokens, checksum, KV digest or 0) of an in-place value whose header
        holds; the caller checks the payload against one of them itself."""
        serde, _, num_tokens, checksum, digest = self._header(
            memoryview(header), payload_len, raw_len
        )
        if serde != SERDES["naive"]:
            raise CorruptPayload(f"serde id {serde} where naive was expected")
        return num_tokens, checksum, digest

    @staticmethod
    def _header(
        header: memoryview, payload_len: int, raw_len: int
    ) -> tuple[int, int, int, int, int]:
        """(serde, shuffle width, num_tokens, checksum, KV digest or 0) of a header that holds."""
        if len(header) < HEADER.size:
            raise CorruptPayload(f"value of {len(header)} bytes is shorter than the codec header")
        magic, version, serde, shuf, num_tokens, stored_raw, enc_len, checksum = HEADER.unpack(
            header[: HEADER.size]
        )
        if magic != MAGIC or version not in (VERSION, VERSION_DIGEST):
            raise CorruptPayload(f"not a kvtier chunk (magic {bytes(magic)!r}, version {version})")
        digest = 0
        if version == VERSION_DIGEST:
            if serde != SERDES["naive"]:
                raise CorruptPayload(
                    f"version {version} with serde id {serde}: only naive carries a digest"
                )
            digest, enc_len = enc_len, stored_raw
        if stored_raw != raw_len:
            raise CorruptPayload(f"chunk of {stored_raw} bytes, expected {raw_len}")
        if payload_len != enc_len:
            raise CorruptPayload(f"payload of {payload_len} bytes, header says {enc_len}")
        return serde, shuf, num_tokens, checksum, digest

    @classmethod
    def _check(cls, header: memoryview, payload: memoryview, raw_len: int) -> tuple[int, int, int]:
        """(serde, shuffle width, num_tokens) of a value whose header and checksum hold."""
        serde, shuf, num_tokens, stored, _ = cls._header(header, len(payload), raw_len)
        if checksum(payload) != stored:
            raise CorruptPayload("checksum mismatch")
        return serde, shuf, num_tokens


def _xxh3_c():
    """XXH3_64bits of the xxhash extension, through ctypes (which releases the GIL), or None."""
    import xxhash._xxhash as ext

    try:
        fn = ctypes.CDLL(ext.__file__).XXH3_64bits
    except (OSError, AttributeError):  # a build that does not export it
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_uint64
    return fn


_XXH3 = _xxh3_c()


def checksum(payload: memoryview | bytes | np.ndarray) -> int:
    """xxh3-64 of `payload`, with the GIL let go while it reads (where the C function is
    reachable)."""
    if _XXH3 is None:
        return xxhash.xxh3_64_intdigest(payload)
    arr = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
    if not arr.flags.c_contiguous:
        return xxhash.xxh3_64_intdigest(payload)
    return _XXH3(arr.ctypes.data, arr.nbytes)


# The KV digest: over the payload as little-endian u32 words w_i (its length a
# multiple of 4), D = sum_i (w_i + 1) * ((i * DIGEST_A + DIGEST_B) | 1) mod 2^64.
# Each word has an odd (so invertible) weight of its own: any change of one
# word changes D, and words trading places change it; the sum over a slice
# that starts at word o uses weights from o on, so slices (a chunk's layers,
# hashed as each crosses) add up to the chunk's. 0 means "none" (a chunk whose
# digest comes out 0 is checked by its xxh3). The GPU kernel: triton_copy.py.
DIGEST_A, DIGEST_B = 0x5851F42D4C957F2D, 0x14057B7EF767814F
U64 = (1 << 64) - 1


def kv_digest(payload: memoryview | bytes | np.ndarray, first_word: int = 0) -> int:
    """The KV digest of `payload` (a slice starting at word `first_word` of its chunk), in numpy."""
    w = (
        np.frombuffer(payload, np.uint32)
        if not isinstance(payload, np.ndarray)
        else payload.reshape(-1).view(np.uint32)
    )
    i = np.arange(first_word, first_word + len(w), dtype=np.uint64)
    with np.errstate(over="ignore"):
        weights = (i * np.uint64(DIGEST_A) + np.uint64(DIGEST_B)) | np.uint64(1)
        return int(((w.astype(np.uint64) + np.uint64(1)) * weights).sum(dtype=np.uint64))


def _shuffle(raw: memoryview, itemsize: int) -> np.ndarray:
    """[n, itemsize] bytes → [itemsize, n]: byte planes one after the other."""
    if itemsize <= 1 or len(raw) % itemsize:
        return np.frombuffer(raw, np.uint8)
    return np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T)


def _unshuffle_into(data: bytes, itemsize: int, out: memoryview) -> None:
    dst = np.frombuffer(out, np.uint8)
    src = np.frombuffer(data, np.uint8)
    if itemsize <= 1 or len(data) % itemsize:
        dst[:] = src
    else:
        dst.reshape(-1, itemsize)[:] = src.reshape(itemsize, -1).T
