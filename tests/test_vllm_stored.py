"""The scheduler skips a lookup only where the worker's would load nothing: with CPU RAM as
kvtier's only tier, a request whose span past vLLM's own GPU hit this engine never saved is not
looked up (kvtier/integrations/vllm/stored.py). Real vLLM requests with vLLM's block hashes, a
real lookup server and a worker over a CPU engine that stores what the scheduler's steps save."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_requests import vllm_request

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import Identity, KVFormat
from kvtier.transfer import PagedKV

pytestmark = pytest.mark.vllm

LAYERS = 2
BLOCK = 16
BLOCKS = 16  # 256 tokens of vLLM's KV


def hasher():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


class Engine:
    """vLLM's scheduler side and one worker of kvtier, in one process, talking through the
    lookup socket; `asked` lists the requests the worker was asked about."""

    def __init__(self, name: str, full_graphs: bool = False, **config) -> None:
        from kvtier.integrations.vllm.lookup import Handlers, LookupServer, socket_path
        from kvtier.integrations.vllm.scheduler import SchedulerSide
        from kvtier.integrations.vllm.spec import Shape
        from kvtier.integrations.vllm.worker import WorkerSide

        self.config = KvtierConfig(**{"chunk_size": 32, "max_local_cpu_size": 0.01, **config})
        shape = Shape(BLOCK, self.config.chunk_size, False, 0, full_graphs)
        layers = [torch.randn(2, BLOCKS, BLOCK, 2, 16) for _ in range(LAYERS)]
        self.worker = WorkerSide(self.config, shape, name, True)
        self.worker.engine = CacheEngine(
            self.config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", "f32")
        )
        self.worker._layer_index = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
        self.asked: list[str] = []

        def find(tokens, identity, request_id, computed, beside):
            self.asked.append(request_id)
            return self.worker._find(tokens, identity, request_id, computed, beside)

        self.server = LookupServer(
            socket_path(name, 0), Handlers(find, self.worker._release, self.worker.engine.clear)
        )
        self.scheduler = SchedulerSide(self.config, shape, name, 1, True, True)
        self.hasher = hasher()
        self._n = 0

    def request(self, toks: list[int], **fields):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        return Request(
            f"r{self._n}",
            toks,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self.hasher,
            **fields,
        )

    def serve(self, request) -> None:
        """vLLM's lookup of a request with nothing in its GPU cache, then the step that
        prefills it whole: the scheduler saves it, the worker stores it."""
        toks = request.prompt_token_ids
        self.scheduler.get_num_new_matched_tokens(request, 0)
        blocks = list(range(-(-len(toks) // BLOCK)))
        self.scheduler.update_state_after_alloc(
            request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0
        )
        cached = SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        )
        new = SimpleNamespace(
            req_id=request.request_id,
            prompt_token_ids=toks,
            block_ids=(blocks,),
            num_computed_tokens=0,
        )
        meta = self.scheduler.build_connector_meta(
            SimpleNamespace(
                num_scheduled_tokens={request.request_id: len(toks)},
                scheduled_new_reqs=[new],
                scheduled_cached_reqs=cached,
                preempted_req_ids=None,
            )
        )
        self.worker.wait_for_save(meta)  # a step run as one graph: every layer written
        self.worker.engine.flush()
        self.scheduler.request_finished(request)

    def loads(self, toks: list[int], computed: int, salt: str | None = None) -> int:
        """What the worker's lookup would have vLLM load past `computed` (held for nobody)."""
        hit = self.worker.engine.find(
            np.array(toks, dtype=np.uint32),
            identity=Identity.of(salt=salt or ""),
            limit=len(toks) - 1,
        )
        return self.scheduler.shape.to_load(hit.tokens, len(toks), computed)

    def close(self) -> None:
        self.scheduler.close()
        self.server.close()
        self.worker.close()


