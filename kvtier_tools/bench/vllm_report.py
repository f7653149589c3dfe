"""The table and the token checks of `kvtier_tools.bench.vllm`'s records (one JSON a setup):
`compare` prints a row a setup and length, and fails the run where a setup's tokens part
from vLLM's own or its warm run is faster than its KV's copy (a load that did not happen)."""

from __future__ import annotations

import json
from pathlib import Path


def agrees(cold: list[int], plain: dict) -> bool:
    """A setup's cold tokens against plain vLLM's: equal, or parting from them first where
    plain vLLM's own two paths (its cold prefill, its GPU prefix hit) part, with the token
    one of them gave. That is a near-tie in bf16: a setup that runs another CUDA graph
    mode (layerwise needs PIECEWISE) may fall on either side of it."""
    if not plain:
        return False
    if cold == plain["cold"]:
        return True
    at = next(
        (i for i, (a, b) in enumerate(zip(cold, plain["cold"])) if a != b),
        min(len(cold), len(plain["cold"])),
    )
    split = next(
        (i for i, (a, b) in enumerate(zip(plain["cold"], plain["gpu_hit"])) if a != b), None
    )
    return at == split and cold[: at + 1] == plain["gpu_hit"][: at + 1]


def under_the_copy(name: str, r: dict) -> bool:
    """A warm run faster than its KV's bytes over the H2D bandwidth measured in the same
    process: the offloader cannot have loaded the KV it reported as a hit (vLLM then ran the
    forward on whatever the pages held)."""
    return name != "plain" and r["warm_median"] * 1e3 < r["copy_ms"]


def compare(out: Path) -> int:
    """The table of every setup's record, and the token checks against plain vLLM."""
    recs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    plain = recs.get("plain")
    bad = 0
    for name, rec in recs.items():
        for length, r in rec["lengths"].items():
            t = r["tokens"]
            # Loaded KV computes what vLLM's own cached KV does; plain vLLM recomputes "warm" (a
            # prefix-cache hit and a whole prefill may differ in the last bits of bf16).
            same_warm = t["warm"] == (t["cold"] if name == "plain" else t["gpu_hit"])
            same_plain = plain is None or agrees(
                t["cold"], plain["lengths"].get(length, {}).get("tokens", {})
            )
            control_differs = t["control"] != t["cold"]
            unloaded = under_the_copy(name, r)
            ok = same_warm and same_plain and control_differs and not unloaded
            bad += not ok
            print(
                f"{name:18s} {length:>6s}  cold {r['cold_median'] * 1e3:7.1f}  "
                f"warm {r['warm_median'] * 1e3:7.1f} ms"
                f"  (GPU hit {r['gpu_hit_median'] * 1e3:6.1f}, "
                f"in the engine {r['gpu_hit_engine_median_ms']:5.1f})"
                f"  floor ratio {r['warm_over_floor_paired']:.3f}  max(load,fwd) ratio "
                f"{r['warm_over_max_load_fwd_paired']:.3f}  tokens {'OK' if ok else 'DIFFER'}"
                f" (warm=GPU hit {same_warm}, cold=plain {same_plain}, "
                f"control differs {control_differs},"
                f" logprob err {t['warm_logprob_err']:.3g}, "
                f"cold vs GPU hit {t['cold_vs_gpu_hit_logprob_err']:.3g})"
                + ("  WARM UNDER THE COPY OF ITS KV: not loaded" if unloaded else "")
            )
    return 1 if bad else 0


def load(records: Path, setups: list[str]) -> dict[str, dict]:
    """The records of `setups` in `records` (NAME.json or NAME.json.gz a setup), in order; a
    name may be a path under `records` (`run1/plain`)."""
    from kvtier_tools.bench.records import read

    return {name: read(records / f"{name}.json") for name in setups}


def label(name: str, rec: dict) -> str:
    """A setup as tables and plots name it: its record's setup (`query-twice-plain.json` is
    plain's), or its path where the records come from several runs (`run1/plain`)."""
    return name if "/" in name else rec.get("setup", name)


def _runs(rec: dict) -> int:
    return len(rec["lengths"][next(iter(rec["lengths"]))]["warm"])


def footnote(records: Path, recs: dict[str, dict]) -> str:
    """Machine and date of the records (each distinct one), and the pairs behind a median."""
    from kvtier_tools.bench.records import machine

    where = []
    for name, rec in recs.items():
        it = f"{machine(records / f'{name}.json', rec)}, {rec['machine']['date']}"
        where += [it] if it not in where else []
    pairs = {_runs(rec) for rec in recs.values()}
    runs = (
        f"medians of {pairs.pop()} pairs"
        if len(pairs) == 1
        else "medians of " + ", ".join(f"{_runs(r)} pairs ({label(n, r)})" for n, r in recs.items())
    )
    return f"{'; '.join(where)}, {runs}."


