"""P2P sharing between engines (enable_p2p): a chunk one instance stored in CPU RAM is loaded
by another from that instance's PeerServer, found through an index in a real store (`kvtier
server` or redis-server); only addresses are written there. The chunks come as bytes over TCP
or, between instances of one host, copied out of the holder's pool (a memfd the asker maps). A
peer gone, a peer that evicted, a reply cut midway, damaged bytes, a lease that ran out or a
wrong token: misses, never wrong KV."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.fleet.holders import index_key
from kvtier.fleet.peer_reads import NIXL_POOL
from kvtier.fleet.peers import BYTES, DONE, KEY_LEN, LENT, PLACE, POOL, REPLY, REQUEST
from kvtier.framing import recv_exact
from kvtier.keys import KVFormat, wire_key
from kvtier.remote import open_store
from kvtier.server.protocol import host_id
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import kvtier_server, redis_server

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("m", "flash_attn", "bfloat16")
FLEET_TOKEN = "fleet-token-0123456789abcdef"
CHUNK_BYTES = 16 * L * 2 * H * D * 2  # chunk_size tokens of K and V, bf16


def node(
    index: str,
    token: str | None = None,
    cpu_gb: float = 1 / 1024,
    shared: bool = True,
    channel: str = "tcp",
):
    layers = [torch.randn(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    cfg = KvtierConfig(
        save_unfull_chunk=False,
        chunk_size=16,
        max_local_cpu_size=cpu_gb,
        blocking_timeout_secs=2.0,
        enable_p2p=True,
        p2p_port=0,
        p2p_index_url=index,
        remote_auth_token=token,
        p2p_shared_memory=shared,
        transfer_channel=channel,
    )
    return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def announced(engine: CacheEngine, tokens: list[int], n: int, timeout: float = 10) -> None:
    """Wait until the index names `engine` for the first n chunks of `tokens`."""
    assert engine.peers is not None
    keys = [s.key for s in engine.spans(tokens)][:n]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = engine.peers.holders.store.get([index_key(k) for k in keys])
        if all(v is not None and bytes(v) == engine.peers.server.address.encode() for v in got):
            return
        time.sleep(0.02)
    raise AssertionError("the index never named the storing instance")


def name_in_index(index: str, engine: CacheEngine, tokens: list[int], address: str) -> None:
    """The index names `address` for the 6 whole chunks of `tokens`, whoever holds them."""
    store = open_store(index, 2.0)
    keys = [index_key(s.key) for s in engine.spans(tokens)][:6]
    store.delete(keys)
    store.put(keys, [address.encode()] * 6)
    store.close()


@pytest.fixture(scope="module", params=["kvtier", "redis"])
def index(request):
    start = {"kvtier": lambda: kvtier_server(0.0625), "redis": redis_server}[request.param]
    with start() as srv:
        yield srv.url


def tokens_for(case: int) -> list[int]:
    return [1000 + 131 * case + i for i in range(100)]  # 6 whole chunks of 16, then 4


@pytest.mark.parametrize("way", ["tcp", "shared-memory", "nixl"])
def test_a_chunk_stored_by_a_is_loaded_by_b_from_as_cpu_ram(index, way):
    """Bytes over TCP; copied out of a's pool (one host); read by b's NIXL agent from a's pool
    (how an instance on another host reads it with `transfer_channel: nixl`)."""
    tokens = tokens_for({"tcp": 1, "shared-memory": 7, "nixl": 9}[way])
    shared, channel = way == "shared-memory", "nixl" if way == "nixl" else "tcp"
    a, a_kv = node(index, shared=shared, channel=channel)
    b, b_kv = node(index, shared=shared, channel=channel)
    try:
        src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
        assert b.lookup(tokens) == 0
        assert a.store(tokens, src) == 96
        announced(a, tokens, 6)
        assert b.lookup(tokens) == 96
        mask = b.retrieve(tokens, dst)
        assert mask[:96].all() and not mask[96:].any()
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
        assert b.peers.stats.hits == 6
        # Copied out of a's pool or read from it over NIXL: no bytes sent.
        assert (a.peers.server.lent, a.peers.server.served) == ((0, 6) if way == "tcp" else (6, 0))
        assert (b.peers.reader.reads if way == "nixl" else 0) == (6 if way == "nixl" else 0)
        # The index holds addresses only: no value of a chunk's size was ever written there.
        store = open_store(index, 2.0)
        keys = [index_key(s.key) for s in a.spans(tokens)][:6]
        assert all(len(bytes(v)) < 64 for v in store.get(keys))
        store.close()
    finally:
        a.close(), b.close()


def test_a_peer_that_is_gone_or_evicted_gives_a_miss_and_its_entries_go(index):
    tokens = tokens_for(2)
    a, _ = node(index)
    b, b_kv = node(index)
    try:
        src = torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        announced(a, tokens, 6)
        a.tiers.cpu.clear()  # a evicts everything: its entries are withdrawn
        deadline = time.monotonic() + 10
        while b.lookup(tokens) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.lookup(tokens) == 0
        a.store(tokens, src)
        announced(a, tokens, 6)
    finally:
        a.close()  # a is gone; the index still names it
    try:
        assert b.lookup(tokens) == 96  # the index names a
        before = b_kv[0].clone()
        dst = torch.randperm(NB * BS)[:100]
        mask = b.retrieve(tokens, dst)
        assert not mask.any() and torch.equal(b_kv[0], before)
        assert b.peers.stats.faults >= 1
        # a refused the connection: b deleted the entries that named it
        keys = [s.key for s in b.spans(tokens)]
        deadline = time.monotonic() + 10
        while any(b.peers.holders.where(keys)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(b.peers.holders.where(keys))
        time.sleep(1.1)  # past the backoff: the next lookup asks the index again
        assert b.lookup(tokens) == 0
    finally:
        b.close()


class CuttingRelay:
    """A real TCP relay to a peer that forwards the request and `keep` bytes of the reply,
    then shuts both sides: the peer died mid-reply, as far as the asker can tell. Nothing the
    asker sends once the reply has begun (its DONE) reaches the peer."""

    def __init__(self, target: str, keep: int):
        host, _, port = target.rpartition(":")
        self.target, self.keep = (host, int(port)), keep
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            replying = threading.Event()
            pipe = (client, upstream, replying)
            threading.Thread(target=self._pipe, args=pipe, daemon=True).start()
            sent = 0
            while sent < self.keep:
                data = upstream.recv(min(65536, self.keep - sent))
                if not data:
                    break
                replying.set()
                client.sendall(data)
                sent += len(data)
            for side in (client, upstream):  # shut first: it wakes the pipe's recv and sends FIN
                with contextlib.suppress(OSError):  # the other end may have gone already
                    side.shutdown(socket.SHUT_RDWR)
                side.close()

    @staticmethod
    def _pipe(src, dst, replying):
        try:
            while (data := src.recv(65536)) and not replying.is_set():
                dst.sendall(data)
        except OSError:
            pass

    def close(self):
        self.sock.close()


def test_a_reply_cut_midway_is_a_miss_and_the_next_fetch_works_again(index):
    tokens = tokens_for(3)
    a, a_kv = node(index)
    b, b_kv = node(index, shared=False)  # bytes over TCP, which the relay cuts
    relay = CuttingRelay(a.peers.server.address, keep=3 * CHUNK_BYTES)
    try:
        src = torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        announced(a, tokens, 6)
        # The index names the relay for a's chunks: b's fetch is cut in its third chunk.
        name_in_index(index, a, tokens, relay.address)
        dst = torch.randperm(NB * BS)[:100]
        mask = b.retrieve(tokens, dst)
        # what arrived whole and checked may load; nothing after the cut does
        loaded = int(mask.sum())
        assert loaded < 96 and loaded % 16 == 0
        assert torch.equal(kv_at(b_kv, dst[:loaded]), kv_at(a_kv, src[:loaded]))
        assert b.peers.stats.faults == 1
        # The entries named a again: after the back-off the fetch from a works.
        name_in_index(index, a, tokens, a.peers.server.address)
        time.sleep(1.1)
        mask = b.retrieve(tokens, dst)
        assert mask[:96].all()
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
    finally:
        relay.close()
        a.close(), b.close()


def test_a_holder_lets_lent_chunks_go_when_the_lease_runs_out_and_says_nothing_held(index):
    """An asker on this host that does not say DONE within the lease: the holder releases the
    blocks and ends the connection without HELD (the asker then uses none of its copies)."""
    tokens = tokens_for(5)
    a, _ = node(index)
    try:
        a.store(tokens, torch.randperm(NB * BS)[:100])
        a.peers.server._lease_s = 0.3
        keys = [s.key for s in a.spans(tokens)][:6]
        host, _, port = a.peers.server.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=5)
        me = host_id().encode()
        wires = [wire_key(k) for k in keys]
        parts = [REQUEST.pack(0, len(me), len(wires), BYTES), me]
        parts += [KEY_LEN.pack(len(w)) + w for w in wires]
        sock.sendall(b"".join(parts))
        status, count = REPLY.unpack(recv_exact(sock, REPLY.size))
        assert (status, count) == (LENT, 6)
        recv_exact(sock, POOL.size + 6 * PLACE.size)
        blocks = [a.tiers.cpu.get(k) for k in keys]  # a's chunks, retained here to look
        assert all(c.block.ref_count == 3 for c in blocks)  # the tier, the lease, this look
        time.sleep(0.6)
        assert all(c.block.ref_count == 2 for c in blocks)  # the lease let them go
        sock.sendall(DONE)
        assert sock.recv(1) == b""  # closed, no HELD
        sock.close()
        for c in blocks:
            c.block.release()
    finally:
        a.close()


@pytest.mark.parametrize("way", ["shared-memory", "nixl"])
def test_an_asker_that_hears_no_held_uses_none_of_its_copies(index, way, caplog):
    tokens = tokens_for({"shared-memory": 8, "nixl": 10}[way])
    shared, channel = way == "shared-memory", "nixl" if way == "nixl" else "tcp"
    a, a_kv = node(index, shared=shared, channel=channel)
    b, b_kv = node(index, shared=shared, channel=channel)
    pool = POOL.size if shared else len(a.peers.server.nixl.header())
    lent_reply = REPLY.size + pool + 6 * PLACE.size
    relay = CuttingRelay(a.peers.server.address, keep=lent_reply)  # then closes: no HELD
    try:
        src = torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        announced(a, tokens, 6)
        name_in_index(index, a, tokens, relay.address)
        before = b_kv[0].clone()
        dst = torch.randperm(NB * BS)[:100]
        mask = b.retrieve(tokens, dst)
        assert not mask.any() and torch.equal(b_kv[0], before)
        # b copied the chunks, then heard no HELD; or its NIXL read stalled: a's agent is
        # driven only while a lease is open, and a's lease ended when the relay cut
        if shared:
            assert "chunks are copied out of its pool" in caplog.text
        else:
            assert "NIXL read not done" in caplog.text and b.peers.reader.reads == 0
        assert b.peers.stats.faults == 1 and a.peers.server.lent == 0
    finally:
        relay.close()
        a.close(), b.close()


def test_a_pool_that_is_not_the_one_named_is_not_read_and_bytes_come_instead(index):
    """The holder names a file that, opened here, is another (another PID namespace, or its
    process gone and the number reused): the asker copies nothing from it and asks for bytes."""
    tokens = tokens_for(6)
    a, a_kv = node(index)
    b, b_kv = node(index)
    try:
        arena = a.peers.server._arena
        a.peers.server._arena = dataclasses.replace(arena, ino=arena.ino + 1)
        src = torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        announced(a, tokens, 6)
        dst = torch.randperm(NB * BS)[:100]
        mask = b.retrieve(tokens, dst)
        assert mask[:96].all()
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
        assert a.peers.server.served == 6  # after a lease that b left unread
        (client,) = b.peers._clients.values()
        assert client.copied == 0
    finally:
        a.close(), b.close()


def test_a_nixl_read_that_fails_gives_bytes_instead_and_from_then_on(index, caplog):
    """The holder names pool addresses its agent has not registered (as a holder whose agent
    lost its registration would): b's NIXL read fails by name, b ends the lease in order and
    asks for the same chunks as bytes, on the same connection, and for bytes from then on."""
    tokens = tokens_for(11)
    a, a_kv = node(index, shared=False, channel="nixl")
    b, b_kv = node(index, shared=False, channel="nixl")
    try:
        lender = a.peers.server.nixl
        base, meta_len = NIXL_POOL.unpack_from(lender.header())
        lender._header = NIXL_POOL.pack(base + 2**40, meta_len) + lender.header()[NIXL_POOL.size :]
        src = torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        announced(a, tokens, 6)
        dst = torch.randperm(NB * BS)[:100]
        mask = b.retrieve(tokens, dst)
        assert mask[:96].all()
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
        assert "NIXL read failed" in caplog.text and b.peers.reader.reads == 0
        assert (a.peers.server.lent, a.peers.server.served) == (6, 6)  # a lease left unread
        assert b.peers.stats.faults == 0
        (client,) = b.peers._clients.values()
        assert client._reader is None  # bytes from then on
    finally:
        a.close(), b.close()


def test_a_wrong_token_is_refused_and_gives_misses():
    with kvtier_server(0.0625, "--auth-token", FLEET_TOKEN) as srv:
        tokens = tokens_for(4)
        a, _ = node(srv.url, token=FLEET_TOKEN)
        b, b_kv = node(srv.url, token=FLEET_TOKEN)
        try:
            a.store(tokens, torch.randperm(NB * BS)[:100])
            announced(a, tokens, 6)
            b.peers._token = "not-the-fleets"
            mask = b.retrieve(tokens, torch.randperm(NB * BS)[:100])
            assert not mask.any() and b.peers.stats.faults == 1
        finally:
            a.close(), b.close()


def test_a_non_loopback_host_without_a_token_is_refused_at_start():
    with kvtier_server(0.0625) as srv:
        layers = [torch.zeros(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
        cfg = KvtierConfig(
            chunk_size=16,
            max_local_cpu_size=1 / 1024,
            enable_p2p=True,
            p2p_host="0.0.0.0",
            p2p_port=0,
            p2p_index_url=srv.url,
        )
        with pytest.raises(Exception, match="remote_auth_token"):
            CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT)
