"""On a GPU: Triton gather/scatter equal a plain-torch reference (random data)."""

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV
from kvtier.transfer.factory import make_transfer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NB, BS, H, D, L = 64, 16, 8, 128, 4
SHAPES = {
    "flash_attn": (2, NB, BS, H, D),
    "flashinfer": (NB, 2, BS, H, D),
    "mla": (NB, BS, 576),
    "vllm": (NB, H, BS, 2 * D),
    "packed": (NB, H, BS, 2 * D),
    "packed-nhd": (NB, BS, H, 2 * D),  # vLLM 0.26's FLASH_ATTN in memory; seen as [NB, H, BS, 2*D]
}


def make_kv(layout: str, scale: float = 1.0) -> tuple[list[torch.Tensor], PagedKV]:
    """L random bf16 layers of `layout` on the GPU, and kvtier's view of them."""
    layers = [
        (torch.randn(SHAPES[layout], device="cuda") * scale).to(torch.bfloat16) for _ in range(L)
    ]
    if layout == "packed-nhd":
        layers = [t.permute(0, 2, 1, 3) for t in layers]
        return layers, PagedKV.wrap(layers, "packed")
    return layers, PagedKV.wrap(layers, layout)


def make_engine(
    layout: str, transfer: str = "auto"
) -> tuple[list[torch.Tensor], PagedKV, CacheEngine, torch.Tensor]:
    """An engine over `make_kv(layout)` (64-token chunks, a 0.05 GiB CPU pool), and the slots
    in a random order."""
    layers, kv = make_kv(layout)
    eng = CacheEngine(
        KvtierConfig(chunk_size=64, max_local_cpu_size=0.05),
        kv,
        KVFormat("m", layout, "bf16"),
        transfer=transfer,
    )
    return layers, kv, eng, torch.randperm(kv.num_slots)


def reference(kv: PagedKV, slots: torch.Tensor) -> torch.Tensor:
    """[L, K, T, H, D] by plain torch indexing on the GPU."""
    s = slots.cuda()
    return torch.stack(
        [layer[:, s // kv.block_size, s % kv.block_size] for layer in kv.layers]
    ).cpu()


@pytest.mark.parametrize("backend", ["triton", "triton-direct", "torch"])
@pytest.mark.parametrize("layout", SHAPES)
def test_gather_scatter_match_torch_reference(layout, backend):
    torch.manual_seed(0)
    layers, kv = make_kv(layout)
    perm = torch.randperm(kv.num_slots)
    src, dst = perm[:300], perm[300:600]
    sizes = [128, 128, 44]
    chunks = [torch.empty(kv.chunk_shape(n), dtype=kv.dtype, pin_memory=True) for n in sizes]
    transfer = make_transfer(kv, backend)
    transfer.gather(src, chunks)
    assert torch.equal(torch.cat(chunks, dim=2), reference(kv, src))
    transfer.scatter(dst, chunks)
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, dst), reference(kv, src))


@pytest.mark.parametrize("backend", ["triton", "triton-direct"])
def test_engine_roundtrip_on_gpu(backend):
    """Includes chunks cut by `start`, which are pageable copies: direct must stage them;
    and the prompt's partial last chunk (stored by default, `save_unfull_chunk`)."""
    _, kv, eng, perm = make_engine("flash_attn", transfer=backend)
    toks = list(range(200))
    assert eng.store(toks, perm[:200]) == 200
    mask = eng.retrieve(toks, perm[200:400], start=10)
    torch.cuda.synchronize()
    assert int(mask.sum()) == 190
    assert torch.equal(reference(kv, perm[10:200]), reference(kv, perm[210:400]))


