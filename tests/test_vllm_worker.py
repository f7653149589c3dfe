"""The connector's worker side stores a step's KV whole at wait_for_save (kvtier's default),
and only where the step's forward ran to its end: vLLM calls wait_for_save also after a
forward that raised, and KV of layers it never wrote is not the model's."""

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

pytestmark = pytest.mark.vllm

LAYERS = 3


def worker_and_step():
    """A worker over a CPU engine, as register_kv_caches makes it, and a step's metadata
    that saves the first 32 tokens of a request (blocks 0 and 1 of 16 tokens)."""
    from kvtier.integrations.vllm.spec import KvtierMetadata, Shape, TransferSpec
    from kvtier.integrations.vllm.worker import WorkerSide

    config = KvtierConfig(chunk_size=16, max_local_cpu_size=1 / 1024)
    layers = [torch.randn(2, 8, 16, 2, 32) for _ in range(LAYERS)]
    worker = WorkerSide(config, Shape(16, 16, False, 0), "worker-test", True)
    worker.engine = CacheEngine(config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", "float32"))
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
            worker.wait_for_save(meta)  # a forward that wrote one layer of three, no exception in flight
        assert worker.engine.lookup(list(range(32))) == 0
        forward(worker, LAYERS)  # the next step is whole again
        worker.wait_for_save(meta)
        assert worker.engine.lookup(list(range(32))) == 32
    finally:
        worker.close()


def test_the_scheduler_asks_no_worker_when_vllm_has_all_but_less_than_a_block():
    """A prompt again at once is vLLM's own hit but for its last block: nothing kvtier holds
    would be loaded, and a worker's lookup would wait for that prefix's stores in flight."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    worker, _ = worker_and_step()
    toks = list(range(50))
    worker.engine.store(toks, torch.arange(50))
    asked = []

    def find(tokens, request_id, computed):
        asked.append(computed)
        return worker._find(tokens, request_id, computed)

    def release(request_id):
        asked.append(("release", request_id))
        worker._release(request_id)

    server = LookupServer(socket_path("worker-test", 0), Handlers(find, release, worker.engine.clear))
    scheduler = SchedulerSide(worker.config, worker.shape, "worker-test", 1, True, True)
    try:
        request = SimpleNamespace(prompt_token_ids=toks, request_id="r", kv_transfer_params=None)
        assert scheduler.get_num_new_matched_tokens(request, 48) == (0, False)  # 1 token past vLLM's
        assert asked == []
        assert scheduler.get_num_new_matched_tokens(request, 16) == (32, False)  # 2 chunks past it: loaded
        assert asked == [16] and len(worker.engine.holds) == 1  # r's hit, held until its load
        # A prompt that shares only the first chunk, which vLLM has: kvtier's hit is that chunk,
        # nothing of it to load. The worker lets its hold go at once, and the scheduler sends
        # no RELEASE round trip for it.
        other = SimpleNamespace(prompt_token_ids=toks[:16] + list(range(100, 134)), request_id="r2",
                                kv_transfer_params=None)
        assert scheduler.get_num_new_matched_tokens(other, 16) == (0, False)
        assert asked == [16, 16] and len(worker.engine.holds) == 1
    finally:
        scheduler.close()
        server.close()
        worker.close()
