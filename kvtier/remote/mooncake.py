"""mooncakestore://host:port — Mooncake Store: one KV pool over the RAM of many nodes.

`mooncake_master` places each value in a memory segment that some client
contributed (every kvtier process gives `global_segment_size` bytes of its
RAM; `mooncake_client` processes can give more); values move by Mooncake's
transfer engine (TCP here, RDMA where there is a device). Settings:
remote/mooncake_settings.py. Needs `pip install kvtier[mooncake]`
(mooncake-transfer-engine, or its -non-cuda wheel) and Debian's libibverbs1.

Chunks move with no copy in Python: a value is (codec header, payload) and
goes out of, or lands in, its places as two buffers of one batch call
(`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`). Payloads
are kvtier's CPU pool blocks, registered with Mooncake at start
(`register_memory`); headers pass through a small registered arena of
slots. Where the protocol moves only registered memory and a buffer lies
outside it, that value takes Mooncake's copying calls instead.

Mooncake's answers, per key: a put of a key already there keeps the first
value (kvtier's keys name their content; a reader removes a value that fails
its checks); a segment whose owner died reads as a miss (-800), and the
master forgets its values after its client_ttl; an unreachable master is
RPC_FAIL (-900) after Mooncake's own RPC timeout (about 4 s), which is
RemoteUnavailable here. `setup` against a master that is down retries for
about 90 s holding the GIL (every Python thread stops), so it runs on a
thread of its own and only once the master's port accepts a connection;
until it has succeeded, every call is RemoteUnavailable at once.
"""

from __future__ import annotations

import ctypes
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvtier.buffers import Value, as_parts, fill
from kvtier.errors import ConfigError, RemoteRefused, RemoteUnavailable, ValueTooLarge
from kvtier.logs import get_logger
from kvtier.remote.mooncake_settings import MooncakeSettings, mooncake_settings

log = get_logger(__name__)

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that kvtier tells apart.
NO_AVAILABLE_HANDLE = -200  # no segment has room
INVALID_PARAMS = -600  # e.g. a destination smaller than the value
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800  # the segment that holds it is gone
RPC_FAIL = -900  # the master did not answer

SLOT = 64  # bytes of one header slot (codec.HEADER is 48)
SLOTS = 4096
RETRY_FIRST, RETRY_MAX = 1.0, 30.0

INSTALL = (
    "remote_url mooncakestore:// needs Mooncake's Python package and its libraries: "
    "pip install 'kvtier[mooncake]' (or mooncake-transfer-engine-non-cuda on a host without CUDA) "
    "and Debian's libibverbs1 (apt-get install libibverbs1)"
)


def open_mooncake(url: str, timeout: float, extra: Mapping[str, Any]) -> MooncakeStore:
    return MooncakeStore(url, mooncake_settings(url, extra), timeout)


def _mooncake_module(url: str):
    try:
        from mooncake import store
    except ImportError as e:  # the package, or a library it links (libibverbs.so.1)
        raise ConfigError(
            "remote_url", url, f"a store whose package is installed: {INSTALL} ({e})"
        ) from None
    return store


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _address(buf: memoryview) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data if len(buf) else 0


class _Slots:
    """Registered places for headers: `take(n)` gives n slot addresses (or fewer when short)."""

    def __init__(self) -> None:
        self.arena = np.zeros(SLOT * SLOTS, np.uint8)
        self.base = self.arena.ctypes.data
        self._free = list(range(SLOTS))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self._lock:
            got, self._free = self._free[:n], self._free[n:]
        return got

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def view(self, slot: int, n: int) -> np.ndarray:
        return self.arena[slot * SLOT : slot * SLOT + n]


