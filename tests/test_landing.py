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
    its way to the host as an earlier store's (its bytes already in a pool block, which lands
    in CPU RAM as a store's would): its key, its `Arrival`, and what has landed."""
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
    span = eng.spans(toks)[0]
    block = eng.tiers.allocate()
    eng.mover.gather(slots[:64], [(span, block)])  # (on a GPU the copy would still run)
    arrival, landed = Arrival(), []

    def land() -> None:
        eng.tiers.put(span.key, block, 64)
        landed.append(span.key)

    eng.landing.add(InFlight(arrival), [span.key], land, [(block, 64)])
    return eng, toks, slots, span.key, arrival, landed


def test_a_store_does_not_gather_again_a_chunk_an_earlier_store_has_in_flight():
    """Two requests with one prefix in consecutive steps: the second's store leaves the
    chunks the first has on their way to the host (on a GPU, not waited for) to it."""
    eng, toks, slots, first, arrival, landed = engine_with_first_chunk_in_flight(192)
    assert eng.start_store(toks, slots).finish() == 128  # chunks 2 and 3; chunk 1 is in flight
    assert eng.lookup(toks) == 192 and landed == []  # found on its way, not waited for
    arrival.arrived = True
    eng.flush()
    assert landed == [first] and eng.lookup(toks) == 192
    eng.close()


def test_a_lookup_never_waits_for_a_store_and_holds_what_it_has_on_its_way():
    """A lookup (vLLM's scheduler waits for it) counts the chunks a store still has on their
    way to the host as found in CPU RAM, without waiting for them (the wait held vLLM's
    scheduler until the GPU ended the step the store's copies queue behind). Their blocks join
    the request's hold: once landed, they stay until its load."""
    eng, toks, slots, first, arrival, landed = engine_with_first_chunk_in_flight(256)
    assert eng.store(toks[:192], slots[:192]) == 128  # chunks 2 and 3; chunk 1 is in flight
    hit = eng.find(toks, hold_for="r")
    assert (hit.tokens, hit.in_cpu) == (192, 192) and not arrival.waited and landed == []
    assert len(eng.holds._holds["r"].blocks) == 3  # chunks 2 and 3, and the one on its way
    eng.release_hold("r")
    eng.close()


def test_a_load_reads_a_chunk_on_its_way_once_it_has_landed():
    """A load with no upload started at its lookup (here: a CPU engine, whose copies go in
    place) reads a chunk a store has on its way from CPU RAM: it waits for it to land first,
    and loads the bytes the store gathered."""
    import torch

    eng, toks, slots, first, arrival, landed = engine_with_first_chunk_in_flight(128)
    want = [x.clone() for x in eng.kv.layers]
    assert eng.store(toks, slots) == 64  # chunk 2; chunk 1 is in flight
    assert eng.find(toks, hold_for="r").tokens == 128
    for x in eng.kv.layers:
        x.zero_()
    assert int(eng.retrieve(toks, slots, request_id="r").sum()) == 128
    assert arrival.waited and landed == [first]
    for x, w in zip(eng.kv.layers, want):
        assert torch.equal(x.flatten(1, 2)[:, :128], w.flatten(1, 2)[:, :128])
    eng.close()


def test_a_borrowed_chunk_is_retained_and_lent_until_it_has_landed():
    """`borrow` lends a chunk on its way with its block retained, and still while a thread
    lands it (it is in no tier until that ends: a reader told None then found it nowhere); a
    reader that needs it in the tiers waits for that thread's landing to end. Once landed it
    is not lent: the reader finds it in the tiers."""
    import threading

    eng, toks, slots, first, arrival, landed = engine_with_first_chunk_in_flight(64)
    (lent,) = eng.landing.borrow([first])
    assert lent is not None and lent.block.ref_count == 2 and lent.done is arrival
    lent.block.release()
    entered, go = threading.Event(), threading.Event()
    flight = eng.landing._flying[0]
    land = flight.land

    def slow_land() -> None:
        entered.set()
        go.wait(10)
        land()

    flight.land = slow_land
    arrival.arrived = True
    lander = threading.Thread(target=eng.landing.settle)
    lander.start()
    assert entered.wait(10)
    assert eng.tiers.locate([first]) == []  # landing: in no tier yet
    (lent,) = eng.landing.borrow([first])
    assert lent is not None and lent.block.ref_count == 2 and eng.landing.holds(first)
    lent.block.release()
    reader = threading.Thread(target=eng.landing.settle, kwargs={"keys": [first]})
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # waits for the lander
    go.set()
    lander.join(10)
    reader.join(10)
    assert not reader.is_alive() and landed == [first] and len(eng.landing) == 0
    assert eng.landing.borrow([first]) == [None] and eng.tiers.locate([first]) == ["cpu"]
    eng.close()


def test_a_background_lander_lands_each_copy_once_it_has_arrived_with_no_other_call():
    """On a GPU an idle engine's last stores must reach CPU RAM (and its peers, the P2P index, a
    router's events) without its next request: a thread lands them once done a while."""
    import time

    landing, landed = Landing(background=True), []
    events = [Arrival() for _ in range(2)]
    for i, done in enumerate(events):
        landing.add(InFlight(done), [key(i)], lambda i=i: landed.append(i))

    def soon(want: list[int]) -> bool:
        deadline = time.monotonic() + 5
        while landed != want and time.monotonic() < deadline:
            time.sleep(0.005)
        return landed == want

    time.sleep(0.05)
    assert landed == [] and len(landing) == 2  # nothing has arrived
    events[1].arrived = True
    assert soon([1])
    events[0].arrived = True
    assert soon([1, 0]) and len(landing) == 0
    assert not any(e.waited for e in events)  # landed as they arrived, never waited for
    landing.close()
    landing.add(InFlight(Arrival()), [key(3)], lambda: landed.append(3))
    time.sleep(0.05)
    assert landed == [1, 0]  # closed: nothing lands in the background any more


def test_the_background_lander_leaves_a_copy_a_reader_borrowed_to_the_engines_calls():
    """A chunk a lookup borrowed is read by its load (behind the store's copies, on the GPU),
    and lands on the engine's calls as without the lander. (A GPU test failure first put on
    landing it under the load was the test's own GIL-holding poll: 2026-11-30.)"""
    import time

    from kvtier.memory import HostPool

    pool = HostPool(4096, 1024, pin=False)
    block = pool.allocate()
    landing, landed = Landing(background=True), []
    done = Arrival()
    landing.add(InFlight(done), [key(1)], lambda: landed.append(1), [(block, 16)])
    (lent,) = landing.borrow([key(1)])
    assert lent is not None and lent.block is block
    done.arrived = True
    time.sleep(0.3)  # done for six times IDLE_S: still borrowed, so not landed here
    assert landed == [] and len(landing) == 1
    lent.block.release()  # the load is over
    deadline = time.monotonic() + 5
    while not landed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert landed == [1] and len(landing) == 0
    landing.close()