def plot(
    records: Path,
    setups: list[str],
    out: Path,
    cold: bool = False,
    note: str = "",
    floor: bool = False,
) -> None:
    """Warm (or cold) TTFT per length, one bar per setup, as an SVG at `out`. With `floor`,
    two more bars from the first setup's record: the pinned copy of its KV bytes alone, and
    that copy + plain vLLM's one-token forward (each timed alone in the same run)."""
    from kvtier_tools.bench.plot import bars

    recs = load(records, setups)
    first = recs[setups[0]]
    lengths = list(first["lengths"])
    key = "cold_median" if cold else "warm_median"
    series = {
        label(name, rec): [rec["lengths"][n][key] * 1e3 for n in lengths]
        for name, rec in recs.items()
    }
    if floor:
        at = [first["lengths"][n] for n in lengths]
        series[f"copy of {label(setups[0], first)}'s KV"] = [r["copy_ms"] for r in at]
        series["copy + forward"] = [r["copy_ms"] + r["fwd_median_ms"] for r in at]
    groups = [f"{int(n) // 1024}k tokens" for n in lengths]
    machine = first["machine"]
    what = "Cold TTFT (a miss)" if cold else "Warm TTFT"
    title = (
        f"{what} inside vLLM, lower is better ({machine['gpu']}, {machine['date']}; "
        f"median of {len(first['lengths'][lengths[0]]['warm'])})"
    )
    out.write_text(bars(groups, series, title, "ms", note=note))


def markdown(records: Path, setups: list[str]) -> str:
    """A table a setup and length: cold, warm and GPU-hit TTFT (medians, ms), warm against
    the first setup's, and whether the warm tokens are the GPU hit's."""
    recs = load(records, setups)
    base = recs[setups[0]]
    rows = [
        "| setup | tokens | cold ms | warm ms | GPU hit ms | warm vs "
        f"{label(setups[0], base)} | warm tokens = GPU hit's |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rec in recs.items():
        for n, r in rec["lengths"].items():
            t = r["tokens"]
            faster = base["lengths"][n]["warm_median"] / r["warm_median"]
            # plain vLLM's "warm" run recomputes the prompt: no hit to compare its tokens with
            same = "yes" if t["warm"] == t["gpu_hit"] else "no"
            same = "- (recomputes)" if rec.get("setup") == "plain" else same
            rows.append(
                f"| {label(name, rec)} | {int(n):,} | {r['cold_median'] * 1e3:.1f} | "
                f"{r['warm_median'] * 1e3:.1f} | {r['gpu_hit_median'] * 1e3:.1f} | "
                f"{faster:.2f}x | {same} |"
            )
    rows += ["", footnote(records, recs)]
    return "\n".join(rows) + "\n"


def back_to_back_markdown(records: Path, setups: list[str]) -> str:
    """A table a setup and length of a `--back-to-back` run: the warm TTFT with the store
    landed and right after the cold run (medians, ms), and their paired ratio."""
    recs = load(records, setups)
    rows = [
        "| setup | tokens | warm, store landed ms | warm right after cold ms | ratio (paired) |",
        "|---|---|---|---|---|",
    ]
    for name, rec in recs.items():
        for n, r in rec["lengths"].items():
            rows.append(
                f"| {label(name, rec)} | {int(n):,} | {r['warm_median'] * 1e3:.1f} | "
                f"{r['warm_b2b_median'] * 1e3:.1f} | {r['warm_b2b_over_warm_paired']:.3f} |"
            )
    rows += ["", footnote(records, recs)]
    return "\n".join(rows) + "\n"


def cold_markdown(records: Path, setups: list[str]) -> str:
    """A table a setup and length: cold TTFT (median and range, ms), against the first
    setup's (plain vLLM where it is listed first), and whether its cold tokens are the first
    setup's (`agrees`: equal, or parting where plain vLLM's own two paths part)."""
    recs = load(records, setups)
    base = recs[setups[0]]
    first_name = label(setups[0], base)
    rows = [
        f"| setup | tokens | cold ms | range ms | cold vs {first_name} | "
        f"cold tokens = {first_name}'s |",
        "|---|---|---|---|---|---|",
    ]
    for name, rec in recs.items():
        for n, r in rec["lengths"].items():
            first = base["lengths"].get(n)
            ratio = f"{r['cold_median'] / first['cold_median']:.3f}" if first else "-"
            same = agrees(r["tokens"]["cold"], first["tokens"]) if first else None
            rows.append(
                f"| {label(name, rec)} | {int(n):,} | {r['cold_median'] * 1e3:.1f} | "
                f"{min(r['cold']) * 1e3:.1f}-{max(r['cold']) * 1e3:.1f} | {ratio} | "
                f"{'-' if same is None else 'yes' if same else 'no'} |"
            )
    rows += ["", footnote(records, recs)]
    return "\n".join(rows) + "\n"


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(
        description="kvtier_tools.bench.vllm's records: checks, table, plot"
    )
    p.add_argument("records", type=Path, help="a folder of records (one JSON a setup)")
    p.add_argument("--plot", type=Path, help="write the warm TTFT bars here (SVG)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--cold", action="store_true", help="the table or plot of cold TTFT (a miss)")
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="the table of a --back-to-back run: warm with the store landed and right after cold",
    )
    p.add_argument(
        "--floor", action="store_true", help="the plot adds the copy alone and copy + forward"
    )
    p.add_argument("--setups", default="", help="comma list, in this order (default: all)")
    args = p.parse_args()
    names = [s for s in args.setups.split(",") if s] or sorted(
        p.name.split(".")[0] for p in args.records.glob("*.json*")
    )
    if args.markdown:
        table = (
            cold_markdown if args.cold else back_to_back_markdown if args.back_to_back else markdown
        )
        print(table(args.records, names), end="")
    elif args.plot is not None:
        from kvtier_tools.bench.records import command

        note = command("kvtier_tools.bench.vllm_report")
        plot(args.records, names, args.plot, args.cold, note, args.floor)
    else:
        raise SystemExit(compare(args.records))


if __name__ == "__main__":
    main()
