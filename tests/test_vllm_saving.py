"""A step's stores run on the saver thread (saving.py): wait_for_save returns before they run,
a lookup on their path waits for them, and pages vLLM freed are written only after the stores
that read them have: the chunks hold the KV of the step that computed it."""

import threading
import time

import numpy as np
import pytest
import torch
from test_vllm_worker import LAYERS, forward

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import PLAIN, KVFormat
from kvtier.transfer import PagedKV

pytestmark = pytest.mark.vllm


class Gated:
    """The worker's store, held until `open()`; the threads it ran on."""

    def __init__(self, store):
        self._store, self.gate, self.threads = store, threading.Event(), []

    def __call__(self, spec):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        if spec.req_id == "fails":
            raise RuntimeError("a store that fails")
        self._store(spec)

    def open_after(self, seconds: float) -> None:
        threading.Timer(seconds, self.gate.set).start()


def saving_worker(device: str = "cpu", dtype=torch.float32):
    """A worker over an engine on `device` whose stores run on the saver thread, gated; the
    layers; a step's metadata that saves the first 32 tokens of request "r" (blocks 0 and 1)."""
    from kvtier.integrations.vllm.saving import StepSaves
    from kvtier.integrations.vllm.spec import KvtierMetadata, Shape, TransferSpec
    from kvtier.integrations.vllm.worker import WorkerSide

    config = KvtierConfig(save_unfull_chunk=False, chunk_size=16, max_local_cpu_size=1 / 64)
    layers = [torch.randn(2, 8, 16, 2, 32, device=device).to(dtype) for _ in range(LAYERS)]
    worker = WorkerSide(config, Shape(16, 16, False, 0), "saving-test", True)
    worker.engine = CacheEngine(
        config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", str(dtype)[6:])
    )
    worker._layer_index = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    gated = Gated(worker._store)
    worker._saves = StepSaves(gated, worker.engine.kv.device, config.chunk_size)
    meta = KvtierMetadata(saves=[TransferSpec("r", list(range(32)), [[0, 1]], 0, 32)])
    return worker, layers, meta, gated


def stored_kv(worker, layers) -> list[torch.Tensor]:
    """Tokens 0-31 as kvtier holds them, loaded into blocks 4 and 5."""
    loaded = worker.engine.retrieve(list(range(32)), torch.arange(64, 96, device=layers[0].device))
    assert int(loaded.sum()) == 32
    return [layer[:, 4:6].clone() for layer in layers]


def test_a_steps_stores_run_beside_and_a_lookup_on_their_path_waits_for_them():
    worker, _, meta, gated = saving_worker()
    try:
        forward(worker, LAYERS)
        worker.wait_for_save(meta)  # returns while the store is held
        assert gated.threads == ["kvtier-store_0"]
        assert worker.engine.lookup(list(range(32))) == 0
        # another prompt's lookup does not wait for it
        t0 = time.perf_counter()
        worker._saves.wait_on_path(np.arange(100, 132, dtype=np.uint32), PLAIN)
        assert time.perf_counter() - t0 < 0.2 and not gated.gate.is_set()
        gated.open_after(0.3)
        tokens = np.arange(48, dtype=np.uint32)  # the same prefix and more: a turn that follows
        assert worker._find(tokens, PLAIN, "next", 0) == (32, 32, True)
    finally:
        gated.gate.set()
        worker.close()


def test_pages_vllm_freed_are_written_only_after_the_stores_that_read_them():
    """vLLM lists a finished request in the next step's `freed`: that step's start waits for
    its store, and what the step then writes into the pages is not what kvtier keeps."""
    from kvtier.integrations.vllm.spec import KvtierMetadata

    worker, layers, meta, gated = saving_worker()
    try:
        want = [layer[:, 0:2].clone() for layer in layers]
        forward(worker, LAYERS)
        worker.wait_for_save(meta)
        t0 = time.perf_counter()
        worker.start_load_kv(KvtierMetadata())  # "r" still runs: nothing to wait for
        assert time.perf_counter() - t0 < 0.2 and not gated.gate.is_set()
        gated.open_after(0.3)
        worker.handle_preemptions(KvtierMetadata(freed=["r"]))
        assert gated.gate.is_set()
        for layer in layers:  # the step writes another request's KV into blocks 0 and 1
            layer[:, 0:2] = 7.0
        assert all(torch.equal(g, w) for g, w in zip(stored_kv(worker, layers), want))
    finally:
        gated.gate.set()
        worker.close()


def test_a_store_that_fails_on_the_thread_is_logged_and_the_next_ones_are_kept(caplog):
    from dataclasses import replace

    worker, _, meta, gated = saving_worker()
    try:
        gated.gate.set()
        failing = replace(meta.saves[0], req_id="fails")
        worker._saves.submit([failing])
        worker._saves.order_freed(["fails"])
        assert "request fails: its store failed" in caplog.text
        worker._saves.submit(meta.saves)
        worker._saves.drain()
        assert worker.engine.lookup(list(range(32))) == 32
    finally:
        worker.close()


def test_the_scheduler_lists_the_requests_whose_pages_vllm_freed():
    from test_vllm_worker import step_running

    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.spec import Shape

    config = KvtierConfig(chunk_size=16)
    scheduler = SchedulerSide(config, Shape(16, 16, False, 0), "freed-test", 1, True, True)
    try:
        step = step_running("a")
        step.finished_req_ids = {"done"}
        step.preempted_req_ids = {"preempted"}
        assert sorted(scheduler.build_connector_meta(step).freed) == ["done", "preempted"]
        assert scheduler.build_connector_meta(step_running("a")).freed == []
    finally:
        scheduler.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_freed_page_is_written_after_the_gathers_that_read_it():
    """The step's forward is still running (a long kernel on vLLM's stream) when the store is
    queued behind it; the next step writes the freed pages on that stream at once. Its stream
    waits for the gathers' reads, so kvtier keeps the forward's KV, not the next step's."""
    from kvtier.integrations.vllm.spec import KvtierMetadata

    worker, layers, meta, gated = saving_worker("cuda", torch.bfloat16)
    try:
        gated.gate.set()
        want = [layer[:, 0:2].clone() for layer in layers]
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)  # ~0.25 s: the forward, on vLLM's stream
        forward(worker, LAYERS)
        worker.wait_for_save(meta)
        worker.handle_preemptions(KvtierMetadata(freed=["r"]))
        for layer in layers:
            layer[:, 0:2] = 7.0
        torch.cuda.synchronize()
        worker._saves.drain()
        assert all(torch.equal(g, w) for g, w in zip(stored_kv(worker, layers), want))
    finally:
        worker.close()
