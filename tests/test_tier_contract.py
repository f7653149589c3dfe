"""The tier contract suite: one set of behaviours, every tier an engine keeps chunks in.

Each case is an engine whose only keeping tier is the one under test: CPU RAM,
the disk tier, the remote tier on each remote store (kvtier server over TCP
and over same-host shared memory, redis-server, a Redis Cluster, a directory,
Mooncake Store), and a tier this module adds (SqliteTier: a kind of tier kvtier does not
have, registered from here alone through kvtier/tiers/registry.py, as a user's package would).
The store-level contract of the remote stores is tests/test_remote_stores.py.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence

import pytest
import torch

from kvtier.codec import Codec
from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import CorruptPayload
from kvtier.keys import ChunkKey, KVFormat, wire_key
from kvtier.remote import open_store
from kvtier.tiers.base import LocalTier, Tier
from kvtier.tiers.disk import file_name
from kvtier.tiers.registry import NotATier, TierContext, register_tier, unregister_tier
from kvtier.transfer import PagedKV

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("contract", "flash_attn", "float32")
CHUNK_BYTES = 16 * L * 2 * H * D * 4
TOKENS = list(range(7000, 7160))  # 10 chunks of 16
SRC, DST = torch.arange(0, 160), torch.arange(400, 560)
TIERS = [
    "cpu",
    "disk",
    "kvtier-tcp",
    "kvtier-shm",
    "redis",
    "redis-cluster",
    "fs",
    "mooncake",
    "sqlite",
]
SQLITE_KEY = "sqlite_tier.path"  # in extra_config: the database file, or no such tier


class SqliteTier(LocalTier):
    """Chunks as rows of one SQLite table: a tier kvtier does not have, written against the
    protocols of kvtier/tiers/base.py alone. Each value is framed by kvtier's codec (header,
    checksum), so damaged bytes read as a miss."""

    name = "sqlite"
    min_stores = 1

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS chunks (key BLOB PRIMARY KEY, value BLOB)")
        self._lock = threading.Lock()
        self._codec = Codec("naive")
        self.evicted = 0

    @property
    def evictions(self) -> int:
        return self.evicted

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [v is not None for v in self._values(keys)]

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[int | None]:
        got: list[int | None] = []
        for value, out in zip(self._values(keys), outs):
            try:
                got.append(None if value is None else self._codec.decode_into(value, out))
            except CorruptPayload:
                got.append(None)
        return got

    def put(self, keys: Sequence[ChunkKey], chunks: Sequence[tuple[memoryview, int, int]]) -> bool:
        rows = [(wire_key(k), b"".join(self._codec.encode(*c))) for k, c in zip(keys, chunks)]
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?)", rows)
        return True

    def damage(self, key: ChunkKey) -> None:
        with self._lock, self._db:
            (value,) = self._db.execute(
                "SELECT value FROM chunks WHERE key = ?", (wire_key(key),)
            ).fetchone()
            data = bytearray(value)
            data[-100] ^= 0xFF  # one byte of KV
            self._db.execute("UPDATE chunks SET value = ? WHERE key = ?", (data, wire_key(key)))

    def clear(self) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM chunks")

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def delete(self, key: ChunkKey) -> bool:
        with self._lock, self._db:
            return (
                self._db.execute("DELETE FROM chunks WHERE key = ?", (wire_key(key),)).rowcount > 0
            )

    def close(self) -> None:
        self._db.close()

    def _values(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        with self._lock:
            return [
                (row[0] if row else None)
                for row in (
                    self._db.execute(
                        "SELECT value FROM chunks WHERE key = ?", (wire_key(k),)
                    ).fetchone()
                    for k in keys
                )
            ]


def sqlite_tier(context: TierContext) -> SqliteTier | None:
    path = context.config.extra_config.get(SQLITE_KEY)
    return None if path is None else SqliteTier(path)


@pytest.fixture(autouse=True, scope="module")
def registered_sqlite_tier():
    register_tier("sqlite", sqlite_tier)
    yield
    unregister_tier("sqlite")


@pytest.fixture(params=TIERS)
def tier(request, tmp_path):
    """(kind, the config of an engine keeping chunks only there, where a chunk of it is found)."""
    kind = request.param
    cfg: dict = {"chunk_size": 16}
    if kind == "cpu":
        cfg["max_local_cpu_size"] = 12 * CHUNK_BYTES * 1.001 / 1024**3
    else:  # CPU RAM only stages: 2 blocks
        cfg.update(local_cpu=False, max_local_cpu_size=2 * CHUNK_BYTES * 1.001 / 1024**3)
    if kind == "disk":
        cfg.update(local_disk=f"file://{tmp_path}/disk", max_local_disk_size=0.01)
    elif kind.startswith("kvtier"):
        cfg["remote_url"] = request.getfixturevalue("kvserver").url + (
            "" if kind == "kvtier-shm" else "/?shm=0"
        )
    elif kind == "redis":
        cfg["remote_url"] = request.getfixturevalue("redis_srv").url
    elif kind == "redis-cluster":
        cfg["remote_url"] = request.getfixturevalue("redis_cluster_srv").url
    elif kind == "fs":
        cfg["remote_url"] = f"fs://{tmp_path}/fs"
    elif kind == "mooncake":
        srv = request.getfixturevalue("mooncake_srv")
        cfg.update(remote_url=srv.url, extra_config=srv.extra_config)
    elif kind == "sqlite":
        cfg["extra_config"] = {SQLITE_KEY: str(tmp_path / "chunks.sqlite")}
    found = {"cpu": Tier.CPU, "disk": Tier.DISK, "sqlite": "sqlite"}.get(kind, Tier.REMOTE)
    yield kind, KvtierConfig(**cfg), found


def engine(config: KvtierConfig, seed: int = 0) -> tuple[CacheEngine, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randn(2, NB, BS, H, D, generator=gen) for _ in range(L)]
    return CacheEngine(config, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def setup(config: KvtierConfig, request) -> tuple[CacheEngine, list[torch.Tensor], list[int]]:
    """An engine, its KV, and a prompt of the test's own (the remote stores outlive one test)."""
    eng, layers = engine(config)
    return eng, layers, [t + hash(request.node.name) % 10**6 * 1000 for t in TOKENS]


