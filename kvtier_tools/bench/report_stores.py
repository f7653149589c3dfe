"""Tables and a plot of the store records, for the docs' benchmark page on the store server.

    python -m kvtier_tools.bench.report_stores server RECORD [--plot SVG --conns N]
    python -m kvtier_tools.bench.report_stores vllm RECORD

`server` reads a `kvtier bench server` record (kvtier_tools.bench.server): GB/s of each
target a value size, connection count and operation (medians of the runs), and kvtier's
ratios to the baselines (ratios of the medians). `vllm` reads a
`kvtier_tools.bench.stores_vllm` record: two vLLM instances sharing a store, the first
storing (cold), the second loading the same prompts from the store.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier_tools.bench.records import command, read, source

# `kvtier bench server --targets` and `stores_vllm --stores`, as the tables name them.
TARGETS = {
    "raw": "raw TCP",
    "raw-ring": "raw TCP into a ring",
    "kvtier": "kvtier TCP",
    "kvtier-shm": "kvtier same host",
    "kvtier-auth": "kvtier TCP + token",
    "kvtier-tls": "kvtier TLS",
    "redis": "redis TCP",
    "redis-unix": "redis unix socket",
    "mooncake": "Mooncake via kvtier",
    "mooncake-py": "Mooncake's own API",
}
STORES = {
    "kvtier": "kvtier server",
    "mooncake": "Mooncake Store",
    "redis": "redis-server",
    "lmcache": "LMCache's lm:// server",
}
# The ratios a record keeps a cell (kvtier_tools.bench.server._cell), as the tables name them:
# the ratio of the medians, and in brackets the median of each run's ratio (paired).
RATIOS = {
    "tcp_vs_raw": "kvtier TCP / raw TCP",
    "tcp_vs_redis": "kvtier TCP / redis TCP",
    "same_host_vs_redis": "kvtier same host / faster redis",
    "kvtier_vs_mooncake": "kvtier TCP / Mooncake via kvtier",
    "mooncake_vs_own": "Mooncake via kvtier / its own API",
    "auth_vs_plain": "token / plain",
    "tls_vs_plain": "TLS / plain",
}


def _ratio(cell: dict, key: str) -> str:
    paired = cell.get(f"{key}_paired")
    return f"{cell[key]:.2f}" + ("" if paired is None else f" ({paired:.2f})")


def server_table(path: Path) -> str:
    """A row a value size, connection count and operation: each target's GB/s, then
    kvtier's ratios to the baselines that ran."""
    rec = read(path)
    targets = rec["config"]["targets"]
    ratios = [key for key in RATIOS if key in rec["throughput"][0]]
    names = [f"{TARGETS.get(t, t)} GB/s" for t in targets] + [RATIOS[k] for k in ratios]
    rows = [
        "| value | conns | op | "
        + " | ".join(f"{n}{'' if '/' in n else ' GB/s'}" for n in names)
        + " |",
        "|---" * (3 + len(names)) + "|",
    ]
    for cell in rec["throughput"]:
        speeds = [f"{cell[f'{t}_GBps']:.2f}" for t in targets]
        parts = [_ratio(cell, key) for key in ratios]
        rows.append(
            f"| {cell['size_mib']} MiB | {cell['conns']} | {cell['op']} | "
            + " | ".join(speeds + parts)
            + " |"
        )
    cfg = rec["config"]
    rows += [
        "",
        f"Medians of {cfg['repeats']} runs of {cfg['duration']} s a cell; ratios of the medians "
        f"(in brackets: the median of each run's ratio). {source(path, rec)}",
    ]
    return "\n".join(rows) + "\n" + latency(rec)


def latency(rec: dict) -> str:
    """The small calls' latency line of a record that timed them."""
    lat = rec.get("latency") or {}
    if not lat:
        return ""
    calls = [
        f"{key.removesuffix('_ms').replace('_', ' ')} p50 {v['p50']:.3f} ms, p99 {v['p99']:.3f} ms"
        for key, v in lat.items()
    ]
    return "\nOver 64 keys: " + "; ".join(calls) + ".\n"


def server_plot(path: Path, out: Path, conns: int, note: str = "") -> None:
    """GB/s of each target a value size and operation, at `conns` connections."""
    from kvtier_tools.bench.plot import bars

    rec = read(path)
    cells = [c for c in rec["throughput"] if c["conns"] == conns]
    groups = [f"{c['size_mib']} MiB {c['op']}" for c in cells]
    series = {TARGETS.get(t, t): [c[f"{t}_GBps"] for c in cells] for t in rec["config"]["targets"]}
    where = source(path, rec).split(";")[0]
    title = f"Store throughput, {conns} connections, higher is better ({where})"
    out.write_text(bars(groups, series, title, "GB/s", fmt=".2f", note=note))


def vllm_table(path: Path) -> str:
    """A row a store: the first instance's TTFT (cold, storing), the second's from the
    store, the second's hit tokens, failed requests and whether its tokens are the first's."""
    rec = read(path)
    rows = [
        "| store | first instance (cold) median / mean TTFT ms | second (from the store) "
        "median / mean ms | second / first (median) | second's hit tokens | failed "
        "| second's tokens = first's |",
        "|---|---|---|---|---|---|---|",
    ]
    for store, run in rec["stores"].items():
        a, b = run["a"]["bench"], run["b"]["bench"]
        rows.append(
            f"| {STORES.get(store, store)} | {a['Median TTFT (ms)']:.1f} / "
            f"{a['Mean TTFT (ms)']:.1f} | {b['Median TTFT (ms)']:.1f} / "
            f"{b['Mean TTFT (ms)']:.1f} | {run['warm_vs_cold_median']:.2f} | "
            f"{run['b_hit_tokens']:,} of {run['b_prompt_tokens']:,} | {run['failed']:.0f} | "
            f"{'yes' if run['same_tokens'] else 'no'} |"
        )
    w = rec["workload"]
    rows += [
        "",
        f"`vllm bench serve`: {w['num_prompts']} prompts of {w['input_len']:,} tokens. "
        + source(path, rec),
    ]
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("server", help="a `kvtier bench server` record: table, or --plot")
    s.add_argument("record", type=Path)
    s.add_argument("--plot", type=Path, help="write the GB/s bars here (SVG)")
    s.add_argument("--conns", type=int, default=2, help="the plot's connection count")
    v = sub.add_parser("vllm", help="a kvtier_tools.bench.stores_vllm record: a table")
    v.add_argument("record", type=Path)
    args = p.parse_args()
    if args.what == "vllm":
        print(vllm_table(args.record), end="")
    elif args.plot is not None:
        note = command("kvtier_tools.bench.report_stores")
        server_plot(args.record, args.plot, args.conns, note)
    else:
        print(server_table(args.record), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
