"""cuda_ipc's writes: a request's KV gathered into a local ring, then copied into the
decoder's GPU buffer by the copy engine.

    gather_ahead(gather, items, nbytes)      the first groups' gathers, while the Alloc
                                             is on the wire (the ring needs no address
                                             of the decoder's)
    write(gather, items, nbytes, views, ...) the rest: each group gathered into a ring
                                             slot, then one copy per run of adjacent
                                             blocks of the decoder's buffer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

Gather = Callable[[Sequence[Any], Sequence[torch.Tensor]], None]


class IpcWriter:
    """cuda_ipc's writes: gather kernel into a local ring, copy engine into the peer.

    A kernel writing into another GPU's memory moves 0.81-0.82 of a plain copy over
    NVLink; the copy engine moves contiguous bytes at the link's rate, and gathering
    into local memory takes 0.4 of the copy's time (HBM, not the link). The two run
    on streams of their own, `SLOTS` groups in flight, a run of adjacent blocks of the
    peer's buffer in one copy: 0.91-0.93 of the copy at 16k-32k tokens (0.87-0.91 with a
    copy per chunk; two H100s, 2026-11-26, scripts/pd_write_profile.py)."""

    SLOTS = 2
    GROUP_BYTES = 256 << 20  # few launches: each group costs ~0.25 ms of host time to queue

    def __init__(self, device: torch.device, chunk_bytes: int, group_bytes: int = GROUP_BYTES) -> None:
        self.device = device
        self.slot_bytes = max(group_bytes, chunk_bytes)
        self.ring = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.SLOTS)]
        self._free: list[torch.cuda.Event | None] = [None] * self.SLOTS  # a slot's last copy out of it
        self._next = 0
        self.gather_stream = torch.cuda.Stream(device)
        self.copy_stream = torch.cuda.Stream(device)

    def gather_ahead(self, gather: Gather, items: Sequence[Any],
                     nbytes: Sequence[int], kv_written: torch.cuda.Event | None = None) -> Gathered:
        """Queue the gathers of the first groups of `items`, one per ring slot, before the
        decoder's blocks are known: they run while the Alloc is on the wire, and `write`
        (given what this returns, for the same `items`) goes on from them."""
        ahead = self._start(items, kv_written)
        self._gather(ahead, gather, nbytes, self.SLOTS)
        return ahead

    def write(self, gather: Gather, items: Sequence[Any],
              nbytes: Sequence[int], views: Sequence[torch.Tensor | None],
              kv_written: torch.cuda.Event | None = None,
              ahead: Gathered | None = None) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue `gather(items[i:j], buffers)` group by group (from `ahead`'s on, if it
        gathered these `items`) and the copies of each group into `views` (None: that
        item is not copied, the decoder holds it); the events at which the forward had
        written the KV (recorded here unless an earlier piece of the step did) and at which
        the last copy completes (timed: their distance is what the writes add)."""
        plan = ahead if ahead is not None and ahead.items is items else self._start(items, kv_written)
        done, k = plan.kv_written, 0
        while k < len(plan.groups) or self._gather(plan, gather, nbytes, 1):
            i, j, slot, offsets, gathered = plan.groups[k]
            self.copy_stream.wait_event(gathered)
            with torch.cuda.stream(self.copy_stream):
                for dst, a, b in contiguous_runs(views[i:j]):  # one copy per run of adjacent blocks
                    dst.copy_(self.ring[slot][offsets[a] : offsets[b]], non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.copy_stream)
            self._free[slot] = done
            k += 1
        return plan.kv_written, done

    def _start(self, items: Sequence[Any], kv_written: torch.cuda.Event | None) -> Gathered:
        if kv_written is None:
            kv_written = torch.cuda.Event(enable_timing=True)
            kv_written.record(torch.cuda.current_stream(self.device))
        self.gather_stream.wait_event(kv_written)
        return Gathered(items, kv_written)

    def _gather(self, plan: Gathered, gather: Gather,
                nbytes: Sequence[int], most: int) -> int:
        """Queue the gathers of up to `most` more groups of `plan` into the ring's next
        slots (each once the copies out of it are done); how many."""
        added = 0
        i = plan.groups[-1][1] if plan.groups else 0
        while added < most and i < len(plan.items):
            j, size = i, 0
            while j < len(plan.items) and size + nbytes[j] <= self.slot_bytes:
                size += nbytes[j]
                j += 1
            slot, self._next = self._next, (self._next + 1) % self.SLOTS
            if self._free[slot] is not None:
                self.gather_stream.wait_event(self._free[slot])
            offsets = [0]
            for n in nbytes[i:j]:
                offsets.append(offsets[-1] + n)
            parts = [self.ring[slot][a:b] for a, b in zip(offsets, offsets[1:])]
            with torch.cuda.stream(self.gather_stream):
                gather(plan.items[i:j], parts)
            gathered = torch.cuda.Event()
            gathered.record(self.gather_stream)
            plan.groups.append((i, j, slot, offsets, gathered))
            added, i = added + 1, j
        return added


@dataclass
class Gathered:
    """A write's groups whose gathers into the ring are queued: (first item, end, ring
    slot, byte offsets of the items in it, the event after the gather)."""

    items: Sequence[Any]
    kv_written: torch.cuda.Event
    groups: list[tuple[int, int, int, list[int], torch.cuda.Event]] = field(default_factory=list)


def contiguous_runs(views: Sequence[torch.Tensor | None]) -> list[tuple[torch.Tensor, int, int]]:
    """`views` (uint8, one device; None: nothing to copy there) grouped into runs that
    lie end to end in memory: each run as one view over them and its [first, last + 1)
    indices. The decoder's buffer hands a reservation its free blocks in address order:
    one copy then moves many chunks."""
    runs: list[tuple[torch.Tensor, int, int]] = []
    start = 0
    for k in range(1, len(views) + 1):
        prev, here = views[k - 1], views[k] if k < len(views) else None
        if prev is not None and here is not None and here.data_ptr() == prev.data_ptr() + prev.numel():
            continue
        first = views[start]
        if first is not None and prev is not None:
            n = prev.data_ptr() + prev.numel() - first.data_ptr()
            runs.append((first.as_strided((n,), (1,), first.storage_offset()), start, k))  # within its storage
        start = k
    return runs
