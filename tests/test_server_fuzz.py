"""Property-based fuzzing of the store server's wire protocol (hypothesis).

1. The frame parser and every meta decoder, fed random and mutated bytes,
   raise only ProtocolError; encoders and decoders round-trip.
2. A live `kvtier server` (tokens, tenants, tight bounds) is sent random,
   structured and mutated frames over many connections, authenticated or
   not, for FUZZ_SECONDS (default 40; set it higher to fuzz for longer by
   hand). Meanwhile a checker tenant keeps writing and reading values over
   TCP and shared memory. Asserted: the server never dies, the checker is
   always served, nothing it reads differs from what it wrote (a miss is
   allowed: the fuzz fills the pool), and the server's peak RSS stays
   within a bound. The figures (frames, peak RSS) are printed and written
   to $FUZZ_REPORT when set.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvtier.errors import RemoteRefused
from kvtier.server import auth
from kvtier.server import protocol as p
from kvtier.server.client import KVClient
from kvtier_tools.dev.localservers import kvtier_server

MiB = 1 << 20
FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "40"))
TOKEN = "fuzz-operator-0123456789"
FUZZER = "fuzz-tenant-0123456789"
CHECKER = "fuzz-checker-0123456789"
# over the server's RSS before the fuzz (its 64 MiB pool is populated at start)
RSS_BOUND = 160 * MiB

QUICK = settings(max_examples=300, deadline=None, database=None)


# -- 1. the parser -------------------------------------------------------------------------


@QUICK
@given(st.binary(min_size=p.HEADER_SIZE, max_size=p.HEADER_SIZE), st.booleans())
def test_parse_header_takes_any_bytes(buf, replies):
    try:
        h = p.parse_header(buf, replies=replies)
    except p.ProtocolError:
        return
    assert h.meta_len <= p.MAX_META and h.payload_len <= p.MAX_PAYLOAD


def _valid_header(op: int, meta_len: int, payload_len: int) -> bytes:
    return p.pack_header(op, 1, meta_len, payload_len)


@QUICK
@given(st.sampled_from(list(p.Op)), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.data())
def test_mutated_headers_are_parsed_or_refused(op, meta_len, payload_len, data):
    buf = bytearray(_valid_header(op, meta_len, payload_len))
    for i in data.draw(st.lists(st.integers(0, p.HEADER_SIZE - 1), max_size=3)):
        buf[i] = data.draw(st.integers(0, 255))
    try:
        p.parse_header(buf)
    except p.ProtocolError:
        pass


DECODERS = [
    lambda b: p.decode_keys(b),
    lambda b: p.decode_keys(b, with_sizes=True),
    p.decode_sizes,
    p.decode_extents,
    p.decode_u32,
    p.decode_json,
]


@QUICK
@given(st.binary(max_size=512), st.sampled_from(range(len(DECODERS))))
def test_meta_decoders_take_any_bytes(buf, which):
    try:
        DECODERS[which](buf)
    except p.ProtocolError:
        pass


@QUICK
@given(st.lists(st.binary(min_size=1, max_size=80), max_size=40), st.data())
def test_keys_sizes_and_extents_round_trip(keys, data):
    sizes = data.draw(st.lists(st.integers(0, 2**64 - 2), min_size=len(keys), max_size=len(keys)))
    assert p.decode_keys(p.encode_keys(keys, sizes), with_sizes=True) == (keys, sizes)
    assert p.decode_sizes(p.encode_sizes(sizes)) == sizes
    extents = [(s, [(o, 1) for o in range(s % 4)]) for s in sizes]
    assert p.decode_extents(p.encode_extents(7, extents)) == (7, [(s, list(e)) for s, e in extents])


# -- 2. a live server ----------------------------------------------------------------------


def _meta_for(op: int, keys: list[bytes], sizes: list[int], n: int) -> bytes:
    if op in (p.Op.PUT, p.Op.PUT_ALLOC):
        return p.encode_keys(keys, sizes)
    if op in (p.Op.PUT_COMMIT, p.Op.RELEASE):
        return p.encode_u32(n)
    if op in (p.Op.HELLO, p.Op.AUTH, p.Op.STATS):
        return p.encode_json({"host_id": p.host_id(), "proof": "00" * n})
    return p.encode_keys(keys)


@st.composite
def frames(draw) -> bytes:
    """One frame: random bytes, a well-formed frame of any op, or one mutated."""
    kind = draw(st.sampled_from(["random", "frame", "mutated"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=200))
    op = draw(st.one_of(st.sampled_from(list(p.Op)), st.integers(0, 255)))
    keys = draw(
        st.lists(st.sampled_from([b"a", b"b", b"k" * 100, b"\x00", b"x" * 1024]), max_size=4)
    )
    sizes = draw(
        st.lists(
            st.sampled_from([0, 1, 4096, MiB, 20 * MiB, 40 * MiB, 1 << 40]),
            min_size=len(keys),
            max_size=len(keys),
        )
    )
    meta = (
        _meta_for(op, keys, sizes, draw(st.integers(0, 8)))
        if op in p.Op._value2member_map_
        else b""
    )
    declared = sum(sizes) if op == p.Op.PUT else draw(st.sampled_from([0, 0, 5, 1 << 20]))
    sent = draw(st.integers(0, min(declared, 8192)))
    frame = bytearray(
        p.pack_header(op, draw(st.integers(0, 2**32 - 1)), len(meta), declared) + meta
    )
    frame += random.Random(len(frame)).randbytes(sent)
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 4))):
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
        if draw(st.booleans()):
            frame = frame[: draw(st.integers(1, len(frame)))]
    return bytes(frame)


class _Checker(threading.Thread):
    """A tenant that writes values and reads them back, over TCP and shared memory."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.clients = [
            KVClient("127.0.0.1", port, timeout=10, token=CHECKER, shm=shm) for shm in (True, False)
        ]
        self.stop, self.errors, self.ops, self.refused = threading.Event(), [], 0, 0
        self.written: dict[bytes, bytes] = {}

    def run(self) -> None:
        rng = random.Random(1)
        while not self.stop.is_set():
            c = rng.choice(self.clients)
            key = b"check-%d" % rng.randrange(64)
            value = rng.randbytes(rng.choice([1, 1000, 100_000, MiB]))
            try:
                c.put([key], [value])
                self.written[key] = value
                keys = [key, rng.choice(list(self.written))]
                got = c.get(keys)
                self.ops += 2
            except RemoteRefused:  # the fuzz may hold the whole pool for a moment
                self.refused += 1
                continue
            except Exception as e:  # anything else: the server failed the checker
                self.errors.append(repr(e))
                return
            for k, v in zip(keys, got):
                if v is not None and bytes(v) != self.written[k]:
                    self.errors.append(f"{k!r}: read back different bytes")


