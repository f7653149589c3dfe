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
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Step:
    at: float  # wall clock at scheduling
    tokens: int
    prefills: dict[str, int]
    decodes: int
    cached: dict[str, int]  # a new request's tokens found cached (prefix cache, connector)
    host: float = 0.0  # execute_model + sample_tokens
    out: float | None = None  # wall clock when its output was taken in
    first: list[str] = field(default_factory=list)


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
                step = Step(row["t"], row["n"], row["p"], row["dec"], dict(row["new"]))
                steps.append(step)
                waiting.append(step)
            elif kind in "xy" and steps:
                steps[-1].host += row["d"]
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
    got = {rid: s.out for s in r.steps for rid in s.first if s.out is not None}
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
            begin = min(r.arrivals.values())
            numbers = {rid: i for i, rid in enumerate(r.arrivals)}
            shown = [s for s in r.steps if s.at - begin <= window]
            lines.append(f"round {n + 1}, {folder.name}: {len(shown)} steps in {window} s")
            lines += ["  " + _cell(s, begin, numbers) for s in shown if s.tokens]
            host = sum(s.host for s in shown) * 1e3
            ttft = " ".join(f"{t:.0f}" for t in ttfts(r)[:requests])
            lines.append(f"  host {host:.1f} ms; ttft by arrival: {ttft}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="servers' folders (steps-*.jsonl)")
    p.add_argument("--per-round", type=int, required=True, help="requests a round")
    p.add_argument("--window", type=float, default=1.0, help="seconds of each round shown")
    p.add_argument("--requests", type=int, default=16, help="TTFTs shown a round")
    p.add_argument("--warm-up", type=int, default=1, help="a server's requests before its rounds")
    args = p.parse_args()
    for line in report(args.folders, args.per_round, args.window, args.requests, args.warm_up):
        print(line)


if __name__ == "__main__":
    main()
