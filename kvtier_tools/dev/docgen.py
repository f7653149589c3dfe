"""The docs' generated blocks and figures: tables, help texts and plots made from the code
and the records in results/, one source.

    python -m kvtier_tools.dev.docgen           (rewrites every block in docs/ and every figure)
    python -m kvtier_tools.dev.docgen --check   (exit 1, naming the stale blocks and figures)

A block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in a page of docs/; a
figure is an SVG under docs/img/ that a report command writes (FIGURES). tests/test_docs.py
fails while one differs from what its command makes now.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
HELP_COLUMNS = "100"  # argparse wraps to $COLUMNS: the pages' width, whatever the terminal
# The `kvtier` commands whose --help the CLI reference shows.
# `kvtier vllm`: vLLM's own
HELP_OF = "", "server", "proxy", "router", "controller", "config", "demo", "bench"


def _output(module: str, *args: str) -> str:
    """What `python -m module args` prints, run from the repository's root, $COLUMNS wide."""
    env = dict(os.environ, COLUMNS=HELP_COLUMNS)
    cmd = [sys.executable, "-m", module, *args]
    root = DOCS.parent
    return subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=root).stdout


def _kvtier(*args: str) -> str:
    return _output("kvtier.cli", *args)


def cli_help() -> str:
    parts = []
    for command in HELP_OF:
        args = [command, "--help"] if command else ["--help"]
        title = f"kvtier {command}".strip()
        parts.append(f"## `{title}`\n\n```text\n{_kvtier(*args).rstrip()}\n```\n")
    return "\n".join(parts)


def _report(run: str, setups: str, *more: str) -> str:
    """A table of `kvtier_tools.bench.vllm`'s records of one run (bench.vllm_report)."""
    return _output(
        "kvtier_tools.bench.vllm_report", f"results/{run}", "--setups", setups, "--markdown", *more
    )


def _bench(module: str, what: str, *records: str) -> str:
    """A table of a report module's (kvtier_tools.bench.report_*) over records in results/."""
    return _output(f"kvtier_tools.bench.{module}", what, *(f"results/{r}" for r in records))


WARM = "gpu-h200-warm-ttft-2026-11-30"  # scripts/warm_ttft.sh's parts (issue 62)

BLOCKS = {
    "warm-ttft-h200-compiled": lambda: _report(f"{WARM}/compiled", "native,kvtier,kvtier-int4"),
    "warm-ttft-h200-compiled-b2b": lambda: _report(
        f"{WARM}/compiled", "native,kvtier,kvtier-int4", "--back-to-back"
    ),
    "warm-ttft-h200-eager": lambda: _report(f"{WARM}/eager", "native,kvtier,kvtier-int4"),
    "warm-ttft-h200-fp8-kv-mp": lambda: _report(f"{WARM}/fp8-kv", "native,kvtier"),
    "warm-ttft-h200-lengths-mp": lambda: _report(f"{WARM}/lengths", "native,kvtier,kvtier-int4"),
    "warm-ttft-h200-quality": lambda: _output(
        "kvtier_tools.bench.profiles.kv_codec", f"results/{WARM}/quality/kv-codec.json", "--report"
    ),
    "warm-ttft-h200-lossy": lambda: _report(
        "gpu-h200-vllm-2026-11-29/lossy", "native,kvtier-int8,kvtier-fp8"
    ),
    "warm-ttft-h200-mla": lambda: _report("gpu-h200-vllm-2026-11-29/mla", "native,kvtier,plain"),
    "warm-ttft-h200-b2b-before": lambda: _report(
        "gpu-h200-vllm-2026-11-30/back-to-back", "kvtier,native", "--back-to-back"
    ),
    "warm-ttft-h200-b2b-after": lambda: _report(
        "gpu-h200-vllm-2026-11-30/back-to-back-after", "kvtier", "--back-to-back"
    ),
    "fleet-2core": lambda: _output(
        "kvtier_tools.bench.report_fleet", "results/cpu-2core-2026-11-30/fleet.json"
    ),
    "fleet-h200x2": lambda: _output(
        "kvtier_tools.bench.report_fleet", "results/gpu2-h200x2-2026-11-30/fleet-8b.json"
    ),
    "p2p-2core": lambda: _output(
        "kvtier_tools.bench.p2p", "--report", "results/cpu-2core-2026-11-30/p2p.json"
    ),
    "p2p-ucx-tcp-2core": lambda: _output(
        "kvtier_tools.bench.p2p", "--report", "results/cpu-2core-2026-11-30/p2p-ucx-tcp.json"
    ),
    "cold-ttft-h100-default": lambda: _report(
        "gpu-h100-vllm-2026-11-27/paired-serving-query-twice",
        "query-twice-plain,query-twice-kvtier,query-twice-lmcache",
        "--cold",
    ),
    "cold-ttft-h100-eager": lambda: _report(
        "gpu-h100-vllm-2026-11-27/eager-query-twice",
        "plain,kvtier,kvtier-layerwise,lmcache",
        "--cold",
    ),
    "cold-ttft-h100-layerwise": lambda: _report(
        "gpu-h100-vllm-2026-11-28/query-twice", "plain,kvtier,kvtier-layerwise", "--cold"
    ),
    "cold-ttft-h200-mla": lambda: _report(
        "gpu-h200-vllm-2026-11-29/mla", "plain,native,kvtier", "--cold"
    ),
    "cold-ttft-h100-tiers": lambda: _report(
        "gpu-h100-vllm-2026-11-26",
        "run1/plain,run1/kvtier,run3/kvtier-disk,run3/kvtier-server,run3/kvtier-server-tcp",
        "--cold",
    ),
    "pd-transfer-h200x2": lambda: _bench(
        "report_pd", "transfer", "gpu2-h200x2-2026-11-28b/pd-2gpu.json"
    ),
    "pd-nixl-h100x2": lambda: _bench(
        "report_pd", "transfer", "gpu2-h100x2-2026-11-26b/pd-nixl-2gpu.json"
    ),
    "pd-vllm-h200x2": lambda: _bench("report_pd", "vllm", "gpu2-h200x2-2026-11-28/pd-vllm.json"),
    "pd-vllm-lmcache-h100x2": lambda: _bench(
        "report_pd",
        "vllm",
        "gpu2-h100x2-2026-11-27b/pd-vllm-kvtier.json",
        "gpu2-h100x2-2026-11-27b/pd-vllm-lmcache.json",
    ),
    "server-stores-2core": lambda: _bench(
        "report_stores", "server", "cpu-2core-2026-11-25/server-stores.json"
    ),
    "server-redis-2core": lambda: _bench(
        "report_stores", "server", "cpu-2core-2026-11-22/server.json"
    ),
    "server-tcp-2core": lambda: _bench(
        "report_stores", "server", "cpu-2core-2026-11-22/server-tcp-7repeats.json"
    ),
    "server-auth-tls-2core": lambda: _bench(
        "report_stores", "server", "cpu-2core-2026-11-23/server-auth-tls.json"
    ),
    "shared-store-h100": lambda: _bench(
        "report_stores", "vllm", "gpu-h100-vllm-2026-11-27/shared-store/shared-store-f.json"
    ),
    "shared-store-2core": lambda: _bench(
        "report_stores", "vllm", "cpu-2core-2026-11-25/stores-vllm.json"
    ),
    "server-warm-h100": lambda: _report(
        "gpu-h100-vllm-2026-11-26", "run1/kvtier,run3/kvtier-server,run3/kvtier-server-tcp"
    ),
    "disk-tier-file": lambda: _bench(
        "report_disk", "tier", "gpu-h100-2026-11-23/disk.json", "cpu-2core-2026-11-23/disk.json"
    ),
    "disk-ttft-h100": lambda: _bench(
        "report_disk", "ttft", "gpu-h100-2026-11-23/disk-ttft/ttft.json"
    ),
    "disk-warm-h100": lambda: _report(
        "gpu-h100-vllm-2026-11-26", "run1/plain,run1/kvtier,run3/kvtier-disk"
    ),
    "config-keys": lambda: (
        "| key | default | meaning |\n|---|---|---|\n" + _kvtier("config", "--keys")
    ),
    "lmcache-keys": lambda: _kvtier("config", "--keys", "--lmcache"),
    "cli-help": cli_help,
}

