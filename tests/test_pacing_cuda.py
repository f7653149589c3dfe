"""On a GPU: a store not waited for queues its copies down a few at a time
(kvtier/transfer/pacing.py), so a small copy to the host queued after it (vLLM's sampled tokens)
does not wait for the whole store, and whoever needs its bytes has them queued at once."""

import threading
import time

import pytest
import torch

from kvtier.transfer import InFlight, PagedKV, pacing
from kvtier.transfer.factory import make_transfer

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
    own, takes on the GPU from its queuing until it has landed (CUDA events around it)."""
    src = torch.ones(32768, dtype=torch.int32, device="cuda")
    dst = torch.empty(32768, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    time.sleep(after_s)
    with torch.cuda.stream(stream):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def landed(flight: InFlight) -> None:
    """Wait for a paced store's copies without queuing the held ones at once."""
    while not flight.arrived():
        time.sleep(0.0001)


@pytest.mark.parametrize("piece_mb", [32, 8, 0])
def test_a_small_copy_down_waits_for_little_of_a_store_queued_before_it(piece_mb):
    """2 GiB gathered, not waited for; 1 ms later a 128 KB copy down on another stream. Queued
    whole (gpu_store_piece_mb 0) the store holds it ~35 ms at 55 GB/s; one piece at a time (32
    MiB, a chunk; or 8, a quarter of one), at most a piece (0.6 ms for 32; 0.42 measured on an
    H200). The store's bytes all land right, paced at no less than half the bandwidth of one
    waited for."""
    kv, slots, chunks = big_store(16384)
    transfer = make_transfer(kv, "triton", store_piece=piece_mb << 20)
    assert transfer.gather(slots[: 4 * CHUNK], chunks[:4]) is None  # its kernels compiled
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
    landed(flight)
    paced_s = time.perf_counter() - t0
    print(
        f"{piece_mb} MiB pieces: a 128 KB copy waited {waited * 1e3:.2f} ms; the store took "
        f"{paced_s * 1e3:.1f} ms not waited for, {whole_s * 1e3:.1f} ms waited for"
    )
    if piece_mb:
        assert waited < 0.002
        assert paced_s < 2 * whole_s
    else:
        assert waited > 0.015  # what pacing removes: the copy waits for most of the store
    for i in (0, 13, len(chunks) - 1):
        assert torch.equal(chunks[i], expected(kv, slots, i))


def test_a_store_held_back_is_queued_at_once_for_whoever_needs_its_bytes():
    """Two stores behind a slow forward: all but the first piece are held (it has not landed).
    Asking for the second's `done` queues everything up to its last piece now, without
    waiting for the forward, and its bytes are right once it has completed."""
    kv, slots, chunks = big_store(2048)
    transfer = make_transfer(kv, "triton")
    half = len(chunks) // 2
    torch.cuda._sleep(200_000_000)  # a slow forward (~0.1 s) on the current stream
    first = transfer.gather(slots[: half * CHUNK], chunks[:half], wait=False)
    second = transfer.gather(slots[half * CHUNK :], chunks[half:], wait=False)
    assert first is not None and second is not None
    time.sleep(0.005)
    assert not first.is_queued and not second.is_queued  # behind the forward's first piece
    t0 = time.perf_counter()
    done = second.done
    assert time.perf_counter() - t0 < 0.05 and second.is_queued and first.is_queued
    assert not done.query()  # behind the forward still
    done.synchronize()
    assert first.arrived() and second.arrived()
    for i in (half, len(chunks) - 1):
        assert torch.equal(chunks[i], expected(kv, slots, i))


def feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-copies-down"]


def test_a_burst_of_stores_is_fed_by_one_thread_that_ends_once_they_stop(monkeypatch):
    """Stores that come one after another (a burst of cold prompts) share one feeder thread:
    none is started per store (its start and the GIL handed to it were the storing thread's
    time); it ends once no store has come for FEEDER_IDLE_S, and every store lands right."""
    monkeypatch.setattr(pacing, "FEEDER_IDLE_S", 0.2)
    kv, slots, chunks = big_store(4096)
    transfer = make_transfer(kv, "triton")
    assert transfer.gather(slots[:CHUNK], chunks[:1]) is None  # its kernels compiled
    earlier = set(feeders())  # the earlier tests' transfers', not yet idle long enough
    seen, flights = set(), []
    for i in range(0, len(chunks), 2):
        torch.cuda._sleep(2_000_000)  # a short forward between the stores
        flight = transfer.gather(slots[i * CHUNK : (i + 2) * CHUNK], chunks[i : i + 2], wait=False)
        assert flight is not None
        flights.append(flight)
        seen |= set(feeders()) - earlier
        time.sleep(0.001)
    assert len(seen) == 1
    (feeder,) = seen
    for flight in flights:
        landed(flight)
    for i in (0, 5, len(chunks) - 1):
        assert torch.equal(chunks[i], expected(kv, slots, i))
    feeder.join(timeout=5)
    assert not feeder.is_alive()
