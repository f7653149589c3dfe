"""KV events from every tier (kvtier/engine/events.py): a chunk stored in CPU RAM, written to
disk and to the remote store, each announced with its medium, parent and token ids; a chunk
the disk tier evicts announced as removed from disk; vLLM's event types carry the medium."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

L, NB, BS, H, D = 2, 64, 16, 2, 32
CHUNK = 16
CHUNK_BYTES = CHUNK * L * 2 * H * D * 4
FMT = KVFormat("events", "flash_attn", "float32")


def engine(tmp_path, disk_chunks: int, cpu_chunks: int = 8) -> CacheEngine:
    config = KvtierConfig(
        chunk_size=CHUNK,
        enable_kv_events=True,
        max_local_cpu_size=cpu_chunks * CHUNK_BYTES * 1.001 / 1024**3,
        local_disk=f"file://{tmp_path}/disk",
        max_local_disk_size=disk_chunks * (CHUNK_BYTES + 64) * 1.001 / 1024**3,
        remote_url=f"fs://{tmp_path}/remote",
    )
    layers = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    return CacheEngine(config, PagedKV.wrap(layers, "flash_attn"), FMT)


def by_medium(events, stored: bool) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        if e.stored == stored:
            out.setdefault(e.medium, []).append(e)
    return out


def test_every_tier_announces_what_it_stored_with_the_chunks_parent_and_tokens(tmp_path):
    eng = engine(tmp_path, disk_chunks=8)
    try:
        tokens = list(range(1000, 1064))  # four chunks
        assert eng.store(tokens, torch.arange(64)) == 64 and eng.flush(timeout=30)
        stored = by_medium(eng.take_events(), stored=True)
        assert set(stored) == {"cpu", "disk", "remote"}
        digests = [s.key.digest for s in eng.spans(tokens)]
        for medium, events in stored.items():
            events = sorted(events, key=lambda e: digests.index(e.digest))
            assert [e.digest for e in events] == digests, medium
            assert [e.parent for e in events] == [None, *digests[:-1]], medium
            assert [e.token_ids for e in events] == [
                tokens[i : i + CHUNK] for i in range(0, 64, CHUNK)
            ], medium
        assert eng.take_events() == []  # taken once
    finally:
        eng.close()


def test_a_chunk_the_disk_evicts_is_announced_as_removed_from_disk(tmp_path):
    eng = engine(tmp_path, disk_chunks=4)
    try:
        first = list(range(2000, 2064))
        assert eng.store(first, torch.arange(64)) == 64 and eng.flush(timeout=30)
        eng.take_events()
        second = list(range(3000, 3064))  # four more chunks: the disk holds four in all
        assert eng.store(second, torch.arange(64, 128)) == 64 and eng.flush(timeout=30)
        events = eng.take_events()
        removed = by_medium(events, stored=False)
        first_digests = {s.key.digest for s in eng.spans(first)}
        assert {e.digest for e in removed["disk"]} == first_digests
        assert "remote" not in removed  # the remote store evicts unseen
        assert len(by_medium(events, stored=True)["disk"]) == 4
    finally:
        eng.close()


def test_a_write_that_lands_before_its_stores_event_is_announced_when_that_comes(tmp_path):
    eng = engine(tmp_path, disk_chunks=8)
    try:
        tokens = np.arange(4000, 4016, dtype=np.uint32)
        spans = eng.spans(tokens.tolist())
        eng.events._written("disk", [spans[0].key])  # the writer was first
        assert eng.take_events() == []
        eng.events.stored(spans, tokens, spans)
        (event,) = [e for e in eng.take_events() if e.medium == "disk"]
        assert event.stored and event.digest == spans[0].key.digest
        assert event.token_ids == tokens.tolist()
    finally:
        eng.close()


def test_vllms_events_carry_the_tier_as_the_medium():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvtier.engine import ChunkEvent
    from kvtier.integrations.vllm.events import to_vllm

    events = [
        ChunkEvent(True, b"a" * 16, None, [1, 2], None, "cpu"),
        ChunkEvent(True, b"a" * 16, None, [1, 2], None, "disk"),
        ChunkEvent(False, b"a" * 16, medium="disk"),
    ]
    out = to_vllm(events, 2)
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockRemoved]
    assert [e.medium for e in out] == ["CPU", "DISK", "DISK"]  # CPU: vLLM's MEDIUM_CPU
