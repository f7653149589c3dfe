"""A prompt's partial last chunk (a tail, engine/tails.py), stored with `save_unfull_chunk`,
is found again inside a longer prompt that continues it: a conversation's next turn reuses
all of the last turn's prompt, not only its whole chunks."""

import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("m", "flash_attn", "float32")


def make_engine(unfull=True):
    layers = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    cfg = KvtierConfig(chunk_size=64, max_local_cpu_size=1 / 1024, save_unfull_chunk=unfull)
    return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def test_the_next_turn_finds_the_last_turns_partial_chunk_and_loads_it():
    eng, layers = make_engine()
    turn1 = list(range(1000, 1160))  # two whole chunks and a tail of 32
    turn2 = turn1 + list(range(5000, 5100))  # the answer and the next question
    perm = torch.randperm(NB * BS)
    src, dst = perm[:160], perm[200:460]
    assert eng.store(turn1, src) == 160
    hit = eng.find(turn2, hold_for="t2")
    assert (hit.tokens, hit.in_cpu) == (160, 160)  # where whole chunks alone end at 128
    # the keys of the stored prefix's tokens
    mask = eng.retrieve(turn2[:160], dst[:160], request_id="t2")
    assert mask.all() and torch.equal(at(layers, dst[:160]), at(layers, src))
    eng.close()


def test_a_tail_is_found_only_where_the_tokens_continue_it():
    eng, _ = make_engine()
    turn1 = list(range(1000, 1160))
    eng.store(turn1, torch.arange(160))
    other = turn1[:150] + [7] * 10 + list(range(5000, 5100))  # differs inside the tail
    assert eng.lookup(other) == 128
    assert eng.lookup(turn1[:150]) == 128  # shorter than the tail: its whole chunks only
    assert eng.lookup(turn1[:32] + [1] * 200) == 0  # another prompt after the first chunk's tokens
    # a prompt shorter than a chunk: its tail has no chunk before it
    short = list(range(9000, 9020))
    eng.store(short, torch.arange(20))
    assert eng.lookup(short + [3] * 100) == 20
    eng.clear()
    assert eng.lookup(turn1 + [5] * 100) == 0
    eng.close()


def test_without_save_unfull_chunk_no_tail_is_stored_or_found():
    eng, _ = make_engine(unfull=False)
    turn1 = list(range(1000, 1160))
    assert eng.store(turn1, torch.arange(160)) == 128
    assert eng.lookup(turn1 + [5] * 100) == 128
    eng.close()


def test_save_unfull_chunk_is_on_by_default_since_tails_are_found_again():
    assert KvtierConfig().save_unfull_chunk