def _send(port: int, data: list[bytes], login: bool) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.settimeout(0.05)
        if login:
            hello = p.encode_json({"host_id": ""})
            s.sendall(p.pack_header(p.Op.HELLO, 1, len(hello)) + hello)
            s.settimeout(2)
            h = p.parse_header(_exactly(s, p.HEADER_SIZE), replies=True)
            challenge = p.decode_json(_exactly(s, h.meta_len))["challenge"]
            proof = p.encode_json({"proof": auth.prove(FUZZER, bytes.fromhex(challenge)).hex()})
            s.sendall(p.pack_header(p.Op.AUTH, 2, len(proof)) + proof)
            h = p.parse_header(_exactly(s, p.HEADER_SIZE), replies=True)
            _exactly(s, h.meta_len)
            s.settimeout(0.05)
        try:
            for frame in data:
                s.sendall(frame)
            while s.recv(1 << 16):
                pass
        except (TimeoutError, ConnectionError):
            pass


def _exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


@pytest.mark.alone  # its checker must see progress within 10 s while the fuzzer floods the server
def test_a_live_server_survives_random_frames_and_keeps_serving(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"fuzz: {FUZZER}\nchecker: {CHECKER}\n")
    tenants.chmod(0o600)
    with kvtier_server(
        0.0625,
        "--auth-token",
        TOKEN,
        "--tenants",
        str(tenants),
        "--put-deadline",
        "2",
        "--lease-timeout",
        "2",
        "--idle-timeout",
        "5",
        "--max-held-per-conn",
        "0.03",
    ) as srv:
        server = psutil.Process(srv.procs[0].pid)
        rss0 = server.memory_info().rss
        checker = _Checker(srv.ports[0])
        checker.start()
        tried = {"frames": 0, "connections": 0}

        @settings(
            max_examples=50,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(frames(), min_size=1, max_size=5), st.booleans())
        def one_connection(data, login):
            _send(srv.ports[0], data, login)
            tried["frames"] += len(data)
            tried["connections"] += 1

        t0, peak = time.monotonic(), rss0
        while time.monotonic() - t0 < FUZZ_SECONDS and not checker.errors:
            one_connection()
            assert srv.procs[0].poll() is None, "the server died:\n" + srv.log()[-3000:]
            peak = max(peak, server.memory_info().rss)
        ops_during = checker.ops
        checker.stop.set()
        checker.join(30)
        hwm = int(
            next(
                line.split()[1]
                for line in open(f"/proc/{server.pid}/status")
                if line.startswith("VmHWM")
            )
        )
        report = {
            "seconds": round(time.monotonic() - t0, 1),
            **tried,
            "crashes": 0,
            "checker_ops": ops_during,
            "checker_refused": checker.refused,
            "rss_start_MiB": round(rss0 / MiB, 1),
            "rss_peak_sampled_MiB": round(peak / MiB, 1),
            "vm_hwm_MiB": round(hwm / 1024, 1),
            "stats": KVClient("127.0.0.1", srv.ports[0], token=TOKEN).stats(),
        }
        print("fuzz:", json.dumps(report))
        if os.environ.get("FUZZ_REPORT"):
            with open(os.environ["FUZZ_REPORT"], "w") as f:
                json.dump(report, f, indent=1)
        assert not checker.errors, checker.errors
        assert ops_during > 0, "the checker was never served"
        assert hwm * 1024 - rss0 < RSS_BOUND, report
        assert srv.procs[0].poll() is None
        assert tried["frames"] > 0
