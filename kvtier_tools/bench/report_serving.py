"""The tables of a serving run (kvtier_tools.bench.serving): a row per record, each setup's
mean TTFT by round and by turn, and `vllm bench serve`'s runs twice.

`python -m kvtier_tools.bench.report_serving CHAT.json`: the tables by round and by turn of a
run packed for results/ (kvtier_tools.bench.pack). With `--by-steps CHAT.json...`: over every
round of those runs, each setup's mean TTFT fitted to the round's count of steps past 512
tokens (results/gpu-h200-ab-2026-12-02/README.md)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvtier_tools.bench.chat import Record, same_outputs


def serve_twice_table(rows: dict[str, dict]) -> list[str]:
    """The runs' figures, and how many of each setup's second-run outputs equal the first
    setup's first-run outputs (the reference: plain vLLM's recompute, when it runs first)
    and its own first run's (greedy; a bf16 near-tie under another batch may still part)."""
    ran = [r for r in rows.values() if "error" not in r]
    reference = ran[0]["outputs"]["first"] if ran else []
    lines = [
        "| setup | first: median / mean / p99 TTFT ms | second | second / first (median) | "
        "req/s first, second | failed | second's outputs = the reference's, = its first's |",
        "|---" * 7 + "|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(
                f"| {name} | failed to run: "
                f"{r['error'].splitlines()[-1][:120] if r['error'] else '?'} ||||||"
            )
            continue
        a, b, outputs = r["first"], r["second"], r["outputs"]
        lines.append(
            f"| {name} | {_three(a)} | {_three(b)} | {r['second_vs_first_median']:.3f} | "
            f"{a.get('Request throughput (req/s)', 0):.2f}, "
            f"{b.get('Request throughput (req/s)', 0):.2f} | "
            f"{a.get('Failed requests', 0) + b.get('Failed requests', 0):.0f} | "
            f"{_equal(outputs['second'], reference)}, "
            f"{_equal(outputs['second'], outputs['first'])} |"
        )
    return lines


def _equal(these: list[str], those: list[str]) -> str:
    """Outputs equal in both, of the requests both ran (a failed request's empty text never
    counts)."""
    return f"{sum(bool(a) and a == b for a, b in zip(these, those))}/{min(len(these), len(those))}"


def _three(f: dict[str, float]) -> str:
    return f"{f['Median TTFT (ms)']:.1f} / {f['Mean TTFT (ms)']:.1f} / {f['P99 TTFT (ms)']:.1f}"


def by_round(records: dict[str, Record]) -> list[str]:
    """Each setup's mean TTFT per round ("x#k"), their median, and its ratio to the first
    setup's in the same round (median over rounds): what a setup costs beside another; and
    per round the share of requests sent in lockstep (chat.bunched), what a round's mean TTFT
    followed at capacity."""
    rounds: dict[str, dict[str, tuple[float, float]]] = {}  # setup -> round -> (mean TTFT, req/s)
    # setup -> vLLM's (queue, prefill) ms per round
    phases: dict[str, list[tuple[float, float]]] = {}
    lockstep: dict[str, list[float | None]] = {}  # setup -> share of sends bunched, per round
    for key, rec in records.items():
        name, _, r = key.partition("#")
        if r and rec.summary.get("ttft_mean_ms") is not None:
            rounds.setdefault(name, {})[r] = (
                rec.summary["ttft_mean_ms"],
                rec.summary["requests_per_s"],
            )
            lockstep.setdefault(name, []).append(rec.summary.get("sent_bunched"))
            if rec.summary.get("queue_ms_mean") is not None:
                phases.setdefault(name, []).append(
                    (rec.summary["queue_ms_mean"], rec.summary["prefill_ms_mean"])
                )
    if not rounds:
        return []
    first = next(iter(rounds.values()))
    lines = [
        "| setup | mean TTFT ms by round | median | / first setup, same round (median) | "
        "req/s / first setup's (median) | rounds it leads the first setup on both | "
        "vLLM's queue / prefill ms (medians) | sent in lockstep by round |",
        "|---" * 8 + "|",
    ]
    for name, by in rounds.items():
        paired = [(m / first[r][0], q / first[r][1]) for r, (m, q) in by.items() if r in first]
        leads = sum(t < 1 and q > 1 for t, q in paired)
        split = phases.get(name)
        split_ms = (
            f"{statistics.median(q for q, _ in split):.1f} / "
            f"{statistics.median(p for _, p in split):.1f}"
            if split
            else "—"
        )
        lines.append(
            f"| {name} | {' '.join(f'{m:.1f}' for m, _ in by.values())} | "
            f"{statistics.median(m for m, _ in by.values()):.1f} | "
            f"{statistics.median(t for t, _ in paired):.3f} | "
            f"{statistics.median(q for _, q in paired):.3f} | "
            f"{leads} of {len(paired)} | {split_ms} | "
            f"{' '.join('—' if b is None else f'{b:.2f}' for b in lockstep[name])} |"
        )
    return lines


