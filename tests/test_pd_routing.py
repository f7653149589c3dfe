"""KvRouter (kvtier/fleet/routing.py), the proxy's `--route kv` choice of prefiller, on its own:
prompts as token ids (no /tokenize), the index fed as the prefillers' events would feed it."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import CollectorRegistry, Gauge

from kvtier.fleet.routing import KvRouter
from kvtier.fleet.upstreams import Upstreams

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
TOKENS = list(range(500, 532))  # 8 blocks of 4


def store(router: KvRouter, url: str, blocks: int) -> None:
    parent = None
    for i in range(blocks):
        block = f"{url}-{i}".encode()
        router.index.apply(
            url,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [block],
                    "parent_block_hash": parent,
                    "token_ids": TOKENS[4 * i : 4 * i + 4],
                    "block_size": 4,
                    "medium": "CPU",
                }
            ],
        )
        parent = block


def picks(router: KvRouter, ns: list[int]) -> list[int | None]:
    async def main() -> list[int | None]:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": TOKENS}
            return [await router.pick(n, "/v1/completions", body, session) for n in ns]

    return asyncio.run(main())


def router(load_tokens: int = 8) -> KvRouter:
    gauge = Gauge("up", "up", ["node", "url"], registry=CollectorRegistry())
    nodes = Upstreams("prefiller", URLS, 0.5, 0.1, gauge)
    return KvRouter(nodes, URLS, {}, load_tokens)


def test_the_prefiller_holding_the_longest_prefix_is_picked_whatever_the_turn():
    r = router()
    try:
        assert picks(r, [0, 1, 2]) == [0, 1, 2]  # nothing held: in turn
        store(r, URLS[1], 3)
        store(r, URLS[2], 5)
        assert picks(r, [0, 1, 2]) == [2, 2, 2] and r.routed_last == "kv"
    finally:
        r.close()


def test_a_busy_prefiller_loses_to_one_holding_less_and_a_down_one_is_never_picked():
    r = router(load_tokens=8)
    try:
        store(r, URLS[1], 3)  # 12 tokens
        store(r, URLS[2], 5)  # 20 tokens
        r.started(2)  # 20 - 8 = 12: a tie with prefiller 1, settled by the turn
        assert picks(r, [1, 2]) == [1, 2]
        r.started(2)  # 20 - 16 = 4 < 12
        assert picks(r, [2]) == [1]
        r.ended(2)
        r.ended(2)
        r.nodes.down(2, "test")
        assert picks(r, [0, 2]) == [1, 1]
        r.nodes.down(1, "test")
        r.nodes.down(0, "test")
        assert picks(r, [0]) == [None]
    finally:
        r.close()
