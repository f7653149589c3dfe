"""The remote tier through the CacheEngine: two engines (two "nodes") sharing one store."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.codec import HEADER, Codec
from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import CorruptPayload
from kvtier.keys import KVFormat, wire_key
from kvtier.remote import open_store
from kvtier.transfer import PagedKV
from kvtier.transfer.staging import runs as _runs
from kvtier_tools.dev.localservers import (
    kvtier_server,
    mooncake_store,
    redis_cluster,
    redis_server,
    refusing_ports,
)

L, NB, BS, H, D = 2, 64, 16, 2, 32
FMT = KVFormat("m", "flash_attn", "bfloat16")
TOKENS = list(range(1000, 1100))  # 6 whole chunks of 16, then 4 tokens
JOIN: dict[str, dict] = {}  # url -> the extra_config a client of that local store needs


def node(url: str, serde: str = "naive", local_cpu: bool = True, timeout: float = 2.0):
    layers = [torch.randn(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    cfg = KvtierConfig(
        save_unfull_chunk=False,
        chunk_size=16,
        max_local_cpu_size=1 / 1024,
        remote_url=url,
        remote_serde=serde,
        local_cpu=local_cpu,
        blocking_timeout_secs=timeout,
        extra_config=JOIN.get(url, {}),
    )
    return CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT), layers


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


def stored_by_one_lent_to_another(url: str, tokens: list[int]):
    """(engine, KV, slots) of a node that stored `tokens` in the server at `url`,
    and of one on the same host with its CPU tier off (chunks lent in place)."""
    a, a_kv = node(url)
    b, b_kv = node(url, local_cpu=False)
    src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
    a.store(tokens, src)
    a.flush(timeout=10)
    return (a, a_kv, src), (b, b_kv, dst)


@pytest.fixture(scope="module", params=["kvtier", "redis", "redis-cluster", "fs", "mooncake"])
def url(request, tmp_path_factory):
    if request.param == "fs":
        yield f"fs://{tmp_path_factory.mktemp('shared')}"
        return
    start = {
        "kvtier": lambda: kvtier_server(0.0625),
        "redis": redis_server,
        "redis-cluster": lambda: redis_cluster(3),
        "mooncake": lambda: mooncake_store(2, 64),
    }[request.param]
    with start() as srv:
        JOIN[srv.url] = srv.extra_config
        yield srv.url


@pytest.mark.parametrize("serde, local_cpu", [("naive", True), ("lz4", True), ("naive", False)])
def test_a_prefix_stored_by_one_node_loads_on_another(url, serde, local_cpu):
    # keys of their own per case
    tokens = [t + 7 * (serde == "lz4") + 3 * (not local_cpu) for t in TOKENS]
    a, a_kv = node(url, serde, local_cpu)
    b, b_kv = node(url, serde, local_cpu)
    src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
    assert b.lookup(tokens) == 0
    assert a.store(tokens, src) == 96
    assert a.flush(timeout=10)
    assert b.lookup(tokens) == 96
    mask = b.retrieve(tokens, dst)
    assert mask[:96].all() and not mask[96:].any()
    assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
    a.close(), b.close()


def test_a_corrupt_disk_chunk_is_read_from_the_remote_store_instead(url, tmp_path):
    """A chunk on both the disk tier and the remote store whose file turns out damaged is
    loaded from the store: the hit is whole, not cut at that chunk (and recomputed)."""
    from kvtier.tiers.disk import file_name

    tokens = [t + 13 for t in TOKENS]
    layers = [torch.randn(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    cfg = KvtierConfig(
        save_unfull_chunk=False,
        chunk_size=16,
        max_local_cpu_size=1 / 1024,
        remote_url=url,
        local_cpu=False,
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=0.01,
        blocking_timeout_secs=2.0,
        extra_config=JOIN.get(url, {}),
    )
    e = CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT)
    perm = torch.randperm(NB * BS)
    src, dst = perm[:100], perm[100:200]  # one engine: its loads land beside what it stored
    want = kv_at(layers, src[:96]).clone()
    assert e.store(tokens, src) == 96 and e.flush(timeout=10)
    key = e.spans(tokens)[2].key
    assert e.tiers.tier("disk").exists([key]) == [True]
    assert e.tiers.tier("remote").exists([key]) == [True]
    path = tmp_path / "disk" / file_name(key)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    mask = e.retrieve(tokens, dst)
    assert mask[:96].all() and not mask[96:].any()
    assert torch.equal(kv_at(layers, dst[:96]), want)
    assert e.tiers.tier("disk").stats.corrupt == 1 and e.tiers.tier("disk").exists([key]) == [False]
    e.close()


def test_a_corrupt_remote_chunk_is_a_miss_not_wrong_kv(url):
    tokens = [t + 11 for t in TOKENS]
    a, a_kv = node(url)
    b, b_kv = node(url)
    src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
    a.store(tokens, src)
    a.flush(timeout=10)
    key = wire_key(b.spans(tokens)[2].key)  # the third chunk: flip one payload byte
    store = open_store(url, 5, extra=JOIN.get(url))
    value = bytearray(store.get([key])[0])
    value[-1] ^= 0x40
    store.delete([key])  # Mooncake keeps a key's first value
    store.put([key], [bytes(value)])
    before = kv_at(b_kv, dst[32:]).clone()
    mask = b.retrieve(tokens, dst)
    assert mask[:32].all() and not mask[32:].any()  # loading stops at the bad chunk
    assert torch.equal(kv_at(b_kv, dst[32:]), before)
    assert torch.equal(kv_at(b_kv, dst[:32]), kv_at(a_kv, src[:32]))
    assert b.tiers.tier("remote").stats.corrupt == 1
    assert store.exists([key]) == [False]  # removed, so that the next store of it lands
    a.close(), b.close(), store.close()


def test_same_host_chunks_are_read_in_place_and_a_bad_one_is_not_loaded():
    # CPU tier off, kvtier server on this host: chunks go from the server's pool
    # straight into the KV (lent, no staging block); checksums are checked meanwhile.
    with kvtier_server(0.0625) as srv:
        tokens = [t + 13 for t in TOKENS]
        (a, a_kv, src), (b, b_kv, dst) = stored_by_one_lent_to_another(srv.url, tokens)
        mask = b.retrieve(tokens, dst)
        assert mask[:96].all() and not mask[96:].any()
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
        assert b.tiers.tier("remote").stats.lent == 6
        assert b.pool.free_blocks == b.pool.num_blocks  # no block was needed
        key = wire_key(b.spans(tokens)[3].key)  # the fourth chunk: flip one payload byte
        store = open_store(srv.url, 5)
        value = bytearray(store.get([key])[0])
        value[-1] ^= 0x40
        store.put([key], [bytes(value)])
        mask = b.retrieve(tokens, dst)
        assert mask[:48].all() and not mask[48:].any()  # loading counts up to the bad chunk only
        assert torch.equal(kv_at(b_kv, dst[:48]), kv_at(a_kv, src[:48]))
        assert b.lookup(tokens) == 96  # it is still there; a load just does not trust it
        # a bad header on the first chunk: not lent, read by copy
        first = wire_key(b.spans(tokens)[0].key)
        value = bytearray(store.get([first])[0])
        value[0] ^= 0xFF  # the codec's magic
        store.put([first], [bytes(value)])
        lent, corrupt = b.tiers.tier("remote").stats.lent, b.tiers.tier("remote").stats.corrupt
        assert not b.retrieve(tokens, dst).any()
        # the copying path read the batch: chunk 0 (bad header) and chunk 3 (bad payload), each
        # counted once
        stats = b.tiers.tier("remote").stats
        assert stats.lent == lent and stats.corrupt == corrupt + 2
        a.close(), b.close(), store.close()


def test_layerwise_loads_lent_chunks_in_one_lease_and_a_bad_one_cuts_the_mask_at_finish():
    # Layer by layer from the store server of this host: every chunk lent in one
    # lease; their checksums run while the layers move, and finish() says what holds.
    with kvtier_server(0.0625) as srv:
        tokens = [t + 23 for t in TOKENS]
        (a, a_kv, src), (b, b_kv, dst) = stored_by_one_lent_to_another(srv.url, tokens)
        lent = b.tiers.lend_whole(b.spans(tokens)[:6])
        views = [c.block.view(torch.bfloat16, b.kv.chunk_shape(s.num_tokens)) for s, c in lent]
        # slices of one tensor over the pool: chunks stored one after another make one strided run
        pitch = views[1].data_ptr() - views[0].data_ptr()
        assert _runs(views, range(6), [v.numel() * 2 for v in views]) == [(0, 6, pitch)]
        for _, c in lent:
            c.block.release()
        load = b.start_retrieve(tokens, dst, layerwise=True)
        assert load.num_tokens == 96 and b.tiers.tier("remote").stats.lent == 12
        for layer in range(L):
            load.wait(layer)
        assert load.finish()[:96].all()
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
        assert b.stats.loaded_by_tier == {"remote": 96}
        key = wire_key(b.spans(tokens)[3].key)  # the fourth chunk: flip one payload byte
        store = open_store(srv.url, 5)
        value = bytearray(store.get([key])[0])
        value[-1] ^= 0x40
        store.put([key], [bytes(value)])
        load = b.start_retrieve(tokens, dst, layerwise=True)
        assert load.num_tokens == 96 and not load.settled  # promised before the layers move ...
        mask = load.finish()  # ... and cut at the bad chunk once its checksum is known
        assert mask[:48].all() and not mask[48:].any()
        assert b.stats.loaded_by_tier == {"remote": 96 + 48}
        store.delete([key])  # gone: the lease says so, and the three chunks before it are lent
        spans, lent = b.spans(tokens)[:6], b.tiers.tier("remote").stats.lent
        got = b.tiers.lend_whole(spans)
        assert [s for s, _ in got] == spans[:3] and b.tiers.tier("remote").stats.lent == lent + 3
        for _, chunk in got:
            chunk.block.release()
        load = b.start_retrieve(tokens, dst, layerwise=True)
        assert load.num_tokens == 48 and load.finish()[:48].all() and not load.mask[48:].any()
        a.close(), b.close(), store.close()


def test_a_layerwise_load_whose_lease_has_a_chunk_split_over_pages_loads_by_copy():
    # Pages of 4 KiB, chunks of 8 KiB + header (3 pages each). The server holds chunks
    # 0-3 (4 is deleted), chunk 3 rewritten onto pages that are not neighbours: a
    # lease lends it only as a split value, so the layerwise load does not take a
    # shorter prefix than the server holds: it copies all four, batch by batch.
    with kvtier_server(0.0625, "--page-size-kb", "4") as srv:
        tokens = [t + 31 for t in TOKENS]
        (a, a_kv, src), (b, b_kv, dst) = stored_by_one_lent_to_another(srv.url, tokens)
        store = open_store(srv.url, 5)
        keys = [wire_key(s.key) for s in b.spans(tokens)[:6]]
        store.put([b"barrier"], [b"x"])  # the lowest never-used page: not next to any chunk's
        store.delete([keys[4]])  # its three pages go back on the free stack
        store.put([b"filler"], [b"y"])  # takes the first of them
        store.put([keys[3]], store.get([keys[3]]))  # two of chunk 4's old pages and a far one
        lease = b.tiers.tier("remote").store.borrow(keys)
        assert lease.leading == 4 and None not in lease.places[:3] and lease.places[3] is None
        lease.release()
        assert b.tiers.lend_whole(b.spans(tokens)[:6]) == []
        load = b.start_retrieve(tokens, dst, layerwise=True)
        assert load._handle is None and load.num_tokens == 64  # loaded by copy before it returned
        assert load.finish()[:64].all() and not load.mask[64:].any()
        assert torch.equal(kv_at(b_kv, dst[:64]), kv_at(a_kv, src[:64]))
        a.close(), b.close(), store.close()


def test_a_layerwise_load_larger_than_one_lease_may_hold_loads_whole():
    # 6 chunks of 8 KiB, a server that lets a connection hold 52 KiB (a put of all
    # six fits): not lent whole (over 90% of that), so loaded in batches of a quarter
    # of it, lent, all before start_retrieve returns.
    with kvtier_server(0.0625, "--max-held-per-conn", str(52 / 2**20)) as srv:
        tokens = [t + 29 for t in TOKENS]
        (a, a_kv, src), (b, b_kv, dst) = stored_by_one_lent_to_another(srv.url, tokens)
        load = b.start_retrieve(tokens, dst, layerwise=True)
        # loaded already: no layer to wait for
        assert load._handle is None and load.num_tokens == 96
        # each chunk counted once
        assert load.finish()[:96].all() and b.tiers.tier("remote").stats.lent == 6
        assert torch.equal(kv_at(b_kv, dst[:96]), kv_at(a_kv, src[:96]))
        a.close(), b.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_lent_chunks_go_from_the_registered_server_pool_to_the_kv():
    with kvtier_server(0.0625) as srv:
        tokens = [t + 17 for t in TOKENS]
        cfg = dict(
            save_unfull_chunk=False,
            chunk_size=16,
            max_local_cpu_size=1 / 1024,
            remote_url=srv.url,
            blocking_timeout_secs=5,
        )
        layers = [
            [torch.randn(2, NB, BS, H, D, device="cuda").to(torch.bfloat16) for _ in range(L)]
            for _ in "ab"
        ]
        a = CacheEngine(KvtierConfig(**cfg), PagedKV.wrap(layers[0], "flash_attn"), FMT)
        b = CacheEngine(
            KvtierConfig(**cfg, local_cpu=False), PagedKV.wrap(layers[1], "flash_attn"), FMT
        )
        src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        a.flush(timeout=10)
        assert b.retrieve(tokens, dst)[:96].all()
        assert torch.equal(kv_at(layers[1], dst[:96].cuda()), kv_at(layers[0], src[:96].cuda()))
        assert b.tiers.tier("remote").stats.lent == 6
        pool = b.tiers.tier("remote").store._ch.link.shm
        assert torch.from_numpy(pool[:16]).is_pinned()  # registered: the copy was a DMA
        layers[1][0].zero_()
        load = b.start_retrieve(tokens, dst, layerwise=True)  # all six in one lease, layer by layer
        assert load._handle is not None and b.tiers.tier("remote").stats.lent == 12
        for layer in range(L):
            load.wait(layer)
        assert load.finish()[:96].all()
        assert torch.equal(kv_at(layers[1], dst[:96].cuda()), kv_at(layers[0], src[:96].cuda()))
        a.close(), b.close()


def test_over_tcp_the_next_batch_is_read_while_this_one_loads_and_nothing_leaks():
    with kvtier_server(0.0625) as srv:
        tokens = [t + 19 for t in TOKENS]
        a, a_kv = node(srv.url)
        layers = [torch.randn(2, NB, BS, H, D).to(torch.bfloat16) for _ in range(L)]
        cfg = KvtierConfig(
            save_unfull_chunk=False,
            chunk_size=16,
            max_local_cpu_size=2.5 * L * 2 * 16 * H * D * 2 / 2**30,  # 2 blocks
            remote_url=srv.url + "/?shm=0",
            local_cpu=False,
            blocking_timeout_secs=5,
        )
        b = CacheEngine(cfg, PagedKV.wrap(layers, "flash_attn"), FMT)
        assert b.pool.num_blocks == 2
        src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
        a.store(tokens, src)
        a.flush(timeout=10)
        threads = []
        next_batch = b.tiers._next_batch
        b.tiers._next_batch = lambda *args: (
            threads.append(threading.current_thread().name) or next_batch(*args)
        )
        # 6 chunks through 2 blocks: batches of 1, the next read ahead
        mask = b.retrieve(tokens, dst)
        assert len(threads) == 6 and sum(t.startswith("kvtier-fetch-ahead") for t in threads) == 5
        assert mask[:96].all() and torch.equal(kv_at(layers, dst[:96]), kv_at(a_kv, src[:96]))
        assert b.pool.free_blocks == 2
        spans = b.spans(tokens)[:6]
        batches = b.tiers.fetch(spans, ["remote"] * 6, ahead=True)
        first = next(batches)  # the second is being read meanwhile
        batches.close()  # given up: the batch read ahead goes back to the pool
        for _, chunk in first:
            chunk.block.release()
        assert b.pool.free_blocks == 2
        a.close(), b.close()


def test_a_dead_remote_store_is_a_fast_miss_and_is_used_again_once_back():
    with kvtier_server(0.0625) as srv:
        a, _ = node(srv.url, timeout=1.0)
        srv.kill()
        t0 = time.monotonic()
        src = torch.randperm(NB * BS)[:100]
        assert a.store(TOKENS, src) == 96  # the CPU tier still works
        a.flush(timeout=10)
        a.tiers.cpu.clear()
        assert a.lookup(TOKENS) == 0
        for _ in range(20):  # during the back-off nothing is even tried
            assert a.lookup(TOKENS) == 0
        assert time.monotonic() - t0 < 3
        stats = a.tiers.tier("remote").stats
        assert stats.faults >= 1 and stats.skipped >= 1
        srv.start()
        deadline = time.monotonic() + 10
        while a.tiers.tier("remote").stats.puts == 0 and time.monotonic() < deadline:
            a.store(TOKENS, src)  # the CPU tier was cleared, so this stores again
            a.flush(timeout=10)
            a.tiers.cpu.clear()
            time.sleep(0.2)
        assert a.lookup(TOKENS) == 96  # reconnected after the back-off, and found remotely
        a.close()


def test_an_unreachable_url_at_start_is_not_fatal():
    with refusing_ports(1) as (down,):
        a, _ = node(f"kvtier://127.0.0.1:{down.getsockname()[1]}", timeout=0.5)
        assert a.lookup(TOKENS) == 0
        a.close()


@pytest.mark.parametrize("serde", ["naive", "lz4"])
def test_codec_roundtrip_and_checks(serde):
    codec = Codec(serde, itemsize=2)
    raw = torch.randn(4096).to(torch.bfloat16).view(torch.uint8).numpy()
    value = b"".join(bytes(x) for x in codec.encode(memoryview(raw), 16))
    n, out = codec.decode(value, len(raw))
    assert n == 16 and bytes(out) == raw.tobytes()
    for bad, why in [
        (value[:-1], "payload of"),
        (value[:20], "shorter"),
        (b"XXXX" + value[4:], "not a kvtier"),
        (value[:-1] + bytes([value[-1] ^ 1]), "checksum"),
    ]:
        with pytest.raises(CorruptPayload, match=why):
            codec.decode(bad, len(raw))
    with pytest.raises(CorruptPayload, match="expected"):
        codec.decode(value, len(raw) + 2)


@pytest.mark.parametrize("n", [0, 1, 17, 4096, 3 * 2**20 + 5])
def test_the_gil_free_checksum_is_xxh3_64(n):
    import os

    import numpy as np
    import xxhash

    from kvtier.codec import checksum

    data = os.urandom(n)
    want = xxhash.xxh3_64_intdigest(data)
    assert (
        checksum(data)
        == checksum(memoryview(data))
        == checksum(np.frombuffer(data, np.uint8))
        == want
    )


def test_lz4_shrinks_structured_kv():
    # bf16 values near a common scale share their exponent byte: the byte planes compress.
    raw = (1 + 0.01 * torch.randn(1 << 16)).to(torch.bfloat16).view(torch.uint8).numpy()
    header, payload = Codec("lz4").encode(memoryview(raw), 16)
    assert len(payload) < 0.75 * len(raw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layerwise", [False, True])
def test_on_a_gpu_lent_chunks_are_checked_by_their_digests_on_the_device(layerwise):
    """A GPU storer writes each chunk's KV digest (codec version 2); a GPU reader of lent
    chunks sums them as they cross and hashes nothing on the CPU; a flipped byte is caught."""
    from kvtier.codec import kv_digest

    with kvtier_server(0.0625) as srv:
        tokens = [t + 23 + layerwise for t in TOKENS]
        cfg = dict(
            save_unfull_chunk=False,
            chunk_size=16,
            max_local_cpu_size=1 / 1024,
            remote_url=srv.url,
            blocking_timeout_secs=5,
        )
        layers = [
            [torch.randn(2, NB, BS, H, D, device="cuda").to(torch.bfloat16) for _ in range(L)]
            for _ in "ab"
        ]
        a = CacheEngine(KvtierConfig(**cfg), PagedKV.wrap(layers[0], "flash_attn"), FMT)
        b = CacheEngine(
            KvtierConfig(**cfg, local_cpu=False), PagedKV.wrap(layers[1], "flash_attn"), FMT
        )
        src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
        if layerwise:
            storing = a.start_store(tokens, src, layerwise=True)
            for layer in range(L):
                storing.save(layer)
            storing.finish()
        else:
            a.store(tokens, src)
        a.flush(timeout=10)
        store = open_store(srv.url, 5)
        key = wire_key(b.spans(tokens)[3].key)
        value = bytearray(store.get([key])[0])
        n, _, digest = Codec("naive").check_header(
            bytes(value[: HEADER.size]), len(value) - HEADER.size, 16 * b.chunk_bytes_per_token
        )
        assert value[4] == 2 and digest == kv_digest(bytes(value[HEADER.size :]))

        def load():
            handle = b.start_retrieve(tokens, dst, layerwise=layerwise)
            batch = handle._held[0][1].block._batch if layerwise else None
            for layer in range(L):
                handle.wait(layer)
            return handle.finish(), batch

        mask, batch = load()
        assert mask[:96].all()
        torch.cuda.synchronize()
        assert torch.equal(kv_at(layers[1], dst[:96].cuda()), kv_at(layers[0], src[:96].cuda()))
        if batch is not None:
            assert batch._sums is None and batch._device_sums is not None  # no CPU checksum ran
        # the fourth chunk: one payload bit (its xxh3 left as it was)
        value[HEADER.size + 1000] ^= 0x40
        store.put([key], [bytes(value)])
        mask, _ = load()
        assert mask[:48].all() and not mask[48:].any()
        a.close(), b.close(), store.close()


def test_an_engine_connects_to_the_store_server_at_start_not_at_its_first_request():
    """The server's pool is mapped (on a GPU registered with CUDA: seconds at tens of GB)
    by the first connection; an engine makes it when it starts (before vLLM captures its CUDA
    graphs), before any request."""
    with kvtier_server(0.0625) as srv:
        before = srv.metrics()["accepted_connections"]  # the readiness probe's
        e, _ = node(srv.url)
        # made while the engine was built
        assert srv.metrics()["accepted_connections"] == before + 1
        assert e.tiers.tier("remote").store.shm_active  # the same connection, its pool mapped
        assert srv.metrics()["accepted_connections"] == before + 1
        e.close()
