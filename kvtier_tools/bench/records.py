"""The benchmark records in results/, read for the docs' report commands (report_*.py,
vllm_report.py): a record as JSON or gzipped in place, the machine it was made on, and the
line every table and figure ends with (machine, date, the record)."""

from __future__ import annotations

import gzip
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def find(path: Path) -> Path:
    """`path`, or `path.gz` where the record was gzipped in place (results/README.md)."""
    if path.exists() or path.suffix == ".gz":
        return path
    gz = path.with_name(path.name + ".gz")
    return gz if gz.exists() else path


def read(path: Path):
    """A record's JSON; a `.gz` one decompressed."""
    path = find(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def gpus(folder: Path) -> str | None:
    """The GPUs named in the machine.txt the GPU scripts write beside their records
    ("NVIDIA H200", "2 × NVIDIA H200"); None where there is none."""
    text = folder / "machine.txt"
    if not text.exists():
        return None
    names = [line.split(",")[0] for line in text.read_text().splitlines()]
    names = [n for n in names if n.startswith("NVIDIA")]
    if not names:
        return None
    return names[0] if len(names) == 1 else f"{len(names)} × {names[0]}"


def machine(path: Path, rec: dict) -> str:
    """Where a record was made: its folder's GPUs, else the record's own `machine` field."""
    named = rec.get("machine")
    if isinstance(named, dict):  # kvtier_tools.bench.vllm's records: {"gpu": ..., ...}
        named = named.get("gpu")
    return gpus(find(path).parent) or str(named or "machine not recorded")


def shown(path: Path) -> str:
    """A record's path as the docs name it: from the repository's root where it is inside."""
    path = find(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def source(path: Path, rec: dict, date: str | None = None) -> str:
    """The line under a table: machine, date and the record it was read from."""
    when = date or rec.get("date") or "date not recorded"
    return f"{machine(path, rec)}, {when}; record `{shown(path)}`."


def command(module: str) -> str:
    """The command line this process was started with, as `python -m module ...`."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])
