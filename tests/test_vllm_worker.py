"""The connector's worker side stores a step's KV whole at wait_for_save (kvtier's default),
and only where the step's forward ran to its end: vLLM calls wait_for_save also after a
forward that raised, and KV of layers it never wrote is not the model's."""

import time

import numpy as np
import pytest
import torch
from vllm_requests import vllm_request

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import PLAIN, KVFormat
from kvtier.transfer import PagedKV

pytestmark = pytest.mark.vllm

LAYERS = 3


def worker_and_step(**config):
    """A worker over a CPU engine, as register_kv_caches makes it (whole chunks only, unless
    `config` says otherwise), and a step's metadata that saves the first 32 tokens of a
    request (blocks 0 and 1 of 16 tokens)."""
    from kvtier.integrations.vllm.spec import KvtierMetadata, Shape, TransferSpec
    from kvtier.integrations.vllm.worker import WorkerSide

    config = KvtierConfig(
        **{"save_unfull_chunk": False, "chunk_size": 16, "max_local_cpu_size": 1 / 1024, **config}
    )
    layers = [torch.randn(2, 8, 16, 2, 32) for _ in range(LAYERS)]
    worker = WorkerSide(config, Shape(16, 16, False, 0), "worker-test", True)
    worker.engine = CacheEngine(
        config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", "float32")
    )
    worker._layer_index = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    meta = KvtierMetadata(saves=[TransferSpec("r", list(range(32)), [[0, 1]], 0, 32)])
    return worker, meta


def forward(worker, layers: int) -> None:
    for name in list(worker._layer_index)[:layers]:
        worker.save_kv_layer(name)


@pytest.mark.parametrize("layers", [LAYERS, 0])
def test_a_step_that_wrote_every_layer_or_ran_as_one_graph_is_stored_whole(layers):
    worker, meta = worker_and_step()
    try:
        forward(worker, layers)  # 0: a full CUDA graph calls no save_kv_layer
        worker.wait_for_save(meta)
        assert worker.engine.lookup(list(range(32))) == 32
    finally:
        worker.close()


@pytest.mark.parametrize("raised", [True, False])
def test_a_forward_that_raised_or_stopped_early_stores_nothing(raised):
    worker, meta = worker_and_step()
    try:
        with pytest.raises(RuntimeError):
            try:
                forward(worker, 1 if not raised else LAYERS)
                raise RuntimeError("the forward failed")
            finally:  # where vLLM calls it (kv_connector_model_runner_mixin)
                if raised:
                    worker.wait_for_save(meta)
        if not raised:
            # a forward that wrote one layer of three, no exception in flight
            worker.wait_for_save(meta)
        assert worker.engine.lookup(list(range(32))) == 0
        forward(worker, LAYERS)  # the next step is whole again
        worker.wait_for_save(meta)
        assert worker.engine.lookup(list(range(32))) == 32
    finally:
        worker.close()


def test_the_scheduler_asks_no_worker_when_vllm_has_all_but_less_than_a_block():
    """A prompt again at once is vLLM's own hit but for its last block: nothing kvtier holds
    would be loaded, and a worker's lookup would wait for that prefix's stores in flight."""

    from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    worker, _ = worker_and_step()
    toks = list(range(50))
    worker.engine.store(toks, torch.arange(50))
    asked = []

    def find(tokens, identity, request_id, computed, beside):
        asked.append(computed)
        return worker._find(tokens, identity, request_id, computed, beside)

    def release(request_id):
        asked.append(("release", request_id))
        worker._release(request_id)

    server = LookupServer(
        socket_path("worker-test", 0), Handlers(find, release, worker.engine.clear)
    )
    scheduler = SchedulerSide(worker.config, worker.shape, "worker-test", 1, True, True)
    try:
        request = vllm_request("r", toks)
        # 1 token past vLLM's
        assert scheduler.get_num_new_matched_tokens(request, 48) == (
            0,
            False,
        )
        assert asked == []
        # 2 chunks past it: loaded
        assert scheduler.get_num_new_matched_tokens(request, 16) == (
            32,
            False,
        )
        assert asked == [16] and len(worker.engine.holds) == 1  # r's hit, held until its load
        # A prompt that shares only the first chunk, which vLLM has: kvtier's hit is that chunk,
        # nothing of it to load. The worker lets its hold go at once, and the scheduler sends
        # no RELEASE round trip for it.
        other = vllm_request("r2", toks[:16] + list(range(100, 134)))
        assert scheduler.get_num_new_matched_tokens(other, 16) == (0, False)
        assert asked == [16, 16] and len(worker.engine.holds) == 1
    finally:
        scheduler.close()
        server.close()
        worker.close()


