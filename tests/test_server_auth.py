"""kvtier server access and bounds, against the real process: tokens (HMAC
handshake), tenants, TLS, and the per-connection bounds."""

from __future__ import annotations

import os
import time

import pytest
import torch
from rawwire import Raw

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError, RemoteAuthFailed, RemoteRefused, RemoteUnavailable
from kvtier.keys import KVFormat
from kvtier.remote import open_store
from kvtier.server import protocol as p
from kvtier.server.client import KVClient
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import kvtier_server, self_signed_cert

MiB = 1 << 20
TOKEN = "operator-token-0123456789"
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"


@pytest.fixture(scope="module")
def tenants_srv(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(f"alice: {ALICE}\nbob: {BOB}\n")
    path.chmod(0o600)
    with kvtier_server(0.0625, "--auth-token", TOKEN, "--tenants", str(path)) as s:
        yield s


def metrics(srv, token: str | None = TOKEN) -> dict[str, float]:
    return srv.metrics(token)


def client(srv, token: str | None, **kw) -> KVClient:
    return KVClient("127.0.0.1", srv.ports[0], timeout=5, token=token, **kw)


# -- tokens --------------------------------------------------------------------------


ONE_KEY = p.encode_keys([b"k"])
REQUESTS = {  # every op but HELLO and AUTH, each with well-formed meta
    p.Op.PUT: (p.encode_keys([b"k"], [3]), b"abc"),
    p.Op.GET: (ONE_KEY, b""),
    p.Op.EXISTS: (ONE_KEY, b""),
    p.Op.MATCH_PREFIX: (ONE_KEY, b""),
    p.Op.DELETE: (ONE_KEY, b""),
    p.Op.STATS: (b"", b""),
    p.Op.PUT_ALLOC: (p.encode_keys([b"k"], [3]), b""),
    p.Op.PUT_COMMIT: (p.encode_u32(1), b""),
    p.Op.GET_SHM: (ONE_KEY, b""),
    p.Op.RELEASE: (p.encode_u32(1), b""),
}
assert set(REQUESTS) == set(p.Op) - {p.Op.HELLO, p.Op.AUTH}


@pytest.mark.parametrize("op", list(REQUESTS), ids=lambda op: op.name)
def test_without_authentication_every_op_but_hello_is_refused_and_the_connection_closed(
    tenants_srv, op
):
    before = metrics(tenants_srv)["auth_failures"]
    raw = Raw(tenants_srv.ports[0])
    info = raw.hello(host_id=p.host_id())
    assert info["auth"] == "hmac-sha256" and len(bytes.fromhex(info["challenge"])) == 32
    assert info["shm"] is None  # the pool is offered only after AUTH
    h, meta, _ = raw.call(op, *REQUESTS[op])
    assert h.flags == p.Status.UNAUTHORIZED and b"authenticate first" in meta
    assert raw.closed()
    assert metrics(tenants_srv)["auth_failures"] == before + 1


def test_a_client_without_a_token_or_with_a_wrong_one_is_refused_by_name(tenants_srv):
    with pytest.raises(RemoteAuthFailed, match="wants a token"):
        client(tenants_srv, None).exists([b"k"])
    before = metrics(tenants_srv)["auth_failures"]
    for _ in range(3):
        with pytest.raises(RemoteAuthFailed, match="authentication failed: wrong token"):
            client(tenants_srv, "not-the-token-0123456789").exists([b"k"])
    assert metrics(tenants_srv)["auth_failures"] == before + 3
    # logged once per client host
    assert tenants_srv.log().count("authentication failed: wrong token") == 1
    assert client(tenants_srv, TOKEN).exists([b"k"]) == [False]


def test_a_replayed_handshake_fails(tenants_srv):
    first = Raw(tenants_srv.ports[0])
    challenge = first.hello()["challenge"]
    from kvtier.server.auth import prove

    # what a sniffer saw
    recorded = p.encode_json({"proof": prove(ALICE, bytes.fromhex(challenge)).hex()})
    h, _, _ = first.call(p.Op.AUTH, recorded)
    assert h.flags == p.Status.OK
    again = Raw(tenants_srv.ports[0])
    assert again.hello()["challenge"] != challenge
    h, meta, _ = again.call(p.Op.AUTH, recorded)
    assert h.flags == p.Status.UNAUTHORIZED and b"wrong token" in meta
    assert again.closed()
    late = Raw(tenants_srv.ports[0])  # nor without asking for a challenge first
    h, _, _ = late.call(p.Op.AUTH, recorded)
    assert h.flags == p.Status.UNAUTHORIZED and late.closed()


# -- tenants ---------------------------------------------------------------------------


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_tenants_cannot_see_each_others_keys(tenants_srv, shm):
    alice, bob, op = (client(tenants_srv, t, shm=shm) for t in (ALICE, BOB, TOKEN))
    assert alice.server_info()["tenant"] == "alice" and alice.shm_active == shm
    same = b"prompt-hash-%d" % shm  # both tenants hash the same prompt
    alice.put([same], [b"alice's kv"])
    bob.put([same], [b"bob's kv"])
    assert bytes(alice.get([same])[0]) == b"alice's kv" and bytes(bob.get([same])[0]) == b"bob's kv"
    assert op.get([same]) == [None]  # the operator's tenant ("") is a namespace too
    only_bob = [b"bob-only-%d-%d" % (shm, i) for i in range(3)]
    bob.put(only_bob, [b"x" * 1000] * 3)
    assert alice.get(only_bob) == [None] * 3
    assert alice.get_into(only_bob[:1], [bytearray(1000)]) == [False]
    assert alice.exists(only_bob) == [False] * 3
    assert alice.match_prefix(only_bob) == 0
    assert alice.delete(only_bob) == 0
    assert bob.match_prefix(only_bob) == 3 and bob.exists(only_bob) == [True] * 3
    assert bob.delete([same]) == 1 and bytes(alice.get([same])[0]) == b"alice's kv"


def test_engines_of_two_tenants_hit_only_their_own_chunks(tenants_srv, monkeypatch):
    monkeypatch.setenv("BOB_KV_TOKEN", BOB)
    fmt = KVFormat("m", "flash_attn", "bfloat16")
    url = f"kvtier://127.0.0.1:{tenants_srv.ports[0]}"

    def node(remote_url: str, token: str | None):
        layers = [torch.randn(2, 16, 16, 2, 32).to(torch.bfloat16) for _ in range(2)]
        cfg = KvtierConfig(
            chunk_size=16,
            max_local_cpu_size=1 / 1024,
            local_cpu=False,
            remote_url=remote_url,
            remote_auth_token=token,
            blocking_timeout_secs=2,
        )
        return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), fmt)

    tokens = list(range(5000, 5064))
    alice = node(url, ALICE)  # the token from the config key
    bob = node(url + "/?token_env=BOB_KV_TOKEN", None)  # from the environment, named by the URL
    alice2 = node(url, ALICE)
    assert alice.store(tokens, torch.arange(64)) == 64 and alice.flush(timeout=10)
    assert alice2.lookup(tokens) == 64
    assert bob.lookup(tokens) == 0
    assert bob.tiers.tier("remote").stats.faults == 0
    for engine in (alice, bob, alice2):
        engine.close()
    with pytest.raises(ConfigError, match="remote_auth_token"):
        KvtierConfig(remote_url="redis://127.0.0.1:6379", remote_auth_token="x" * 20)
    with pytest.raises(ValueError, match="NO_SUCH_VAR is not set"):
        open_store(url + "/?token_env=NO_SUCH_VAR", 2)


