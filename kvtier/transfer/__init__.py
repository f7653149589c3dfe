"""Moving KV between an engine's paged cache and contiguous chunk buffers: the types here,
the builder in factory.py (make_transfer)."""

from __future__ import annotations

from kvtier.transfer.base import InFlight, LayerHandle, LayerSaver, Transfer, Upload
from kvtier.transfer.layout import LAYOUTS, PagedKV
from kvtier.transfer.quant import Quant

__all__ = [
    "LAYOUTS",
    "InFlight",
    "LayerHandle",
    "LayerSaver",
    "PagedKV",
    "Quant",
    "Transfer",
    "Upload",
]
