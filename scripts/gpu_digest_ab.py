"""A/B on a GPU: same-host and layerwise loads from the store server with the KV digests
checked on the device (on) and with xxh3 on the CPU (off), in one process.

    python3 scripts/gpu_digest_ab.py OUT_DIR [lengths...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvtier.engine as engine  # noqa: E402
from kvtier.bench.ttft import run_ttft  # noqa: E402

out = Path(sys.argv[1])
lengths = [int(x) for x in sys.argv[2:]] or [16384, 32768]
init = engine.CacheEngine.__init__


def without_digests(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.mover.digests = False
    if self.tiers.remote is not None:
        self.tiers.remote.digests_on_device = False


summary = {}
for mode in ("off", "on", "off2", "on2"):
    engine.CacheEngine.__init__ = without_digests if mode.startswith("off") else init
    points = run_ttft(lengths, 7, out / mode, server=True)
    summary[mode] = {
        p.tokens: {
            k: v
            for k, v in p.row().items()
            if k
            in (
                "warm_server_over_warm_paired",
                "server_layerwise_over_max_paired",
                "warm_server_s",
                "warm_server_layerwise_s",
                "warm_s",
                "forward_1_s",
                "load_floor_s",
            )
        }
        for p in points
    }
    print(mode, json.dumps(summary[mode]), flush=True)
(out / "digest-ab.json").write_text(json.dumps(summary, indent=1) + "\n")
