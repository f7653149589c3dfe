"""The KV digest (codec.kv_digest): the codec's version-2 header that carries it, the
numpy reference, and the Triton kernel that sums it (in the interpreter here; on a GPU
in test_remote_tier.py, where lent chunks are checked by it)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.codec import HEADER, U64, VERSION_DIGEST, Codec, kv_digest
from kvtier.errors import CorruptPayload


def test_the_digest_of_slices_adds_up_and_any_word_changes_it():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    whole = kv_digest(data)
    cut = 4 * 1234
    assert whole == (kv_digest(data[:cut]) + kv_digest(data[cut:], first_word=cut // 4)) & U64
    for at in (0, 7, 4 * 999 + 2, len(data) - 1):  # one bit anywhere
        flipped = data.copy()
        flipped[at] ^= 0x10
        assert kv_digest(flipped) != whole
    swapped = data.view(np.uint32).copy()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert swapped[10] == swapped[20] or kv_digest(swapped) != whole
    # zero words count
    assert kv_digest(np.zeros(64, np.uint8)) != kv_digest(np.zeros(68, np.uint8))


def test_a_value_with_a_digest_is_version_2_and_every_reader_still_checks_its_xxh3():
    codec = Codec("naive")
    chunk = np.arange(4096, dtype=np.uint8)
    header, payload = codec.encode(memoryview(chunk), 16, digest=kv_digest(chunk))
    assert header[4] == VERSION_DIGEST
    assert codec.check_header(header, len(payload), 4096) == (
        16,
        *codec.check_header(header, 4096, 4096)[1:2],
        kv_digest(chunk),
    )
    assert codec.check_in_place(header, memoryview(chunk)) == 16
    assert codec.decode(bytes(header) + bytes(payload), 4096)[0] == 16
    bad = chunk.copy()
    bad[100] ^= 1
    with pytest.raises(CorruptPayload, match="checksum"):  # the xxh3 still guards the CPU readers
        codec.check_in_place(header, memoryview(bad))
    with pytest.raises(CorruptPayload, match="4096"):  # the length is still checked (it is raw_len)
        codec.check_header(header, 4000, 4096)
    plain, _ = codec.encode(memoryview(chunk), 16)
    # no digest: version 1, as before
    assert plain[4] == 1 and codec.check_header(plain, 4096, 4096)[2] == 0
    lz4 = bytearray(header)
    lz4[5] = 1  # a version-2 header may only name the naive serde
    with pytest.raises(CorruptPayload, match="only naive"):
        codec.check_header(bytes(lz4), 4096, 4096)
    assert len(header) == HEADER.size


KERNEL_CHECK = """
import torch
from kvtier.codec import U64, kv_digest
from kvtier.transfer import PagedKV, Quant
from kvtier.transfer.factory import make_transfer
torch.manual_seed(0)
L, NB, BS, H, D = 3, 8, 16, 2, 32
layers = [torch.randn(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
kv = PagedKV.wrap(layers, "flash_attn")
slots = torch.randperm(NB * BS)[:40]
for quant in (None, Quant("int8", H, D)):
    t = make_transfer(kv, "triton", quant)
    shape = (
        (lambda n: kv.chunk_shape(n)) if quant is None else (lambda n: (L, 2, n, quant.row_bytes))
    )
    dtype = kv.dtype if quant is None else torch.uint8
    chunks = [torch.zeros(shape(n), dtype=dtype) for n in (16, 16, 8)]
    sums = torch.zeros(3, dtype=torch.int64)
    t.gather(slots, chunks, digests=sums)
    want = [kv_digest(c.view(torch.uint8).numpy()) for c in chunks]
    assert [x & U64 for x in sums.tolist()] == want, "gather"
    back = torch.zeros(3, dtype=torch.int64)
    t.scatter(slots, chunks, digests=back)
    assert back.tolist() == sums.tolist(), "scatter"
    layered, saved = torch.zeros(3, dtype=torch.int64), [torch.zeros_like(c) for c in chunks]
    # (the pages hold what the scatter wrote)
    saves = t.gather_layerwise(slots, saved, digests=layered)
    for layer in range(L):
        saves.save(layer)
    saves.finish()
    assert [x & U64 for x in layered.tolist()] == [
        kv_digest(c.view(torch.uint8).numpy()) for c in saved
    ], "layers"
    chunks[1].view(torch.uint8).view(-1)[1001] ^= 1
    again = torch.zeros(3, dtype=torch.int64)
    t.scatter(slots, chunks, digests=again)
    assert [a == b for a, b in zip(again.tolist(), sums.tolist())] == [
        True,
        False,
        True,
    ], "a flipped bit"
print("ok")
"""


def test_the_triton_digest_kernel_in_the_interpreter_equals_the_numpy_digest():
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
