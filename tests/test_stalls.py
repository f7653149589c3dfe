"""kvtier/stalls.py: a slow call on the engine's thread is one log line that splits its time
into CPU, the host waits kvtier counted, garbage collections, and the rest; fast calls,
calls nested in a traced one, and waits on other threads say nothing."""

import gc
import logging
import threading
import time

import pytest

from kvtier.stalls import Stalls


@pytest.fixture
def stalls():
    s = Stalls(threshold_ms=20)
    yield s
    gc.callbacks.remove(s._on_gc)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "slow call" in r.getMessage()]


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_slow_call_says_where_its_time_went(stalls, caplog):
    class Copies:  # a CUDA event's stand-in: its synchronize is a host wait of 30 ms
        def synchronize(self) -> None:
            time.sleep(0.03)

    @stalls.traced("lookup")
    def lookup() -> int:
        stalls.synchronized("stores landing", Copies())  # a host wait kvtier counts
        spin(0.015)
        time.sleep(0.02)  # one it does not count
        return 7

    with caplog.at_level(logging.INFO, logger="kvtier"):
        assert lookup() == 7
    [line] = lines(caplog)
    numbers = {
        k: float(v)
        for k, v in (part.rsplit(" ", 1) for part in line.split("(")[1].split(";")[0].split(", "))
    }
    assert line.startswith("slow call on the engine's thread: lookup took ")
    # (upper bounds loose: a loaded machine stretches sleeps and preempts the spin)
    assert 29 <= numbers["waiting for stores landing"] < 90
    assert 14 <= numbers["cpu"] < 45
    rest = float(line.rsplit("the rest ", 1)[1].split(":")[0])
    assert 15 <= rest < 90


def test_a_collection_during_the_call_is_named(stalls, caplog):
    @stalls.traced("wait_for_save")
    def save() -> None:
        garbage = [[i] for i in range(300_000)]
        for a, b in zip(garbage, garbage[1:]):
            a.append(b)  # cycles: a full collection walks them
        gc.collect()
        spin(0.02)

    with caplog.at_level(logging.INFO, logger="kvtier"):
        save()
    [line] = lines(caplog)
    assert "wait_for_save took" in line and ", gc " in line


def test_fast_calls_nested_calls_and_other_threads_waits_say_nothing_more(stalls, caplog):
    @stalls.traced("inner")
    def inner() -> None:
        spin(0.025)

    @stalls.traced("outer")
    def outer() -> None:
        inner()  # counted in outer's line, no line of its own
        other = threading.Thread(target=stalls.waited, args=("copies", 5.0))
        other.start()
        other.join()  # a wait on another thread is not this call's

    @stalls.traced("fast")
    def fast() -> None:
        pass

    with caplog.at_level(logging.INFO, logger="kvtier"):
        fast()
        outer()
        stalls.waited("copies", 1.0)  # no traced call running: dropped
    [line] = lines(caplog)
    assert "outer took" in line and "waiting for" not in line


def test_off_without_a_threshold(caplog):
    off = Stalls(threshold_ms=None)
    assert off._on_gc not in gc.callbacks

    @off.traced("lookup")
    def lookup() -> int:
        time.sleep(0.03)
        return 1

    with caplog.at_level(logging.INFO, logger="kvtier"):
        assert lookup() == 1
    assert lines(caplog) == []