def test_under_full_cuda_graphs_a_prompt_again_loads_the_tail_past_vllms_own_hit():
    """A prompt again at once, vLLM's own hit but for its last block: where vLLM replays a full
    CUDA graph for a step of one token, the scheduler asks the worker, and kvtier's hit of that
    block (a partial chunk stored) is loaded, so that the step computes the last token alone."""
    from dataclasses import replace

    from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    worker, _ = worker_and_step(save_unfull_chunk=True)
    worker.shape = replace(worker.shape, full_graphs=True)
    toks = list(range(50))
    worker.engine.store(toks, torch.arange(50))
    server = LookupServer(
        socket_path("tail-test", 0), Handlers(worker._find, worker._release, worker.engine.clear)
    )
    scheduler = SchedulerSide(worker.config, worker.shape, "tail-test", 1, True, True)
    try:
        request = vllm_request("r", toks)
        assert scheduler.get_num_new_matched_tokens(request, 48) == (1, False)
        assert len(worker.engine.holds) == 1  # held until its load
    finally:
        scheduler.request_finished(vllm_request("r", toks))
        scheduler.close()
        server.close()
        worker.close()


def step_running(*req_ids):
    """What the scheduler side reads of a step (vLLM's SchedulerOutput) that ran `req_ids`,
    each a decode token, none new."""
    from types import SimpleNamespace

    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    return SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(req_ids, 1),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        preempted_req_ids=None,
    )


