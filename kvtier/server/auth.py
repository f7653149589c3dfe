"""Who may use the store server's KV port, and whose keys they see.

The handshake, after HELLO (protocol.py):

    client                                   server
    HELLO {host_id}              ------->
                                 <-------    {"auth": "hmac-sha256",
                                              "challenge": 32 random bytes, hex}
    AUTH {"proof": HMAC-SHA256(token, CONTEXT + challenge), hex}
                                 ------->    checks the proof against every token, in constant time
                                 <-------    {"tenant": name, "shm": ...}
                                             or UNAUTHORIZED, then closed

The token never crosses the wire, and a proof is good for one challenge
only, which the server draws fresh for every connection: a recorded
handshake replayed on a new connection fails. Everything but HELLO and
AUTH is refused until AUTH succeeds.

Tenants: each token belongs to a tenant, and a tenant's keys live under
its own prefix in the server's one index, so two tenants that hash the
same prompt hold two values and neither can read, test, match or delete
the other's. Prefixes are length-prefixed names (b"\\x05alice"), so no
tenant's prefix starts another's; `--auth-token` is the tenant "" (prefix
b"\\x00"). Without any token there is one keyspace and no prefix.

Same-host clients are offered the shared pool (the memfd) only after
AUTH. Mapping it needs the right to open /proc/<server pid>/fd/<n>, which
the kernel grants only to processes that could already read the server's
memory (same user, or ptrace rights): tenants are separated on the wire,
not from the server's own user.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

CONTEXT = b"kvtier-auth-v1:"
SCHEME = "hmac-sha256"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def new_challenge() -> bytes:
    return secrets.token_bytes(32)


def prove(token: str, challenge: bytes) -> bytes:
    """The client's answer to `challenge`: it shows the token without sending it."""
    return hmac.new(token.encode(), CONTEXT + challenge, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    prefix: bytes  # put in front of every key this tenant sends


def tenant(name: str) -> Tenant:
    return Tenant(name, bytes([len(name)]) + name.encode())


class Tokens:
    """The server's token → tenant table."""

    def __init__(self, tenants: dict[str, str]) -> None:
        if not tenants:
            raise ValueError("no tokens: leave authentication off instead")
        tokens = list(tenants.values())
        if len(set(tokens)) != len(tokens):
            raise ValueError("two tenants share a token: each tenant needs its own")
        for name, token in tenants.items():
            if name and not _NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: expected 1-64 of A-Z a-z 0-9 _ . -")
            if len(token) < 16:
                raise ValueError(
                    f"the token of tenant {name or '(default)'!r} is {len(token)} characters; "
                    "use at least 16 (e.g. `openssl rand -hex 32`)"
                )
        self._entries = [(token, tenant(name)) for name, token in tenants.items()]

    def __len__(self) -> int:
        return len(self._entries)

    def verify(self, challenge: bytes, proof: bytes) -> Tenant | None:
        """The tenant whose token made `proof`, or None. Every token is tried,
        so the time taken does not say which one matched, or how closely."""
        found = None
        for token, who in self._entries:
            if hmac.compare_digest(prove(token, challenge), proof):
                found = who
        return found


def load_tokens(auth_token: str | None, tenants_file: Path | None) -> Tokens | None:
    """The table from `--auth-token` (the tenant "") and `--tenants FILE`
    (a JSON or YAML mapping of tenant name to token); None: no authentication."""
    tenants: dict[str, str] = {}
    if tenants_file is not None:
        tenants = _read_tenants(tenants_file)
    if auth_token:
        tenants[""] = auth_token
    return Tokens(tenants) if tenants else None


def _read_tenants(path: Path) -> dict[str, str]:
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--tenants {path}: {e.strerror}") from None
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        from kvtier.logs import get_logger

        get_logger("kvtier.server").warning(
            "--tenants %s is readable by other users (chmod 600 it)", path
        )
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ValueError(
            f"--tenants {path}: expected a mapping of tenant name to token, e.g. `alice: <token>`"
        )
    if "" in data:
        raise ValueError(f"--tenants {path}: the tenant '' is --auth-token's")
    return dict(data)


def token_from_env(name: str) -> str:
    """A client's token, from the environment variable a URL's `token_env=` names."""
    token = os.environ.get(name)
    if not token:
        raise ValueError(f"token_env={name}: the environment variable {name} is not set")
    return token
