"""vLLM's engine steps recorded, whatever its KV connector: plain vLLM's, native offloading's
and kvtier's steps side by side (kvtier's own trace, `KVTIER_TRACE_STALLS_MS`, sees only
kvtier's servers, to the millisecond of its log stamps).

A vLLM plugin (pyproject.toml's `vllm.general_plugins`), idle unless `STEP_TRACE_DIR` is set:
`kvtier_tools.dev.demo.vllm_server` sets it to the server's folder when its own environment
has `STEP_TRACE=1`. Each vLLM process that runs a scheduler writes
`<STEP_TRACE_DIR>/steps-<pid>.jsonl`, a line each:

    {"k": "a", ...}   a request arrives at the scheduler: its id, its prompt's tokens
    {"k": "s", ...}   a step scheduled: the prefill tokens of each request in it (with, for a
                      new request, the tokens vLLM's prefix cache and the connector gave it),
                      the count of decodes, the call's time
    {"k": "x", ...}   the executor's execute_model, {"k": "y"} its sample_tokens: the host time
                      of queueing a step's forward and sampling on the engine thread (the KV
                      connector's worker calls run inside them)
    {"k": "u", ...}   a step's output taken in: the requests that got their first token

`t` is the wall clock (seconds) at the call's start, `d` its length. The patches wrap the
scheduler's and the executors' classes in each process as vLLM loads its plugins.
`python -m kvtier_tools.bench.report_steps` reads the files.

The same plugin sets each process's GIL switch interval where `BENCH_SWITCH_INTERVAL_MS` is set
(the serving bench's setup kvtier-switch; a shorter one made kvtier slower:
results/gpu-h200-steps-2026-12-03).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

DIR_ENV = "STEP_TRACE_DIR"
SWITCH_ENV = "BENCH_SWITCH_INTERVAL_MS"


class Recorder:
    """The lines of one process, written as they come (a killed server keeps its steps)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file: TextIO | None = None
        self._pid = 0

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None or self._pid != os.getpid():  # a forked child: a file of its own
            self._pid = os.getpid()
            self._file = (self.folder / f"steps-{self._pid}.jsonl").open("a", buffering=1)
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")


# What a line says besides its kind and times: from the call's arguments before it ran, and
# from them and its result after.
Before = Callable[[tuple], Any]
After = Callable[[Any, tuple, Any], dict[str, Any]]


def _timed(kind: str, fn: Callable, recorder: Recorder, before: Before, after: After) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        seen = before(args)
        t0 = time.time()
        out = fn(*args, **kwargs)
        row = {"k": kind, "t": t0, "d": time.time() - t0}
        row.update(after(out, args, seen))
        recorder.write(row)
        return out

    return call


def _none(args: tuple) -> None:
    return None


def _nothing(out: Any, args: tuple, seen: None) -> dict[str, Any]:
    return {}


def _arrival(out: Any, args: tuple, seen: None) -> dict[str, Any]:
    request = args[1]
    return {"id": request.request_id, "n": request.num_prompt_tokens}


def _scheduled(out: Any, args: tuple, seen: None) -> dict[str, Any]:
    counts = out.num_scheduled_tokens
    return {
        "n": out.total_num_scheduled_tokens,
        "p": {rid: n for rid, n in counts.items() if n > 1},
        "dec": sum(n == 1 for n in counts.values()),
        "new": [[r.req_id, r.num_computed_tokens] for r in out.scheduled_new_reqs],
    }


def _without_output(args: tuple) -> list[str]:
    """The step's requests that have no output token yet (before its output is taken in)."""
    requests, output = args[0].requests, args[1]
    return [
        rid
        for rid in output.num_scheduled_tokens
        if rid in requests and requests[rid].num_output_tokens == 0
    ]


def _got_first(out: Any, args: tuple, seen: list[str]) -> dict[str, Any]:
    requests = args[0].requests
    got = [r for r in seen if r not in requests or requests[r].num_output_tokens > 0]
    return {"n": args[1].total_num_scheduled_tokens, "first": got}


_installed: set[str] = set()


def install(folder: Path) -> None:
    """Wrap vLLM's scheduler and executors so that each call writes its line (once a process)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if str(folder) in _installed:
        return
    _installed.add(str(folder))
    recorder = Recorder(folder)
    wraps: list[tuple[type, str, str, Before, After]] = [
        (Scheduler, "add_request", "a", _none, _arrival),
        (Scheduler, "schedule", "s", _none, _scheduled),
        (Scheduler, "update_from_output", "u", _without_output, _got_first),
    ]
    for executor in (UniProcExecutor, MultiprocExecutor):
        wraps += [
            (executor, "execute_model", "x", _none, _nothing),
            (executor, "sample_tokens", "y", _none, _nothing),
        ]
    for cls, name, kind, before, after in wraps:
        setattr(cls, name, _timed(kind, getattr(cls, name), recorder, before, after))


def register() -> None:
    """vLLM's plugin entry point (pyproject.toml), called in each of its processes: the
    patches, where `STEP_TRACE_DIR` is set; the interpreter's switch interval, where
    `BENCH_SWITCH_INTERVAL_MS` is set (an experiment's knob, any setup's: how long a thread
    that wants the GIL waits before the thread that holds it must let go; Python's 5 ms)."""
    folder = os.environ.get(DIR_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        install(Path(folder))
    switch_ms = os.environ.get(SWITCH_ENV)
    if switch_ms:
        sys.setswitchinterval(float(switch_ms) / 1e3)
