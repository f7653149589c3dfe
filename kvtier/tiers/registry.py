"""The tiers an engine keeps chunks in below CPU RAM, in the order a lookup asks them.

    disk        the built-in disk tier (`local_disk`)
    registered  each tier registered here, in the order registered
    remote      the built-in remote tier (`remote_url`, its store by URL scheme)

A new tier is a module that implements `LowerTier` (and the capabilities it has:
kvtier/tiers/base.py) and registers a factory, called for every engine with the engine's
`TierContext`; the factory returns its tier, or None when the config does not ask for it
(it reads its settings from `extra_config`). Registered by `register_tier` in the process
that builds the engine, or by an installed package's entry point in the group
`kvtier.tiers` (`name = "module:factory"`): vLLM builds engines in its worker processes,
which load entry points but not a module the user imported in the parent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.keys import KVFormat
from kvtier.tiers.base import LowerTier

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig

ENTRY_POINT_GROUP = "kvtier.tiers"


class NotATier(KvtierError, TypeError):
    """A registered factory returned something that is not a LowerTier."""

    def __init__(self, name: str, got: object) -> None:
        super().__init__(
            f"kvtier: the tier factory {name!r} returned {type(got).__name__!r}, which does "
            "not implement LowerTier (kvtier/tiers/base.py)"
        )


@dataclass(frozen=True)
class TierContext:
    """What a tier factory knows of the engine it builds a tier for."""

    config: KvtierConfig
    fmt: KVFormat  # the KV's format and this rank (fmt.tp_rank, fmt.tp_size)
    bytes_per_token: int  # a chunk's bytes are num_tokens * bytes_per_token


TierFactory = Callable[[TierContext], LowerTier | None]

_factories: dict[str, TierFactory] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register_tier(name: str, factory: TierFactory) -> None:
    """Register a kind of tier; `name` also names it in errors. Registering a name again
    replaces its factory (a module imported twice)."""
    with _lock:
        _factories[name] = factory


def unregister_tier(name: str) -> None:
    with _lock:
        _factories.pop(name, None)


def registered_tiers(context: TierContext) -> list[LowerTier]:
    """The registered tiers this engine's config asks for, each built by its factory."""
    _load_entry_points()
    with _lock:
        factories = list(_factories.items())
    tiers: list[LowerTier] = []
    for name, factory in factories:
        tier = factory(context)
        if tier is None:
            continue
        if not isinstance(tier, LowerTier):
            raise NotATier(name, tier)
        tiers.append(tier)
    return tiers


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        register_tier(point.name, point.load())
