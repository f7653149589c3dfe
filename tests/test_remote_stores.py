"""The remote-store contract suite: one set of behaviours, every remote store (KVStore).

Runs against real servers on free loopback ports: kvtier server (over TCP
and over the same-host shared-memory path), redis-server, a 3-master Redis
Cluster, a directory (fs://), and Mooncake Store (mooncake_master and two
mooncake_client processes holding the segments).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier.errors import RemoteUnavailable
from kvtier.remote import open_store
from kvtier.remote.mooncake import MooncakeStore
from kvtier.remote.redis import RedisStore
from kvtier.server.client import KVClient
from kvtier_tools.dev.localservers import refusing_ports


@pytest.fixture(params=["kvtier-tcp", "kvtier-shm", "redis", "redis-cluster", "fs", "mooncake"])
def store(request, tmp_path):
    """(store, size of a value it must refuse as too large, or None)."""
    kind = request.param
    if kind.startswith("kvtier"):
        srv = request.getfixturevalue("kvserver")
        st = KVClient("127.0.0.1", srv.ports[0], timeout=5, shm=kind == "kvtier-shm")
        assert st.shm_active == (kind == "kvtier-shm")
        too_large = (64 << 20) + 1
    elif kind == "redis":
        st = open_store(request.getfixturevalue("redis_srv").url, 5)
        st.max_value, too_large = 16 << 20, (16 << 20) + 1
    elif kind == "redis-cluster":
        st = open_store(request.getfixturevalue("redis_cluster_srv").url, 5)
        st.max_value, too_large = 16 << 20, (16 << 20) + 1
    elif kind == "mooncake":
        srv = request.getfixturevalue("mooncake_srv")
        # Mooncake answers a value larger than every segment as it answers a full pool
        # (NO_AVAILABLE_HANDLE): RemoteRefused, tests/test_mooncake.py.
        st, too_large = open_store(srv.url, 5, extra=srv.extra_config), None
    else:
        st, too_large = open_store(f"fs://{tmp_path}/kv", 5), None
    keys = [f"{kind}-{os.getpid()}-{i}".encode() for i in range(64)]
    yield st, keys, too_large
    st.delete(keys)
    st.close()


def test_get_returns_what_put_stored_and_none_for_misses(store):
    st, keys, _ = store
    values = [os.urandom(n) for n in (1, 1000, 3 << 20)]
    st.put(keys[:3], values)
    got = st.get([keys[0], keys[10], keys[1], keys[2]])
    assert got[1] is None
    assert [bytes(g) for g in (got[0], got[2], got[3])] == values


def test_a_value_given_in_parts_is_stored_joined(store):
    st, keys, _ = store
    st.put([keys[0]], [[b"header", memoryview(b"-payload-"), bytearray(b"tail")]])
    assert bytes(st.get([keys[0]])[0]) == b"header-payload-tail"


def test_get_into_fills_destinations_of_the_exact_size_only(store):
    st, keys, _ = store
    big, small = os.urandom((2 << 20) + 5), os.urandom(100)
    st.put(keys[:2], [big, small])
    head, body = bytearray(5), bytearray(2 << 20)
    wrong = bytearray(99)
    missing = bytearray(10)
    assert st.get_into([keys[0], keys[1], keys[2]], [[head, memoryview(body)], wrong, missing]) == [
        True,
        False,
        False,
    ]
    assert bytes(head) + bytes(body) == big
    assert st.get_into([keys[1]], [bytearray(100)]) == [True]


def test_put_replaces_and_delete_counts(store):
    st, keys, _ = store
    st.put([keys[0]], [b"old"])
    st.put([keys[0]], [b"new value"])
    # Mooncake keeps a key's first value: kvtier's keys name their content, and the
    # remote tier removes a value that fails its checks (test_remote_tier.py).
    assert bytes(st.get([keys[0]])[0]) == (
        b"old" if isinstance(st, MooncakeStore) else b"new value"
    )
    assert st.delete([keys[0], keys[1]]) == 1
    assert st.get([keys[0]]) == [None]


def test_exists_and_match_prefix(store):
    st, keys, _ = store
    st.put([keys[0], keys[1], keys[3]], [b"a", b"b", b"d"])
    assert st.exists(keys[:5]) == [True, True, False, True, False]
    assert st.match_prefix(keys[:5]) == 2
    assert st.match_prefix(keys[2:4]) == 0
    assert st.match_prefix([]) == 0
    assert st.match_prefix([keys[0], keys[0], keys[1]]) == 3
    st.put(keys[:64], [b"x"] * 64)
    assert st.match_prefix(keys) == 64


def test_large_values_survive_intact(store):
    st, keys, _ = store
    values = [os.urandom(8 << 20), os.urandom((4 << 20) + 17)]
    st.put(keys[:2], values)
    assert [bytes(v) for v in st.get(keys[:2])] == values


def test_a_value_too_large_is_a_value_error_and_the_store_still_works(store):
    st, keys, too_large = store
    if too_large is None:
        pytest.skip("a directory has no size limit of its own")
    with pytest.raises(ValueError, match="larger|limit"):
        st.put([keys[0]], [bytes(too_large)])
    st.put([keys[1]], [b"fine"])
    assert bytes(st.get([keys[1]])[0]) == b"fine"


@pytest.mark.parametrize(
    "url",
    [
        "kvtier://127.0.0.1:{port}",
        "redis://127.0.0.1:{port}",
        "redis-cluster://127.0.0.1:{port}",
        "mooncakestore://127.0.0.1:{port}",
    ],
)
def test_an_unreachable_store_is_remote_unavailable_within_the_timeout(url):
    t0 = time.monotonic()
    opened = []
    with refusing_ports(1) as (down,), pytest.raises(RemoteUnavailable):
        opened.append(open_store(url.format(port=down.getsockname()[1]), 2))
        opened[0].exists([b"k"])
    assert time.monotonic() - t0 < 5
    for st in opened:  # Mooncake's goes on trying in the background until closed
        st.close()


def test_redis_uses_the_copy_free_command_packer(redis_srv):
    st = open_store(redis_srv.url, 5)
    assert isinstance(st, RedisStore)
    packed = st.client.connection_pool.get_connection().pack_command("SET", b"k", b"v" * 100_000)
    assert any(len(chunk) == 100_000 for chunk in packed)  # the value travels as its own buffer


def test_redis_threads_at_first_use_share_one_client_and_every_call_succeeds(redis_srv):
    """The P2P index's writer and a lookup once made a client each at first use; the one
    dropped closed, as it went, the socket the other's pipeline was reading (EBADF)."""
    st = open_store(redis_srv.url, 5)
    assert isinstance(st, RedisStore)
    made = []
    connect = st.connect

    def slow_connect():  # a cluster client contacts its nodes when made: the window is wide
        time.sleep(0.05)
        made.append(connect())
        return made[-1]

    st.connect = slow_connect
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def first_use(i: int) -> None:
        start.wait()
        try:
            st.put([f"k{i}".encode()], [b"v" * 1000])
            assert st.get([f"k{i}".encode()]) == [b"v" * 1000]
        except BaseException as exc:  # noqa: BLE001 - each thread's failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(made) == 1
    st.close()