# -- bounds ------------------------------------------------------------------------------


def test_a_client_that_leases_the_whole_pool_and_idles_loses_its_leases_after_the_timeout():
    with kvtier_server(0.0625, "--lease-timeout", "1", "--max-held-per-conn", "1") as srv:
        owner = client(srv, None, shm=False)
        keys = [b"lease-%d" % i for i in range(15)]
        for key in keys:  # 60 of 64 MiB
            owner.put([key], [os.urandom(4 * MiB)])
        hog = Raw(srv.ports[0])
        hog.hello()
        h, _, _ = hog.call(p.Op.GET_SHM, p.encode_keys(keys))  # leases everything, never releases
        assert h.flags == p.Status.OK
        other = client(srv, None, shm=False)
        with pytest.raises(RemoteRefused, match="pool full"):
            other.put([b"new"], [os.urandom(8 * MiB)])  # nothing evictable: all leased
        time.sleep(1.6)
        other.put([b"new"], [os.urandom(8 * MiB)])  # the leases were dropped: evicted, stored
        assert other.exists([b"new"]) == [True]
        # the hog's connection still works
        h, meta, _ = hog.call(p.Op.EXISTS, p.encode_keys([b"new"]))
        assert h.flags == p.Status.OK and meta == b"\x01"
        assert metrics(srv, None)["lease_timeouts"] >= 1
        assert srv.log().count("held past --lease-timeout 1 s was dropped") == 1


def test_a_put_that_stalls_after_its_header_frees_its_reservation_at_the_deadline():
    with kvtier_server(0.0625, "--put-deadline", "1", "--max-held-per-conn", "1") as srv:
        stall = Raw(srv.ports[0])
        stall.hello()
        stall.send(
            p.Op.PUT, p.encode_keys([b"slow"], [48 * MiB]), payload=b"x" * MiB, payload_len=48 * MiB
        )
        other = client(srv, None, shm=False)
        time.sleep(0.2)
        with pytest.raises(RemoteRefused, match="pool full"):
            other.put([b"fast"], [os.urandom(32 * MiB)])  # 48 MiB reserved by the stalled put
        assert stall.closed(within=3)  # closed at the deadline
        other.put([b"fast"], [os.urandom(32 * MiB)])
        assert other.exists([b"fast", b"slow"]) == [True, False]
        assert metrics(srv, None)["put_deadlines"] == 1
        assert "did not arrive within --put-deadline 1 s" in srv.log()


