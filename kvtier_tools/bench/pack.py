"""`python -m kvtier_tools.bench.pack OUT.json DIR [NAME=FILE ...]`: a serving run's records
(kvtier_tools.bench.serving's `<setup>[#k].json` in DIR) as one lean JSON for results/: each
record's summary and workload, its requests as rows (`request_fields`), without the
generated token ids (the run's table already compared them) and their logprobs; any
NAME=FILE given beside them (a stall trace, a profile's summary) under `_NAME`, as text.

results/ travels to the GPU machine with every call (64 MiB in all, the vLLM bundle
included), so a run of 16 records (3.7 MB with its token ids) is kept as ~0.2 MB."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIELDS = [
    "conversation",
    "turn",
    "prompt_tokens",
    "sent_s",
    "ttft_s",
    "latency_s",
    "output_tokens",
    "error",
]


def _row(result: dict) -> list:
    return [round(v, 5) if isinstance(v, float) else v for v in (result.get(f) for f in FIELDS)]


def pack(records: dict[str, dict]) -> dict[str, dict]:
    """Records by name -> the lean form: summary, workload, request_fields, requests."""
    return {
        name: {
            "summary": rec.get("summary", {}),
            "workload": rec.get("workload", {}),
            "request_fields": FIELDS,
            "requests": [_row(r) for r in rec.get("results", [])],
        }
        for name, rec in records.items()
    }


def _key(path: Path) -> tuple[str, int]:
    name, _, k = path.stem.partition("#")
    return name, int(k) if k.isdigit() else 0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out")
    p.add_argument("dir")
    p.add_argument("extra", nargs="*", metavar="NAME=FILE")
    args = p.parse_args()
    paths = sorted(
        (q for q in Path(args.dir).glob("*.json") if not q.stem.endswith("bench-serve")), key=_key
    )
    packed: dict = pack({q.stem: json.loads(q.read_text()) for q in paths})
    for item in args.extra:
        name, _, file = item.partition("=")
        packed[f"_{name}"] = Path(file).read_text()
    Path(args.out).write_text(json.dumps(packed, separators=(",", ":")))
    print(f"{args.out}: {len(paths)} records, {Path(args.out).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