# The figures under docs/img/: the report command that writes each (its --plot is the path).
FIGURES = {
    "docs/img/warm-ttft-lengths-h200-mp.svg": (
        "vllm_report",
        f"results/{WARM}/lengths --setups native,kvtier,kvtier-int4 --floor",
    ),
    "docs/img/fleet-2core.svg": (
        "report_fleet",
        "results/cpu-2core-2026-11-30/fleet.json",
    ),
    "docs/img/fleet-h200x2.svg": (
        "report_fleet",
        "results/gpu2-h200x2-2026-11-30/fleet-8b.json",
    ),
    "docs/img/warm-ttft-h200.svg": (
        "vllm_report",
        "results/gpu-h200-vllm-2026-11-29/lossy --setups native,kvtier-int8,kvtier-fp8",
    ),
    "docs/img/cold-ttft-h100.svg": (
        "vllm_report",
        "results/gpu-h100-vllm-2026-11-27/paired-serving-query-twice "
        "--setups query-twice-plain,query-twice-kvtier,query-twice-lmcache --cold",
    ),
    "docs/img/pd-transfer-h200x2.svg": (
        "report_pd",
        "transfer results/gpu2-h200x2-2026-11-28b/pd-2gpu.json",
    ),
    "docs/img/server-stores-2core.svg": (
        "report_stores",
        "server results/cpu-2core-2026-11-25/server-stores.json --conns 2",
    ),
    "docs/img/disk-ttft-h100.svg": (
        "report_disk",
        "ttft results/gpu-h100-2026-11-23/disk-ttft/ttft.json",
    ),
}


def figure(path: str) -> str:
    """The SVG FIGURES[path]'s command writes now. It runs in a scratch folder that sees
    results/ and has an empty docs/img/, so that it writes to the same relative path (which
    the figure names in its command line) without touching the one in the tree."""
    module, args = FIGURES[path]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "results").symlink_to(DOCS.parent / "results")
        (Path(tmp) / path).parent.mkdir(parents=True)
        cmd = [sys.executable, "-m", f"kvtier_tools.bench.{module}", *args.split()]
        subprocess.run([*cmd, "--plot", path], check=True, cwd=tmp, capture_output=True)
        return (Path(tmp) / path).read_text()


def blocks_in(text: str) -> list[str]:
    return re.findall(r"<!-- ([a-z0-9-]+):begin -->", text)


def refreshed(text: str) -> str:
    """`text` with each of its blocks made anew."""
    for name in blocks_in(text):
        begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + begin + BLOCKS[name]() + end + tail
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args()
    stale = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        if not blocks_in(text):
            continue
        new = refreshed(text)
        if new != text:
            stale.append(str(page.relative_to(DOCS.parent)))
            if not args.check:
                page.write_text(new)
    for path in FIGURES:
        new = figure(path)
        target = DOCS.parent / path
        if not target.exists() or target.read_text() != new:
            stale.append(path)
            if not args.check:
                target.write_text(new)
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every generated block is up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