@pytest.mark.parametrize(
    "policy, in_step", [("busy", 0), ("busy", 48), ("busy", 49), ("never", 0), ("always", 0)]
)
def test_a_cpu_hit_loads_beside_the_steps_while_other_requests_run(policy, in_step):
    """async_loading busy: a hit all in CPU RAM loads in its step while no other request
    runs (an idle engine serves it soonest so), and beside the steps once another request
    ran in the last one (whose steps would otherwise wait for the copies) unless it is as
    small as what is left of the step's in_step_load_tokens; the worker is told so at the
    lookup, and its background load writes the KV into the request's blocks."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    worker, _ = worker_and_step(async_loading=policy, in_step_load_tokens=in_step)
    toks = list(range(50))
    worker.engine.store(toks, torch.arange(50))  # blocks 0-3
    told = []

    def find(tokens, identity, request_id, computed, beside):
        told.append(beside)
        return worker._find(tokens, identity, request_id, computed, beside)

    # an address of its own per policy: ZMQ lets go of a closed socket's address in its own
    # time, and the next case binding the same one failed (1 run in ~30)
    engine_id = f"beside-test-{policy}-{in_step}"
    server = LookupServer(
        socket_path(engine_id, 0), Handlers(find, worker._release, worker.engine.clear)
    )
    scheduler = SchedulerSide(worker.config, worker.shape, engine_id, 1, True, True)
    try:

        def ask(rid):
            return scheduler.get_num_new_matched_tokens(vllm_request(rid, toks), 0)

        idle = policy == "always"
        assert ask("alone") == (48, idle) and told == [idle]  # nothing ran yet
        scheduler.request_finished(SimpleNamespace(request_id="alone"))
        scheduler.build_connector_meta(step_running("other"))
        miss = vllm_request("miss", list(range(100, 150)))
        assert scheduler.get_num_new_matched_tokens(miss, 0) == (0, False)  # loads nothing
        scheduler.request_finished(SimpleNamespace(request_id="miss"))
        busy = policy == "always" or policy == "busy" and in_step < 49  # 49 not computed
        assert ask("joins") == (48, busy) and told[-1] == busy
        blocks = SimpleNamespace(get_block_ids=lambda: ([4, 5, 6, 7],))
        scheduler.update_state_after_alloc(vllm_request("joins", toks), blocks, 48)
        if busy:  # planned with the next step's metadata: all in CPU RAM, its copies are queued in
            # start_load_kv itself (nothing there blocks); the worker's thread waits for them to
            # land
            meta = scheduler.build_connector_meta(step_running("other"))
            assert [(s.req_id, s.background, s.from_cpu, s.start, s.end) for s in meta.loads] == [
                ("joins", True, True, 0, 48)
            ]
            worker.start_load_kv(meta)
            assert worker._beside_loads()._loads["joins"].queued_s is not None
            for _ in range(200):
                done = worker.get_finished()
                if done:
                    break
                time.sleep(0.01)
            assert done == {"joins"} and not worker.load_errors()
            for layer in worker.engine.kv.layers:  # blocks 4-6 hold what blocks 0-2 did
                assert torch.equal(layer[:, 4:7], layer[:, 0:3])
        elif policy == "busy":  # the step's in-step tokens are spent: the next hit goes beside
            assert ask("also") == (48, True) and told[-1]
            scheduler.request_finished(SimpleNamespace(request_id="also"))
            scheduler.build_connector_meta(step_running("other"))
            assert ask("next") == (48, False) and not told[-1]  # a new step's
            scheduler.request_finished(SimpleNamespace(request_id="next"))
        scheduler.request_finished(SimpleNamespace(request_id="other"))
        scheduler.request_finished(SimpleNamespace(request_id="joins"))
        assert ask("later") == (48, idle)  # nothing runs again
    finally:
        scheduler.close()
        server.close()
        worker.close()


def test_the_scheduler_looks_up_and_saves_under_each_requests_identity():
    """A salted request finds nothing stored without its salt and saves under it; a request
    with prompt embeddings beside its token ids is neither looked up nor saved."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.keys import PLAIN, Identity

    worker, _ = worker_and_step()
    toks = list(range(50))
    worker.engine.store(toks, torch.arange(50))
    asked = []

    def find(tokens, identity, request_id, computed, beside):
        asked.append((request_id, identity))
        return worker._find(tokens, identity, request_id, computed, beside)

    server = LookupServer(
        socket_path("identity-test", 0), Handlers(find, worker._release, worker.engine.clear)
    )
    scheduler = SchedulerSide(worker.config, worker.shape, "identity-test", 1, True, True)
    salted = Identity.of(salt="tenant")
    try:
        assert scheduler.get_num_new_matched_tokens(vllm_request("plain", toks), 0) == (48, False)
        assert scheduler.get_num_new_matched_tokens(
            vllm_request("salted", toks, cache_salt="tenant"), 0
        ) == (0, False)
        mixed = vllm_request("mixed", toks, prompt_embeds=torch.zeros(50, 8))
        assert scheduler.get_num_new_matched_tokens(mixed, 0) == (0, False)
        assert asked == [("plain", PLAIN), ("salted", salted)]  # the mixed one never asked
        new = [
            SimpleNamespace(
                req_id=rid, prompt_token_ids=toks, block_ids=([0, 1, 2, 3],), num_computed_tokens=0
            )
            for rid in ("salted", "mixed")
        ]
        cached = SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        )
        step = SimpleNamespace(
            num_scheduled_tokens={"salted": 50, "mixed": 50},
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            preempted_req_ids=None,
        )
        meta = scheduler.build_connector_meta(step)
        assert [(s.req_id, s.identity) for s in meta.saves] == [("salted", salted)]
    finally:
        scheduler.request_finished(vllm_request("plain", toks))
        scheduler.close()
        server.close()
        worker.close()


