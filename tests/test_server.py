"""kvtier server: flags, management API, eviction, and faults, against the real process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import psutil
import pytest

from kvtier.errors import RemoteUnavailable, ValueTooLarge
from kvtier.server import protocol as p
from kvtier.server.client import KVClient
from kvtier_tools.dev.localservers import free_port, kvtier_server

MiB = 1 << 20


@pytest.fixture(scope="module")
def srv():
    with kvtier_server(
        0.0625,
        "--dev-name",
        "mlx5_0",
        "--link-type",
        "Ethernet",
        "--hint-gid-index",
        "3",
        "--io-threads",
        "3",
    ) as s:
        yield s


def client(srv, **kw) -> KVClient:
    return KVClient("127.0.0.1", srv.ports[0], timeout=5, **kw)


def http(srv, path: str, method: str = "GET", token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{srv.manage_port}{path}", method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_without_the_rdma_device_it_says_so_once_and_serves_tcp(srv):
    assert srv.log().count("RDMA device mlx5_0 not available; serving TCP") == 1
    info = client(srv).server_info()
    assert info["transport"] == "tcp" and "mlx5_0" in info["rdma"]


def test_management_api(srv):
    c = client(srv)
    c.put([b"m1", b"m2"], [b"x" * 100, b"y"])
    c.get([b"m1", b"nope"])
    assert json.loads(http(srv, "/health")[1])["status"] == "ok"
    status, text = http(srv, "/metrics")
    assert status == 200
    for name in [
        "kvtier_server_keys",
        "kvtier_server_value_bytes",
        "kvtier_server_hits_total",
        "kvtier_server_misses_total",
        "kvtier_server_evictions_total",
        "kvtier_server_bytes_in_total",
        "kvtier_server_bytes_out_total",
        "kvtier_server_connections",
    ]:
        assert f"\n{name} " in text, name
    assert json.loads(http(srv, "/kvmap_len")[1])["len"] >= 2
    assert json.loads(http(srv, "/purge", "POST")[1])["purged"] >= 2
    assert json.loads(http(srv, "/kvmap_len")[1])["len"] == 0
    assert c.get([b"m1"]) == [None]


def test_management_token_is_required_when_set():
    with kvtier_server(0.0625, "--auth-token", "s3cret-0123456789") as s:
        assert http(s, "/health")[0] == 401
        assert http(s, "/health", token="wrong")[0] == 401
        assert http(s, "/health", token="s3cret-0123456789")[0] == 200


def test_a_non_loopback_address_without_a_token_is_refused():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.server",
            "--host",
            "0.0.0.0",
            "--service-port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "KVTIER_SERVER_TOKEN"},
    )
    assert r.returncode == 2 and "--auth-token" in r.stderr


def test_a_full_pool_evicts_oldest_first_down_to_the_low_watermark(srv):
    c = client(srv)
    http(srv, "/purge", "POST")
    keys = [b"evict-%d" % i for i in range(40)]
    for key in keys:  # 40 x 4 MiB into 64 MiB
        c.put([key], [os.urandom(4 * MiB)])
    stats = c.stats()
    assert stats["evictions"] >= 24
    assert stats["used_bytes"] <= 0.95 * stats["capacity_bytes"]
    assert c.exists([keys[0], keys[-1]]) == [False, True]


@pytest.mark.parametrize("size", [(1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 17, 9 << 20])
def test_values_around_the_wakeup_mark_arrive_whole_and_never_stall(srv, size):
    # The server asks the kernel to wake it once per MiB of a PUT's values
    # (SO_RCVLOWAT), never for more than the value still owes; a fresh
    # connection starts with a small receive window.
    value = os.urandom(size)
    for _attempt in range(3):
        c = client(srv, shm=False)
        t0 = time.monotonic()
        c.put([b"mark-%d" % size], [value])
        assert bytes(c.get([b"mark-%d" % size])[0]) == value
        assert time.monotonic() - t0 < 2  # a stalled wakeup waits for a TCP timer (200 ms and up)
        c.close()


def test_a_value_larger_than_the_pool_is_a_clear_error(srv):
    c = client(srv, shm=False)
    with pytest.raises(ValueTooLarge, match="larger than the server's whole pool"):
        c.put([b"huge"], [bytes(65 * MiB)])
    c.put([b"after"], [b"ok"])  # the connection stayed in step
    assert bytes(c.get([b"after"])[0]) == b"ok"
    with pytest.raises(ValueTooLarge):
        client(srv, shm=True).put([b"huge"], [bytes(65 * MiB)])


def _raw(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.ports[0]), timeout=5)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


BAD_INPUT = {
    "random bytes": os.urandom(4096),
    "wrong version": p.FRAMING.head.pack(b"KVTS", 9, p.Op.GET, 0, 1, 4, 0) + b"\0" * 4,
    "absurd meta length": p.FRAMING.pack(p.Op.GET, 0, 1, 0xFFFFFFFF, 0),
    "absurd payload length": p.FRAMING.pack(p.Op.PUT, 0, 1, 4, 1 << 62),
    "key count past meta": p.pack_header(p.Op.GET, 1, 4) + (1000).to_bytes(4, "little"),
    "sizes not matching payload": p.pack_header(
        p.Op.PUT, 1, len(m := p.encode_keys([b"k"], [10])), 5
    )
    + m,
}
REASONS = {
    "random bytes": "bad magic",
    "wrong version": "unsupported protocol version 9",
    "absurd meta length": "meta length",
    "absurd payload length": "payload length",
    "key count past meta": "meta truncated",
    "sizes not matching payload": "sizes add up",
}


@pytest.mark.parametrize("what", list(BAD_INPUT))
def test_bad_input_closes_that_connection_with_a_reason_and_others_go_on(srv, what):
    good = client(srv)
    good.put([b"survivor"], [b"alive"])
    server = psutil.Process(srv.procs[0].pid)
    rss0 = server.memory_info().rss
    for _ in range(20):
        with _raw(srv) as bad:
            bad.sendall(BAD_INPUT[what])
            assert _closed_by_server(bad)
    assert server.memory_info().rss < rss0 + 16 * MiB
    assert bytes(good.get([b"survivor"])[0]) == b"alive"
    assert REASONS[what] in srv.log()


def test_truncated_frames_are_dropped_with_the_connection(srv):
    good = client(srv)
    frame = p.pack_header(p.Op.PUT, 7, len(m := p.encode_keys([b"trunc"], [MiB])), MiB) + m
    for cut in (3, p.HEADER_SIZE, len(frame), len(frame) + MiB // 2):
        with _raw(srv) as bad:
            bad.sendall((frame + os.urandom(MiB))[:cut])
        time.sleep(0.05)
    assert good.exists([b"trunc"]) == [False]
    assert good.stats()["connections"] == 1


def test_a_client_killed_mid_put_leaves_nothing_visible(srv):
    good = client(srv)
    used0 = good.stats()["used_bytes"]
    script = textwrap.dedent(f"""
        import socket, sys, time
        from kvtier.server import protocol as p
        s = socket.create_connection(("127.0.0.1", {srv.ports[0]}))
        meta = p.encode_keys([b"half"], [{8 * MiB}])
        s.sendall(p.pack_header(p.Op.PUT, 1, len(meta), {8 * MiB}) + meta + bytes({4 * MiB}))
        print("sent", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "sent"
    time.sleep(0.2)
    assert good.exists([b"half"]) == [False]  # half a value is never visible
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while good.stats()["used_bytes"] != used0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert good.stats()["used_bytes"] == used0  # and its pages went back to the pool
    assert good.exists([b"half"]) == [False]


def test_a_killed_server_is_remote_unavailable_and_the_client_reconnects_after_restart():
    with kvtier_server(0.0625) as s:
        c = KVClient("127.0.0.1", s.ports[0], timeout=2)
        c.put([b"k"], [b"v"])
        s.kill()
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            c.get([b"k"])
        assert time.monotonic() - t0 < 2.5
        s.start()
        assert c.get([b"k"]) == [None]  # a new, empty server
        c.put([b"k"], [b"v2"])
        assert bytes(c.get([b"k"])[0]) == b"v2"


def test_a_server_that_stops_answering_is_remote_unavailable_within_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        c = KVClient("127.0.0.1", silent.getsockname()[1], timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable, match="no progress within 0.5 s"):
            c.exists([b"k"])
        assert time.monotonic() - t0 < 2


def test_many_clients_at_once_share_a_fixed_set_of_loops_and_always_read_whole_values(srv):
    # 16 clients over 3 loops, 80 MiB of puts into a 64 MiB pool: values are
    # evicted on one loop while another reads them; a read is the value or a miss.
    import threading

    errors = []

    clients = [client(srv, shm=i % 2 == 0) for i in range(16)]
    for c in clients:
        c.server_info()  # all 16 connected before any works: the loops share them out evenly
    # the 16 and this one, on the loop serving the fewest
    spread = client(srv).stats()["loop_connections"]
    # every loop serves some
    assert len(spread) == 3 and min(spread) >= 5 and sum(spread) >= 17, spread

    def work(i: int) -> None:
        try:
            c = clients[i]
            for j in range(20):
                value = os.urandom(256 * 1024 + i)
                c.put([b"c%d-%d" % (i, j)], [value])
                got = c.get([b"c%d-%d" % (i, j)])[0]
                assert got is None or bytes(got) == value  # None only if evicted meanwhile
        except Exception as e:  # collected and reported by the test thread
            errors.append(e)

    server = psutil.Process(srv.procs[0].pid)
    before = {t.id for t in server.threads()}
    evictions = client(srv).stats()["evictions"]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert {t.id for t in server.threads()} == before  # no thread per client
    assert client(srv).stats()["evictions"] > evictions


def test_the_server_benchmark_runs_every_target_and_reports_its_ratios():
    # `kvtier bench server` at the smallest size: the figures are noise here,
    # the shape of the result (every target, both ratio forms) is checked.
    from kvtier_tools.bench.server import ServerBenchConfig, run_server_bench

    result = run_server_bench(
        ServerBenchConfig(sizes_mib=(1,), conns=(2,), duration=0.1, repeats=2, latency_iters=20),
        progress=lambda line: None,
    )
    cells = {(c["op"], c["conns"]): c for c in result["throughput"]}
    assert cells.keys() == {("put", 2), ("get", 2)}
    for cell in cells.values():
        for target in (
            "raw",
            "raw-ring",
            "kvtier",
            "kvtier-shm",
            "kvtier-auth",
            "kvtier-tls",
            "redis",
            "redis-unix",
        ):
            assert cell[f"{target}_GBps"] > 0 and len(cell[f"{target}_runs"]) == 2
        for ratio in (
            "tcp_vs_raw",
            "tcp_vs_raw_ring",
            "tcp_vs_redis",
            "same_host_vs_redis",
            "auth_vs_plain",
            "tls_vs_plain",
        ):
            assert cell[ratio] > 0 and cell[ratio + "_paired"] > 0
    for op in ("exists", "match_prefix"):
        assert (
            0
            < result["latency"][f"kvtier_{op}_ms"]["p50"]
            <= result["latency"][f"kvtier_{op}_ms"]["p99"]
        )
    assert result["shm"]["put_batch8_vs_memcpy_cold"] > 0
    assert 0 < result["serde"]["lz4"]["ratio"] < 1


def test_a_large_tcp_get_is_spread_over_several_connections_and_lands_in_order(monkeypatch):
    import kvtier.server.client as client_mod

    monkeypatch.setattr(client_mod, "READER_BYTES", 64 << 10)  # 64 KiB per extra connection
    with kvtier_server(0.0625, "--max-connections", "3") as srv:
        c = KVClient("127.0.0.1", srv.ports[0], timeout=5, shm=False)
        keys = [f"k{i}".encode() for i in range(16)]
        values = [os.urandom(48 << 10) for _ in keys]
        c.put(keys, values)
        outs = [bytearray(48 << 10) for _ in keys]
        asked = keys[:5] + [b"missing"] + keys[5:]
        outs.insert(5, bytearray(48 << 10))
        got = c.get_into(asked, outs)
        # The cap is 3 connections: this one and two readers (the third is refused, logged, not
        # fatal).
        assert len(c._readers) == 2
        assert got == [True] * 5 + [False] + [True] * 11
        assert [bytes(o) for i, o in enumerate(outs) if i != 5] == values
        assert not any(outs[5])
        c.close()
        assert c._readers is None


def test_a_request_on_a_kept_connection_to_a_restarted_server_is_sent_again_on_a_new_one():
    """The server restarts between two calls, well within its idle timeout: the client's kept
    connection is dead, and its next call answers from the new server, not with a miss. A
    call that fails on a new connection is not sent again (the server is down)."""
    with kvtier_server(0.0625, "--idle-timeout", "600") as s:
        c = KVClient("127.0.0.1", s.ports[0], timeout=2, shm=False)
        c.put([b"k"], [b"v" * 100])
        assert c.exists([b"k"]) == [True]
        s.kill()
        s.start()
        assert c.exists([b"k"]) == [False]  # the new, empty server answered the same call
        assert c.exists([b"k"]) == [False]
        s.kill()
        with pytest.raises(RemoteUnavailable):
            c.exists([b"k"])  # the kept connection is dead, and so is the server
        with pytest.raises(RemoteUnavailable):
            c.exists([b"k"])  # a new connection, refused: no second try
        s.start()
        c.close()


@pytest.mark.parametrize("shm", [False, True])
def test_a_put_get_or_lease_on_a_kept_connection_to_a_restarted_server_goes_on_a_new_one(shm):
    """As a request without payload: a put, a get (into fresh buffers or the caller's) and a
    lease from the shared pool, each the first call after a restart, are answered by the new
    server over TCP or its pool, not failed as a miss; a get into the caller's buffer leaves
    it untouched where the new server has no value."""
    with kvtier_server(0.0625, "--idle-timeout", "600") as s:
        c = KVClient("127.0.0.1", s.ports[0], timeout=2, shm=shm)

        def restart():
            s.kill()
            s.start()

        c.put([b"k"], [b"v" * 100])
        assert c.shm_active == shm
        restart()
        c.put([b"k"], [b"w" * 100])  # the new server took it
        assert bytes(c.get([b"k"])[0]) == b"w" * 100
        restart()
        assert c.get([b"k"]) == [None]  # the new, empty server answered
        c.put([b"k"], [b"x" * 100])
        restart()
        dest = bytearray(100)
        assert c.get_into([b"k"], [dest]) == [False] and dest == bytearray(100)
        c.put([b"k"], [b"y" * 100])
        restart()
        lease = c.borrow([b"k"])
        assert (lease is not None) == shm
        if lease is not None:
            assert lease.leading == 0  # asked of the new server, which has nothing yet
            lease.release()
        c.close()


def test_the_pool_stays_mapped_across_an_idled_out_connection_and_is_mapped_anew_for_a_new_server():
    """Mapping the pool and registering it with CUDA takes seconds at tens of GB: a
    connection replaced because it idled must not do it again; a restarted server's
    pool is another memfd and must be mapped anew (never the dead one's memory)."""
    with kvtier_server(0.0625, "--idle-timeout", "1") as s:
        c = KVClient("127.0.0.1", s.ports[0], timeout=2)
        mapped, unmapped = [], []
        c.on_map = lambda m: mapped.append(m) is None
        c.on_unmap = unmapped.append
        value = os.urandom(MiB)
        c.put([b"k"], [value])
        assert c.shm_active and len(mapped) == 1
        # past the server's idle timeout: it closed the connection, the next call takes a new one
        time.sleep(1.5)
        lease = c.borrow([b"k"])
        assert lease is not None and lease.leading == 1
        offset, size = lease.places[0]
        assert bytes(lease.pool[offset : offset + size]) == value
        lease.release()
        assert len(mapped) == 1 and not unmapped
        assert s.metrics()["idle_closed"] == 1
        s.kill()
        s.start()
        assert c.exists([b"k"]) == [False]  # a new, empty server (the connection idled: replaced)
        # its pool is another memfd: the old one let go
        assert len(unmapped) == 1 and len(mapped) == 2
        c.put([b"k"], [value[::-1]])
        assert bytes(c.get([b"k"])[0]) == value[::-1]
        assert len(mapped) == 2 and mapped[1] is not mapped[0]
        c.close()
        assert len(unmapped) == 2
