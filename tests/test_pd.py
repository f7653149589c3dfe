"""Disaggregated prefill without vLLM: a sender engine pushes KV into a receiver's
buffer over real sockets (tcp, and nixl where the package is installed), and the
receiver's engine loads it. Faults: no room, a dead decoder, malformed frames,
releases and expiry."""

import json
import os
import socket
import struct
import threading
import time

import pytest
import torch

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.errors import ConfigError
from kvtier.keys import Identity, Item, KVFormat
from kvtier.pd import protocol as proto
from kvtier.pd.build import make_buffer, start_receiver
from kvtier.pd.sender import PdSender, Target
from kvtier.transfer import PagedKV
from kvtier_tools.dev.localservers import free_port, free_ports

L, NB, BS, H, D = 2, 64, 16, 2, 32
# UCX over TCP where there is no GPU; a GPU host's UCX picks its own transports (on the
# two-H100 machine, UCX_TLS=tcp,self,sm made NIXL's UCX backend fail: NIXL_ERR_BACKEND)
UCX_ENV = {} if torch.cuda.is_available() else {"UCX_TLS": "tcp,self,sm"}
CHUNK = 16
FMT = KVFormat("m", "flash_attn", "float32")
BPT = L * 2 * H * D * 4  # bytes per token


def digests(*ids: int) -> bytes:
    """Alloc's payload: one 16-byte chunk-key digest per id."""
    return b"".join(i.to_bytes(proto.DIGEST_BYTES, "big") for i in ids)


def channels():
    out = ["tcp"]
    try:
        import nixl._api  # noqa: F401

        out.append("nixl")
    except ImportError:
        pass
    return out


class Pair:
    """A sender engine and a receiver (buffer, ports, engine) on loopback."""

    def __init__(
        self,
        channel="tcp",
        buffer_chunks=16,
        alloc_timeout=0.5,
        ttl=300,
        proxy_port=None,
        staging_chunks=0,
    ):
        self.init_port, self.alloc_port = free_ports(2)
        common = dict(
            chunk_size=CHUNK,
            save_unfull_chunk=True,
            enable_pd=True,
            transfer_channel=channel,
            local_cpu=False,
            max_local_cpu_size=1 / 1024,
        )
        self.rcfg = KvtierConfig(
            **common,
            pd_role="receiver",
            pd_buffer_size=buffer_chunks * CHUNK * BPT,
            pd_peer_host="127.0.0.1",
            pd_peer_init_port=self.init_port,
            pd_peer_alloc_port=self.alloc_port,
            pin_timeout_sec=ttl,
        )
        self.scfg = KvtierConfig(
            **common,
            pd_role="sender",
            pd_proxy_host="127.0.0.1",
            pd_proxy_port=proxy_port or free_port(),
            pd_allocation_timeout_sec=alloc_timeout,
            blocking_timeout_secs=2.0,
            pd_buffer_size=staging_chunks * CHUNK * BPT,
        )
        self.src_layers = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
        self.dst_layers = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]
        self.sender_engine = CacheEngine(
            self.scfg, PagedKV.wrap(self.src_layers, "flash_attn"), FMT
        )
        dst = PagedKV.wrap(self.dst_layers, "flash_attn")
        self.buffer = make_buffer(self.rcfg, dst, FMT)
        self.receiver = start_receiver(self.rcfg, self.buffer, 0)
        self.receiver_engine = CacheEngine(self.rcfg, dst, FMT, cpu=self.buffer.tier)
        self.sender = PdSender(self.sender_engine, self.scfg, 0)

    def target(self, req_id):
        return Target("127.0.0.1", self.init_port, self.alloc_port, req_id)

    def close(self):
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def pair(request):
    p = Pair(**getattr(request, "param", {}))
    yield p
    p.close()