def gpu_worker_with_a_hit(engine_id: str, upload: bool = True, now: bool = False):
    """A worker over a GPU engine holding 256 tokens (blocks 0-15), found and held for
    request "r" as a load beside the steps (its copies up ahead and landed; `upload` False:
    not looked up yet); and the spec of that load into blocks 32-47 (`now`: a hit all from
    CPU RAM, its copies queued in start_load_kv; else on the loader thread)."""
    from kvtier.integrations.vllm.spec import Shape, TransferSpec
    from kvtier.integrations.vllm.worker import WorkerSide

    config = KvtierConfig(chunk_size=16, max_local_cpu_size=0.05)
    layers = [
        torch.randn(2, 64, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)
    ]
    worker = WorkerSide(config, Shape(16, 16, False, 0), engine_id, True)
    worker.engine = CacheEngine(
        config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", "bfloat16")
    )
    toks = list(range(256))
    worker.engine.store(toks, torch.arange(256))
    if upload:
        assert worker._find(np.array(toks, dtype=np.uint32), PLAIN, "r", 0, True) == (
            256,
            256,
            True,
        )
    torch.cuda.synchronize()
    return (
        worker,
        layers,
        TransferSpec("r", toks, [list(range(32, 48))], 0, 255, background=True, from_cpu=now),
    )


def reported(worker) -> set[str] | None:
    """What get_finished reports within 5 s, asked every millisecond as vLLM's steps ask it. A
    loop without the sleep holds the GIL from the loader thread: each of its CUDA calls then
    waited the 5 ms switch interval to return (0.5-0.8 s a load, an H200, 2026-11-30)."""
    t0, done = time.perf_counter(), None
    while not done and time.perf_counter() - t0 < 5:
        done = worker.get_finished()
        if not done:
            time.sleep(0.001)
    return done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("now", [False, True])
def test_on_a_gpu_a_load_beside_the_steps_never_waits_for_the_forward_queued_after_it(now):
    """The worker's background load runs on its own stream, after what vLLM's stream held
    when the step started (its blocks' earlier readers), not after the forward queued since:
    it lands while that forward (a long kernel here) still runs, and the forward never waits
    for its copies (nothing of the load is ordered into vLLM's stream)."""
    from kvtier.integrations.vllm.spec import KvtierMetadata

    worker, layers, spec = gpu_worker_with_a_hit(f"gpu-beside-test-{now}", now=now)
    try:
        worker.start_load_kv(KvtierMetadata(loads=[spec]))
        torch.cuda._sleep(2_000_000_000)  # this step's forward, queued after start_load_kv: ~1 s
        assert reported(worker) == {"r"} and not worker.load_errors()
        assert not torch.cuda.current_stream().query()  # landed while the forward still runs
        torch.cuda.synchronize()
        for layer in layers:  # tokens 0-254 in blocks 32-47
            got = layer[:, 32:48].flatten(1, 2)[:, :255]
            want = layer[:, 0:16].flatten(1, 2)[:, :255]
            assert torch.equal(got, want)
    finally:
        worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("now", [False, True])
