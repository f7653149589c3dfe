"""`python -m kvtier_tools.bench.report_steps DIR...`: the engine steps that
`kvtier_tools.bench.step_trace` recorded for each server (DIR: a server's folder, e.g. a serving
run's `<out>/<setup>`), round by round, side by side.

A round is `--per-round` requests in a row (the chat workload's conversations times turns),
after a server's `--warm-up` first requests (the serving bench's one); a last round cut short
is left out. For each round and folder, its first
`--window` seconds, a line a step:

    at      ms from the round's first arrival to the step's scheduling
    out     ms from its scheduling until its output was taken in (the forward, the wait in the
            batch queue behind the step before, the sampled tokens' copy)
    host    ms the engine thread spent queueing its forward and its sampling (execute_model,
            sample_tokens: the KV connector's worker calls run in them)
    tokens  the step's tokens; then each prefill in it as request:tokens (requests numbered by
            arrival in the round; `+h` the tokens its first step found cached), decodes as `d`
    first   the requests whose first token this step gave

and then, per round and folder, each request's time from arrival to first token (`ttft`, the
first `--requests` by arrival) and the engine thread's host time over the window.

With `--chat <chat.json>` (the serving run's records, packed by kvtier_tools.bench.pack; a
folder's name is its setup's) it prints instead, per folder, two tables over all its rounds:
by conversation turn, where a request's time to its first token went (the engine's wait and
run, the paths in and out of it); and by what a step held, the engine thread's calls a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Step:
    at: float  # wall clock at scheduling
    tokens: int
    prefills: dict[str, int]
    decodes: int
    cached: dict[str, int]  # a new request's tokens found cached (prefix cache, connector)
    schedule: float = 0.0  # seconds in the scheduler's schedule()
    execute: float = 0.0  # in the executor's execute_model (the forward queued)
    sample: float = 0.0  # in its sample_tokens (the KV connector's wait_for_save runs there)
    out: float | None = None  # wall clock when its output was taken in
    first: list[str] = field(default_factory=list)

    @property
    def host(self) -> float:
        return self.execute + self.sample


@dataclass
class Round:
    arrivals: dict[str, float]  # request id: wall clock, in arrival order
    steps: list[Step]


def read(folder: Path) -> tuple[dict[str, float], list[Step]]:
    """Every arrival and scheduled step in a server's folder (its engine process's file)."""
    arrivals: dict[str, float] = {}
    steps: list[Step] = []
    waiting: list[Step] = []  # scheduled, output not yet taken in (vLLM's batch queue: FIFO)
    for path in sorted(folder.glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            kind = row["k"]
            if kind == "a":
                arrivals[row["id"]] = row["t"]
            elif kind == "s":
                step = Step(row["t"], row["n"], row["p"], row["dec"], dict(row["new"]), row["d"])
                steps.append(step)
                waiting.append(step)
            elif kind == "x" and steps:
                steps[-1].execute += row["d"]
            elif kind == "y" and steps:
                steps[-1].sample += row["d"]
            elif kind == "u" and waiting:
                done = waiting.pop(0)
                done.out, done.first = row["t"], row["first"]
    return arrivals, steps


def rounds(
    arrivals: dict[str, float], steps: list[Step], per_round: int, warm_up: int = 1
) -> list[Round]:
    """The server's requests after its `warm_up` first, `per_round` at a time (a last round
    cut short is left out), each with the steps scheduled from its first request to the next
    round's."""
    ordered = sorted(arrivals.items(), key=lambda kv: kv[1])[warm_up:]
    cut = [
        dict(ordered[i : i + per_round]) for i in range(0, len(ordered) - per_round + 1, per_round)
    ]
    out = []
    for i, group in enumerate(cut):
        end = _begin(cut[i + 1]) if i + 1 < len(cut) else float("inf")
        out.append(Round(group, [s for s in steps if _begin(group) <= s.at < end]))
    return out


def _begin(group: dict[str, float]) -> float:
    return min(group.values())


def _name(rid: str, numbers: dict[str, int]) -> str:
    return str(numbers[rid]) if rid in numbers else "?"


def _cell(step: Step, begin: float, numbers: dict[str, int]) -> str:
    parts = []
    for rid, n in step.prefills.items():
        hit = f"+h{step.cached[rid]}" if step.cached.get(rid) else ""
        parts.append(f"{_name(rid, numbers)}:{n}{hit}")
    if step.decodes:
        parts.append(f"{step.decodes}d")
    out = "  -  " if step.out is None else f"{(step.out - step.at) * 1e3:5.1f}"
    first = ",".join(_name(r, numbers) for r in step.first)
    return (
        f"{(step.at - begin) * 1e3:7.1f} {out} {step.host * 1e3:5.1f} {step.tokens:5d} "
        f"{' '.join(parts)}" + (f" first {first}" if first else "")
    )


def ttfts(r: Round) -> list[float]:
    """Each request's ms from arrival to first token, by arrival."""
    got = firsts(r)[1]
    return [(got[rid] - t) * 1e3 if rid in got else float("nan") for rid, t in r.arrivals.items()]


def report(
    folders: list[Path], per_round: int, window: float, requests: int, warm_up: int = 1
) -> list[str]:
    per = [rounds(*read(f), per_round, warm_up) for f in folders]
    lines = ["per step: at, out, host (ms), tokens, prefills request:tokens(+h cached), decodes"]
    for n in range(max((len(p) for p in per), default=0)):
        for folder, rs in zip(folders, per):
            if n >= len(rs):
                continue
            r = rs[n]
            begin = _begin(r.arrivals)
            numbers = {rid: i for i, rid in enumerate(r.arrivals)}
            shown = [s for s in r.steps if s.at - begin <= window]
            lines.append(f"round {n + 1}, {folder.name}: {len(shown)} steps in {window} s")
            lines += ["  " + _cell(s, begin, numbers) for s in shown if s.tokens]
            host = sum(s.host for s in shown) * 1e3
            ttft = " ".join(f"{t:.0f}" for t in ttfts(r)[:requests])
            lines.append(f"  host {host:.1f} ms; ttft by arrival: {ttft}")
    return lines


