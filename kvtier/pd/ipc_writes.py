"""cuda_ipc's writes: a step's KV gathered into a local ring, then copied into the
decoder's GPU buffer by the copy engine.

    start(make_launch, nbytes, kv_written)   the step's groups and their ring slots; its
                                             gather's tables go up once (`AddressedGather`)
    gather(step, most)                       queue the gathers of up to `most` more groups
                                             (the first ones while the Alloc is on the
                                             wire: the ring needs no address of the decoder's)
    write(step, views)                       each group's copies into the decoder's blocks,
                                             one per run of adjacent blocks, gathering the
                                             groups not gathered yet
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Places = Sequence[tuple[torch.Tensor, int]]  # per chunk: a ring slot and its byte offset there
# `CacheEngine.gather_addressed` for one step
MakeLaunch = Callable[[Places], Callable[[int, int], None]]


class IpcWriter:
    """cuda_ipc's writes: gather kernel into a local ring, copy engine into the peer.

    A kernel writing into another GPU's memory moves 0.81-0.82 of a plain copy over
    NVLink; the copy engine moves contiguous bytes at the link's rate, and gathering
    into local memory takes 0.4 of the copy's time (HBM, not the link). The two run
    on streams of their own, `SLOTS` groups in flight, a run of adjacent blocks of the
    peer's buffer in one copy: 0.91-0.93 of the copy at 16k-32k tokens (0.87-0.91 with a
    copy per chunk; two H100s, 2026-11-26, kvtier_tools.bench.profiles.pd_write).

    A step's groups grow: the first holds `first_bytes` (one chunk at least), each next one
    twice the last, up to a slot. The copy engine starts after the first group's gather
    only, and while it copies group k the kernel gathers group k+1 (twice the bytes at
    about 2.5x the copy's rate: done before the copy engine needs it)."""

    SLOTS = 2
    GROUP_BYTES = 256 << 20
    FIRST_BYTES = 32 << 20

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int,
        group_bytes: int = GROUP_BYTES,
        first_bytes: int = FIRST_BYTES,
    ) -> None:
        self.device = device
        self.slot_bytes = max(group_bytes, chunk_bytes)
        self.first_bytes = min(first_bytes, self.slot_bytes)
        self.ring = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, device=device)
            for _ in range(self.SLOTS)
        ]
        # a slot's last copy out of it
        self._free: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._next = 0
        # steps started: a step gathered ahead is written only if none started after it
        self._steps = 0
        self.gather_stream = torch.cuda.Stream(device)
        self.copy_stream = torch.cuda.Stream(device)

    def start(
        self,
        make_launch: MakeLaunch,
        items: Sequence[Any],
        nbytes: Sequence[int],
        kv_written: torch.cuda.Event | None = None,
    ) -> Step:
        """The groups of `items` (`nbytes` each), a ring slot each in turn, and their
        gather (`make_launch(places)`), ordered after `kv_written` (the forward that wrote
        the KV; recorded now on the current stream unless an earlier piece did)."""
        if kv_written is None:
            kv_written = torch.cuda.Event(enable_timing=True)
            kv_written.record(torch.cuda.current_stream(self.device))
        self.gather_stream.wait_event(kv_written)
        groups: list[_Group] = []
        places: list[tuple[torch.Tensor, int]] = []
        i, cap = 0, self.first_bytes
        while i < len(items):
            slot, self._next = self._next, (self._next + 1) % self.SLOTS
            group = _Group(i, i, slot, [0])
            while group.end < len(items) and (
                group.end == i or group.offsets[-1] + nbytes[group.end] <= cap
            ):
                places.append((self.ring[slot], group.offsets[-1]))
                group.offsets.append(group.offsets[-1] + nbytes[group.end])
                group.end += 1
            groups.append(group)
            i, cap = group.end, min(2 * max(cap, group.offsets[-1]), self.slot_bytes)
        with torch.cuda.stream(self.gather_stream):
            launch = make_launch(places)
        self._steps += 1
        return Step(items, nbytes, kv_written, launch, groups, self._steps)

    def gather(self, step: Step, most: int) -> None:
        """Queue the gathers of up to `most` more groups of `step`, each into its ring
        slot once the copies out of it are done."""
        for group in step.groups[step.gathered : step.gathered + most]:
            if self._free[group.slot] is not None:
                self.gather_stream.wait_event(self._free[group.slot])
            with torch.cuda.stream(self.gather_stream):
                step.launch(group.first, group.end)
            group.gathered = torch.cuda.Event()
            group.gathered.record(self.gather_stream)
            step.gathered += 1

    def current(self, step: Step) -> bool:
        """No step started after `step`: what it gathered ahead is still in the ring."""
        return step.number == self._steps

    def write(
        self, step: Step, views: Sequence[torch.Tensor | None]
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue each group's copies into `views` (one per item; None: the decoder holds
        that chunk already), gathering the groups not gathered yet; the events at which
        the forward had written the KV and at which the last copy completes (timed:
        their distance is what the writes add)."""
        done = step.kv_written
        for k, group in enumerate(step.groups):
            if step.gathered <= k:
                self.gather(step, 1)
            runs = contiguous_runs(views[group.first : group.end])
            if not runs:
                continue
            self.copy_stream.wait_event(group.gathered)
            ring, at = self.ring[group.slot], group.offsets
            with torch.cuda.stream(self.copy_stream):
                for dst, a, b in runs:  # one copy per run of adjacent blocks
                    dst.copy_(ring[at[a] : at[b]], non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.copy_stream)
            self._free[group.slot] = done
        return step.kv_written, done


@dataclass
class _Group:
    """Items [first, end) of a step in one ring slot, at `offsets` (bytes, one more than items)."""

    first: int
    end: int
    slot: int
    offsets: list[int]
    gathered: torch.cuda.Event | None = None


@dataclass
class Step:
    """A step's writes as planned by `IpcWriter.start`; `gathered` groups are queued."""

    items: Sequence[Any]
    nbytes: Sequence[int]  # each item's
    kv_written: torch.cuda.Event
    launch: Callable[[int, int], None]
    groups: list[_Group]
    number: int
    gathered: int = 0


def contiguous_runs(views: Sequence[torch.Tensor | None]) -> list[tuple[torch.Tensor, int, int]]:
    """`views` (uint8, one device; None: nothing to copy there) grouped into runs that
    lie end to end in memory: each run as one view over them and its [first, last + 1)
    indices. The decoder's buffer hands a reservation its free blocks in address order:
    one copy then moves many chunks."""
    runs: list[tuple[torch.Tensor, int, int]] = []
    start = 0
    for k in range(1, len(views) + 1):
        prev, here = views[k - 1], views[k] if k < len(views) else None
        if (
            prev is not None
            and here is not None
            and here.data_ptr() == prev.data_ptr() + prev.numel()
        ):
            continue
        first = views[start]
        if first is not None and prev is not None:
            n = prev.data_ptr() + prev.numel() - first.data_ptr()
            # within its storage
            runs.append((first.as_strided((n,), (1,), first.storage_offset()), start, k))
        start = k
    return runs
