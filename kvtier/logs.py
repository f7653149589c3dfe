"""kvtier's log lines: 'kvtier INFO: ...' on stderr, whatever the host app does."""

from __future__ import annotations

import logging
import os


def get_logger(name: str) -> logging.Logger:
    root = logging.getLogger("kvtier")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("kvtier %(levelname)s %(asctime)s: %(message)s"))
        root.addHandler(handler)
        level = os.environ.get("KVTIER_LOG_LEVEL") or os.environ.get("LMCACHE_LOG_LEVEL") or "INFO"
        root.setLevel(level.upper())
        root.propagate = False
    return logging.getLogger(name)
