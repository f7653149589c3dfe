"""Before/after figures of `scripts/gpu_ab.sh`: per figure, the median of each side's
runs and after / before (the runs alternate A B B A ..., so drift falls on both).

    python3 scripts/gpu_ab.py DIR [DIR ...]      (folders the archive was unpacked into)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

TTFT = [
    "warm_s",
    "warm_over_floor_paired",
    "warm_layerwise_s",
    "layerwise_over_max_paired",
    "warm_server_s",
    "warm_server_layerwise_s",
    "cold_store_over_cold",
]
OFFLOAD = ["store_GBps", "retrieve_GBps", "store_ratio", "retrieve_ratio"]


def collect(dirs: list[Path]) -> dict:
    out: dict = {}
    for d in dirs:
        for side in ("before", "after"):
            for run in sorted(d.glob(f"{side}-ttft-*/ttft.json")):
                for point in json.loads(run.read_text())["points"]:
                    for key in TTFT:
                        if point.get(key) is not None:
                            out.setdefault((f"ttft {point['tokens']}", key), {}).setdefault(
                                side, []
                            ).append(point[key])
            offload = d / f"{side}-offload.json"
            if offload.exists():
                for rec in json.loads(offload.read_text()):
                    for key in OFFLOAD:
                        out.setdefault(("offload", key), {}).setdefault(side, []).append(
                            rec["summary"][key]
                        )
    return out


def main() -> None:
    rows = []
    for (where, key), sides in sorted(collect([Path(a) for a in sys.argv[1:]]).items()):
        if "before" in sides and "after" in sides:
            b, a = statistics.median(sides["before"]), statistics.median(sides["after"])
            rows.append(
                {
                    "what": where,
                    "figure": key,
                    "before": b,
                    "after": a,
                    "after_over_before": round(a / b, 3),
                    "runs": [len(sides["before"]), len(sides["after"])],
                }
            )
            print(
                f"{where:11s} {key:28s} before {b:9.4f}  after {a:9.4f}  after/before {a / b:.3f}"
                f"  ({len(sides['before'])}+{len(sides['after'])} runs)"
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
