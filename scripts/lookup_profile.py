"""The worker's side of a scheduler lookup, alone and through its ZMQ socket: `WorkerSide._find`
(keys, locate, hold) of a 6,272-token prompt held in CPU RAM, its release, and the same two
over the lookup protocol (the scheduler's `LookupClient`, a server thread in this process, as
vLLM's engine core runs them at TP=1). CPU engine, no GPU upload: on a GPU a hit that will be
loaded also queues its copies at the lookup. Means of 200.

    python3 scripts/lookup_profile.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.integrations.vllm.lookup import Handlers, LookupClient, LookupServer, socket_path
from kvtier.integrations.vllm.spec import Shape
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

TOKENS, REPEATS = 6272, 200


def main() -> None:
    config = KvtierConfig(chunk_size=256, max_local_cpu_size=2)
    worker = WorkerSide(config, Shape(16, 256, False, 0), "lookup-profile", True)
    layers = [torch.zeros(2, 512, 16, 2, 32) for _ in range(4)]
    worker.engine = CacheEngine(
        config, PagedKV.wrap(layers, "flash_attn"), KVFormat("m", "flash_attn", "float32")
    )
    toks = np.random.default_rng(0).integers(0, 30000, TOKENS).astype(np.uint32)
    worker.engine.store(toks.tolist(), torch.arange(TOKENS))
    server = LookupServer(
        socket_path("lookup-profile", 0),
        Handlers(worker._find, worker._release, worker.engine.clear),
    )
    client = LookupClient([socket_path("lookup-profile", 0)], 5)
    computed = TOKENS - 272  # the engine has all but the last chunk and a bit: one chunk to load
    try:
        for name, step in [
            ("find (worker, direct)", lambda i: worker._find(toks, f"d{i}", computed, False)),
            ("release (direct)", lambda i: worker._release(f"d{i}")),
            ("lookup over ZMQ", lambda i: client.lookup(toks, f"z{i}", computed, False)),
            ("release over ZMQ", lambda i: client.release(f"z{i}")),
        ]:
            t0 = time.perf_counter()
            for i in range(REPEATS):
                step(i)
            print(f"{name}: {(time.perf_counter() - t0) / REPEATS * 1e3:.3f} ms")
    finally:
        client.close()
        server.close()
        worker.close()


if __name__ == "__main__":
    main()
