"""Tables and a plot of the disaggregated-prefill records, for the docs' benchmark page.

    python -m kvtier_tools.bench.report_pd transfer RECORD [--plot SVG]
    python -m kvtier_tools.bench.report_pd vllm RECORD [RECORD ...]

`transfer` reads a `kvtier bench pd` record (kvtier_tools.bench.pd): each channel, variant
and length, the send against a plain GPU0 -> GPU1 copy of the same bytes timed in the same
run (the ratio is the median of each repeat's copy / send where the record keeps its
repeats). `vllm` reads `kvtier_tools.bench.pd_vllm` records: 1P1D inside vLLM, through the
proxy, against the decoder prefilling alone and its own prefix hit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvtier_tools.bench.records import command, read, source

# `kvtier bench pd --pieces` variants, as the tables name them.
VARIANTS = {
    "default": "lone send",
    "forward=20": "behind a 20 ms forward (vLLM's flow)",
    "first=256": "lone send, 256 MiB groups",
    "gather-after-alloc": "lone send, gather after the Alloc",
    "sync-commit": "lone send, Commit after the writes",
}


# The same, short enough for a plot's legend.
SHORT = {
    "default": "lone send",
    "forward=20": "behind a forward",
    "first=256": "lone, 256 MiB groups",
}


def variant(run: dict, names: dict[str, str] = VARIANTS) -> str:
    pieces = run.get("pieces") or "default"
    return names.get(pieces, pieces)


def ratio(run: dict) -> float:
    """The send against the copy: the median of each repeat's copy / send (paired) where the
    record keeps its repeats, else the ratio of the medians."""
    raw = run.get("raw") or {}
    if raw.get("copy_ms") and raw.get("send_ms"):
        return statistics.median(c / s for c, s in zip(raw["copy_ms"], raw["send_ms"]))
    return run["ratio_to_copy"]


def _tokens(n: int) -> str:
    return f"{n:,}"


def transfer_table(path: Path) -> str:
    """A row a channel, variant and length of a `kvtier bench pd` record."""
    rec = read(path)
    rows = [
        "| channel | how it was sent | tokens | GB | send ms | GB/s | copy GB/s "
        "| send / copy | Alloc / write / Commit ms | GPU: forward's end to last write ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in rec["runs"]:
        phases = " / ".join(f"{p:.2f}" for p in run["alloc_write_commit_ms"])
        tail = run.get("gpu_tail_ms") if (run.get("pieces") or "").startswith("forward=") else None
        rows.append(
            f"| {run['channel']} | {variant(run)} | {_tokens(run['tokens'])} | {run['GB']:.3f} "
            f"| {run['send_ms']:.2f} | {run['send_GBps']:.1f} | {run['copy_GBps']:.1f} "
            f"| {ratio(run):.3f} | {phases} | {'-' if tail is None else f'{tail:.2f}'} |"
        )
    rows += ["", f"Medians of {rec['repeats']} repeats. {source(path, rec)}"]
    return "\n".join(rows) + "\n"


def transfer_plot(path: Path, out: Path, note: str = "") -> None:
    """The send / copy ratio a length, one bar a channel and variant."""
    from kvtier_tools.bench.plot import bars

    rec = read(path)
    lengths = sorted({run["tokens"] for run in rec["runs"]})
    series: dict[str, list[float]] = {}
    channels = {run["channel"] for run in rec["runs"]}
    for run in rec["runs"]:
        name = variant(run, SHORT)
        name = name if len(channels) == 1 else f"{run['channel']}, {name}"
        series.setdefault(name, [0.0] * len(lengths))[lengths.index(run["tokens"])] = ratio(run)
    title = (
        f"PD transfer / a plain GPU0->GPU1 copy, higher is better "
        f"({source(path, rec).split(';')[0]})"
    )
    groups = [f"{n // 1024}k tokens" for n in lengths]
    out.write_text(bars(groups, series, title, "send / copy", fmt=".2f", note=note))


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def vllm_table(paths: list[Path]) -> str:
    """A row an engine and length of `kvtier_tools.bench.pd_vllm` records (medians, ms)."""
    rows = [
        "| engine | tokens | through the proxy ms | decoder prefilling alone ms "
        "| decoder's own prefix hit ms | writes after the last forward ms "
        "| tokens = the decoder's hit | parting at a near-tie | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for path in paths:
        rec = read(path)
        engine = rec.get("engine", "kvtier")
        for run in rec["runs"]:
            pairs = len(run["pd_ttft_ms"])
            sender = run.get("sender_median_ms")
            rows.append(
                f"| {engine} | {_tokens(run['tokens'])} | {_median(run['pd_ttft_ms'])} "
                f"| {_median(run['alone_ttft_ms'])} | {_median(run['hit_ttft_ms'])} "
                f"| {'-' if sender is None else f'{sender:.1f}'} | {run['equal']}/{pairs} "
                f"| {run['near_tie']} | {run['failed']} |"
            )
        notes.append(f"{engine}: {source(path, rec)}")
    rows += ["", "Medians of the pairs. " + " ".join(notes)]
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("transfer", help="a `kvtier bench pd` record: table, or --plot")
    t.add_argument("record", type=Path)
    t.add_argument("--plot", type=Path, help="write the send / copy bars here (SVG)")
    v = sub.add_parser("vllm", help="kvtier_tools.bench.pd_vllm records: a table")
    v.add_argument("records", type=Path, nargs="+")
    args = p.parse_args()
    if args.what == "vllm":
        print(vllm_table(args.records), end="")
    elif args.plot is not None:
        transfer_plot(args.record, args.plot, command("kvtier_tools.bench.report_pd"))
    else:
        print(transfer_table(args.record), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