def test_on_a_gpu_a_load_beside_the_steps_is_reported_while_its_upload_still_crosses(now):
    """The lookup queued the hit's copies into device staging; the load's kernels wait for
    them on the load's own stream, so its thread queues them at once and vLLM hears of the
    load in this step (not after the copies, a step later: 2026-11-28, the chat's load turns),
    while the engine's shared kernel stream holds nothing behind the copies. Here the copies
    wait behind a long kernel on the copy stream; the next step's read sees the loaded KV."""
    from kvtier.integrations.vllm.spec import KvtierMetadata

    worker, layers, spec = gpu_worker_with_a_hit(f"gpu-upload-test-{now}", upload=False, now=now)
    try:
        want = [layer[:, 0:16].flatten(1, 2)[:, :255].clone() for layer in layers]
        transfer = worker.engine.mover.transfer
        with torch.cuda.stream(transfer.streams.up):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the upload's copies wait behind it
        assert worker._find(np.array(spec.token_ids, dtype=np.uint32), PLAIN, "r", 0, True) == (
            256,
            256,
            True,
        )
        worker.start_load_kv(KvtierMetadata(loads=[spec]))
        assert reported(worker) == {"r"} and not worker.load_errors()
        assert not transfer.streams.up.query()  # reported while the upload still waits
        # the steps' shared kernel stream holds nothing of it
        assert transfer.streams.kernels.query()
        worker.start_load_kv(KvtierMetadata())  # the next step: its stream waits for the load
        got = [layer[:, 32:48].flatten(1, 2)[:, :255].clone() for layer in layers]
        torch.cuda.synchronize()
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("now", [False, True])
def test_on_a_gpu_a_queued_load_beside_the_steps_is_reported_and_the_next_forward_waits_for_it(now):
    """A load beside the steps from CPU RAM is reported done once its copies are queued
    (nothing can cut it short then), not a step after they end; the next step's stream,
    the one its request's forward runs on, is ordered after those copies. Here the load's
    stream is held back by a long kernel: the report comes while its copies wait, and a
    read queued on the next step's stream still sees the loaded KV."""
    from kvtier.integrations.vllm.spec import KvtierMetadata

    worker, layers, spec = gpu_worker_with_a_hit(f"gpu-queued-test-{now}", now=now)
    try:
        want = [layer[:, 0:16].flatten(1, 2)[:, :255].clone() for layer in layers]
        with torch.cuda.stream(worker._beside_loads().stream):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the load's copies wait behind it
        worker.start_load_kv(KvtierMetadata(loads=[spec]))
        assert reported(worker) == {"r"} and not worker.load_errors()
        assert not worker._beside_loads().stream.query()  # reported while its copies still wait
        worker.start_load_kv(KvtierMetadata())  # the next step: its stream waits for the load
        # its forward reads
        got = [layer[:, 32:48].flatten(1, 2)[:, :255].clone() for layer in layers]
        torch.cuda.synchronize()
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_how_long_a_steps_forward_waited_for_its_loads_is_counted():
    """load_wait_seconds: a hit whose copies up wait ~0.5 s behind a long kernel on the copy
    stream holds its step's forward about that long; the same hit with its copies over before
    its step holds it only for the scatter. Both steps are counted, and read without a wait
    once the GPU has passed them."""
    from dataclasses import replace

    from kvtier.integrations.vllm.spec import KvtierMetadata

    worker, layers, spec = gpu_worker_with_a_hit("gpu-wait-test", upload=False)
    spec = replace(spec, background=False, from_cpu=True)
    tokens = np.array(spec.token_ids, dtype=np.uint32)
    try:
        with torch.cuda.stream(worker.engine.mover.transfer.streams.up):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the hit's copies up wait behind it
        assert worker._find(tokens, PLAIN, "r", 0) == (256, 256, True)
        worker.start_load_kv(KvtierMetadata(loads=[spec]))
        worker.wait_for_save(KvtierMetadata())
        torch.cuda.synchronize()
        first = worker._counters()
        assert first["load_wait_steps"] == 1 and first["load_wait_seconds"] > 0.2
        assert worker._find(tokens, PLAIN, "r", 0) == (256, 256, True)
        torch.cuda.synchronize()  # its copies over before its step
        worker.start_load_kv(KvtierMetadata(loads=[spec]))
        worker.wait_for_save(KvtierMetadata())
        torch.cuda.synchronize()
        second = worker._counters()
        assert second["load_wait_steps"] == 2
        assert (second["step_loads"], second["step_loads_ahead"]) == (2, 2)  # both started ahead
        assert second["load_wait_seconds"] - first["load_wait_seconds"] < 0.05
        for layer in layers:  # tokens 0-254 in blocks 32-47
            assert torch.equal(
                layer[:, 32:48].flatten(1, 2)[:, :255], layer[:, 0:16].flatten(1, 2)[:, :255]
            )
    finally:
        worker.close()
