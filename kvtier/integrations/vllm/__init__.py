"""kvtier inside vLLM: the KV connector (connector.py) split by role (scheduler.py,
worker.py), PD hooks (pd.py), the KV layout read from vLLM (layout.py), the
scheduler⇄worker lookup (lookup.py), metrics and events, the plugin entry point.

`kv_connector_module_path: kvtier.integrations.vllm` names this package: the
connector class is imported from it when vLLM asks for it, so that importing
the layout or the plugin does not import vLLM's connector machinery.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