def test_a_stored_prompt_is_found_in_the_tier_and_loads_the_same_kv(tier, request):
    kind, config, found = tier
    eng, layers, tokens = setup(config, request)
    try:
        assert eng.store(tokens, SRC) == 160 and eng.flush(timeout=30)
        assert eng.tiers.locate([s.key for s in eng.spans(tokens)]) == [found] * 10
        assert eng.lookup(tokens) == 160
        mask = eng.retrieve(tokens, DST)
        assert mask.all() and torch.equal(kv_at(layers, DST), kv_at(layers, SRC))
        assert eng.pool.free_blocks + len(eng.tiers.cpu) == eng.pool.num_blocks  # no block leaked
    finally:
        eng.close()


def test_a_prompt_is_found_up_to_its_first_chunk_the_tier_does_not_hold(tier, request):
    _, config, _ = tier
    eng, _, tokens = setup(config, request)
    try:
        assert eng.store(tokens[:96], SRC[:96]) == 96 and eng.flush(timeout=30)
        assert eng.lookup(tokens) == 96  # six chunks of ten
        other = tokens[:48] + [t + 1 for t in tokens[48:]]  # chunk 3 on differs: so do its keys
        assert eng.lookup(other) == 48
        assert eng.lookup([t + 3 for t in tokens]) == 0
        mask = eng.retrieve(tokens, DST)
        assert mask.tolist() == [True] * 96 + [False] * 64
    finally:
        eng.close()


def test_damaged_bytes_are_a_miss_not_wrong_kv(tier, request, tmp_path):
    kind, config, _ = tier
    if kind == "cpu":
        pytest.skip(
            "CPU RAM holds the gathered bytes themselves: nothing between them and the load"
        )
    eng, layers, tokens = setup(config, request)
    try:
        assert eng.store(tokens, SRC) == 160 and eng.flush(timeout=30)
        third = eng.spans(tokens)[3].key
        if kind == "disk":
            path = tmp_path / "disk" / file_name(third)
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF  # one byte of KV
            path.write_bytes(bytes(data))
        elif kind == "sqlite":
            eng.tiers.tier("sqlite").damage(third)
        else:
            store = open_store(config.remote_url, 5, extra=config.extra_config)
            value = bytearray(store.get([wire_key(third)])[0])
            value[-100] ^= 0xFF
            store.delete([wire_key(third)])  # Mooncake keeps a key's first value
            store.put([wire_key(third)], [bytes(value)])
            store.close()
        mask = eng.retrieve(tokens, DST)
        # Loaded up to the damaged chunk, no further: the caller recomputes the rest (a chunk lent
        # in place may have crossed before its check failed; its slots are the caller's to rewrite).
        assert mask.tolist() == [True] * 48 + [False] * 112
        assert torch.equal(kv_at(layers, DST[:48]), kv_at(layers, SRC[:48]))
    finally:
        eng.close()


def test_what_the_tier_keeps_outlives_the_engine_where_it_should(tier, request):
    kind, config, _ = tier
    eng, _, tokens = setup(config, request)
    assert eng.store(tokens, SRC) == 160 and eng.flush(timeout=30)
    eng.close()
    again, _ = engine(config, seed=1)
    try:  # CPU RAM is the process's; disk and the remote stores keep chunks for the next engine
        assert again.lookup(tokens) == (0 if kind == "cpu" else 160)
    finally:
        again.close()


def test_a_registered_factory_that_returns_no_tier_is_a_named_error():
    register_tier("broken", lambda context: object())
    try:
        with pytest.raises(NotATier, match="'broken' returned 'object'"):
            engine(KvtierConfig(chunk_size=16, max_local_cpu_size=0.01))
    finally:
        unregister_tier("broken")
