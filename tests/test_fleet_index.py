"""The fleet's prefix index (kvtier/fleet/index.py) and its feed from vLLM's ZMQ event
publisher (kvtier/fleet/feed.py): kvtier's chunk events and vLLM's own block events, encoded
by vLLM's own event classes, published on a real ZMQ socket."""

from __future__ import annotations

import time

import msgspec
import zmq

from kvtier.fleet.feed import EventFeed
from kvtier.fleet.index import PrefixIndex
from kvtier_tools.dev.localservers import free_port

TOKENS = list(range(100, 116))  # four chunks of 4


def stored(hashes, parent, tokens, size=4, medium="CPU", lora=None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "medium": medium,
        "lora_name": lora,
    }


def chain(instance_index: PrefixIndex, instance: str, n: int, medium="CPU", lora=None):
    """`n` chunks of TOKENS stored by `instance`, one event a chunk, as kvtier sends them."""
    parent = None
    for i in range(n):
        block = f"h{i}{lora or ''}".encode()
        instance_index.apply(
            instance, [stored([block], parent, TOKENS[4 * i : 4 * i + 4], medium=medium, lora=lora)]
        )
        parent = block


def test_the_longest_prefix_each_instance_holds_is_found_from_the_token_ids():
    index = PrefixIndex()
    chain(index, "a", 3)
    chain(index, "b", 1, medium="DISK")
    chain(index, "c", 4, medium="REMOTE")  # a store every instance reads: no reason to pick c
    assert index.match(TOKENS) == {"a": 12, "b": 4}
    assert index.match(TOKENS[:7]) == {"a": 4, "b": 4}  # whole blocks only
    assert index.match([1, 2, 3, 4] + TOKENS[4:]) == {}  # another first block: nothing follows
    chain(index, "a", 2, lora="A")
    assert index.match(TOKENS, lora="A") == {"a": 8}  # the adapter's own blocks


def test_removed_and_cleared_blocks_leave_the_index():
    index = PrefixIndex()
    chain(index, "a", 3)
    chain(index, "b", 3, medium="DISK")
    index.apply("a", [{"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "CPU"}])
    assert index.match(TOKENS) == {"a": 4, "b": 12}  # a's prefix ends at its missing block
    index.apply("b", [{"type": "AllBlocksCleared"}])  # vLLM's GPU cache reset: b's DISK stays
    assert index.match(TOKENS) == {"a": 4, "b": 12}
    index.forget("b")
    assert index.match(TOKENS) == {"a": 4}
    index.forget("a")
    assert len(index) == 0 and index.match(TOKENS) == {}


def test_vllms_multi_block_events_chain_like_kvtiers():
    index = PrefixIndex()
    index.apply("gpu", [stored([11, 12], None, TOKENS[:8], medium=None)])  # vLLM's GPU blocks
    index.apply("gpu", [stored([13], 12, TOKENS[8:12], medium=None)])
    assert index.match(TOKENS) == {"gpu": 12}


def test_the_feed_applies_what_vllms_publisher_sends():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    feed = EventFeed({"a": f"tcp://127.0.0.1:{port}"}, index)
    encoder = msgspec.msgpack.Encoder()
    try:
        blocks = [
            BlockStored(
                block_hashes=[b"x" * 16],
                parent_block_hash=None,
                token_ids=TOKENS[:4],
                block_size=4,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            BlockStored(
                block_hashes=[b"y" * 16],
                parent_block_hash=b"x" * 16,
                token_ids=TOKENS[4:8],
                block_size=4,
                lora_id=None,
                medium="DISK",
                lora_name=None,
            ),
        ]
        deadline = time.monotonic() + 10
        seq = 0
        while index.match(TOKENS) != {"a": 8} and time.monotonic() < deadline:
            # a SUB socket misses what was sent before it joined: send until it is seen
            batch = KVEventBatch(ts=time.time(), events=blocks)
            pub.send_multipart((b"", seq.to_bytes(8, "big"), encoder.encode(batch)))
            seq += 1
            time.sleep(0.05)
        assert index.match(TOKENS) == {"a": 8}
        removed = KVEventBatch(
            ts=time.time(), events=[BlockRemoved(block_hashes=[b"y" * 16], medium="DISK")]
        )
        pub.send_multipart((b"", seq.to_bytes(8, "big"), encoder.encode(removed)))
        deadline = time.monotonic() + 10
        while index.match(TOKENS) != {"a": 4} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert index.match(TOKENS) == {"a": 4}
        pub.send_multipart((b"", b"\0" * 8, b"not msgpack \xc1"))
        deadline = time.monotonic() + 10
        while feed.errors == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert feed.errors == 1 and index.match(TOKENS) == {"a": 4}  # and it goes on
    finally:
        feed.close()
        pub.close(0)
        ctx.term()


def test_two_instances_naming_the_same_tokens_differently_are_both_found():
    """vLLM seeds its block hashes per process: the same tokens, two chains of hashes."""
    index = PrefixIndex()
    index.apply("a", [stored([1, 2], None, TOKENS[:8], medium=None)])
    index.apply("b", [stored([7, 8, 9], None, TOKENS[:12], medium=None)])
    assert index.match(TOKENS) == {"a": 8, "b": 12}
    index.apply("b", [{"type": "BlockRemoved", "block_hashes": [7], "medium": None}])
    assert index.match(TOKENS) == {"a": 8}