class MooncakeStore:
    def __init__(self, url: str, settings: MooncakeSettings, timeout: float) -> None:
        self.url, self.settings = url, settings
        self._module = _mooncake_module(url)
        self._replicas = self._module.ReplicateConfig()
        self._replicas.replica_num = 1
        self._slots = _Slots()
        self._regions: list[tuple[int, int]] = [(self._slots.base, self._slots.arena.nbytes)]
        self._client: Any = None
        self._why = "not set up yet"
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ready = threading.Event()
        threading.Thread(target=self._connect, name="kvtier-mooncake-setup", daemon=True).start()
        if not self._ready.wait(timeout):
            log.warning(
                "remote %s: Mooncake master %s not reached in %.0f s (%s); serving without it, "
                "and connecting again in the background",
                url,
                settings.master,
                timeout,
                self._why,
            )

    def __repr__(self) -> str:
        return f"MooncakeStore({self.url}, master {self.settings.master}, {self.settings.protocol})"

    # -- setup ---------------------------------------------------------------------

    def _connect(self) -> None:
        wait = RETRY_FIRST
        s = self.settings
        while not self._closed.is_set():
            # setup holds the GIL while it retries (90 s): only when it will answer
            if not _listening(s.master):
                self._why = "nothing listening there"
                self._closed.wait(wait)
                wait = min(wait * 2, RETRY_MAX)
                continue
            client = self._module.MooncakeDistributedStore()
            code = client.setup(
                s.local_hostname,
                s.metadata_server,
                s.global_segment_size,
                s.local_buffer_size,
                s.protocol,
                s.device_name,
                s.master,
            )
            if code == 0:
                with self._lock:
                    if self._closed.is_set():
                        client.close()
                        return
                    for address, size in self._regions:
                        self._register(client, address, size)
                    self._client = client
                self._ready.set()
                log.info(
                    "remote %s: joined the Mooncake pool (master %s, %s, this process gives "
                    "%.2f GB)",
                    self.url,
                    s.master,
                    s.protocol,
                    s.global_segment_size / 1e9,
                )
                return
            self._why = f"setup returned {code}"
            self._closed.wait(wait)
            wait = min(wait * 2, RETRY_MAX)

    def _register(self, client: Any, address: int, size: int) -> None:
        code = client.register_buffer(address, size)
        if code != 0 and self.settings.needs_registration:
            log.warning(
                "remote %s: registering %.2f GB with Mooncake failed (%d): chunks there are copied",
                self.url,
                size / 1e9,
                code,
            )

    def register_memory(self, address: int, size: int) -> None:
        """Memory that values are put from and got into (kvtier's CPU pool): moved in place."""
        with self._lock:
            self._regions.append((address, size))
            if self._client is not None:
                self._register(self._client, address, size)

    def _store(self) -> Any:
        client = self._client
        if client is None:
            raise RemoteUnavailable(
                f"{self.url}: not in the Mooncake pool (master {self.settings.master}: {self._why})"
            )
        return client

    def _in_place(self, parts: list[memoryview]) -> bool:
        """Whether Mooncake may move these buffers where they are."""
        if not self.settings.needs_registration:
            return True
        return all(
            len(p) <= SLOT
            or any(a <= _address(p) and _address(p) + len(p) <= a + n for a, n in self._regions)
            for p in parts
        )

    # -- the KVStore protocol ------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[Value]) -> None:
        client = self._store()
        values = [as_parts(v) for v in values]
        names = [k.decode("latin-1") for k in keys]
        direct = [i for i, parts in enumerate(values) if self._in_place(parts)]
        copied = sorted(set(range(len(keys))) - set(direct))
        codes = {i: client.put_parts(names[i], *values[i], config=self._replicas) for i in copied}
        slots = self._slots.take(sum(1 for i in direct for p in values[i] if len(p) <= SLOT))
        try:
            ptrs, sizes, free = [], [], iter(slots)
            for i in direct:
                ptrs.append(
                    [
                        self._small_in(p, next(free, None)) if len(p) <= SLOT else _address(p)
                        for p in values[i]
                    ]
                )
                sizes.append([len(p) for p in values[i]])
            if direct:
                codes.update(
                    zip(
                        direct,
                        client.batch_put_from_multi_buffers(
                            [names[i] for i in direct], ptrs, sizes, self._replicas
                        ),
                    )
                )
        finally:
            self._slots.give(slots)
        self._check_puts([codes[i] for i in range(len(keys))], values)

    def _small_in(self, part: memoryview, slot: int | None) -> int:
        if slot is None:  # every slot taken: the part's own address (TCP moves any)
            return _address(part)
        self._slots.view(slot, len(part))[:] = np.frombuffer(part, np.uint8)
        return self._slots.base + slot * SLOT

    def _check_puts(self, codes: list[int], values: list[list[memoryview]]) -> None:
        if codes and all(c == RPC_FAIL for c in codes):
            raise RemoteUnavailable(f"{self.url}: the Mooncake master did not answer a put")
        if INVALID_PARAMS in codes:
            size = sum(len(p) for p in values[codes.index(INVALID_PARAMS)])
            raise ValueTooLarge(
                f"a value of {size} bytes is larger than Mooncake takes (its segments, "
                f"local_buffer_size {self.settings.local_buffer_size})"
            )
        bad = [c for c in codes if c != 0]
        if bad:
            raise RemoteRefused(
                f"Mooncake refused {len(bad)} of {len(codes)} puts (codes {sorted(set(bad))}; "
                f"{NO_AVAILABLE_HANDLE}: no segment has room)"
            )

    def get_into(self, keys: Sequence[bytes], dests: Sequence[Value]) -> list[bool]:
        client = self._store()
        dests = [as_parts(d) for d in dests]
        names = [k.decode("latin-1") for k in keys]
        wanted = [sum(len(p) for p in parts) for parts in dests]
        done = [False] * len(keys)
        direct = [i for i, parts in enumerate(dests) if self._in_place(parts)]
        for i in sorted(set(range(len(keys))) - set(direct)):
            done[i] = fill(dests[i], self._copy_out(client, names[i]))
        slots = self._slots.take(sum(1 for i in direct for p in dests[i] if len(p) <= SLOT))
        try:
            ptrs, sizes, placed, free = [], [], [], iter(slots)
            for i in direct:
                row = []
                for p in dests[i]:
                    slot = next(free, None) if len(p) <= SLOT else None
                    row.append(_address(p) if slot is None else self._slots.base + slot * SLOT)
                    if slot is not None:
                        placed.append((i, p, slot))
                ptrs.append(row)
                sizes.append([len(p) for p in dests[i]])
            codes = (
                client.batch_get_into_multi_buffers([names[i] for i in direct], ptrs, sizes)
                if direct
                else []
            )
            if codes and all(c == RPC_FAIL for c in codes):
                raise RemoteUnavailable(f"{self.url}: the Mooncake master did not answer a get")
            for i, code in zip(direct, codes):
                done[i] = code == wanted[i]
            for i, part, slot in placed:
                if done[i]:
                    np.frombuffer(part, np.uint8)[:] = self._slots.view(slot, len(part))
        finally:
            self._slots.give(slots)
        return done

    def _copy_out(self, client: Any, name: str) -> bytes | None:
        handle = client.get_buffer(name)
        return None if handle is None else ctypes.string_at(handle.ptr(), handle.size())

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        client = self._store()
        handles = client.batch_get_buffer([k.decode("latin-1") for k in keys])
        return [None if h is None else ctypes.string_at(h.ptr(), h.size()) for h in handles]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        codes = self._store().batch_is_exist([k.decode("latin-1") for k in keys])
        if all(c < 0 for c in codes):
            raise RemoteUnavailable(f"{self.url}: the Mooncake master did not answer a lookup")
        return [c == 1 for c in codes]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        found = self.exists(keys)
        return found.index(False) if False in found else len(found)

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        codes = self._store().batch_remove([k.decode("latin-1") for k in keys], True)
        return sum(1 for c in codes if c == 0)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            client, self._client = self._client, None
        if client is not None:
            for address, _ in self._regions:
                client.unregister_buffer(address)
            client.close()