@pytest.fixture
def engine(request):
    e = Engine(f"stored-{request.node.name[-40:]}", **getattr(request, "param", {}))
    yield e
    e.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def test_a_chat_turn_whose_last_turn_vllm_still_has_is_not_looked_up(engine):
    """The next turn of a conversation: vLLM's GPU cache has the last turn's prompt (its whole
    blocks), kvtier what it saved of it, which ends there (a tail of 8 tokens past the last
    whole block loads nothing). Not asked; with less in vLLM's cache, asked, and loaded."""
    rng = random.Random(0)
    first = engine.request(tokens(rng, 72))  # 2 chunks and a tail of 8
    engine.serve(first)
    turn = first.prompt_token_ids + tokens(rng, 40)
    engine.asked.clear()
    engine.scheduler.stats()  # the counts from here
    hit = engine.request(turn)
    assert engine.scheduler.get_num_new_matched_tokens(hit, 64) == (0, False)
    assert engine.asked == [] and engine.loads(turn, 64) == 0
    evicted = engine.request(turn)  # vLLM evicted the last two blocks
    assert engine.scheduler.get_num_new_matched_tokens(evicted, 32) == (40, False)
    assert engine.asked == [evicted.request_id]
    stats = engine.scheduler.stats()
    assert stats is not None and stats.data["lookups_skipped"] == 1
    assert stats.data["lookups"] == 1


@pytest.mark.parametrize(
    "engine",
    [{"save_unfull_chunk": True}, {"save_unfull_chunk": False}, {"full_graphs": True}],
    indirect=True,
)
def test_a_lookup_is_skipped_only_where_the_worker_would_load_nothing(engine):
    """Prompts that continue, cut and branch earlier ones (conversations, shared system
    prompts, edits), each asked at every GPU hit vLLM could have: where the scheduler does
    not ask, the worker's lookup loads nothing; where it asks, it loads what the worker
    says. And it does skip some. (Under full CUDA graphs a tail that leaves the step the
    prompt's last token alone loads, however short: Shape.to_load.)"""
    rng = random.Random(1)
    saved = [tokens(rng, 40), tokens(rng, 96)]
    for toks in saved:
        engine.serve(engine.request(toks))
    skipped = 0
    for _ in range(30):
        parent = rng.choice(saved)
        cut = rng.choice([len(parent), rng.randrange(len(parent) + 1)])
        more = rng.choice([0, 1, rng.randrange(2, 70)])  # 0: a prompt again
        toks = (parent[:cut] + tokens(rng, more))[: BLOCKS * BLOCK]
        if len(toks) < 2:
            continue
        # another tenant's prompts share nothing with the others
        salt = rng.choice([None, None, None, "tenant"])
        for computed in range(BLOCK, len(toks), BLOCK):
            request = engine.request(toks, cache_salt=salt)
            engine.asked.clear()
            need, _ = engine.scheduler.get_num_new_matched_tokens(request, computed)
            truth = engine.loads(toks, computed, salt)
            if not engine.asked:
                skipped += 1
                assert truth == 0 and need == 0, (cut, len(toks), computed)
            else:
                assert need == truth, (cut, len(toks), computed)
            engine.scheduler.request_finished(request)
        request = engine.request(toks, cache_salt=salt)
        engine.serve(request)
        saved.append(toks)
    assert skipped > 20


def test_a_save_of_a_request_without_block_hashes_leaves_every_request_asked(engine):
    """vLLM's prefix caching off (no block hashes): a save the scheduler cannot record
    makes it ask about every request from then on, rather than skip one it holds."""
    rng = random.Random(2)
    plain = tokens(rng, 64)
    engine.serve(vllm_request("unhashed", plain))
    assert engine.scheduler.saved_ends is not None and not engine.scheduler.saved_ends.usable
    engine.asked.clear()
    request = engine.request(plain + tokens(rng, 32))
    assert engine.scheduler.get_num_new_matched_tokens(request, 32) == (32, False)
    assert engine.asked == [request.request_id]
    engine.scheduler.request_finished(request)


@pytest.mark.parametrize(
    "config",
    [
        {"local_disk": "/tmp/kvtier-stored-test", "max_local_disk_size": 1.0},
        {"remote_url": "kvtier://127.0.0.1:1"},
        {"local_cpu": False},
    ],
)
def test_where_chunks_can_come_from_elsewhere_every_request_is_asked(config):
    """A disk tier that outlives the process, a remote store shared by a cluster, or no CPU
    tier at all: this engine's saves are not all kvtier holds, and nothing is skipped."""
    from kvtier.integrations.vllm.stored import applies

    assert applies(KvtierConfig(), True, True)
    assert not applies(KvtierConfig(**config), True, True)
    assert not applies(KvtierConfig(), False, True)  # a consumer saves nothing
    assert not applies(KvtierConfig(), True, False)  # a hybrid model's several KV groups
