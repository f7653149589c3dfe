"""What the engine counts and records: its stats and its transfer log lines."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.logs import get_logger

log = get_logger(__name__)


@dataclass
class EngineStats:
    stored_tokens: int = 0
    retrieved_tokens: int = 0
    skipped_store_tokens: int = 0  # not stored: every pool block was held by readers
    prefetched_tokens: int = 0
    step_loads: int = 0  # loads from CPU RAM queued in the engine's step (not beside it)
    step_loads_ahead: int = 0  # of them, those whose copies up had started at the lookup
    store_seconds: float = 0.0
    retrieve_seconds: float = 0.0
    # tokens loaded, by the tier they came from
    loaded_by_tier: dict[str, int] = field(default_factory=dict)


class SkipWarnings:
    """A store cut short is said once per request, though chunked prefill stores a request
    many times."""

    def __init__(self, remembered: int = 1024) -> None:
        self._said: OrderedDict[str, None] = OrderedDict()
        self._remembered = remembered

    def warn(self, skipped: int, request_id: str) -> None:
        if request_id and request_id in self._said:
            return
        log.warning(
            "CPU pool full of chunks in use (being read, or this store's own with no disk or "
            "remote tier to stream to): skipping the store of %d tokens for request %s (said "
            "once per request)",
            skipped,
            request_id or "-",
        )
        if request_id:
            self._said[request_id] = None
            if len(self._said) > self._remembered:
                self._said.popitem(last=False)


def log_transfer(
    what: str,
    n: int,
    total: int,
    request_id: str,
    nbytes: int,
    seconds: float,
    how: str = "",
    queued: bool = False,
) -> None:
    """`queued`: `seconds` is the time to queue copies that were not waited for (no rate)."""
    if queued:
        log.info(
            "%s %d out of %d tokens for request %s (%.1f MB; copies queued in %.1f ms, not "
            "waited for%s)",
            what,
            n,
            total,
            request_id or "-",
            nbytes / 1e6,
            seconds * 1e3,
            how,
        )
        return
    log.info(
        "%s %d out of %d tokens for request %s (%.1f MB in %.1f ms, %.2f GB/s%s)",
        what,
        n,
        total,
        request_id or "-",
        nbytes / 1e6,
        seconds * 1e3,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        how,
    )