def test_layerwise_retrieve_on_gpu_waits_per_layer():
    layers, kv, eng, perm = make_engine("flash_attn")
    toks = list(range(256))
    eng.store(toks, perm[:256])
    load = eng.start_retrieve(toks, perm[256:511], layerwise=True)  # 255: the last chunk is cut
    for i in range(L):
        load.wait(i)
        s_src, s_dst = perm[:255].cuda(), perm[256:511].cuda()
        got = layers[i][:, s_dst // BS, s_dst % BS]  # read on the current stream, after wait(i)
        assert torch.equal(got, layers[i][:, s_src // BS, s_src % BS])
    load.finish()
    assert not any(c.block.pinned for c in eng.tiers.cpu._chunks.values())


def _pool_chunks(kv: PagedKV, sizes: list[int], order: list[int]) -> list[torch.Tensor]:
    """Chunks in the blocks of one pinned arena, at `order` (block index per chunk):
    adjacent blocks make runs of strided copies, gaps and reversals break them."""
    block = kv.chunk_shape(max(sizes))
    numel = 1
    for d in block:
        numel *= d
    arena = torch.empty((max(order) + 1) * numel, dtype=kv.dtype, pin_memory=True)
    return [
        arena[b * numel : b * numel + numel // max(sizes) * n].view(kv.chunk_shape(n))
        for b, n in zip(order, sizes)
    ]


ORDERS = {"adjacent": [0, 1, 2, 3, 4], "gaps": [0, 2, 4, 5, 6], "reversed": [4, 3, 2, 1, 0]}


@pytest.mark.parametrize("upload_by", ["kernel", "copy_engine", "auto"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("layout", ["flash_attn", "vllm", "packed-nhd"])
def test_staged_runs_and_layerwise_paths_match_the_reference(layout, order, upload_by):
    torch.manual_seed(1)
    layers, kv = make_kv(layout)
    perm = torch.randperm(kv.num_slots)
    sizes = [64, 64, 64, 64, 40]
    src, dst = perm[:296], perm[296:592]
    transfer = make_transfer(kv, "triton", upload=upload_by)
    chunks = _pool_chunks(kv, sizes, ORDERS[order])
    transfer.gather(src, chunks)
    assert torch.equal(torch.cat(chunks, dim=2), reference(kv, src))
    saved = _pool_chunks(kv, sizes, ORDERS[order])
    saves = transfer.gather_layerwise(src, saved)
    for layer in range(L):
        saves.save(layer)
    saves.finish()
    assert not saves.unsaved() and torch.equal(torch.cat(saved, dim=2), reference(kv, src))
    handle = transfer.scatter_layerwise(dst, saved)
    handle.finish()
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, dst), reference(kv, src))


@pytest.mark.parametrize("upload_by", ["kernel", "copy_engine", "auto"])
@pytest.mark.parametrize("layer_major", [False, True], ids=["whole", "layerwise"])
def test_an_upload_queued_before_its_slots_are_known_loads_what_a_scatter_does(
    layer_major, upload_by
):
    """The copies start first (a lookup); the slots come later, while a long copy of
    other chunks still holds the copy engine (the slot table must not wait for it)."""
    torch.manual_seed(2)
    layers, kv = make_kv("packed-nhd")
    perm = torch.randperm(kv.num_slots)
    sizes = [64, 64, 64, 64, 40]
    src, dst = perm[:296], perm[296:592]
    transfer = make_transfer(kv, "triton", upload=upload_by)
    chunks = _pool_chunks(kv, sizes, ORDERS["gaps"])
    transfer.gather(src, chunks)
    busy = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    upload = transfer.upload(chunks, layer_major=layer_major)
    busy_dev = busy.to("cuda", non_blocking=True)  # queued behind the upload's copies
    if layer_major:
        handle = transfer.scatter_layerwise(dst, chunks, upload=upload)
        for layer in range(L):
            handle.wait(layer)
        handle.finish()
    else:
        transfer.scatter(dst, chunks, upload=upload, wait=False)()
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, dst), reference(kv, src))
    with pytest.raises(ValueError, match="upload is for"):
        (transfer.scatter if layer_major else transfer.scatter_layerwise)(
            dst, chunks, upload=upload
        )
    del busy, busy_dev


def _a_stored_chunk():
    """An engine with one chunk (tokens 0-255) stored from the first 256 slots of `perm`; and
    the pool's bytes in use then."""
    _, kv, eng, perm = make_engine("packed")
    toks = list(range(256))
    eng.store(toks, perm[:256])
    return kv, eng, perm, toks, eng.pool.used_bytes


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_hit_uploaded_at_its_lookup_is_what_its_retrieve_loads(layerwise):
    kv, eng, perm, toks, used = _a_stored_chunk()
    assert eng.find(toks, hold_for="r").tokens == 256
    assert eng.upload_ahead(toks, "r", layerwise=layerwise)
    assert eng.upload_ahead(toks, "r", layerwise=layerwise)  # looked up again: the same copies
    assert not eng.upload_ahead(toks, "other", layerwise=layerwise)  # one at a time
    # By the load, the engine has the first 70 tokens itself (its prefix cache grew).
    load = eng.start_retrieve(toks, perm[256:511], start=70, request_id="r", layerwise=layerwise)
    assert eng.ahead.request_id is None  # taken by the load
    for i in range(L):
        load.wait(i)
    assert int(load.finish().sum()) == 255 - 70
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, perm[70:255]), reference(kv, perm[326:511]))
    # Looked up, uploaded, then the request ends without loading: everything is given back.
    eng.find(toks, hold_for="s")
    assert eng.upload_ahead(toks, "s", layerwise=layerwise)
    eng.release_hold("s")
    assert eng.ahead.request_id is None and eng.pool.used_bytes == used
    assert not any(c.block.pinned for c in eng.tiers.cpu._chunks.values())
    # Uploaded for one mode, loaded in the other: dropped, and loaded the usual way.
    eng.find(toks, hold_for="t")
    eng.upload_ahead(toks, "t", layerwise=not layerwise)
    load = eng.start_retrieve(toks, perm[600:856], request_id="t", layerwise=layerwise)
    assert int(load.finish().sum()) == 256
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, perm[:256]), reference(kv, perm[600:856]))


