"""How `mooncakestore://` is configured, read the way LMCache 0.5.6 reads it.

From the JSON file named by MOONCAKE_CONFIG_PATH when that is set, else from
`extra_config` (LMCache's; vLLM's kv_connector_extra_config reaches it too):

    local_hostname         this node's address for Mooncake's transfers
                           (default: the address this host reaches the master from)
    metadata_server        Mooncake's metadata service: http://host:port/metadata,
                           etcd://..., or P2PHANDSHAKE (the default: none needed)
    master_server_address  host:port of mooncake_master (default: the URL's host:port)
    protocol               tcp (default) | rdma | ...
    device_name            RDMA devices, e.g. mlx5_0 (Mooncake's rdma_devices)
    global_segment_size    bytes of RAM this process gives the pool (3,355,443,200)
    local_buffer_size      bytes of Mooncake's own registered buffer (1 GiB)
    transfer_timeout       LMCache's bound on one put, s (read; see MooncakeSettings)

Each key may also be given with a `mooncake_` prefix, which wins over the
plain form. Sizes are bytes, or text such as "3.125GB" / "512MiB".
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtier.errors import ConfigError

DEFAULT_SEGMENT = 3_355_443_200  # LMCache's defaults
DEFAULT_BUFFER = 1 << 30
SETUP_KEYS = (
    "local_hostname",
    "metadata_server",
    "master_server_address",
    "protocol",
    "device_name",
    "global_segment_size",
    "local_buffer_size",
    "transfer_timeout",
)
PREFIX = "mooncake_"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


@dataclass(frozen=True)
class MooncakeSettings:
    master: str  # host:port of mooncake_master
    local_hostname: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_SEGMENT
    local_buffer_size: int = DEFAULT_BUFFER
    # LMCache gives up waiting on a put after this long (the put goes on). kvtier's
    # puts run on its writer threads, off every request's path, so it waits them out.
    transfer_timeout: float = 1.0
    source: str = "extra_config"  # where they were read: for messages

    @property
    def needs_registration(self) -> bool:
        """Whether Mooncake moves only memory registered with it (RDMA and the
        others); its TCP transport reads and writes any address."""
        return self.protocol != "tcp"


def mooncake_settings(
    url: str, extra: Mapping[str, Any], env: Mapping[str, str] = os.environ
) -> MooncakeSettings:
    path = env.get("MOONCAKE_CONFIG_PATH")
    source = f"MOONCAKE_CONFIG_PATH={path}" if path else "extra_config"
    raw = _read_json(path) if path else dict(extra)
    picked = {k: raw[k] for k in SETUP_KEYS if raw.get(k) is not None}
    picked.update(
        {
            k[len(PREFIX) :]: v
            for k, v in raw.items()
            if k.startswith(PREFIX) and k[len(PREFIX) :] in SETUP_KEYS and v is not None
        }
    )
    parts = urlsplit(url)
    master = str(picked.get("master_server_address") or parts.netloc)
    if not master or ":" not in master:
        raise ConfigError(
            "remote_url",
            url,
            f"mooncakestore://<mooncake_master host>:<port>, or master_server_address in {source}",
        )
    return MooncakeSettings(
        master=master,
        local_hostname=str(picked.get("local_hostname") or _address_towards(master)),
        metadata_server=str(picked.get("metadata_server") or "P2PHANDSHAKE"),
        protocol=str(picked.get("protocol") or "tcp").lower(),
        device_name=str(picked.get("device_name") or ""),
        global_segment_size=_size(picked, "global_segment_size", DEFAULT_SEGMENT, source),
        local_buffer_size=_size(picked, "local_buffer_size", DEFAULT_BUFFER, source),
        transfer_timeout=float(picked.get("transfer_timeout", 1.0)),
        source=source,
    )


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            "MOONCAKE_CONFIG_PATH", path, f"a readable JSON file of Mooncake settings ({e})"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError("MOONCAKE_CONFIG_PATH", path, "a JSON object of Mooncake settings")
    return raw


def _size(picked: Mapping[str, Any], key: str, default: int, source: str) -> int:
    value = picked.get(key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            key, value, f"a size in bytes, or such as 3.125GB or 512MiB (in {source})"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _address_towards(master: str) -> str:
    """The local address a connection to the master leaves from (no packet is sent)."""
    host, port = master.rsplit(":", 1)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return socket.gethostname()
