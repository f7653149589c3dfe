"""cuda_ipc's ring on GPUs (`kvtier/pd/ipc_writes.py`): a sender in this process writes
into a receiver in another (the second GPU where there is one), as in `kvtier bench pd`;
each load is checked against the sender's KV by a position-weighted checksum."""

import pytest
import torch

from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.pd.ipc_writes import IpcWriter
from kvtier.pd.sender import PdSender, Target
from kvtier_tools.bench.offload import OffloadShape
from kvtier_tools.bench.pd import FMT_MODEL, _config, _paged, _Receiver, _slots, _tokens, checksum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = OffloadShape(layers=4, kv_heads=2, head_dim=64, chunk_size=64)
MAX_TOKENS = 4096


@pytest.fixture(scope="module")
def ring():
    """(sender, its paged layers, receiver), the sender's ring two slots of two chunks each."""
    kv, layers = _paged(SHAPE, MAX_TOKENS, "cuda:0", fill=True)
    receiver_device = f"cuda:{min(torch.cuda.device_count(), 2) - 1}"
    with _Receiver(SHAPE, "cuda_ipc", receiver_device, MAX_TOKENS) as receiver:
        config = _config(SHAPE, "sender", "cuda_ipc", "cuda:0", 0, receiver.init, receiver.alloc)
        engine = CacheEngine(config, kv, KVFormat(FMT_MODEL, "flash_attn", SHAPE.dtype))
        sender = PdSender(engine, config, 0)
        yield sender, layers, receiver
        sender.close()
        engine.close()


def send(
    sender: PdSender, receiver: _Receiver, rid: str, tokens: list[int], slots: torch.Tensor
) -> int:
    return sender.send(
        Target("127.0.0.1", receiver.init, receiver.alloc, rid), tokens, slots, start=0, last=True
    )


def load_matches(sender, layers, receiver, n: int, seed: int) -> bool:
    """The receiver loads request r{seed} (n tokens); its KV equals the sender's."""
    reply = receiver.load(n, seed)
    want = checksum(
        layers, _slots(sender.engine.kv.num_blocks, SHAPE.block_size, n, seed + 1), SHAPE.block_size
    )
    return reply["loaded"] == n and reply["checksum"] == want


def small_ring(sender: PdSender, slot_chunks: int = 2, first_chunks: int = 2) -> None:
    chunk = SHAPE.chunk_size * sender.engine.kv.bytes_per_token()
    channel = sender.channel
    assert channel.ipc is not None
    if (channel.ipc.slot_bytes, channel.ipc.first_bytes) != (
        slot_chunks * chunk,
        first_chunks * chunk,
    ):
        channel.ipc = IpcWriter(
            channel.ipc.device, chunk, slot_chunks * chunk, first_chunks * chunk
        )


def test_a_steps_groups_grow_from_the_first_to_a_slot(ring):
    """The first group holds `first_bytes` (a chunk at least), each next one twice the last,
    up to a slot: the copy engine starts after a small gather."""
    sender, _, _ = ring
    chunk = SHAPE.chunk_size * sender.engine.kv.bytes_per_token()
    ring_ = IpcWriter(torch.device("cuda:0"), chunk, 4 * chunk, chunk)
    step = ring_.start(lambda places: lambda first, end: None, list(range(16)), [chunk] * 16)
    assert [g.end - g.first for g in step.groups] == [1, 2, 4, 4, 4, 1]
    assert [g.slot for g in step.groups] == [0, 1, 0, 1, 0, 1]
    # a first group under a chunk: one chunk
    big = IpcWriter(torch.device("cuda:0"), chunk, 4 * chunk, chunk // 2)
    assert [
        g.end - g.first
        for g in big.start(lambda places: lambda a, b: None, [0, 1, 2], [chunk] * 3).groups
    ] == [1, 2]


@pytest.mark.parametrize("gather_early", [True, False])
def test_growing_groups_land_intact_through_a_reused_ring(ring, gather_early):
    """Groups of 1, 2, 4, 4, ... chunks through two slots of four: every chunk arrives as sent."""
    sender, layers, receiver = ring
    seed, n = 60 + gather_early, 1000
    assert send(sender, receiver, "warm-up-grow", _tokens(64, 998), torch.arange(64)) == 64
    small_ring(sender, slot_chunks=4, first_chunks=1)
    sender.pieces, sender.gather_early = None, gather_early
    slots = _slots(sender.engine.kv.num_blocks, SHAPE.block_size, n, seed + 1)
    assert send(sender, receiver, f"r{seed}", _tokens(n, seed), slots) == n
    assert load_matches(sender, layers, receiver, n, seed)


@pytest.mark.parametrize("pieces", [None, (1, 4)])
@pytest.mark.parametrize("gather_early", [True, False])
def test_every_group_of_a_step_lands_intact_when_the_ring_is_reused_many_times(
    ring, pieces, gather_early
):
    """15.6 chunks in groups of two through a ring of two slots: each slot is reused
    four times within the step, and the first groups are gathered while the Alloc
    travels (or after it); one Alloc a step or pieces of 1, 2, 4."""
    sender, layers, receiver = ring
    seed = 10 + 2 * (pieces is None) + gather_early
    n = 1000
    # connects: the ring
    assert send(sender, receiver, "warm-up", _tokens(64, 999), torch.arange(64)) == 64
    small_ring(sender)
    sender.pieces, sender.gather_early = pieces, gather_early
    slots = _slots(sender.engine.kv.num_blocks, SHAPE.block_size, n, seed + 1)
    assert send(sender, receiver, f"r{seed}", _tokens(n, seed), slots) == n
    assert load_matches(sender, layers, receiver, n, seed)


@pytest.mark.parametrize("held", [3, 16])
def test_chunks_the_decoder_holds_are_gathered_ahead_but_not_copied(ring, held):
    """Another request with the first `held` chunks of this prompt is committed and not yet
    loaded: the decoder holds them, its Allocated says -1 for them, and the ring's copies
    skip them (they were gathered ahead, before the reply said so); the load is intact."""
    sender, layers, receiver = ring
    sender.pieces, sender.gather_early = None, True
    small_ring(sender)
    seed, n = 40 + held, 1000
    tokens = _tokens(n, seed)
    slots = _slots(sender.engine.kv.num_blocks, SHAPE.block_size, n, seed + 1)
    m = min(held * SHAPE.chunk_size, n)
    assert send(sender, receiver, f"early{seed}", tokens[:m], slots[:m]) == m
    moved = sender.stats.sent_tokens
    assert send(sender, receiver, f"r{seed}", tokens, slots) == n
    assert sender.stats.sent_tokens - moved == n - m  # only what the decoder lacked moved
    assert load_matches(sender, layers, receiver, n, seed)
