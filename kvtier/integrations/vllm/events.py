"""KV events (`enable_kv_events`): vLLM publishes what kvtier's tiers store and remove.

A KV-aware router (llm-d, Dynamo) listens on vLLM's event publisher
(`--kv-events-config`) to learn which instance holds which prefix. The
worker's CacheEngine records each chunk stored in a tier (its key digest,
its parent's, its token ids) and each chunk evicted or removed
(kvtier/engine/events.py); the worker hands them to vLLM after every step
(`get_kv_connector_kv_cache_events`), the scheduler collects them
(`update_connector_output`) and vLLM publishes them (`take_events`) as
BlockStored / BlockRemoved with the tier as the medium ("CPU", as vLLM's
MEDIUM_CPU; "DISK", "REMOTE", or a registered tier's name in capitals) and
block_size = chunk_size, a stored chunk with its request's LoRA adapter (`lora_id`,
`lora_name`) as vLLM's own events carry it. Block hashes are kvtier's 16-byte chunk
digests (with the adapter, images and cache_salt folded in: keys.py).
"""

from __future__ import annotations

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from kvtier.engine import ChunkEvent


class KvtierKVEvents(KVConnectorKVEvents):
    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self._events = list(events or [])
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KvtierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


def to_vllm(events: list[ChunkEvent], chunk_size: int) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for e in events:
        if e.stored:
            lora_id, lora_name = e.lora if e.lora is not None else (None, None)
            out.append(
                BlockStored(
                    block_hashes=[e.digest],
                    parent_block_hash=e.parent,
                    token_ids=e.token_ids,
                    block_size=chunk_size,
                    lora_id=lora_id,
                    medium=e.medium.upper(),
                    lora_name=lora_name,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=[e.digest], medium=e.medium.upper()))
    return out
