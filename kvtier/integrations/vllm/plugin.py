"""vLLM's plugin entry point: `"kv_connector": "KvtierConnector"` works without
`kv_connector_module_path`.

vLLM calls `register` in each of its processes (entry point group
`vllm.general_plugins`, pyproject.toml). It names the connector's module and
class to vLLM's connector factory, which imports them only when a
configuration asks for the connector: loading the plugin costs an import of
this file alone.
"""

from __future__ import annotations

CONNECTOR = "KvtierConnector"
MODULE = "kvtier.integrations.vllm"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
    except ValueError:  # registered already: vLLM loads plugins once per process, tests may twice
        pass
