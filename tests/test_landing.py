"""Copies not waited for (engine/landing.py) land in the tiers once their event has completed,
all of them with `wait`, and those holding a looked-up key at once (waiting for them). CUDA
events need a GPU; `Arrival` is an event whose completion the test decides (the GPU test of a
store not waited for is tests/test_transfer_cuda.py)."""

from kvtier.engine.landing import Landing
from kvtier.keys import ChunkKey, KVFormat
from kvtier.transfer import InFlight


class Arrival:
    def __init__(self) -> None:
        self.arrived, self.waited = False, False

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        self.waited |= not self.arrived  # waited: it had not arrived
        self.arrived = True


def key(i: int) -> ChunkKey:
    return ChunkKey(KVFormat("m", "flash_attn", "bf16"), bytes([i]) * 16)


def test_copies_land_when_arrived_when_waited_for_or_when_their_keys_are_looked_up():
    landing, landed = Landing(), []
    events = [Arrival() for _ in range(3)]
    for i, done in enumerate(events):
        landing.add(InFlight(done), [key(i), key(10 + i)], lambda i=i: landed.append(i))
    assert landing.holds(key(11)) and not landing.holds(key(20))
    landing.settle()
    assert landed == [] and len(landing) == 3  # nothing has arrived: nothing waits
    events[1].arrived = True
    landing.settle(keys=[key(5)])
    assert landed == []  # a lookup lands only what holds its keys (the storing thread the rest)
    landing.settle(keys=[key(12)])  # looked up: waited for
    assert landed == [2] and events[2].waited and not events[0].waited
    landing.settle()
    assert landed == [2, 1] and not events[1].waited
    landing.settle(wait=True)
    assert landed == [2, 1, 0] and len(landing) == 0 and not landing.holds(key(10))


def engine_with_first_chunk_in_flight(n: int):
    """A CPU engine (64-token chunks), tokens 0..n-1 and their slots, and their first chunk on
    its way to the host as an earlier store's: its key, its `Arrival`, and what has landed."""
    import torch

    from kvtier.config import KvtierConfig
    from kvtier.engine import CacheEngine
    from kvtier.transfer import PagedKV

    layers = [torch.randn(2, 16, 16, 2, 32) for _ in range(2)]
    eng = CacheEngine(
        KvtierConfig(chunk_size=64, max_local_cpu_size=1 / 1024),
        PagedKV.wrap(layers, "flash_attn"),
        KVFormat("m", "flash_attn", "float32"),
    )
    toks, slots = list(range(n)), torch.arange(n)
    first = eng.spans(toks)[0].key
    arrival, landed = Arrival(), []
    eng.storing.landing.add(InFlight(arrival), [first], lambda: landed.append(first))
    return eng, toks, slots, first, arrival, landed


def test_a_store_does_not_gather_again_a_chunk_an_earlier_store_has_in_flight():
    """Two requests with one prefix in consecutive steps: the second's store leaves the
    chunks the first has on their way to the host (on a GPU, not waited for) to it."""
    eng, toks, slots, first, arrival, landed = engine_with_first_chunk_in_flight(192)
    assert eng.start_store(toks, slots).finish() == 128  # chunks 2 and 3; chunk 1 is in flight
    arrival.arrived = True
    assert eng.lookup(toks) == 0 and landed == [first]  # (this stand-in's landing put nothing)
    assert eng.store(toks, slots) == 64 and eng.lookup(toks) == 192  # now it is gathered
    eng.close()


def test_a_lookup_does_not_wait_for_chunks_the_engine_has_already():
    """vLLM's scheduler asks with the tokens it has in its own prefix cache (`known`): a chunk
    within them still on its way to the host counts as found and is not waited for (the wait
    held vLLM's scheduler until the GPU ended the step the store's copies queue behind), nor
    held. One that reaches past them is waited for, as every other lookup's."""
    eng, toks, slots, first, arrival, landed = engine_with_first_chunk_in_flight(256)
    assert eng.store(toks[:192], slots[:192]) == 128  # chunks 2 and 3; chunk 1 is in flight
    hit = eng.find(toks, hold_for="r", known=64)
    assert (hit.tokens, hit.in_cpu) == (192, 192) and not arrival.waited and landed == []
    assert len(eng.holds._holds["r"].blocks) == 2  # chunks 2 and 3: the one in flight is not held
    assert (
        eng.find(toks, known=48).tokens == 0
    )  # chunk 1 would be read: waited for (this stand-in lands nothing)
    assert arrival.waited and landed == [first]
    eng.close()
