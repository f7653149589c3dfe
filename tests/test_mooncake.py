"""Mooncake Store as the remote tier (mooncakestore://): settings read as LMCache reads
them, a real mooncake_master with segments in other processes, and its faults.

The store-level contract runs in test_remote_stores.py, the tier contract in
test_tier_contract.py, two vLLM instances sharing through it in test_vllm_remote.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError, RemoteRefused, RemoteUnavailable
from kvtier.keys import KVFormat, wire_key
from kvtier.remote import open_store
from kvtier.remote.mooncake import MooncakeStore
from kvtier.remote.mooncake_settings import DEFAULT_BUFFER, DEFAULT_SEGMENT, mooncake_settings
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import LocalServer, free_port, mooncake_store

pytest.importorskip(
    "mooncake.store", reason="Mooncake's wheel is not installed (scripts/setup.sh installs it)"
)

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("mooncake-test", "flash_attn", "float32")
TOKENS = list(range(5000, 5160))  # 10 chunks of 16


# -- settings ------------------------------------------------------------------------


def test_settings_take_lmcaches_keys_and_defaults():
    s = mooncake_settings("mooncakestore://10.0.0.5:50051", {"local_hostname": "10.0.0.7"}, env={})
    assert (s.master, s.local_hostname, s.metadata_server, s.protocol) == (
        "10.0.0.5:50051",
        "10.0.0.7",
        "P2PHANDSHAKE",
        "tcp",
    )
    assert (
        (s.global_segment_size, s.local_buffer_size)
        == (DEFAULT_SEGMENT, DEFAULT_BUFFER)
        == (3355443200, 1 << 30)
    )
    assert not s.needs_registration


def test_prefixed_keys_win_and_sizes_take_units():
    extra = {
        "master_server_address": "a:1",
        "mooncake_master_server_address": "b:2",
        "protocol": "tcp",
        "mooncake_protocol": "RDMA",
        "device_name": "mlx5_0",
        "global_segment_size": "3.125GB",
        "mooncake_local_buffer_size": "512MiB",
        "metadata_server": "http://m:8080/metadata",
        "transfer_timeout": 1,
        "mooncake_transfer_timeout": 5,
        "local_hostname": "h",
    }
    s = mooncake_settings("mooncakestore://ignored:9", extra, env={})
    assert (s.master, s.protocol, s.device_name, s.metadata_server) == (
        "b:2",
        "rdma",
        "mlx5_0",
        "http://m:8080/metadata",
    )
    assert (s.global_segment_size, s.local_buffer_size, s.transfer_timeout) == (
        3355443200,
        512 << 20,
        5.0,
    )
    assert s.needs_registration


def test_mooncake_config_path_wins_over_extra_config(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {"local_hostname": "x", "master_server_address": "m:7", "global_segment_size": 1 << 20}
        )
    )
    s = mooncake_settings(
        "mooncakestore://", {"local_hostname": "ignored"}, env={"MOONCAKE_CONFIG_PATH": str(path)}
    )
    assert (s.master, s.local_hostname, s.global_segment_size) == ("m:7", "x", 1 << 20)
    assert "MOONCAKE_CONFIG_PATH" in s.source


@pytest.mark.parametrize(
    "url, extra, key",
    [
        ("mooncakestore://", {}, "remote_url"),  # no master anywhere
        ("mooncakestore://h:1", {"global_segment_size": "lots"}, "global_segment_size"),
    ],
)
def test_bad_settings_fail_naming_the_key(url, extra, key):
    with pytest.raises(ConfigError) as e:
        mooncake_settings(url, extra, env={})
    assert e.value.key == key


def test_a_missing_package_is_one_error_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(ConfigError, match=r"kvtier\[mooncake\].*libibverbs1"):
        open_store(
            f"mooncakestore://127.0.0.1:{free_port()}", 1, extra={"local_hostname": "127.0.0.1"}
        )


# -- the store -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with mooncake_store(segments=2, segment_mb=64) as srv:
        yield srv


def test_a_value_larger_than_every_segment_is_refused_and_the_store_still_works(pool):
    st = open_store(pool.url, 5, extra=pool.extra_config)
    try:
        with pytest.raises(RemoteRefused):
            st.put([b"too-big"], [bytes(80 << 20)])  # each segment is 64 MiB
        st.put([b"fits"], [b"fine"])
        assert st.get([b"fits"]) == [b"fine"]
    finally:
        st.delete([b"fits"])
        st.close()


def test_where_memory_must_be_registered_other_buffers_are_copied_by_mooncake(pool, monkeypatch):
    st = open_store(pool.url, 5, extra=pool.extra_config)
    registered = bytearray(1 << 20)
    st.register_memory(_address(registered), len(registered))
    monkeypatch.setattr(type(st.settings), "needs_registration", property(lambda s: True))
    outside, header = os.urandom(1 << 20), bytearray(b"h" * 48)
    try:
        # headers go through the slots
        assert st._in_place([memoryview(header), memoryview(registered)])
        assert not st._in_place([memoryview(outside)])
        st.put(
            [b"copied", b"in-place"],
            [[bytes(header), outside], [bytes(header), memoryview(registered)]],
        )
        head, body = bytearray(48), bytearray(1 << 20)
        assert st.get_into(
            [b"copied", b"in-place"], [[head, memoryview(body)], [bytearray(48), registered]]
        ) == [True, True]
        assert head == header and bytes(body) == outside
    finally:
        st.delete([b"copied", b"in-place"])
        st.close()


def _address(buf) -> int:
    import numpy as np

    return np.frombuffer(buf, np.uint8).ctypes.data


WRITER = """
import sys, time
from kvtier.remote import open_store
st = open_store(
    sys.argv[1],
    5,
    extra={
        "local_hostname": "127.0.0.1",
        "global_segment_size": 64 << 20,
        "local_buffer_size": 16 << 20,
    },
)
st.put([b"owned"], [bytes([7]) * (1 << 20)])
print("stored", flush=True)
if sys.argv[2] == "close":
    st.close()
