"""Values in parts, and the copies between them and a shared pool's extents."""

import numpy as np
import pytest

from kvtier import buffers


@pytest.mark.parametrize("threads", [1, 3])
def test_copies_between_parts_and_extents_are_exact(monkeypatch, threads):
    monkeypatch.setattr(buffers, "COPY_THREADS", threads)
    monkeypatch.setattr(buffers, "PARALLEL_FROM", 1)  # every copy goes over the threads
    monkeypatch.setattr(buffers, "_PIECE", 1000)
    monkeypatch.setattr(buffers, "_pool", None)
    rng = np.random.default_rng(0)
    pool = np.zeros(1 << 16, np.uint8)
    extents = [(40_000, 5000), (100, 3000), (20_000, 7)]  # not in address order, of odd sizes
    value = rng.integers(0, 255, 8007, dtype=np.uint8)
    parts = [memoryview(value[:10]), memoryview(value[10:6000]), memoryview(value[6000:])]
    buffers.run_copy(buffers.into_extents(pool, extents, parts))
    assert bytes(np.concatenate([pool[o : o + n] for o, n in extents])) == value.tobytes()
    out = bytearray(8007)
    head, body = memoryview(out)[:40], memoryview(out)[40:]
    buffers.run_copy(buffers.from_extents(pool, extents, [head, body]))
    assert bytes(out) == value.tobytes()


def test_fill_takes_only_a_value_of_the_destinations_size():
    dest = [bytearray(3), bytearray(2)]
    assert not buffers.fill(dest, b"1234") and not buffers.fill(dest, None)
    assert buffers.fill(dest, b"12345") and bytes(dest[0] + dest[1]) == b"12345"


def test_unsent_is_what_a_partial_send_left_of_the_buffers():
    unsent = buffers.unsent
    views = [memoryview(b"head"), memoryview(b"0123456789"), memoryview(b"tail")]
    assert [bytes(v) for v in unsent(views, 0)] == [b"head", b"0123456789", b"tail"]
    assert [bytes(v) for v in unsent(views, 4)] == [b"0123456789", b"tail"]
    assert [bytes(v) for v in unsent(views, 7)] == [b"3456789", b"tail"]
    assert [bytes(v) for v in unsent(views, 15)] == [b"ail"]
    assert unsent(views, 18) == []


@pytest.mark.parametrize("threads", [1, 3])
def test_work_begun_on_the_copy_threads_runs_before_its_results_are_asked_for(monkeypatch, threads):
    import threading

    monkeypatch.setattr(buffers, "COPY_THREADS", threads)
    monkeypatch.setattr(buffers, "PARALLEL_FROM", 10)
    monkeypatch.setattr(buffers, "_pool", None)
    ran = []
    started = threading.Event()

    def work(x):
        ran.append(x)
        started.set()
        return x * x

    results = buffers.start_parallel(work, [1, 2, 3], nbytes=100)
    # begun at once on threads; small or one thread: on asking
    assert started.wait(5) if threads > 1 else not ran
    assert results() == [1, 4, 9] and results() == [1, 4, 9]
    assert sorted(ran) == [1, 2, 3]  # each item ran once, however often the results were asked for
    small = buffers.start_parallel(work, [4], nbytes=100)
    assert small() == [16]