def table(records: dict[str, Record]) -> list[str]:
    """A row per record; its outputs compared with those of the first record of its round
    (the same prompts: a resident run's rounds send different ones)."""
    firsts: dict[str, Record] = {}
    for key, rec in records.items():
        firsts.setdefault(key.partition("#")[2], rec)
    lines = [
        "| setup | TTFT mean ms | TTFT p99 ms | req/s | output tok/s | connector hit rate | "
        "GPU prefix hit rate | in flight mean / max | "
        "kvtier lookup ms (share of the run, longest since the start) | "
        "kvtier: a step's forward waiting for its loads, ms (steps; loads, started ahead) | "
        "vLLM's queue / prefill / ITL ms | "
        "vLLM steps over 512 tokens | failed | outputs equal to the round's first |",
        "|---" * 14 + "|",
    ]
    for name, rec in records.items():
        s = rec.summary
        equal, both = same_outputs(rec, firsts[name.partition("#")[2]])
        lines.append(
            f"| {name} | {_ms(s['ttft_mean_ms'])} | {_ms(s['ttft_p99_ms'])} | "
            f"{s['requests_per_s']:.2f} | "
            f"{s['output_tokens_per_s']:.1f} | {s['connector_hit_rate']:.2f} | "
            f"{s['gpu_prefix_hit_rate']:.2f} | {s['mean_in_flight']:.1f} / {s['max_in_flight']} | "
            f"{_lookups(s)} | {_load_waits(s)} | "
            f"{_ms(s.get('queue_ms_mean'))} / {_ms(s.get('prefill_ms_mean'))} / "
            f"{_ms(s.get('itl_ms_mean'))} | {_steps(s)} | {s['failed']} | {equal}/{both} |"
        )
    return lines


def _steps(s: dict) -> str:
    """vLLM's steps with more tokens than it captures in CUDA graphs, of all (chat.STEPS; records
    from before 2026-11-28 22:40 UTC have none)."""
    return (
        "—" if s.get("steps") is None else f"{s['steps_over_512_tokens']:.0f} of {s['steps']:.0f}"
    )


def _lookups(s: dict) -> str:
    """kvtier's mean lookup and the share of the run vLLM's scheduler spent in lookups (records
    from before 2026-11-28 have neither; other connectors make none)."""
    if s.get("lookup_ms_mean") is None:
        return "—"
    longest = (
        f", longest {s['lookup_ms_longest']:.1f}" if s.get("lookup_ms_longest") is not None else ""
    )
    return f"{s['lookup_ms_mean']:.2f} ({100 * s['lookup_share']:.1f} %{longest})"


def _load_waits(s: dict) -> str:
    """How long a step's forward waited on the GPU for the loads queued in it, mean over the
    steps that had such loads (kvtier's load_wait counters; records from before 2026-12-01
    have none)."""
    steps = s.get("load_wait_steps")
    if not steps:
        return "—"
    loads = f"{s['step_loads']:.0f}, {s['step_loads_ahead']:.0f}"
    return f"{s['load_wait_ms_mean']:.2f} ({steps:.0f}; {loads})"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"  # None: no request succeeded


