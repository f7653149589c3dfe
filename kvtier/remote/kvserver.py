"""kvtier://, kvtiers:// and infinistore:// — our store server, through its own client.

kvtier://host:port                      TCP (shared memory when on the server's host)
kvtiers://host:port  or  ?tls=1         TLS; ?tls_ca=/path/ca.pem for a private CA
?token_env=VAR                          the token (auth.py) from $VAR; or the config
                                        key remote_auth_token
?shm=0                                  never the shared-memory path
infinistore://host:port/?device=mlx5_1  InfiniStore's form (the device is noted, TCP is used)
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from kvtier.logs import get_logger
from kvtier.server.auth import token_from_env
from kvtier.server.client import KVClient

log = get_logger(__name__)

_PARAMS = {"device", "tls", "tls_ca", "token_env", "shm"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def open_kvserver(url: str, timeout: float, auth_token: str | None = None) -> KVClient:
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if unknown := set(query) - _PARAMS:
        raise ValueError(
            f"remote_url {url!r}: unknown parameter(s) {sorted(unknown)}; "
            f"expected some of {sorted(_PARAMS)}"
        )
    if (device := query.get("device")) is not None:
        # InfiniStore's connector uses RDMA only; ours talks TCP (or shared memory
        # on the same host) until the RDMA transport of docs/rdma.md is built.
        log.info("remote %s: RDMA device %s requested; kvtier's client uses TCP", url, device)
    token = token_from_env(query["token_env"]) if "token_env" in query else auth_token
    return KVClient(
        parts.hostname or "127.0.0.1",
        parts.port or 12345,
        timeout=timeout,
        token=token,
        tls=parts.scheme == "kvtiers" or _flag(url, query, "tls", False),
        tls_ca=query.get("tls_ca"),
        shm=_flag(url, query, "shm", True),
    )


def _flag(url: str, query: dict[str, str], name: str, default: bool) -> bool:
    value = query.get(name)
    if value is None:
        return default
    if value.lower() not in _TRUE | _FALSE:
        raise ValueError(f"remote_url {url!r}: {name}={value!r}; expected 1 or 0")
    return value.lower() in _TRUE
