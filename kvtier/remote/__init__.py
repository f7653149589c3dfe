"""Remote KV stores, reached by URL scheme. Every store speaks `KVStore`.

    kvtier://host:port                     our store server (kvtier.server)
    kvtiers://host:port                    the same over TLS (parameters: remote/kvserver.py)
    infinistore://host:port/?device=mlx5_1 the same server, under InfiniStore's scheme
    redis://[:password@]host:port[/db]     one redis-server
    rediss://...                           the same over TLS
    redis-cluster://host:port[,host:port]  a Redis Cluster, from any seed nodes
    fs:///shared/dir                       files in a directory shared by the nodes
    mooncakestore://host:port              Mooncake Store's pool, its master at host:port
                                           (settings: remote/mooncake_settings.py)

Backends import their libraries only when their scheme is opened, so
`import kvtier` never imports redis.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from kvtier.buffers import Value

# scheme -> "module:function(url, timeout) -> KVStore"
SCHEMES = {
    "kvtier": "kvtier.remote.kvserver:open_kvserver",
    "kvtiers": "kvtier.remote.kvserver:open_kvserver",
    "infinistore": "kvtier.remote.kvserver:open_kvserver",
    "redis": "kvtier.remote.redis:open_redis",
    "rediss": "kvtier.remote.redis:open_redis",
    "redis-cluster": "kvtier.remote.redis:open_redis_cluster",
    "fs": "kvtier.remote.fs:open_fs",
    "mooncakestore": "kvtier.remote.mooncake:open_mooncake",
}


class KVStore(Protocol):
    """A byte store shared by a cluster. Contract (tests/test_remote_stores.py):

    - `get` returns one entry per key, None for a miss; a value is seen
      whole or not at all.
    - `get_into(keys, dests)` writes each value into its destination (a
      buffer, or parts filled in order) when the value has exactly the
      destination's size, and says per key whether it did.
    - `match_prefix(keys)` is the number of leading keys all present.
    - `put` of a value too large for the store raises ValueError.
    - Transport faults raise RemoteUnavailable (and only that), after at
      most the timeout the store was opened with.
    """

    def put(self, keys: Sequence[bytes], values: Sequence[Value]) -> None: ...
    def get(self, keys: Sequence[bytes]) -> list[memoryview | bytes | None]: ...
    def get_into(self, keys: Sequence[bytes], dests: Sequence[Value]) -> list[bool]: ...
    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...
    def match_prefix(self, keys: Sequence[bytes]) -> int: ...
    def delete(self, keys: Sequence[bytes]) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class LendingStore(KVStore, Protocol):
    """A store that also lends values in place, out of a pool mapped into this
    process: the store server, reached from its own host (server/client.py).
    `on_map`/`on_unmap` are called with each mapping of the pool (to register it
    with CUDA; on_map returning False: no lending from it)."""

    on_map: Callable[[Any], bool] | None
    on_unmap: Callable[[Any], None] | None

    def borrow(self, keys: Sequence[bytes]) -> Any: ...  # a lease on the values' places, or None
    def server_info(self) -> dict: ...


@runtime_checkable
class RegisteringStore(KVStore, Protocol):
    """A store whose transport moves registered memory in place (Mooncake's):
    the engine registers its CPU pool, which values are put from and got into."""

    def register_memory(self, address: int, size: int) -> None: ...


TOKEN_SCHEMES = ("kvtier", "kvtiers", "infinistore")  # the stores that take remote_auth_token
EXTRA_SCHEMES = ("mooncakestore",)  # the stores configured by extra_config


def open_store(
    url: str, timeout: float, auth_token: str | None = None, extra: Mapping[str, Any] | None = None
) -> KVStore:
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ValueError(
            f"remote_url {url!r}: unknown scheme {scheme!r}; expected one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    module, func = SCHEMES[scheme].split(":")
    opener = getattr(importlib.import_module(module), func)
    if scheme in TOKEN_SCHEMES:
        return opener(url, timeout, auth_token)
    return opener(url, timeout, extra or {}) if scheme in EXTRA_SCHEMES else opener(url, timeout)


def check_url(url: str) -> str | None:
    """Why `url` cannot name a remote store, or None if its form is right (nothing is contacted)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        return "a URL with scheme " + " | ".join(f"{s}://" for s in SCHEMES)
    if parts.scheme == "fs":
        return None if parts.path else "fs:///path/to/shared/dir"
    if parts.scheme == "mooncakestore" and not parts.netloc:  # the master named in extra_config
        return None
    try:
        hosts = parts.netloc.rsplit("@", 1)[-1].split(",")
        if not all(h.rsplit(":", 1)[0] and int(h.rsplit(":", 1)[1]) for h in hosts):
            raise ValueError
    except (IndexError, ValueError):
        return f"{parts.scheme}://host:port"
    return None