def by_turn(records: dict[str, Record]) -> list[str]:
    """Each setup's mean TTFT of each turn of its conversations (the median over rounds): turn
    0 is cold, and a later turn is served by vLLM's own cache, by an offloader's load of what
    the GPU evicted, or both; and the mean over all turns (the median over rounds)."""
    turns: dict[str, list[dict[int, float]]] = {}  # setup -> per round: turn -> mean TTFT ms
    overall: dict[str, list[float]] = {}
    for key, rec in records.items():
        done = _done(rec)
        if not done:
            continue
        by: dict[int, list[float]] = {}
        for r in done:
            by.setdefault(r["turn"], []).append(1e3 * r["ttft_s"])
        name = key.partition("#")[0]
        turns.setdefault(name, []).append({t: statistics.mean(v) for t, v in by.items()})
        overall.setdefault(name, []).append(statistics.mean(1e3 * r["ttft_s"] for r in done))
    if not turns:
        return []
    last = max(t for rounds in turns.values() for by in rounds for t in by)
    lines = [
        "| setup | " + " | ".join(f"turn {t}" for t in range(last + 1)) + " | all |",
        "|---" * (last + 3) + "|",
    ]
    for name, rounds in turns.items():
        cells = [
            _ms(statistics.median(by[t] for by in rounds if t in by))
            if any(t in by for by in rounds)
            else "—"
            for t in range(last + 1)
        ]
        lines.append(f"| {name} | {' | '.join(cells)} | {_ms(statistics.median(overall[name]))} |")
    return lines


def offloader_floor(records: dict[str, Record]) -> list[str]:
    """Where a round ran both `plain` (vLLM alone, the small GPU cache) and `plain-gpu-all`
    (every conversation in its GPU cache): the floor of an offloader beside that small cache.
    Its turn 0 is plain's (the cold prompts meet the same GPU cache; nothing to load), every
    later turn plain-gpu-all's (a hit as fast as vLLM's own). Each setup's mean TTFT over the
    floor's of its round (median), and the floor's mean by round."""
    floors: dict[str, float] = {}  # round -> the floor's mean TTFT, ms
    for key, rec in records.items():
        name, _, r = key.partition("#")
        other = records.get(f"plain-gpu-all#{r}")
        if name != "plain" or other is None:
            continue
        cold = [x["ttft_s"] for x in _done(rec) if x["turn"] == 0]
        hits = [x["ttft_s"] for x in _done(other) if x["turn"] > 0]
        if cold and hits:
            floors[r] = 1e3 * statistics.mean(cold + hits)
    if not floors:
        return []
    lines = [
        "| setup | mean TTFT / the offloader's floor, same round (median) | rounds | "
        "its mean TTFT with plain's turn 0, ms, by round |",
        "|---|---|---|---|",
        f"| the floor (plain's turn 0, plain-gpu-all's later turns) | 1 | "
        f"{' '.join(f'{m:.1f}' for m in floors.values())} ms | |",
    ]
    ratios: dict[str, list[float]] = {}
    swapped: dict[str, list[float]] = {}  # its mean TTFT with plain's turn 0, ms, by round
    for key, rec in records.items():
        name, _, r = key.partition("#")
        if r in floors and rec.summary.get("ttft_mean_ms") is not None:
            ratios.setdefault(name, []).append(rec.summary["ttft_mean_ms"] / floors[r])
            later = [x["ttft_s"] for x in _done(rec) if x["turn"] > 0]
            cold = [x["ttft_s"] for x in _done(records[f"plain#{r}"]) if x["turn"] == 0]
            swapped.setdefault(name, []).append(1e3 * statistics.mean(later + cold))
    for name, by in ratios.items():
        with_plains = " ".join(f"{m:.1f}" for m in swapped[name])
        lines.append(f"| {name} | {statistics.median(by):.3f} | {len(by)} | {with_plains} |")
    return lines


