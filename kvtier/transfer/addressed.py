"""A gather into device memory that the caller addresses chunk by chunk, launched a
group of chunks at a time (a PD sender's ring, `kvtier/pd/ipc_writes.py`).

The slot and address tables of every chunk go up once; a group is then one kernel
launch over slices of them. Made per group instead (pinned tables, uploads, a view
per chunk), queueing a group's gather cost the sender 0.25-0.5 ms of host time on
two H100s (2026-11-26, kvtier_tools.bench.profiles.pd_send), about what the group's copy
takes on NVLink: the sender was host-bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (slots, chunk addresses) of the chunks of one launch
Launch = Callable[[torch.Tensor, torch.Tensor], None]


class AddressedGather:
    """Chunk c holds tokens [c * chunk_tokens, ...) of `slots` ([T] or [G, T]; only the last may be
    short); its bytes go to addresses[c]. `launch(first, end)` queues chunks
    [first, end) on the current stream."""

    def __init__(
        self, kernel: Launch, slots: torch.Tensor, addresses: torch.Tensor, chunk_tokens: int
    ) -> None:
        self._kernel, self._slots, self._addresses = kernel, slots, addresses
        self.chunk_tokens = chunk_tokens

    def launch(self, first: int, end: int) -> None:
        c = self.chunk_tokens
        self._kernel(self._slots[..., first * c : end * c], self._addresses[first:end])
