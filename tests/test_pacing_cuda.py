"""On a GPU: a store not waited for queues its copies down a few at a time
(kvtier/transfer/pacing.py), so a small copy to the host queued after it (vLLM's sampled tokens)
does not wait for the whole store, and whoever needs its bytes has them queued at once."""

import time

import pytest
import torch

from kvtier.transfer import PagedKV
from kvtier.transfer.factory import make_transfer
from kvtier.transfer.pacing import AHEAD_BYTES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Llama-3.1-8B's KV: 32 layers of [2, blocks, 16, 8, 128] bf16, 128 KiB a token
L, BS, H, D, CHUNK = 32, 16, 8, 128, 256


def big_store(tokens: int) -> tuple[PagedKV, torch.Tensor, list[torch.Tensor]]:
    """Random KV pages for `tokens` (in a random slot order) and pinned chunks to gather into."""
    blocks = tokens // BS
    layers = [
        torch.randn((2, blocks, BS, H, D), device="cuda").to(torch.bfloat16) for _ in range(L)
    ]
    kv = PagedKV.wrap(layers, "flash_attn")
    slots = torch.randperm(tokens)
    chunks = [
        torch.empty((L, 2, CHUNK, H, D), dtype=torch.bfloat16, pin_memory=True)
        for _ in range(tokens // CHUNK)
    ]
    return kv, slots, chunks


def expected(kv: PagedKV, slots: torch.Tensor, i: int) -> torch.Tensor:
    s = slots[i * CHUNK : (i + 1) * CHUNK].cuda()
    return torch.stack([x[:, s // BS, s % BS] for x in kv.layers]).cpu()


def small_copy_wait(after_s: float) -> float:
    """Seconds a 128 KB copy to pinned host memory, queued `after_s` from now on a stream of its
    own, takes from its queuing until it has landed."""
    src = torch.ones(32768, dtype=torch.int32, device="cuda")
    dst = torch.empty(32768, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream()
    time.sleep(after_s)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    return time.perf_counter() - t0


def test_a_small_copy_down_waits_for_little_of_a_store_queued_before_it():
    """1 GiB gathered, not waited for; 1 ms later a 128 KB copy down on another stream. Queued
    whole, the store held it ~19 ms at 55 GB/s; paced, it waits for at most AHEAD_BYTES and a
    piece (2 ms at 55 GB/s, with the thread's wakeups: 4). The store's bytes all land right,
    at no less than half the bandwidth of one waited for."""
    kv, slots, chunks = big_store(8192)
    transfer = make_transfer(kv, "triton")
    t0 = time.perf_counter()
    assert transfer.gather(slots, chunks) is None  # waited for: the copy engine's pace
    whole_s = time.perf_counter() - t0
    for c in chunks:
        c.zero_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    flight = transfer.gather(slots, chunks, wait=False)
    assert flight is not None
    waited = small_copy_wait(0.001)
    flight.done.synchronize()
    paced_s = time.perf_counter() - t0
    print(
        f"a 128 KB copy waited {waited * 1e3:.2f} ms; the store {paced_s * 1e3:.1f} ms paced, "
        f"{whole_s * 1e3:.1f} ms waited for ({AHEAD_BYTES >> 20} MiB ahead at most)"
    )
    assert waited < 0.004
    assert paced_s < 2 * whole_s + 0.005
    for i in (0, 13, len(chunks) - 1):
        assert torch.equal(chunks[i], expected(kv, slots, i))


def test_a_store_held_back_is_queued_at_once_for_whoever_needs_its_bytes():
    """Two stores behind a slow forward: the second's pieces are held (the first's fill the
    queue). Asking for the second's `done` queues everything up to its last piece now, without
    waiting for the forward, and its bytes are right once it has completed."""
    kv, slots, chunks = big_store(2048)
    transfer = make_transfer(kv, "triton")
    half = len(chunks) // 2
    torch.cuda._sleep(200_000_000)  # a slow forward (~0.1 s) on the current stream
    first = transfer.gather(slots[: half * CHUNK], chunks[:half], wait=False)
    second = transfer.gather(slots[half * CHUNK :], chunks[half:], wait=False)
    assert first is not None and second is not None
    time.sleep(0.005)
    assert not second.is_queued and not second.arrived()  # 256 MiB ahead: held
    t0 = time.perf_counter()
    done = second.done
    assert time.perf_counter() - t0 < 0.05 and second.is_queued and first.is_queued
    assert not done.query()  # behind the forward still
    done.synchronize()
    assert first.arrived() and second.arrived()
    for i in (half, len(chunks) - 1):
        assert torch.equal(chunks[i], expected(kv, slots, i))
