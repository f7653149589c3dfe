"""How long each step's forward waited on the GPU for the loads queued ahead of it in that
step: their copies not yet over when the forward's stream reached them, and their scatter.
Timed by a pair of CUDA events on the forward's stream around the loads, read once both
have passed (never waited for): the `load_wait_seconds` counter over `load_wait_steps`.

A hit's copies start at its lookup (`upload_ahead`), while vLLM's previous step still runs:
this says how much of them that step hid. Whole loads only: a layerwise load's waits fall
inside the forward, layer by layer. Nothing is timed off a CUDA device.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch


class ForwardWaits:
    def __init__(self) -> None:
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.seconds = 0.0  # the forwards' waits that have been read
        self.steps = 0  # steps whose forward waited for loads, read

    @contextlib.contextmanager
    def around(self, device: torch.device) -> Iterator[None]:
        """Times what the body queues on `device`'s current stream."""
        if device.type != "cuda":
            yield
            return
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        yield
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        self.read()  # what has passed, so that pairs do not pile up where no one asks
        self._open.append((before, after))

    def read(self) -> None:
        """Adds up the pairs the GPU has passed, oldest first."""
        while self._open and self._open[0][1].query():
            before, after = self._open.popleft()
            self.seconds += before.elapsed_time(after) / 1e3
            self.steps += 1