def test_a_hit_that_loads_beside_the_steps_is_uploaded_on_the_slots_thread_and_loads_right():
    """`beside`: the lookup's copies are queued on the ahead slot's thread, the lookup returns
    at once; the load takes them (waiting for the thread), a release drops them, a failure
    there leaves the load to copy the chunks itself."""
    kv, eng, perm, toks, used = _a_stored_chunk()
    assert eng.find(toks, hold_for="r").tokens == 256
    assert eng.upload_ahead(toks, "r", beside=True)
    assert eng.ahead.request_id == "r"  # waits for the slot's thread: queued there
    load = eng.start_retrieve(toks, perm[256:511], start=70, request_id="r", beside=True)
    assert eng.ahead.request_id is None  # taken by the load
    assert int(load.finish().sum()) == 255 - 70
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, perm[70:255]), reference(kv, perm[326:511]))
    eng.find(toks, hold_for="s")
    eng.upload_ahead(toks, "s", beside=True)
    eng.release_hold("s")  # before the thread may have run: it is waited for, then dropped
    assert eng.ahead.request_id is None and eng.pool.used_bytes == used
    assert not any(c.block.pinned for c in eng.tiers.cpu._chunks.values())

    def fails(*args, **kwargs):
        raise RuntimeError("no device memory for staging")

    eng.find(toks, hold_for="t")
    real, eng.mover.upload = eng.mover.upload, fails
    try:
        eng.upload_ahead(toks, "t", beside=True)
        assert eng.ahead.request_id is None  # logged on the thread, nothing ahead
    finally:
        eng.mover.upload = real
    load = eng.start_retrieve(toks, perm[600:856], request_id="t", beside=True)
    assert int(load.finish().sum()) == 256
    torch.cuda.synchronize()
    assert torch.equal(reference(kv, perm[:256]), reference(kv, perm[600:856]))
    assert eng.pool.used_bytes == used


