"""kvtier's named errors. Each says what was wrong and what was expected."""

from __future__ import annotations

import errno
from typing import Any


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A config key has a value of the wrong type or range."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"kvtier config: {key} = {value!r} is invalid; expected {expected}")


class UnknownConfigKey(ConfigError):
    """A config file, env var or override names a key kvtier does not have."""

    def __init__(self, key: str, source: str, closest: str | None) -> None:
        self.key, self.source, self.closest = key, source, closest
        hint = f"; did you mean '{closest}'?" if closest else ""
        KvtierError.__init__(self, f"kvtier config: unknown key '{key}' in {source}{hint}")


class UnsupportedKVLayout(KvtierError, ValueError):
    """An engine's KV cache is laid out in a way kvtier cannot map exactly: it refuses
    at start rather than move the wrong bytes."""

    def __init__(self, backend: str, layout: str, expected: str) -> None:
        self.backend, self.layout, self.expected = backend, layout, expected
        super().__init__(
            f"kvtier cannot map the KV cache of attention backend {backend}: {layout}; "
            f"it maps {expected}"
        )


class UnsupportedModel(KvtierError, ValueError):
    """A model whose cached state kvtier cannot store whole (e.g. Mamba layers' recurrent
    state): it refuses at start rather than give a hit that is not the model's."""


class HugePagesUnavailable(KvtierError, MemoryError):
    """The system has too few free 2 MiB huge pages for the CPU pool."""

    def __init__(self, needed: int, free: int) -> None:
        self.needed, self.free = needed, free
        super().__init__(
            f"local_cpu_use_hugepages: the CPU pool needs {needed} huge pages of 2 MiB, "
            f"the system has {free} free. Reserve them before starting: "
            f"sudo sysctl -w vm.nr_hugepages={needed} (check: grep HugePages /proc/meminfo), "
            "or set local_cpu_use_hugepages: false"
        )


class RemoteUnavailable(KvtierError, ConnectionError):
    """A remote store could not be reached or stopped answering in time.

    Remote connectors raise only this for transport faults; the remote tier
    turns it into a logged, counted miss."""


class RemoteAuthFailed(RemoteUnavailable):
    """The store server wants a token and this client has none, or a wrong one.

    A RemoteUnavailable, so the remote tier backs off as from a dead server
    (a token does not fix itself between two requests); the message says which."""


class RemoteRefused(KvtierError):
    """The remote store answered with an error (e.g. its pool is full)."""


class ValueTooLarge(RemoteRefused, ValueError):
    """A value larger than the remote store's whole pool."""


class CorruptPayload(KvtierError):
    """A stored payload failed its header or checksum check: treated as a miss."""


class PortInUse(KvtierError, OSError):
    """A server could not listen: another process holds its port."""

    def __init__(self, what: str, host: str, port: int) -> None:
        self.what, self.host, self.port = what, host, port
        super().__init__(
            f"{what} {port} on {host} is in use by another process; "
            "pick another port or stop the process that holds it"
        )


def port_taken(exc: BaseException, what: str, host: str, port: int) -> BaseException:
    """`exc` as a PortInUse where it says the port is taken (a socket's OSError, ZMQ's
    ZMQError: both carry errno), else `exc` itself: `raise port_taken(e, ...) from None`."""
    return PortInUse(what, host, port) if getattr(exc, "errno", None) == errno.EADDRINUSE else exc


class DiskTierInUse(KvtierError):
    """Another kvtier process holds the disk tier's directory."""

    def __init__(self, root: object, holder: str) -> None:
        self.root, self.holder = root, holder
        super().__init__(
            f"local_disk {root} is in use by another kvtier process (pid {holder or '?'}); "
            "give each vLLM instance its own local_disk directory, or stop the other one first"
        )