else:
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["killed", "closed"])
def test_a_value_whose_segment_owner_is_gone_is_a_miss(how):
    """With no segments of its own, the pool keeps a value in the writer's segment; once
    the writer is gone so is the value: a miss, never an error (killed: reads fail at
    once and the master forgets the value after its client_ttl; closed: gone at once)."""
    with mooncake_store(segments=0, client_ttl=2) as srv:
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, srv.url, "close" if how == "closed" else "stay"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        st = open_store(srv.url, 5, extra=srv.extra_config)
        try:
            assert writer.stdout.readline().strip() == "stored"
            if how == "killed":
                got = bytearray(1 << 20)
                assert st.get_into([b"owned"], [got]) == [True] and got == bytes([7]) * (1 << 20)
                writer.kill()
            writer.wait(timeout=30)
            assert st.get_into([b"owned"], [bytearray(1 << 20)]) == [False]
            deadline = time.monotonic() + 15
            while st.exists([b"owned"]) != [False] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert st.exists([b"owned"]) == [False]
        finally:
            writer.kill()
            st.close()


# -- the tier, through the engine ----------------------------------------------------


def engine(srv: LocalServer, timeout: float = 5.0) -> tuple[CacheEngine, list[torch.Tensor]]:
    layers = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    cfg = KvtierConfig(
        chunk_size=16,
        local_cpu=False,
        max_local_cpu_size=4 * 16 * L * 2 * H * D * 4 / 1024**3,
        remote_url=srv.url,
        extra_config=srv.extra_config,
        blocking_timeout_secs=timeout,
    )
    return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def test_the_engine_registers_its_cpu_pool_and_moves_chunks_in_place(pool):
    eng, layers = engine(pool)
    try:
        store = eng.tiers.tier("remote").store
        assert isinstance(store, MooncakeStore)
        arena = eng.pool.arena
        assert (arena.data_ptr(), eng.pool.capacity) in store._regions
        src, dst = torch.arange(0, 160), torch.arange(300, 460)
        assert eng.store(TOKENS, src) == 160 and eng.flush(timeout=30)
        assert eng.lookup(TOKENS) == 160
        assert eng.retrieve(TOKENS, dst).all()
        assert torch.equal(kv_at(layers, dst), kv_at(layers, src))
    finally:
        eng.close()


def test_a_chunk_evicted_between_lookup_and_load_is_loaded_up_to_it_and_the_rest_recomputed(pool):
    eng, layers = engine(pool)
    tokens = [t + 100_000 for t in TOKENS]
    try:
        src, dst = torch.arange(0, 160), torch.arange(300, 460)
        assert eng.store(tokens, src) == 160 and eng.flush(timeout=30)
        assert eng.lookup(tokens) == 160
        other = open_store(pool.url, 5, extra=pool.extra_config)
        assert other.delete([wire_key(eng.spans(tokens)[4].key)]) == 1  # evicted under the hit
        other.close()
        # vLLM's connector reports the rest as failed blocks: recomputed
        mask = eng.retrieve(tokens, dst)
        assert mask.tolist() == [True] * 64 + [False] * 96  # loaded up to the gone chunk
        assert torch.equal(kv_at(layers, dst[:64]), kv_at(layers, src[:64]))
        assert eng.lookup(tokens) == 64
    finally:
        eng.close()


def test_a_master_down_at_start_is_said_once_and_joined_when_it_comes(caplog):
    port = free_port()
    srv = LocalServer(
        f"mooncakestore://127.0.0.1:{port}",
        [port],
        [],
        extra_config={
            "local_hostname": "127.0.0.1",
            "global_segment_size": 32 << 20,
            "local_buffer_size": 16 << 20,
        },
    )
    t0 = time.monotonic()
    eng, layers = engine(srv, timeout=1.0)
    assert time.monotonic() - t0 < 5
    try:
        assert sum("not reached" in r.getMessage() for r in caplog.records) == 1
        src = torch.arange(0, 160)
        assert eng.store(TOKENS, src) == 160  # no remote: nothing kept, no error
        eng.flush(timeout=10)
        assert eng.lookup(TOKENS) == 0
        with pytest.raises(RemoteUnavailable):
            eng.tiers.tier("remote").store.exists([b"k"])
        from kvtier_tools.dev.localservers import mooncake_binary

        master = subprocess.Popen(
            [
                mooncake_binary("mooncake_master"),
                f"--rpc_port={port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={free_port()}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 40  # the background retry backs off up to 30 s
            while eng.tiers.tier("remote").store._client is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert eng.tiers.tier("remote").store._client is not None
            assert eng.tiers.tier("remote").store.exists([b"k"]) == [False]
        finally:
            master.kill()
            master.wait()
    finally:
        eng.close()


def test_a_master_killed_while_serving_means_misses_within_the_timeout():
    with mooncake_store(segments=1, segment_mb=64) as srv:
        eng, layers = engine(srv, timeout=5.0)
        try:
            src, dst = torch.arange(0, 160), torch.arange(300, 460)
            assert eng.store(TOKENS, src) == 160 and eng.flush(timeout=30)
            srv.kill()
            t0 = time.monotonic()
            assert eng.lookup(TOKENS) == 0  # RPC_FAIL: a fault, then the back-off
            assert not eng.retrieve(TOKENS, dst).any()
            assert time.monotonic() - t0 < 10
            assert eng.tiers.tier("remote").stats.faults >= 1
        finally:
            eng.close()