def test_a_shared_memory_put_not_committed_in_time_is_freed():
    with kvtier_server(0.0625, "--put-deadline", "1", "--max-held-per-conn", "1") as srv:
        stall = Raw(srv.ports[0])
        stall.hello(host_id=p.host_id())
        h, _, _ = stall.call(p.Op.PUT_ALLOC, p.encode_keys([b"never"], [48 * MiB]))
        assert h.flags == p.Status.OK
        assert stall.closed(within=3)
        client(srv, None).put([b"fits"], [os.urandom(32 * MiB)])
        assert metrics(srv, None)["put_deadlines"] == 1


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_one_connection_cannot_hold_more_than_its_cap(shm):
    with kvtier_server(0.0625, "--max-held-per-conn", str(10 / 1024)) as srv:  # 10 MiB
        c = client(srv, None, shm=shm)
        keys = [b"cap-%d" % i for i in range(3)]
        for key in keys:
            c.put([key], [os.urandom(4 * MiB)])
        assert all(v is not None for v in c.get(keys[:2]))
        with pytest.raises(RemoteRefused, match="--max-held-per-conn"):
            c.get(keys)  # 12 MiB at once
        with pytest.raises(RemoteRefused, match="--max-held-per-conn"):
            c.put([b"a", b"b", b"c"], [os.urandom(4 * MiB)] * 3)
        assert all(v is not None for v in c.get(keys[1:]))  # the connection stays usable
        assert metrics(srv, None)["over_limit"] == 2


def test_the_connection_cap_and_the_idle_timeout():
    with kvtier_server(0.0625, "--max-connections", "2", "--idle-timeout", "1") as srv:
        a, b = client(srv, None), client(srv, None)
        a.exists([b"k"]), b.exists([b"k"])
        with pytest.raises(RemoteRefused, match="too many connections"):
            client(srv, None).exists([b"k"])
        a.close()
        time.sleep(0.2)
        c = client(srv, None)
        assert c.exists([b"k"]) == [False]  # a's place
        c.close()
        time.sleep(0.2)
        idle = Raw(srv.ports[0])
        idle.hello()
        t0 = time.monotonic()
        assert idle.closed(within=3) and time.monotonic() - t0 < 2
        assert b.exists([b"k"]) == [False]  # b idled past half the timeout: it reconnects by itself
        m = metrics(srv, None)
        assert m["refused_connections"] == 1 and m["idle_closed"] >= 2
        assert srv.log().count("--max-connections 2") == 1


# -- TLS -------------------------------------------------------------------------------------


def test_tls_with_a_token(tmp_path, monkeypatch):
    cert, key = self_signed_cert(tmp_path)
    monkeypatch.setenv("TLS_TEST_TOKEN", TOKEN)
    with kvtier_server(
        0.0625, "--tls-cert", str(cert), "--tls-key", str(key), "--auth-token", TOKEN
    ) as srv:
        port = srv.ports[0]
        store = open_store(
            f"kvtiers://127.0.0.1:{port}/?tls_ca={cert}&token_env=TLS_TEST_TOKEN&shm=0", 5
        )
        assert store.server_info()["transport"] == "tls" and not store.shm_active
        value = os.urandom(3 * MiB + 5)
        store.put([b"tls"], [value])
        assert bytes(store.get([b"tls"])[0]) == value
        out = bytearray(len(value))
        assert store.get_into([b"tls"], [out]) == [True] and out == value
        same = open_store(
            f"kvtier://127.0.0.1:{port}/?tls=1&tls_ca={cert}&token_env=TLS_TEST_TOKEN", 5
        )
        assert same.exists([b"tls"]) == [True]
        with pytest.raises(RemoteUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            open_store(f"kvtiers://127.0.0.1:{port}/?token_env=TLS_TEST_TOKEN", 5).exists([b"tls"])
        with pytest.raises(RemoteUnavailable):  # a plain client gets no answer it can read
            open_store(f"kvtier://127.0.0.1:{port}/?token_env=TLS_TEST_TOKEN", 2).exists([b"tls"])
        store.close(), same.close()


def test_off_loopback_without_a_token_the_server_refuses_to_start():
    from kvtier.server.state import ServerOptions

    with pytest.raises(ValueError, match="the KV port and the management API need a token"):
        ServerOptions(host="0.0.0.0")
    ServerOptions(host="0.0.0.0", auth_token=TOKEN)