def kv_at(layers, slots):
    return torch.stack([x[:, slots // BS, slots % BS] for x in layers])


@pytest.mark.skipif("nixl" not in channels(), reason="nixl is not installed")
def test_nixl_agent_exits_cleanly():
    """With Debian's libibverbs1 installed and no RDMA device, a process that made
    a NIXL UCX agent died with SIGSEGV at exit (the nixl wheel's libnl), and CI
    failed after its last test. kvtier's channel sets UCX_MODULES=^ib there."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    code = "from kvtier.nixl import agent; agent('exit-test')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


@pytest.mark.parametrize("channel", channels())
def test_sent_kv_is_a_hit_on_the_receiver_and_loads_bit_exact(channel, monkeypatch):
    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)
    p = Pair(channel=channel)
    try:
        toks = list(range(1000, 1100))  # 6 whole chunks and a partial one of 4
        src, dst = torch.randperm(NB * BS)[:100], torch.randperm(NB * BS)[:100]
        # chunked prefill: two steps, the second ends the prompt; one Commit makes both hits
        assert p.sender.send(p.target("r1"), toks[:64], src[:64], start=0, last=False) == 64
        assert p.receiver_engine.lookup(toks) == 0  # reserved and written, not committed
        assert p.buffer.stats.reserved_chunks == 4
        assert p.sender.send(p.target("r1"), toks, src, start=64, last=True) == 36
        assert p.receiver_engine.lookup(toks) == 100
        mask = p.receiver_engine.retrieve(toks, dst[:99])  # all but the last token, as vLLM asks
        assert mask.all()
        assert torch.equal(kv_at(p.src_layers, src[:99]), kv_at(p.dst_layers, dst[:99]))
        p.buffer.release("r1")
        assert p.receiver_engine.lookup(toks) == 0
        assert p.buffer.pool.free_blocks == p.buffer.pool.num_blocks
        # staging given back
        assert p.sender_engine.pool.free_blocks == p.sender_engine.pool.num_blocks
    finally:
        p.close()


@pytest.mark.parametrize("channel", channels())
def test_a_request_larger_than_the_senders_staging_goes_batch_by_batch_intact(channel, monkeypatch):
    """Two batches in flight: one gathered while the channel writes the other."""
    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)
    p = Pair(channel=channel, staging_chunks=4)  # 2 chunks a batch, the prompt 7
    try:
        toks = list(range(500, 612))
        src = torch.randperm(NB * BS)[:112]
        dst = torch.randperm(NB * BS)[:112]
        assert p.sender.staging.num_blocks == 4
        channel, in_flight, most = p.sender.channel, {}, [0]
        push, finish = channel.push, channel.finish

        def watched_push(peer, sock, rid, items):
            blocks = {it.staged.index for it in items}
            assert not blocks & set().union(*in_flight.values()), (
                "a staging block reused while a write reads it"
            )
            token = (push(peer, sock, rid, items),)
            in_flight[id(token)] = blocks
            most[0] = max(most[0], len(in_flight))
            return token

        def watched_finish(token, deadline):
            finish(token[0], deadline)
            del in_flight[id(token)]

        monkeypatch.setattr(channel, "push", watched_push)
        monkeypatch.setattr(channel, "finish", watched_finish)
        assert p.sender.send(p.target("b"), toks, src, start=0, last=True) == 112
        assert most[0] == 2 and not in_flight  # a batch gathered while the one before was written
        assert p.receiver_engine.retrieve(toks, dst).all()
        assert torch.equal(kv_at(p.src_layers, src), kv_at(p.dst_layers, dst))
        assert p.sender.staging.free_blocks == 4
    finally:
        p.close()


def test_a_shared_prefix_is_sent_once_and_freed_with_its_last_owner(pair):
    toks = list(range(64))
    slots = torch.arange(64)
    assert pair.sender.send(pair.target("a"), toks, slots, start=0, last=True) == 64
    used = pair.buffer.pool.num_blocks - pair.buffer.pool.free_blocks
    assert pair.sender.send(pair.target("b"), toks, slots, start=0, last=True) == 64
    assert pair.buffer.pool.num_blocks - pair.buffer.pool.free_blocks == used  # no second copy
    pair.buffer.release("a")
    assert pair.receiver_engine.lookup(toks) == 64  # b still owns it
    pair.buffer.release("b")
    assert pair.receiver_engine.lookup(toks) == 0


def test_a_decoder_takes_a_prefillers_kv_only_for_the_same_adapter_image_and_salt(pair):
    """Two requests of one prompt under other identities (a salt; an adapter; an image in
    the third chunk) sent side by side: each lands under its own keys, and the decoder's
    lookup of each request finds its own chunks and none of the other's."""
    toks, slots = list(range(64)), torch.arange(64)
    tenants = {
        "a": Identity.of(salt="tenant-a"),
        "b": Identity.of(salt="tenant-b"),
        "lora": Identity.of(adapter=b"adapter-A"),
        "img": Identity.of(items=[Item(40, 8, b"1" * 16)]),
    }
    for rid, identity in tenants.items():
        assert (
            pair.sender.send(pair.target(rid), toks, slots, start=0, last=True, identity=identity)
            == 64
        )
    for _rid, identity in tenants.items():
        assert pair.receiver_engine.lookup(toks, identity) == 64
    assert pair.receiver_engine.lookup(toks, Identity.of(salt="tenant-c")) == 0
    # The image's request shares its chunks before the image with the same text: plain, or
    # behind another image; nothing from the image's chunk on.
    assert pair.receiver_engine.lookup(toks) == 32
    assert pair.receiver_engine.lookup(toks, Identity.of(items=[Item(40, 8, b"2" * 16)])) == 32


@pytest.mark.parametrize("pair", [{"buffer_chunks": 6, "alloc_timeout": 0.2}], indirect=True)
def test_a_later_step_that_finds_no_room_frees_what_the_earlier_steps_reserved(pair):
    toks, slots = list(range(160)), torch.arange(160)
    assert pair.sender.send(pair.target("a"), toks[:64], slots[:64], start=0, last=False) == 64
    assert pair.buffer.pool.free_blocks == 2
    # 6 more chunks: no room
    assert pair.sender.send(pair.target("a"), toks, slots, start=64, last=False) == 0
    assert (
        pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
        and pair.buffer.held_requests() == 0
    )
    # its last step sends nothing
    assert pair.sender.send(pair.target("a"), toks, slots, start=160, last=True) == 0
    # the link still works
    assert pair.sender.send(pair.target("b"), toks[:64], slots[:64], start=0, last=True) == 64
    assert pair.receiver_engine.lookup(toks[:64]) == 64


def test_a_request_whose_pages_vllm_freed_mid_prefill_gives_up_its_reservation_and_can_send_anew(
    pair,
):
    toks, slots = list(range(100)), torch.arange(100)
    assert pair.sender.send(pair.target("p"), toks[:64], slots[:64], start=0, last=False) == 64
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks - 4
    pair.sender.drop("p")  # preempted: vLLM freed its pages
    assert (
        pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
        and pair.buffer.held_requests() == 0
    )
    pair.sender.drop("p")  # a second notice (it finished later) is a no-op
    # resumed: its prefill runs again from the start and is sent whole
    assert pair.sender.send(pair.target("p"), toks[:64], slots[:64], start=0, last=False) == 64
    assert pair.sender.send(pair.target("p"), toks, slots, start=64, last=True) == 36
    assert pair.receiver_engine.lookup(toks) == 100


@pytest.mark.parametrize("pair", [{"buffer_chunks": 4, "alloc_timeout": 0.3}], indirect=True)
def test_a_full_buffer_makes_the_sender_wait_bounded_then_give_up(pair, caplog):
    assert (
        pair.sender.send(pair.target("a"), list(range(64)), torch.arange(64), start=0, last=True)
        == 64
    )
    t0 = time.monotonic()
    got = pair.sender.send(
        pair.target("b"), list(range(500, 564)), torch.arange(64), start=0, last=True
    )
    waited = time.monotonic() - t0
    assert got == 0 and 0.3 <= waited < 2.0
    assert "no room" in caplog.text and "recompute" in caplog.text
    assert pair.receiver_engine.lookup(list(range(500, 564))) == 0
    pair.buffer.release("a")  # room again: the next request goes through
    assert (
        pair.sender.send(
            pair.target("c"), list(range(500, 564)), torch.arange(64), start=0, last=True
        )
        == 64
    )


@pytest.mark.parametrize("pair", [{"buffer_chunks": 8, "alloc_timeout": 5.0}], indirect=True)
def test_a_piece_that_finds_no_room_waits_for_it_after_the_others_and_lands_intact(pair):
    """A step's Allocs go in pieces (here 2, 4, 8... chunks), one ahead of the writes: with 5
    blocks free, a 7-chunk prompt gets its first (2) and third (1) pieces at once, its
    second (4) once another request frees its 3 blocks. (cuda_ipc reserves in pieces; the
    reservation is the same for every channel, so tcp runs it here.)"""
    pair.sender.pieces = (2, 8)
    assert (
        pair.sender.send(pair.target("a"), list(range(48)), torch.arange(48), start=0, last=True)
        == 48
    )
    toks = list(range(900, 1012))
    src = torch.randperm(NB * BS)[:112]
    dst = torch.randperm(NB * BS)[:112]
    free_while_waiting = []

    def release_a():
        free_while_waiting.append(pair.buffer.pool.free_blocks)
        pair.buffer.release("a")

    threading.Timer(0.2, release_a).start()
    t0 = time.monotonic()
    assert pair.sender.send(pair.target("b"), toks, src, start=0, last=True) == 112
    assert 0.2 <= time.monotonic() - t0 < 3.0 and pair.sender.stats.waited_for_room == 1
    assert free_while_waiting == [8 - 3 - 3]  # "a"'s 3, and "b"'s first and third pieces
    assert pair.receiver_engine.retrieve(toks, dst).all()
    assert torch.equal(kv_at(pair.src_layers, src), kv_at(pair.dst_layers, dst))


@pytest.mark.parametrize("pair", [{"buffer_chunks": 2}], indirect=True)
def test_a_request_larger_than_the_whole_buffer_fails_at_once(pair, caplog):
    t0 = time.monotonic()
    assert (
        pair.sender.send(pair.target("a"), list(range(64)), torch.arange(64), start=0, last=True)
        == 0
    )
    assert time.monotonic() - t0 < 0.3
    assert "raise pd_buffer_size" in caplog.text
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks


def test_the_proxy_is_told_when_a_prefill_is_done_or_failed():
    listener = socket.create_server(("127.0.0.1", 0))
    got = []

    def serve():
        conn, _ = listener.accept()
        while len(got) < 2:
            got.append(proto.recv(conn)[0])
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    p = Pair(proxy_port=listener.getsockname()[1], buffer_chunks=2)
    try:
        assert (
            p.sender.send(p.target("ok"), list(range(20)), torch.arange(20), start=0, last=True)
            == 20
        )
        assert (
            p.sender.send(p.target("big"), list(range(64)), torch.arange(64), start=0, last=True)
            == 0
        )
        t.join(5)
        assert got[0] == proto.PrefillDone("ok", True, 20, "")
        assert got[1].req_id == "big" and got[1].ok is False and "pd_buffer_size" in got[1].detail
    finally:
        p.close()
        listener.close()


def test_a_dead_decoder_fails_the_send_quickly_and_frees_the_sender(pair, caplog):
    pair.receiver.close()
    t0 = time.monotonic()
    assert (
        pair.sender.send(pair.target("a"), list(range(64)), torch.arange(64), start=0, last=True)
        == 0
    )
    assert time.monotonic() - t0 < 5
    assert "not sent" in caplog.text
    assert pair.sender_engine.pool.free_blocks == pair.sender_engine.pool.num_blocks


def test_a_sender_that_dies_mid_transfer_frees_its_reservation(pair):
    conn = socket.create_connection(("127.0.0.1", pair.alloc_port))
    proto.send(conn, proto.Alloc("x", [CHUNK] * 3), digests(0, 1, 2))
    reply = proto.recv(conn)[0]
    assert isinstance(reply, proto.Allocated) and len(reply.blocks) == 3
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks - 3
    # then dies
    conn.sendall(proto.encode(proto.Write("x", reply.blocks[0]), CHUNK * BPT) + b"\0" * 100)
    conn.close()
    deadline = time.monotonic() + 5
    while (
        pair.buffer.pool.free_blocks != pair.buffer.pool.num_blocks and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks


def test_a_release_before_commit_frees_the_chunks_at_commit(pair):
    conn = socket.create_connection(("127.0.0.1", pair.alloc_port))
    proto.send(conn, proto.Alloc("x", [CHUNK]), digests(1))
    block = proto.recv(conn)[0].blocks[0]
    pair.buffer.release("x")  # the client cancelled while the prefill was running
    proto.send(conn, proto.Write("x", block), b"\1" * (CHUNK * BPT))
    proto.send(conn, proto.Commit("x", ""))
    assert proto.recv(conn)[0] == proto.Ok("x", 0)
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
    conn.close()


@pytest.mark.parametrize("pair", [{"ttl": 1}], indirect=True)
def test_kv_whose_request_never_comes_expires(pair):
    assert (
        pair.sender.send(pair.target("a"), list(range(32)), torch.arange(32), start=0, last=True)
        == 32
    )
    time.sleep(1.2)
    pair.buffer.expire()
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
    assert pair.buffer.stats.expired == 1


MALFORMED = [
    b"GARBAGE" * 10,
    struct.pack("<2sBBIQ", b"KP", 9, 3, 2, 0) + b"{}",  # another version
    struct.pack("<2sBBIQ", b"KP", proto.VERSION, 99, 2, 0) + b"{}",  # unknown type
    struct.pack("<2sBBIQ", b"KP", proto.VERSION, 3, 1 << 30, 0),  # header too large
    proto.FRAME.pack(3, 5, 0) + b"nope!",  # not JSON
    proto.FRAME.pack(3, 2, 0) + b"[]",  # not an object
    proto.encode(proto.Commit("never-reserved", "")),
    proto.encode(proto.Commit("x", "ab" * 64)),  # an event no Hello opened here
    proto.encode(proto.Write("x", 0), 10) + b"0123456789",  # a block not reserved
    proto.encode(proto.Alloc("x", [CHUNK]), 3) + b"zzz",  # a digest of 3 bytes
    proto.encode(proto.Alloc("x", [CHUNK * 99]), 16) + bytes(16),  # more tokens than a chunk
    proto.encode(proto.Alloc("x", [CHUNK]), 32) + bytes(32),  # more digests than chunks
    proto.encode(proto.Hello("s", "f", 1, 1, "tcp", "")),  # Hello on the alloc port
    proto.FRAME.pack(10, 0, 0),  # Ok with no header
    proto.encode(proto.Release("x"), 1 << 40),  # a payload where none belongs
]


@pytest.mark.parametrize("frame", MALFORMED)
def test_malformed_messages_are_rejected_and_the_receiver_keeps_serving(pair, frame):
    for port in (pair.alloc_port, pair.init_port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(frame)
            try:
                reply = proto.recv(conn, max_payload=1 << 20)[0]
                assert isinstance(reply, proto.Error)
            except (TimeoutError, ConnectionError, proto.ProtocolError):
                pass  # closed, or a truncated frame is still being waited for: both fine
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
    toks = list(range(40))
    assert pair.sender.send(pair.target("after"), toks, torch.arange(40), start=0, last=True) == 40


def test_a_sender_with_another_kv_format_is_refused_by_name(pair):
    with socket.create_connection(("127.0.0.1", pair.init_port), timeout=5) as conn:
        proto.send(
            conn,
            proto.Hello(
                "s", KVFormat("other", "flash_attn", "float32").tag(), CHUNK, BPT, "tcp", ""
            ),
        )
        reply = proto.recv(conn)[0]
    assert isinstance(reply, proto.Error) and "KV format differs" in reply.message


def test_a_receiver_without_a_gpu_buffer_refuses_a_commit_event_and_the_sender_commits_after_writes(
    pair,
):
    with socket.create_connection(("127.0.0.1", pair.init_port), timeout=5) as conn:
        hello = proto.Hello(
            "s", pair.sender.engine.fmt.tag(), CHUNK, BPT, pair.sender.config.pd_channel, "ab" * 64
        )
        proto.send(conn, hello)
        welcome = proto.recv(conn, max_payload=1 << 24)[0]
    assert isinstance(welcome, proto.Welcome) and welcome.commit_event is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_receiver_waits_for_the_commit_event_of_a_sender_in_another_process():
    """cuda_ipc's early Commit: the decoder's wait on the event a sender names returns only
    once the work the sender queued before recording it is done (another process, and
    another GPU where there are two)."""
    import subprocess
    import sys

    from kvtier.pd.commit_events import commit_event

    device = f"cuda:{torch.cuda.device_count() - 1}"
    event, handle = commit_event()
    code = (
        "import sys, time, torch\n"
        "from kvtier.pd.commit_events import CommitEvents\n"
        "events = CommitEvents(torch.device(sys.argv[2]))\n"
        "print('OPEN', events.open(sys.argv[1]), flush=True)\n"
        "sys.stdin.readline(); t0 = time.perf_counter(); events.wait(sys.argv[1])\n"
        "print('WAITED', (time.perf_counter() - t0) * 1e3, flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, handle, device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().split() == ["OPEN", "True"]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
        event.record(stream)
        t0 = time.perf_counter()
        child.stdin.write("go\n")
        child.stdin.flush()
        waited = float(child.stdout.readline().split()[1])
        stream.synchronize()
        sleep_left = (time.perf_counter() - t0) * 1e3
    finally:
        child.kill()
    assert waited > 200 and waited > 0.5 * sleep_left, (waited, sleep_left)


def test_random_frames_never_crash_the_receiver(pair):
    gen = torch.Generator().manual_seed(7)
    valid = [
        proto.encode(proto.Alloc("f", [CHUNK]), 16) + digests(9),
        proto.encode(proto.Release("f")),
        proto.encode(proto.Commit("f", "")),
    ]
    for i in range(200):
        frame = bytearray(valid[i % len(valid)])
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            pos = int(torch.randint(0, len(frame), (1,), generator=gen))
            frame[pos] = int(torch.randint(0, 256, (1,), generator=gen))
        with socket.create_connection(("127.0.0.1", pair.alloc_port), timeout=2) as conn:
            try:
                conn.sendall(bytes(frame))
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):
                    pass
            except OSError:
                pass  # the receiver closed first: fine
    deadline = time.monotonic() + 5  # reservations of closed connections are aborted
    while pair.buffer.held_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.buffer.pool.free_blocks == pair.buffer.pool.num_blocks
    assert (
        pair.sender.send(
            pair.target("after"), list(range(40)), torch.arange(40), start=0, last=True
        )
        == 40
    )


@pytest.mark.parametrize(
    "settings, key",
    [
        (
            {
                "pd_role": "receiver",
                "pd_peer_host": "h",
                "pd_peer_init_port": 1,
                "pd_peer_alloc_port": 2,
            },
            "pd_buffer_size",
        ),
        (
            {"pd_role": "sender", "enable_p2p": True, "pd_proxy_host": "h", "pd_proxy_port": 1},
            "enable_p2p",
        ),
        ({"pd_role": "sender"}, "pd_proxy_host"),
        ({"pd_role": "sender", "pd_peer_host": "h"}, "pd_peer_host"),
        ({"pd_role": "both"}, "pd_role"),
        (
            {
                "pd_role": "receiver",
                "pd_buffer_size": 1,
                "pd_peer_host": "h",
                "pd_peer_init_port": 1,
                "pd_peer_alloc_port": 2,
                "transfer_channel": "carrier-pigeon",
            },
            "transfer_channel",
        ),
        (
            {
                "pd_role": "receiver",
                "pd_buffer_size": 1,
                "pd_peer_host": "h",
                "pd_peer_init_port": 1,
                "pd_peer_alloc_port": 2,
                "transfer_channel": "cuda_ipc",
            },
            "pd_buffer_device",
        ),
        (
            {
                "pd_role": "sender",
                "pd_proxy_host": "h",
                "pd_proxy_port": 1,
                "pd_allocation_timeout_sec": 0,
            },
            "pd_allocation_timeout_sec",
        ),
    ],
)
def test_inconsistent_pd_settings_fail_at_start_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        KvtierConfig(enable_pd=True, **settings)


def test_the_guides_configs_parse(tmp_path):
    from kvtier.config import load_config

    (tmp_path / "p.yaml").write_text(
        'local_cpu: False\nenable_pd: True\ntransfer_channel: "nixl"\npd_role: "sender"\n'
        'pd_proxy_host: "localhost"\npd_proxy_port: 7500\npd_buffer_size: 1073741824\n'
        'pd_buffer_device: "cuda"\n'
    )
    (tmp_path / "d.yaml").write_text(
        'local_cpu: False\nenable_pd: True\ntransfer_channel: "nixl"\npd_role: "receiver"\n'
        'pd_peer_host: "localhost"\npd_peer_init_port: 7300\npd_peer_alloc_port: 7400\n'
        'pd_buffer_size: 1073741824\npd_buffer_device: "cuda"\n'
    )
    p = load_config(env={"LMCACHE_CONFIG_FILE": str(tmp_path / "p.yaml")})
    d = load_config(env={"LMCACHE_CONFIG_FILE": str(tmp_path / "d.yaml")})
    assert (p.pd_role, p.pd_proxy_port, p.pd_channel) == ("sender", 7500, "nixl")
    assert (d.pd_role, d.pd_peer_alloc_port, d.pd_buffer_size) == ("receiver", 7400, 1 << 30)
    json.dumps([p.pd_role, d.pd_role])


@pytest.mark.parametrize(
    "role, kv_role, ok",
    [
        ("sender", "kv_producer", True),
        ("receiver", "kv_consumer", True),
        ("sender", "kv_both", True),
        ("sender", "kv_consumer", False),
        ("receiver", "kv_producer", False),
    ],
)
def test_a_pd_role_that_contradicts_vllms_kv_role_fails_naming_both(role, kv_role, ok):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.spec import check_pd_role as _check_pd_role

    extra = (
        {"pd_buffer_size": 1, "pd_peer_host": "h", "pd_peer_init_port": 1, "pd_peer_alloc_port": 2}
        if role == "receiver"
        else {"pd_proxy_host": "h", "pd_proxy_port": 1}
    )
    config = KvtierConfig(enable_pd=True, pd_role=role, **extra)
    if ok:
        _check_pd_role(config, kv_role)
    else:
        with pytest.raises(ConfigError, match=f"pd_role.*{kv_role}"):
            _check_pd_role(config, kv_role)


@pytest.mark.parametrize("channel", channels())
def test_bench_pd_runs_on_cpu_and_checks_the_data(tmp_path, channel):
    # nixl: sender and receiver in two processes (NIXL's own progress thread had writes
    # between two processes on CPU time out here)
    import subprocess
    import sys

    out = tmp_path / "pd.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "pd",
            "--tokens",
            "300",
            "--channels",
            channel,
            "--sender-device",
            "cpu",
            "--receiver-device",
            "cpu",
            "--layers",
            "2",
            "--repeats",
            "1",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **UCX_ENV},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["runs"]
    assert (
        row["tokens"] == 300 and row["ratio_to_copy"] > 0 and len(row["alloc_write_commit_ms"]) == 3
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_writes_land_intact_across_processes_and_gpus(tmp_path):
    """The sender's ring (gather kernel, then the copy engine) into another process's
    buffer, on the second GPU where there is one; the receiver's checksum of what it
    loaded must equal the sender's (a chunk count that is not a multiple of a group)."""
    import subprocess
    import sys

    out, receiver = tmp_path / "pd.json", f"cuda:{min(torch.cuda.device_count(), 2) - 1}"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "pd",
            "--tokens",
            "300",
            "4000",
            "--channels",
            "cuda_ipc",
            "--sender-device",
            "cuda:0",
            "--receiver-device",
            receiver,
            "--repeats",
            "2",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["tokens"] for r in json.loads(out.read_text())["runs"]] == [300, 4000]


@pytest.mark.skipif("nixl" not in channels(), reason="nixl is not installed")
def test_idle_nixl_agents_cost_no_cpu(monkeypatch):
    """NIXL's own progress thread polls without a pause: an idle decoder burnt a core. The
    receiver's agent is driven only while a reservation is open, the sender's while it writes."""
    import resource

    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)
    p = Pair(channel="nixl")
    try:
        toks = list(range(2000, 2040))
        # agents connected
        assert p.sender.send(p.target("r1"), toks, torch.arange(40), start=0, last=True) == 40
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(2.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        busy = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        assert busy < 0.3, f"{busy:.2f} s of CPU in 2 s idle"
    finally:
        p.close()


def test_a_reservation_gets_its_free_blocks_in_address_order(pair):
    """Chunks that follow each other land in adjacent blocks where the free blocks allow,
    also after releases in any order: cuda_ipc then moves each run in one copy."""
    conn = socket.create_connection(("127.0.0.1", pair.alloc_port))
    for rid, salt in (("a", 0), ("b", 100)):
        proto.send(conn, proto.Alloc(rid, [CHUNK] * 6), digests(*range(salt, salt + 6)))
        blocks = proto.recv(conn)[0].blocks
        assert blocks == sorted(blocks) and blocks[-1] - blocks[0] == 5, blocks
        proto.send(conn, proto.Commit(rid, ""))
        assert proto.recv(conn)[0] == proto.Ok(rid, 6)
        pair.buffer.release(rid)  # its chunks go back in the order of a set
    conn.close()


def test_ipc_writes_copy_adjacent_blocks_as_one_run():
    """cuda_ipc's copy engine moves a run of adjacent reserved blocks in one copy; each
    chunk still lands in its own block (run on CPU tensors: the grouping is the same)."""
    from kvtier.pd.ipc_writes import contiguous_runs

    remote, ring = torch.zeros(100, dtype=torch.uint8), torch.arange(1, 46, dtype=torch.uint8)
    sizes = [10, 10, 10, 5, 10]
    views = [remote[0:10], remote[10:20], remote[30:40], remote[40:45], remote[60:70]]
    offsets = [0, 10, 20, 30, 35, 45]
    runs = contiguous_runs(views)
    assert [(v.numel(), a, b) for v, a, b in runs] == [(20, 0, 2), (15, 2, 4), (10, 4, 5)]
    for dst, a, b in runs:
        dst.copy_(ring[offsets[a] : offsets[b]])
    for view, n, off in zip(views, sizes, offsets):
        assert torch.equal(view, ring[off : off + n])
    assert remote[20:30].eq(0).all() and remote[45:60].eq(0).all() and remote[70:].eq(0).all()
    # None: a chunk the decoder holds already (Allocated's -1) breaks a run and is not copied
    held = [views[0], None, views[2], views[3], None]
    assert [(v.numel(), a, b) for v, a, b in contiguous_runs(held)] == [(10, 0, 1), (15, 2, 4)]
    assert contiguous_runs([None, None]) == []


@pytest.mark.skipif("nixl" not in channels(), reason="nixl is not installed")
def test_a_nixl_write_that_nixl_refuses_fails_the_transfer_by_name(monkeypatch):
    """NIXL raises its own exceptions (nixlNotFoundError, nixlRemoteDisconnectError when the
    decoder is gone, ...): the channel turns them into PdPeerError, which fails the request's
    transfer (the decoder recomputes), never vLLM's step."""
    from kvtier.pd.channels import Placement

    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)
    p = Pair(channel="nixl")
    try:
        assert (
            p.sender.send(p.target("r1"), list(range(32)), torch.arange(32), start=0, last=True)
            == 32
        )
        (link,) = p.sender._conns.values()
        block = p.sender.staging.allocate()
        outside = link.peer.welcome.num_blocks + 1000  # an address the decoder never registered
        with pytest.raises(proto.PdPeerError, match="NIXL write failed"):
            p.sender.channel.push(
                link.peer, link.sock, "r2", [Placement(outside, CHUNK * BPT, block)]
            )
        block.release()
    finally:
        p.close()
