"""Blocks a store still reads on the GPU, and the steps that must wait for those reads.

A step's stores gather its KV on kvtier's own stream, beside vLLM's: the next forward does
not wait for them (it did: kvtier's GPU-hit step after a 16k store took 15-23 ms against
native's 9-12 on an H200). The pages a gather reads must not be written before it has read
them, and vLLM writes a page only into a block it has just given a request: its forward
writes from the request's first uncomputed token on, and a load writes the blocks it was
planned for. So each step's metadata names the blocks it may write (`written_blocks`), and
the step's stream waits, on the GPU, for the reads of those among them (vLLM's own
OffloadingConnector fences the same case on the host). The loads beside the steps start
after what vLLM's stream held when the step began (beside.py): after this wait too.

    PageFence.add(event, blocks)        a step's stores read `blocks` until `event`
    PageFence.before_writes(blocks)     the current stream waits for the reads among them
    written_blocks(block_ids, first)    the blocks of a request from its token `first` on
    read_blocks(block_ids, end)         the blocks of a request's tokens before `end`
    writes_come_late(vllm_config, ...)  whether vLLM's config keeps to that premise (else every
                                        step waits for the stores' reads, as before)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class PageFence:
    """The reads of KV blocks still running on kvtier's stream, a step's at a time, in the
    order their events were recorded there: one event's end is every earlier one's too."""

    def __init__(self) -> None:
        self._reads: list[tuple[torch.cuda.Event, frozenset[int]]] = []

    def __len__(self) -> int:
        return len(self._reads)

    def add(self, event: torch.cuda.Event, blocks: Iterable[int]) -> None:
        """The stores queued so far read `blocks` until `event` (recorded after them)."""
        held = frozenset(blocks)
        if held:
            self._reads.append((event, held))

    def before_writes(self, blocks: Iterable[int], device: torch.device) -> bool:
        """Order the current stream after the reads of any of `blocks`; whether it waits.
        Reads that are over, or behind the one waited for, are forgotten: what comes later on
        this stream (and what starts after it) is behind them."""
        while self._reads and self._reads[0][0].query():
            del self._reads[0]
        writes = frozenset(blocks)
        last = max(
            (i for i, (_, held) in enumerate(self._reads) if not held.isdisjoint(writes)),
            default=-1,
        )
        if last < 0:
            return False
        torch.cuda.current_stream(device).wait_event(self._reads[last][0])
        del self._reads[: last + 1]
        return True


def written_blocks(block_ids: Sequence[Sequence[int]], first: int, block_size: int) -> list[int]:
    """The blocks a request's step may write, of its blocks per KV cache group: from the one
    holding token `first` on (those before hold vLLM's prefix hit, which nothing writes). With
    several groups (a hybrid model's, whose blocks map tokens their own ways) every block."""
    skip = first // block_size if len(block_ids) == 1 else 0
    return [b for ids in block_ids for b in ids[skip:] if b]


def read_blocks(block_ids: Sequence[Sequence[int]], end: int, block_size: int) -> list[int]:
    """The blocks holding a request's tokens before `end`, of its blocks per KV cache group
    (a store reads some of them); with several groups every block."""
    upto = -(-end // block_size) if len(block_ids) == 1 else None
    return [b for ids in block_ids for b in ids[:upto] if b]


def writes_come_late(vllm_config: VllmConfig, one_group: bool) -> bool:
    """Whether vLLM writes a step's new blocks only after the connector's start_load_kv, the
    fence's premise. Not with several KV cache groups: vLLM 0.26 zeroes a Mamba model's new
    blocks before it; nor where a prefix hit may end inside a block (`prefix_match_unit` below
    the block size): the copy-on-write copies of such a hit run before it too."""
    cache = vllm_config.cache_config
    unit = getattr(cache, "prefix_match_unit", None)  # (vLLM 0.26 on; absent before)
    return one_group and unit in (None, cache.block_size)