def first_turns(records: dict[str, Record], burst: int = 12) -> list[str]:
    """Each setup's turn-0 TTFT by the order sent, the mean over its rounds after the first
    (round 1 of records made before 2026-12-03 had a warm system prompt): the first `burst`
    one by one (the cold prompts and those queued behind them), then the mean of the rest."""
    rounds: dict[str, list[list[float]]] = {}
    for key, rec in records.items():
        name, _, r = key.partition("#")
        if r in ("", "1"):
            continue
        first = sorted((x for x in _done(rec) if x["turn"] == 0), key=lambda x: x["sent_s"])
        rounds.setdefault(name, []).append([1e3 * x["ttft_s"] for x in first])
    if not rounds:
        return []
    lines = [
        "| setup | " + " | ".join(str(i) for i in range(burst)) + " | the rest | rounds |",
        "|---" * (burst + 3) + "|",
    ]
    for name, by in rounds.items():
        means = [statistics.mean(v) for v in zip(*by)]
        cells = " | ".join(f"{m:.0f}" for m in means[:burst])
        rest = f"{statistics.mean(means[burst:]):.1f}" if means[burst:] else "—"
        lines.append(f"| {name} | {cells} | {rest} | {len(by)} |")
    return lines


def _done(rec: Record) -> list[dict]:
    """A record's requests that did not fail."""
    return [x for x in rec.results if not x.get("error")]


def by_steps(rounds: list[tuple[str, dict]]) -> list[str]:
    """(setup or setup#round, summary) of many rounds: per setup, the least-squares line of a
    round's mean TTFT on its steps past 512 tokens, their correlation and the mean count (rounds
    that do not count those steps left out; a setup with fewer than 3 rounds left out)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for name, s in rounds:
        if s.get("steps_over_512_tokens") is not None and s.get("ttft_mean_ms") is not None:
            point = (float(s["steps_over_512_tokens"]), float(s["ttft_mean_ms"]))
            points.setdefault(name.partition("#")[0], []).append(point)
    lines = [
        "| setup | rounds | mean TTFT ms = a + b x steps over 512 tokens | r | steps a round |",
        "|---|---|---|---|---|",
    ]
    for name, xy in points.items():
        steps, ttft = [x for x, _ in xy], [y for _, y in xy]
        if len(xy) < 3 or len(set(steps)) < 2:
            continue
        slope, intercept = statistics.linear_regression(steps, ttft)
        r = statistics.correlation(steps, ttft)
        lines.append(
            f"| {name} | {len(xy)} | {intercept:.1f} + {slope:.2f} x | {r:.2f} "
            f"| {statistics.mean(steps):.1f} |"
        )
    return lines


def unpacked(packed: dict) -> dict[str, Record]:
    """kvtier_tools.bench.pack's records as Records (no token ids: no outputs compared)."""
    return {
        name: Record(
            rec["workload"],
            "",
            [dict(zip(rec["request_fields"], row)) for row in rec["requests"]],
            rec["summary"],
        )
        for name, rec in packed.items()
        if not name.startswith("_")
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "packed", nargs="+", help="a serving run's records packed by kvtier_tools.bench.pack"
    )
    p.add_argument(
        "--by-steps", action="store_true", help="fit every round of these runs, not the tables"
    )
    args = p.parse_args()
    runs = [unpacked(json.loads(Path(f).read_text())) for f in args.packed]
    if args.by_steps:
        rounds = [(name, r.summary) for records in runs for name, r in records.items()]
        print("\n".join(by_steps(rounds)))
        return
    if len(runs) != 1:
        p.error("the tables are of one run: give one file, or --by-steps")
    tables = [by_round(runs[0]), by_turn(runs[0]), offloader_floor(runs[0]), first_turns(runs[0])]
    print("\n\n".join("\n".join(t) for t in tables if t))


if __name__ == "__main__":
    main()
