"""`python -m kvtier_tools.bench.steps LOG...`: vLLM's steps as kvtier's traced calls show them
in a server's log, round by round, the start of each round side by side for several logs.

With `KVTIER_TRACE_STALLS_MS=0` in its environment a server logs every traced call of kvtier on
vLLM's engine thread (kvtier/stalls.py: lookup, start_load_kv, wait_for_save, get_finished,
build_connector_meta) with its end time (ms) and duration. vLLM calls start_load_kv once a step,
before the step's forward: its start is taken as the step's. For each step: when it began
(from its round's first call), how long until the next began, how long kvtier held the engine
thread from this step's start to the next's (every traced call in between), and the stores
logged there. Rounds are parted by `--idle` seconds without a call (the serving bench's rounds
are seconds apart). `--window` seconds of each round are printed, step by step, a column per
log: e.g. kvtier and kvtier-consumer in the chat workload (scripts/warm_ttft.sh, `CHAT_ARGS`),
where the cold burst's steps differ.

`--by-call` prints instead, per log, each traced call's count, total, mean and CPU time, and
its time per lookup (a lookup is one request): what kvtier holds vLLM's engine thread for,
a request at a time (results/gpu-h200-ab-2026-12-02/README.md).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

STAMP = r"(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
CALL = re.compile(
    STAMP
    + r": slow call on the engine's thread: (?P<name>\w+) took (?P<ms>[\d.]+) ms"
    + r" \(cpu (?P<cpu>[\d.]+)"
)
STORE = re.compile(STAMP + r": Storing KV cache for (?P<tokens>\d+) out of")


@dataclass(frozen=True)
class Call:
    name: str
    begin: float  # seconds (the epoch)
    seconds: float
    cpu: float  # seconds of it on the thread's CPU


@dataclass(frozen=True)
class Step:
    begin: float  # seconds since its round's first call
    length: float | None  # until the next step began (None: the round's last)
    kvtier: float  # seconds of traced calls from its start to the next step's
    stores: int
    stored_tokens: int


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read(path: Path) -> tuple[list[Call], list[tuple[float, int]]]:
    """The traced calls (by their start) and the stores (end time, tokens) in a log."""
    calls: list[Call] = []
    stores: list[tuple[float, int]] = []
    for line in path.read_text(errors="replace").splitlines():
        if m := CALL.search(line):
            seconds = float(m["ms"]) / 1e3
            calls.append(
                Call(m["name"], _seconds(m["at"]) - seconds, seconds, float(m["cpu"]) / 1e3)
            )
        elif m := STORE.search(line):
            stores.append((_seconds(m["at"]), int(m["tokens"])))
    calls.sort(key=lambda c: c.begin)
    return calls, stores


def rounds(calls: list[Call], idle: float) -> list[list[Call]]:
    """The calls parted where none came for `idle` seconds."""
    out: list[list[Call]] = []
    last = None
    for call in calls:
        if last is None or call.begin - last > idle:
            out.append([])
        out[-1].append(call)
        last = call.begin + call.seconds
    return out


def steps(calls: list[Call], stores: list[tuple[float, int]]) -> list[Step]:
    """A round's steps, each from a start_load_kv to the next."""
    if not calls:
        return []
    t0 = calls[0].begin
    last = max(c.begin + c.seconds for c in calls) + 0.001  # the stamps are whole ms
    starts = [c.begin for c in calls if c.name == "start_load_kv"]
    out = []
    for i, begin in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else last
        held = sum(c.seconds for c in calls if begin <= c.begin < end)
        mine = [tokens for at, tokens in stores if begin <= at < end]
        length = end - begin if i + 1 < len(starts) else None
        out.append(Step(begin - t0, length, held, len(mine), sum(mine)))
    return out


def _cell(step: Step | None) -> str:
    if step is None:
        return " " * 40
    length = "   -  " if step.length is None else f"{step.length * 1e3:6.1f}"
    stores = f"{step.stores} ({step.stored_tokens} tok)" if step.stores else ""
    return f"{step.begin * 1e3:7.1f} {length} {step.kvtier * 1e3:5.1f}  {stores:<14}"


def report(paths: list[Path], window: float, idle: float) -> list[str]:
    """Each round's first `window` seconds of steps, a column per log."""
    per_log = []
    for path in paths:
        calls, stores = read(path)
        per_log.append([steps(r, stores) for r in rounds(calls, idle)])
    lines = [
        "per step: its start (ms into the round), its length, kvtier's calls in it (ms), stores"
    ]
    for n in range(max(len(r) for r in per_log)):
        lines.append(f"round {n + 1}: " + " | ".join(p.name for p in paths))
        columns = [
            [s for s in (log[n] if n < len(log) else []) if s.begin <= window] for log in per_log
        ]
        for i in range(max(len(c) for c in columns)):
            lines.append(" | ".join(_cell(c[i] if i < len(c) else None) for c in columns))
        for path, column in zip(paths, columns):
            held = sum(s.kvtier for s in column) * 1e3
            lines.append(f"  {path.name}: {len(column)} steps, kvtier's calls {held:.1f} ms")
    return lines


def by_call(paths: list[Path]) -> list[str]:
    """Each log's traced calls by name: count, total, mean and CPU time, and time a lookup."""
    lines = []
    for path in paths:
        calls, _ = read(path)
        names = sorted({c.name for c in calls})
        lookups = sum(c.name == "lookup" for c in calls)

        def a_lookup(seconds: float) -> str:
            return f"{seconds * 1e3 / lookups:.3f}" if lookups else "-"

        lines += [
            f"{path.name}: {len(calls)} calls, {lookups} lookups",
            "| call | count | total ms | mean ms | CPU of it | ms a lookup |",
            "|---|---|---|---|---|---|",
        ]
        for name in names:
            mine = [c for c in calls if c.name == name]
            total = sum(c.seconds for c in mine)
            cpu = sum(c.cpu for c in mine)
            share = f"{cpu / total:.2f}" if total else "-"
            lines.append(
                f"| {name} | {len(mine)} | {total * 1e3:.1f} | {total * 1e3 / len(mine):.3f} "
                f"| {share} | {a_lookup(total)} |"
            )
        total = sum(c.seconds for c in calls)
        lines.append(f"| all | {len(calls)} | {total * 1e3:.1f} | | | {a_lookup(total)} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path, help="servers' logs (KVTIER_TRACE_STALLS_MS=0)")
    p.add_argument("--window", type=float, default=0.8, help="seconds of each round to print")
    p.add_argument("--idle", type=float, default=1.0, help="seconds without a call between rounds")
    p.add_argument("--by-call", action="store_true", help="each call's totals, not the steps")
    args = p.parse_args()
    lines = by_call(args.logs) if args.by_call else report(args.logs, args.window, args.idle)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
