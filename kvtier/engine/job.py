"""What one store or load is for."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.keys import PLAIN, Identity


@dataclass(frozen=True)
class Job:
    """A request's tokens (from the prompt's first) and their slots in the paged KV
    (int64 on the CPU, checked at the facade); the tokens before `start` the engine
    has already; what besides the tokens decides their KV (`identity`, in their keys)."""

    tokens: np.ndarray
    slots: torch.Tensor
    start: int = 0
    request_id: str = ""
    identity: Identity = PLAIN
    t0: float = field(default_factory=time.perf_counter)

    @property
    def num_tokens(self) -> int:
        """Tokens with slots (a grouped KV's table has a row of them per group)."""
        return self.slots.shape[-1]

    def seconds(self) -> float:
        return time.perf_counter() - self.t0