# -- beside the client's records (kvtier_tools.bench.serving's, packed) ------------------------


def firsts(r: Round) -> tuple[dict[str, float], dict[str, float]]:
    """Each request's first scheduling and the output of the step that gave its first token."""
    scheduled: dict[str, float] = {}
    first: dict[str, float] = {}
    for s in r.steps:
        for rid in s.prefills:
            scheduled.setdefault(rid, s.at)
        first.update({rid: s.out for rid in s.first if s.out is not None})
    return scheduled, first


def matched(r: Round, requests: list[dict]) -> list[tuple[str, dict]]:
    """(request id, the client's record) of each request, matched by order (the client's sends,
    the engine's arrivals)."""
    return list(zip(r.arrivals, sorted(requests, key=lambda q: q["sent_s"])))


def by_turn(rs: list[Round], records: list[list[dict]]) -> list[str]:
    """Per conversation turn, means in ms: the engine's wait (arrival to first scheduling) and
    run (to the step that gave the first token), and the paths around it against the round's
    first request (the clocks differ): in (the client's send to the engine's arrival), out
    (that step's output to the client's first token), and the client's TTFT."""
    rows: dict[int, list[tuple[float, ...]]] = {}
    for r, requests in zip(rs, records):
        scheduled, first = firsts(r)
        pairs = matched(r, requests)
        a0, s0 = r.arrivals[pairs[0][0]], pairs[0][1]["sent_s"]
        for rid, q in pairs:
            if rid not in first or q["ttft_s"] is None:
                continue
            arrived = r.arrivals[rid]
            rows.setdefault(q["turn"], []).append(
                (
                    scheduled[rid] - arrived,
                    first[rid] - scheduled[rid],
                    (arrived - a0) - (q["sent_s"] - s0),
                    (q["sent_s"] + q["ttft_s"] - s0) - (first[rid] - a0),
                    q["ttft_s"],
                )
            )
    out = [
        "| turn | requests | wait | run | in | out | client TTFT |",
        "|---|---|---|---|---|---|---|",
    ]
    for turn, values in sorted(rows.items()):
        means = [statistics.mean(v[i] for v in values) * 1e3 for i in range(5)]
        out.append(f"| {turn} | {len(values)} | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    return out


def host_by_kind(rs: list[Round], records: list[list[dict]]) -> list[str]:
    """The engine thread's calls a step (median ms) by what the step holds: decodes only,
    prefills over 512 tokens, or up to 512 by their requests' turns."""
    kinds: dict[str, list[Step]] = {}
    for r, requests in zip(rs, records):
        turn_of = {rid: q["turn"] for rid, q in matched(r, requests)}
        for s in r.steps:
            if not s.tokens:
                continue
            kinds.setdefault(_kind(s, turn_of), []).append(s)
    out = ["| step | count | schedule | execute_model | sample_tokens |", "|---|---|---|---|---|"]
    for kind in sorted(kinds):
        steps = kinds[kind]
        medians = [
            statistics.median(getattr(s, f) for s in steps) * 1e3
            for f in ("schedule", "execute", "sample")
        ]
        out.append(f"| {kind} | {len(steps)} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")
    return out


def _kind(step: Step, turn_of: dict[str, int]) -> str:
    if not step.prefills:
        return "decodes"
    if step.tokens > 512:
        return "prefill > 512"
    found = {turn_of.get(rid, -1) for rid in step.prefills}
    for name, among in (("turn 0", {0}), ("turns 1-2", {1, 2}), ("turns 3-5", {3, 4, 5})):
        if found <= among:
            return f"prefill <= 512, {name}"
    return "prefill <= 512, mixed"


def beside_records(folders: list[Path], chat: Path, per_round: int, warm_up: int = 1) -> list[str]:
    """Each folder's turn table and step-kind table, its rounds matched with `chat`'s records
    of the same setup (the folder's name) by round."""
    from kvtier_tools.bench.report_serving import unpacked

    records = unpacked(json.loads(chat.read_text()))
    lines: list[str] = []
    for folder in folders:
        rs = rounds(*read(folder), per_round, warm_up)
        mine = [records[f"{folder.name}#{k + 1}"].results for k in range(len(rs))]
        lines += [f"{folder.name}: {len(rs)} rounds", *by_turn(rs, mine), ""]
        lines += [*host_by_kind(rs, mine), ""]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="servers' folders (steps-*.jsonl)")
    p.add_argument("--per-round", type=int, required=True, help="requests a round")
    p.add_argument("--window", type=float, default=1.0, help="seconds of each round shown")
    p.add_argument("--requests", type=int, default=16, help="TTFTs shown a round")
    p.add_argument("--warm-up", type=int, default=1, help="a server's requests before its rounds")
    p.add_argument(
        "--chat", type=Path, help="the run's records (bench.pack): the turn and step-kind tables"
    )
    args = p.parse_args()
    if args.chat:
        for line in beside_records(args.folders, args.chat, args.per_round, args.warm_up):
            print(line)
        return
    for line in report(args.folders, args.per_round, args.window, args.requests, args.warm_up):
        print(line)


if __name__ == "__main__":
    main()