@pytest.mark.parametrize("wait", [True, False])
def test_layerwise_store_on_gpu_overlaps_nothing_it_should_not(wait):
    """Each layer is saved right after a kernel rewrites it on the current stream: the store
    must see the new values, never the old ones. Not waited for (`finish(wait=False)`, the
    vLLM worker's), the host does not wait for the copies, yet the next work on the caller's
    stream (a forward writing the pages again) runs after the gathers read them, a lookup of
    the prefix finds the chunks on their way (without waiting for them), and a load reads them
    once they have landed."""
    layers = [
        torch.zeros(SHAPES["flash_attn"], device="cuda", dtype=torch.bfloat16) for _ in range(L)
    ]
    kv = PagedKV.wrap(layers, "flash_attn")
    eng = CacheEngine(
        KvtierConfig(chunk_size=64, max_local_cpu_size=0.05),
        kv,
        KVFormat("m", "flash_attn", "bf16"),
    )
    slots = torch.randperm(kv.num_slots)[:256]
    toks = list(range(256))
    storing = eng.start_store(toks, slots, layerwise=True)
    expect = []
    for i in range(L):
        torch.cuda._sleep(2_000_000)  # a slow "forward" on the current stream before the write
        layers[i].normal_()
        expect.append(layers[i][:, slots.cuda() // BS, slots.cuda() % BS].clone())  # no host sync
        storing.save(i)
    assert storing.finish(wait=wait) == 256
    assert len(eng.storing.landing) == (0 if wait else 1)  # not waited for: still behind the sleeps
    for x in layers:
        x.zero_()  # the next forward, on the same stream: after the gathers' reads
    assert eng.lookup(toks) == 256 and len(eng.storing.landing) == (0 if wait else 1)
    assert int(eng.retrieve(toks, slots).sum()) == 256 and not len(eng.storing.landing)
    torch.cuda.synchronize()
    for i in range(L):
        assert torch.equal(layers[i][:, slots.cuda() // BS, slots.cuda() % BS], expect[i])
    eng.close()


def test_a_whole_store_not_waited_for_reads_the_pages_after_the_forward_and_before_the_next():
    """The vLLM worker's store on a GPU: after the step's forward, gathered whole, its copies
    to the host not waited for (`finish(wait=False)`). Its gathers read what the forward
    (behind a slow kernel) wrote, the next forward's writes come after those reads, its
    staging lives until its copies land though the next store allocates its own right behind
    it, and a load of its prefix (no upload at its lookup) reads them once they have landed."""
    layers = [
        torch.zeros(SHAPES["flash_attn"], device="cuda", dtype=torch.bfloat16) for _ in range(L)
    ]
    kv = PagedKV.wrap(layers, "flash_attn")
    eng = CacheEngine(
        KvtierConfig(chunk_size=64, max_local_cpu_size=0.05),
        kv,
        KVFormat("m", "flash_attn", "bf16"),
    )
    perm = torch.randperm(kv.num_slots)
    steps = [(list(range(256)), perm[:256]), (list(range(1000, 1256)), perm[256:512])]
    # before the sleeps (an upload waits for them)
    pages = [(s.cuda() // BS, s.cuda() % BS) for _, s in steps]
    expect = []
    for (toks, slots), (block, offset) in zip(steps, pages):
        # a slow forward on the current stream, then its writes (about 0.1 s: 20M cycles, ~10 ms,
        # was shorter than the host's own work before the next store on a fresh H100, 2026-11-27)
        # The forward's values drawn and indexed before it: after the sleep only its writes and
        # the store (with an RNG call or an indexing of the pages there, an H200 host waited for it)
        values = [torch.randn_like(x) for x in layers]
        expect.append([v[:, block, offset] for v in values])
        torch.cuda._sleep(200_000_000)
        for x, v in zip(layers, values):
            x.copy_(v)
        assert eng.start_store(toks, slots).finish(wait=False) == 256
    assert len(eng.storing.landing) == 2  # both behind the sleeps: nothing waited
    # in flight: not gathered again (from new pages)
    assert eng.start_store(*steps[0]).finish(wait=False) == 0
    for x in layers:
        x.zero_()  # the next forward
    for (toks, slots), _want in zip(steps, expect):
        assert eng.lookup(toks) == 256
        assert int(eng.retrieve(toks, slots).sum()) == 256
    torch.cuda.synchronize()
    assert not len(eng.storing.landing)
    for (block, offset), want in zip(pages, expect):
        for x, w in zip(layers, want):
            assert torch.equal(x[:, block, offset], w)
    eng.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_on_a_gpu_a_hit_on_a_store_still_landing_loads_behind_it_without_waiting(layerwise):
    """Back to back: a request looks up and loads the prefix a store still has on its way to
    the host (its copies queued behind a slow forward). The lookup counts it and returns while
    the GPU is still busy; the load's copies up, queued at the lookup (`upload_ahead`), wait
    for the store's copies down on the GPU, not on the host; the pages get the stored KV."""
    import time

    layers = [
        torch.zeros(SHAPES["flash_attn"], device="cuda", dtype=torch.bfloat16) for _ in range(L)
    ]
    kv = PagedKV.wrap(layers, "flash_attn")
    eng = CacheEngine(
        KvtierConfig(chunk_size=64, max_local_cpu_size=0.05),
        kv,
        KVFormat("m", "flash_attn", "bf16"),
    )
    perm = torch.randperm(kv.num_slots)
    slots, again = perm[:320], perm[320:576]
    toks = list(range(320))
    values = [torch.randn_like(x) for x in layers]
    pages = (slots[:256].cuda() // BS, slots[:256].cuda() % BS)
    later = (again.cuda() // BS, again.cuda() % BS)
    expect = [v[:, pages[0], pages[1]] for v in values]
    torch.cuda._sleep(1_000_000_000)  # the forward that computes the prefix: ~0.5 s of GPU clock
    for x, v in zip(layers, values):
        x.copy_(v)  # its writes (an RNG call after the sleep made the host wait for it on an H200)
    assert eng.start_store(toks[:256], slots[:256]).finish(wait=False) == 256
    t0 = time.perf_counter()
    hit = eng.find(toks, hold_for="r")
    assert (hit.tokens, hit.in_cpu) == (256, 256)
    assert eng.upload_ahead(toks[:256], "r", layerwise=layerwise)
    flight = eng.landing._flying[0].flight
    assert not flight.done.query() and time.perf_counter() - t0 < 0.2  # nothing waited
    for x in layers:
        x.zero_()  # the next forward's writes (after the store's reads of the pages)
    load = eng.start_retrieve(toks[:256], again, request_id="r", layerwise=layerwise)
    for layer in range(L):
        load.wait(layer)
    assert int(load.finish().sum()) == 256
    for x, want in zip(layers, expect):
        assert torch.equal(x[:, later[0], later[1]], want)
    assert int(eng.retrieve(toks[:256], slots[:256]).sum()) == 256  # landed: from CPU RAM
    eng.close()


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("backend", ["triton", "triton-direct", "torch"])
@pytest.mark.parametrize("layout", SHAPES)
def test_the_lossy_codec_kernels_match_the_torch_codec(layout, backend, codec):
    """Gather quantizes within the codec's bound; scatter writes what the torch codec
    decodes; layer by layer too (staged or direct, pinned pool chunks)."""
    from kvtier.transfer import Quant

    torch.manual_seed(2)
    layers, kv = make_kv(layout, 5.0)
    q = Quant(codec, kv.heads, kv.head_size)
    perm = torch.randperm(kv.num_slots)
    src, dst = perm[:300], perm[300:600]
    sizes = [128, 128, 44]
    arena = torch.zeros(3, L * kv.kv * 128 * q.row_bytes, dtype=torch.uint8, pin_memory=True)
    chunks = [
        arena[i, : L * kv.kv * n * q.row_bytes].view(L, kv.kv, n, q.row_bytes)
        for i, n in enumerate(sizes)
    ]
    transfer = make_transfer(kv, backend, q)
    transfer.gather(src, chunks)
    ref = reference(kv, src)
    dec = torch.cat([q.decode(c, torch.float32) for c in chunks], dim=2)
    assert ((dec - ref.float()).abs() <= q.error_bound(ref) + 1e-6).all()
    want = torch.cat([q.decode(c, kv.dtype) for c in chunks], dim=2).float()
    for scatter in ("whole", "layerwise"):
        for x in layers:
            x.zero_()
        if scatter == "whole":
            transfer.scatter(dst, chunks)
        else:
            transfer.scatter_layerwise(dst, chunks).finish()
        torch.cuda.synchronize()
        got = reference(kv, dst).float()
        # one bf16 rounding apart at most
        assert ((got - want).abs() <= want.abs() / 128).all(), scatter
    saved = [torch.zeros_like(c) for c in chunks]
    saves = transfer.gather_layerwise(dst, saved)
    for layer in range(L):
        saves.save(layer)
    saves.finish()
    redec = torch.cat([q.decode(c, torch.float32) for c in saved], dim=2)
    assert ((redec - got).abs() <= q.error_bound(got) + 1e-6).all()


def test_engine_with_the_int8_codec_through_the_store_server_on_gpu():
    from kvtier_tools.dev.localservers import kvtier_server

    with kvtier_server(0.0625) as srv:
        # whole chunks: 4 lent by the server
        cfg = dict(
            chunk_size=64,
            max_local_cpu_size=0.05,
            remote_url=srv.url,
            remote_serde="int8",
            blocking_timeout_secs=5,
            save_unfull_chunk=False,
        )
        layers = [
            [torch.randn(SHAPES["flash_attn"], device="cuda").to(torch.bfloat16) for _ in range(L)]
            for _ in "ab"
        ]
        fmt = KVFormat("m", "flash_attn", "bf16")
        a = CacheEngine(KvtierConfig(**cfg), PagedKV.wrap(layers[0], "flash_attn"), fmt)
        b = CacheEngine(
            KvtierConfig(**cfg, local_cpu=False), PagedKV.wrap(layers[1], "flash_attn"), fmt
        )
        perm = torch.randperm(NB * BS)
        toks = list(range(300))
        assert a.store(toks, perm[:300]) == 256
        assert a.flush(timeout=10)
        for layerwise in (False, True):
            load = b.start_retrieve(toks, perm[300:556], layerwise=layerwise)
            for i in range(L):
                load.wait(i)
            assert load.finish().all()
            torch.cuda.synchronize()
            want = reference(a.kv, perm[:256]).float()
            got = reference(b.kv, perm[300:556]).float()
            assert ((got - want).abs() <= a.quant.error_bound(want) + want.abs() / 128).all()
        assert b.tiers.tier("remote").stats.lent >= 4
        a.close(), b.close()


def _compiled_variants() -> int:
    from kvtier.transfer import kernels

    return sum(
        len(cache[0])
        for k in (
            kernels.kv_copy_kernel,
            kernels.digest_kernel,
            kernels.host_words_kernel,
            kernels.host_runs_kernel,
        )
        for cache in k.device_caches.values()
    )


@pytest.mark.parametrize("layerwise", [False, True])
def test_requests_of_any_size_compile_nothing_after_the_engines_start(layerwise):
    """The engine's warm-up compiles each copy path; stores and loads of 1, 2 and 3 chunks,
    cut or partial, uploaded at the lookup or not, must reuse those kernels (a compile in a
    request's path cost 134-249 ms of TTFT inside vLLM)."""
    _, kv, eng, perm = make_engine("packed")
    compiled = _compiled_variants()
    toks = list(range(3 * 64 + 17))
    for n in (64, 128, 3 * 64 + 17):  # one, two, three chunks (the last cut)
        eng.store(toks[:n], perm[:n])
    free = perm[256:]
    for start, n, ahead in (
        (0, 64, False),
        (10, 128, True),
        (70, 3 * 64, True),
        (5, 15 + 64, False),
    ):
        rid = f"r{start}"
        if ahead:
            eng.find(toks[:n], hold_for=rid)
            eng.upload_ahead(toks[:n], rid, start=start, layerwise=layerwise)
        load = eng.start_retrieve(
            toks[:n], free[:n], start=start, request_id=rid if ahead else "", layerwise=layerwise
        )
        for i in range(L):
            load.wait(i)
        load.finish()
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled


def test_landing_a_done_store_does_not_make_the_host_wait_for_the_forward_queued_since():
    """vLLM's worker: step N's store is queued and not waited for; step N+1's forward is
    queued behind it; its `wait_for_save` starts the next store, which first lands step N's
    (its copies done). Landing reads step N's KV digests: on the current stream that read
    waited for step N+1's whole forward, so vLLM could not prepare its next step meanwhile
    (`vllm bench serve`, H100, 2026-11-27). Now the host goes on at once, and the digests
    are stamped as the gather computed them."""
    import time

    layers, kv, eng, perm = make_engine("flash_attn", transfer="triton")
    assert eng.mover.digests
    first, second = list(range(256)), list(range(1000, 1256))
    assert eng.start_store(first, perm[:256]).finish(wait=False) == 256
    # step N's copies are done (queued one piece at a time: pacing.py); its flight waits to be
    # landed
    while not eng.storing.landing._flying[0].flight.arrived():
        time.sleep(0.0001)
    torch.cuda._sleep(1_000_000_000)  # step N+1's forward on the current stream: about a second
    t0 = time.perf_counter()
    storing = eng.start_store(second, perm[256:512])  # lands step N's store first
    waited = time.perf_counter() - t0
    storing.finish(wait=False)
    assert waited < 0.2, (
        f"the host waited {waited:.2f} s for the forward queued after the store it landed"
    )
    torch.cuda.synchronize()
    chunks = [eng.tiers.cpu.get(s.key) for s in eng.spans(first)]
    assert all(c is not None and c.block.digest != 0 for c in chunks)
    for c in chunks:
        c.block.release()
    eng.close()
