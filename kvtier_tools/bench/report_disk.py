"""Tables and a plot of the disk tier's records, for the docs' benchmark page.

    python -m kvtier_tools.bench.report_disk tier RECORD [RECORD ...]
    python -m kvtier_tools.bench.report_disk ttft RECORD [--plot SVG]

`tier` reads `kvtier bench disk` records (kvtier_tools.bench.disk): the tier's writes and
reads against one sequential file of the same bytes (paired ratios, the medians of each
repeat's ratio), and how long a disk hit holds an engine step, loaded synchronously or in
the background. `ttft` reads a `kvtier bench ttft --disk` record (kvtier_tools.bench.ttft):
cold, warm from CPU RAM and warm from disk against its floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvtier_tools.bench.records import command, find, gpus, read, source


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def tier_table(paths: list[Path]) -> str:
    """A row a record and direction: tier and file GB/s (median, range), the paired ratio."""
    rows = [
        "| machine | | disk tier GB/s | one sequential file GB/s | tier / file (paired) "
        "| a disk hit holds the step: loaded in the step / in the background ms |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for path in paths:
        for rec in read(path):  # a list: one record a run of the command
            s = rec["summary"]
            host = gpus(find(path).parent)
            where = rec["machine"] + (f" ({host} host)" if host else "") + f", {rec['date']}"
            hold = f"{s['step_wait_sync_ms']:,.0f} / {s['step_wait_async_ms']:.3f}"
            for way in ("write", "read"):
                rows.append(
                    f"| {where} | {way} | {_spread(rec[f'tier_{way}_gbps'])} "
                    f"| {_spread(rec[f'file_{way}_gbps'])} | {s[f'{way}_ratio_paired']:.2f} "
                    f"| {hold if way == 'read' else ''} |"
                )
            notes.append(
                f"{rec['kv_bytes'] / 1e9:.2f} GB ({rec['shape']['tokens']:,} tokens), "
                f"{len(rec['tier_read_gbps'])} repeats: {source(path, rec)}"
            )
    return "\n".join(rows) + "\n\n" + " ".join(notes) + "\n"


def _point(path: Path) -> tuple[dict, dict]:
    rec = read(path)
    return rec, rec["points"][0]


def ttft_table(path: Path) -> str:
    """Cold, warm from CPU RAM and warm from disk (medians, ms), the disk's floor."""
    rec, pt = _point(path)
    samples = pt["samples_ms"]
    rows = [
        f"| {pt['tokens']:,} tokens | ms | range ms |",
        "|---|---|---|",
        f"| cold prefill | {pt['cold_s'] * 1e3:,.0f} | {_range(samples['cold'])} |",
        f"| warm from CPU RAM | {pt['warm_s'] * 1e3:,.1f} | {_range(samples['warm'])} |",
        f"| warm from disk | {pt['warm_disk_s'] * 1e3:,.0f} | {_range(samples['warm_disk'])} |",
        f"| the disk's floor: KV bytes / a sequential file read + a 1-token forward "
        f"| {pt['disk_floor_s'] * 1e3:,.0f} | |",
        f"| warm from disk / its floor | {pt['warm_disk_over_disk_floor']:.3f} | |",
        f"| warm from disk / cold | {pt['warm_disk_s'] / pt['cold_s']:.2f} | |",
        "",
        f"Medians of {rec['repeats']} repeats, transformers, {rec['dtype']}. " + source(path, rec),
    ]
    return "\n".join(rows) + "\n"


def _range(values: list[float]) -> str:
    return f"{min(values):,.0f}-{max(values):,.0f}"


def ttft_plot(path: Path, out: Path, note: str = "") -> None:
    """One group of bars: cold, warm from CPU RAM, warm from disk, the disk's floor."""
    from kvtier_tools.bench.plot import bars

    rec, pt = _point(path)
    series = {
        "cold prefill": [pt["cold_s"] * 1e3],
        "warm from CPU RAM": [pt["warm_s"] * 1e3],
        "warm from disk": [pt["warm_disk_s"] * 1e3],
        "the disk's floor": [pt["disk_floor_s"] * 1e3],
    }
    where = source(path, rec).split(";")[0]
    title = f"TTFT from the disk tier, lower is better ({where})"
    out.write_text(bars([f"{pt['tokens'] // 1024}k tokens"], series, title, "ms", note=note))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tier", help="`kvtier bench disk` records: a table")
    t.add_argument("records", type=Path, nargs="+")
    w = sub.add_parser("ttft", help="a `kvtier bench ttft --disk` record: table, or --plot")
    w.add_argument("record", type=Path)
    w.add_argument("--plot", type=Path, help="write the TTFT bars here (SVG)")
    args = p.parse_args()
    if args.what == "tier":
        print(tier_table(args.records), end="")
    elif args.plot is not None:
        ttft_plot(args.record, args.plot, command("kvtier_tools.bench.report_disk"))
    else:
        print(ttft_table(args.record), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
