"""The docs' generated blocks: tables and help texts made from the code, one source.

    python -m kvtier_tools.dev.docgen           (rewrites every block in docs/)
    python -m kvtier_tools.dev.docgen --check   (exit 1, naming the stale blocks)

A block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in a page of docs/;
tests/test_docs.py fails while one differs from what its command prints now.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
HELP_COLUMNS = "100"  # argparse wraps to $COLUMNS: the pages' width, whatever the terminal
# The `kvtier` commands whose --help the CLI reference shows.
HELP_OF = ("", "server", "proxy", "config", "demo", "bench")  # `kvtier vllm`: vLLM's own


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


def _report(run: str, setups: str) -> str:
    """A table of `kvtier_tools.bench.vllm`'s records of one run (bench.vllm_report)."""
    return _output(
        "kvtier_tools.bench.vllm_report", f"results/{run}", "--setups", setups, "--markdown"
    )


BLOCKS = {
    "warm-ttft-h200-lossy": lambda: _report(
        "gpu-h200-vllm-2026-11-29/lossy", "native,kvtier-int8,kvtier-fp8"
    ),
    "warm-ttft-h200-mla": lambda: _report("gpu-h200-vllm-2026-11-29/mla", "native,kvtier,plain"),
    "config-keys": lambda: (
        "| key | default | meaning |\n|---|---|---|\n" + _kvtier("config", "--keys")
    ),
    "lmcache-keys": lambda: _kvtier("config", "--keys", "--lmcache"),
    "cli-help": cli_help,
}


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
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every generated block is up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
