"""The scheduler ⇄ worker lookup protocol over real ZMQ IPC sockets."""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvtier.framing import ProtocolError
from kvtier.integrations.vllm.lookup import (
    Found,
    Handlers,
    LookupClient,
    LookupServer,
    Op,
    decode,
    encode,
    socket_path,
)
from kvtier.keys import PLAIN, Identity, Item


@pytest.fixture
def served(tmp_path):
    calls = []
    handlers = Handlers(
        lookup=lambda tokens, identity, rid, computed, beside: (
            calls.append(("lookup", rid, list(tokens), identity, computed, beside))
            or (len(tokens), 3, True)
        ),
        release=lambda rid: calls.append(("release", rid)),
        reset=lambda: calls.append(("reset",)),
    )
    address = f"ipc://{tmp_path}/w0.sock"
    server = LookupServer(address, handlers)
    client = LookupClient([address], timeout_s=2)
    yield client, calls, address
    client.close()
    server.close()


def test_lookup_release_and_reset_reach_the_worker(served):
    client, calls, _ = served
    image = Identity.of(
        salt="tenant-a", items=[Item(1, 2, bytes(range(16))), Item(3, 1, b"\xff" * 16)]
    )
    assert client.lookup([5, 6, 7, 8], "req-1", computed=2) == Found(4, 3, True)
    assert client.lookup([5, 6], "req-2", computed=0, beside=True, identity=image) == Found(
        2, 3, True
    )
    client.release("req-1")
    assert client.reset() is True
    assert calls == [
        ("lookup", "req-1", [5, 6, 7, 8], PLAIN, 2, False),
        ("lookup", "req-2", [5, 6], image, 0, True),
        ("release", "req-1"),
        ("reset",),
    ]


def test_a_malformed_request_is_answered_as_no_hit(served):
    _, calls, address = served
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(address)
    for bad in (
        b"\x01",
        bytes([9, Op.LOOKUP, 0, 0]) + b"\0" * 4,
        encode(Op.LOOKUP, "r", b"\0" * 4)[:-1],
        encode(Op.LOOKUP, "r"),
        encode(Op.LOOKUP, "r", b"\0" * 4),  # no flags
        encode(Op.LOOKUP, "r", b"\0" * 8 + b"\0" * 16 + b"\3\0\0\0"),  # 3 items promised, none sent
    ):
        sock.send(bad)
        assert sock.recv() == b"\0" * 17
    sock.close(0)
    assert calls == []


def test_messages_carry_version_request_id_and_tokens():
    op, rid, payload = decode(encode(Op.LOOKUP, "ré-1", np.array([1, 2**32 - 1], "<u4").tobytes()))
    assert (op, rid, np.frombuffer(payload, "<u4").tolist()) == (Op.LOOKUP, "ré-1", [1, 2**32 - 1])
    with pytest.raises(ProtocolError, match="version 1 "):
        decode(b"KL" + bytes([1, Op.RESET, 0, 0]))
    with pytest.raises(ProtocolError, match="bad magic"):
        decode(bytes([6, Op.RESET, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="unknown op 9"):  # a ProtocolError is a ValueError
        decode(encode(Op.RESET)[:2] + bytes([6, 9, 0, 0]))


def test_a_silent_worker_is_a_miss_within_the_timeout(tmp_path):
    client = LookupClient([socket_path("nobody-listens", 0)], timeout_s=0.3)
    t0 = time.monotonic()
    assert client.lookup([1, 2, 3], "r") == Found(0, 0, False) and client.reset() is False
    assert time.monotonic() - t0 < 2
    client.close()


@pytest.mark.skipif(sys.platform != "linux", reason="abstract sockets are Linux's")
def test_a_worker_that_dies_without_closing_leaves_no_socket_file():
    """vLLM's workers are often killed, not shut down: their lookup socket is abstract."""
    address = socket_path("abstract-check", 0)
    handlers = Handlers(
        lookup=lambda tokens, identity, rid, computed, beside: (len(tokens), 0, False),
        release=lambda rid: None,
        reset=lambda: None,
    )
    server = LookupServer(address, handlers)
    client = LookupClient([address], timeout_s=2)
    try:
        assert address.startswith("ipc://@")
        assert client.lookup([1, 2, 3], "r") == Found(3, 0, False)
        assert not list(Path(tempfile.gettempdir()).glob("kvtier-abstract-check*"))
    finally:
        client.close()
        server.close()


def test_the_hit_is_the_shortest_rank_s_and_held_if_any_rank_holds_it(tmp_path):
    """Tensor parallelism: a rank that holds its longer hit must be told to let it go when
    the request loads nothing, even where the others let theirs go at once."""
    answers = [(64, 64, False), (96, 32, True)]
    servers = [
        LookupServer(
            f"ipc://{tmp_path}/r{i}.sock",
            Handlers(
                lookup=lambda t, i, r, c, b, a=a: a, release=lambda rid: None, reset=lambda: None
            ),
        )
        for i, a in enumerate(answers)
    ]
    client = LookupClient([s.address for s in servers], timeout_s=2)
    try:
        assert client.lookup([1, 2, 3], "r") == Found(64, 32, True)
    finally:
        client.close()
        for server in servers:
            server.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_worker_in_the_schedulers_process_is_called_directly_on_its_thread(tmp_path, direct):
    """vLLM's uniprocess executor (one GPU) runs the scheduler and the worker on the engine
    core's thread: a `direct` server's handlers run on the asking thread, with no socket
    between them (each handoff of the GIL cost the lookup inside vLLM); once the server is
    closed the client is back on the socket (then a miss: nobody answers there)."""
    import threading

    threads = []
    handlers = Handlers(
        lookup=lambda tokens, identity, rid, computed, beside: (
            threads.append(threading.get_ident()) or (len(tokens), len(tokens), True)
        ),
        release=lambda rid: threads.append(threading.get_ident()),
        reset=lambda: None,
    )
    address = f"ipc://{tmp_path}/w0.sock"
    server = LookupServer(address, handlers, direct=direct)
    client = LookupClient([address], timeout_s=0.3)
    try:
        assert client.lookup([5, 6, 7], "r", computed=1) == Found(3, 3, True)
        client.release("r")
        here = threading.get_ident()
        assert threads == ([here, here] if direct else [threads[0]] * 2) and (
            direct or threads[0] != here
        )
        server.close()
        assert client.lookup([5, 6, 7], "r2") == Found(0, 0, False)
    finally:
        client.close()
        server.close()
