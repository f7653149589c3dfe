"""A hybrid model's recurrent state beside its KV (kvtier/engine/states.py): snapshots at
chunk ends, stored through the tiers, and hits that end only where one is."""

import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.engine.states import StateLayers, _runs
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

L, NB, BS, H, D = 2, 64, 16, 2, 32  # attention layers: a chunk of 16 tokens is 16 KiB
FMT = KVFormat("m", "flash_attn", "float32")
STATE_BYTES = (20_000, 5_000)  # two recurrent layers: 25 kB, two pieces, the first layer over both
PAGE = 32_768  # vLLM pads a state block to the attention page


def make(tmp_path=None, **cfg):
    attn = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    raw = [torch.randint(0, 256, (NB, PAGE), dtype=torch.uint8) for _ in STATE_BYTES]
    pages = StateLayers([r[:, :n] for r, n in zip(raw, STATE_BYTES)])
    disk = (
        {}
        if tmp_path is None
        else {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    )
    config = KvtierConfig(
        chunk_size=16, max_local_cpu_size=1 / 1024, blocking_timeout_secs=5, **disk, **cfg
    )
    return CacheEngine(config, PagedKV.wrap(attn, "flash_attn"), FMT, states=pages), attn, raw


def state(raw, block):
    return [r[block, :n].clone() for r, n in zip(raw, STATE_BYTES)]


def test_runs_lay_every_layer_byte_once_and_cross_no_piece_end():
    runs = _runs([20_000, 5_000, 7], 16_384)
    assert sum(n for *_, n in runs) == 25_007
    assert all(po + n <= 16_384 for _, _, _, po, n in runs)
    assert [(layer, piece) for layer, _, piece, _, _ in runs] == [(0, 0), (0, 1), (1, 1), (2, 1)]


def test_a_hit_ends_at_the_last_chunk_end_with_a_state_and_loads_it():
    eng, attn, raw = make()
    assert eng.states is not None and eng.states.num_pieces == 2
    toks = list(range(64))
    assert eng.store(toks, torch.arange(64)) == 64
    assert eng.find(toks).tokens == 0  # KV without any state: no hit
    assert eng.save_state(toks[:32], [3, 7])
    assert eng.save_state(toks[:48], [4, 8])
    assert not eng.save_state(toks[:40], [4, 8])  # not a chunk's end
    assert eng.find(toks).tokens == 48
    assert eng.find(toks, limit=47).tokens == 32  # vLLM computes the prompt's last token itself
    assert eng.find(toks[:40]).tokens == 32
    want = [state(raw, 4)[0], state(raw, 8)[1]]
    load = eng.load_state(toks[:48], [10, 11])
    assert load is not None
    load.finish()
    assert torch.equal(state(raw, 10)[0], want[0]) and torch.equal(state(raw, 11)[1], want[1])
    assert eng.load_state(toks[:16], [12, 13]) is None  # none stored there: nothing written
    load = eng.load_state(toks[:48], [14, 15], also=[16, 17])  # into two blocks a layer
    load.finish()
    assert torch.equal(state(raw, 16)[0], want[0]) and torch.equal(state(raw, 17)[1], want[1])
    assert torch.equal(state(raw, 14)[0], want[0])


def test_a_state_missing_a_piece_is_no_hit_and_never_loads():
    eng, _, raw = make()
    toks = list(range(64))
    eng.store(toks, torch.arange(64))
    eng.save_state(toks[:32], [3, 7])
    eng.save_state(toks[:64], [4, 8])
    key = eng.spans(toks)[3].key
    assert eng.tiers.cpu.delete(eng.states.keys(key)[1])
    assert eng.find(toks).tokens == 32
    before = state(raw, 20)
    assert eng.load_state(toks, [20, 20]) is None
    assert all(torch.equal(a, b) for a, b in zip(state(raw, 20), before))


def test_states_go_to_disk_and_come_back_from_it(tmp_path):
    eng, _, raw = make(tmp_path)
    toks = list(range(32))
    eng.store(toks, torch.arange(32))
    want = state(raw, 5)
    assert eng.save_state(toks, [5, 5])
    assert eng.flush(10)
    eng.tiers.cpu.clear()
    hit = eng.find(toks, hold_for="r")
    # from disk: the scheduler loads it in the background
    assert hit.tokens == 32 and hit.in_cpu == 0
    load = eng.load_state(toks, [9, 9], request_id="r")
    assert load is not None
    load.finish()
    assert all(torch.equal(a, b) for a, b in zip(state(raw, 9), want))
    eng.release_hold("r")
    eng.close()


def test_a_cpu_only_hit_needs_its_snapshot_in_cpu_ram_and_a_prefetch_brings_it_up(tmp_path):
    """vLLM's hybrid allocator cannot take a failed load back (it would recompute): such a
    hit is promised only from CPU RAM, and what lies below comes up for the next request."""
    eng, _, raw = make(tmp_path)
    toks = list(range(48))
    eng.store(toks, torch.arange(48))
    eng.save_state(toks[:32], [5, 5])
    assert eng.flush(10)
    eng.tiers.cpu.clear()
    assert eng.find(toks).tokens == 32 and eng.find(toks, cpu_only=True).tokens == 0
    eng.start_prefetch(toks, "").result()
    assert eng.find(toks, cpu_only=True).tokens == 32
    eng.close()
