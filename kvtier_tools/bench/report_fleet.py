"""The table and plot of a `kvtier bench fleet` record, for the docs' benchmark page.

    python -m kvtier_tools.bench.report_fleet RECORD [--plot SVG]

A row a workload and setup: the connector hit rate over the fleet, mean and p99 TTFT at the
client, failed requests; the machine, date and command under the table. The plot: mean TTFT
per workload, a bar a setup.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier_tools.bench.fleet import table
from kvtier_tools.bench.plot import bars


def report(record: dict) -> str:
    if record.get("gpus"):
        layers = record.get("model", {}).get("num_hidden_layers", "?")
        what = f"over {record['gpus']} GPUs, a seeded Llama of {layers} layers"
    else:
        what = "CPU build, tiny Llama"
    return (
        table(record)
        + f"\n\n{record['instances']} vLLM instances ({what}) on "
        + f"{record.get('machine', 'one host')}, {record['date']}: `{record['command']}`"
    )


def plot(record: dict) -> str:
    workloads = list(record["workloads"])
    series = {
        setup: [by[w]["ttft_mean_ms"] for w in workloads] for setup, by in record["setups"].items()
    }
    title = f"{record['instances']} vLLM instances behind kvtier router: mean TTFT"
    note = f"{record.get('machine', '')}, {record['date']}: {record['command']}"
    return bars(workloads, series, title, "mean TTFT (ms)", fmt=".0f", note=note)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("record", type=Path)
    p.add_argument("--plot", type=Path, help="write the SVG here")
    args = p.parse_args(argv)
    record = json.loads(args.record.read_text())
    print(report(record))
    if args.plot:
        args.plot.write_text(plot(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
