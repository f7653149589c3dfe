"""The cache engine: a facade (facade.py) over the lookup (finding.py), the store path
(storing.py) and the load path (loading.py), built from its config (build.py)."""

from kvtier.engine.events import ChunkEvent
from kvtier.engine.facade import CacheEngine
from kvtier.engine.finding import Hit
from kvtier.engine.loading import Loading
from kvtier.engine.records import EngineStats
from kvtier.engine.storing import Storing

__all__ = ["CacheEngine", "ChunkEvent", "EngineStats", "Hit", "Loading", "Storing"]
