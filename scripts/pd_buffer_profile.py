"""The decoder's bookkeeping per PD request, alone: `PdBuffer.alloc`, `.commit` and `.release`
of N chunks (key digests at random, a CPU buffer, no bytes written), medians of 30, so the
Commit phase's growth with the prompt can be split into this and the round trip.

    python3 scripts/pd_buffer_profile.py [--chunks 16 64 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvtier.keys import KVFormat
from kvtier.pd import protocol as proto
from kvtier.pd.buffer import PdBuffer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128])
    args = p.parse_args()
    bpt = 1024  # small chunks: the bookkeeping is what is timed
    buf = PdBuffer(
        (max(args.chunks) + 8) * 256 * bpt,
        256 * bpt,
        "cpu",
        KVFormat("m", "flash_attn", torch.bfloat16),
        bpt,
        ttl=60,
    )
    for n in args.chunks:
        times: dict[str, list[float]] = {"alloc": [], "commit": [], "release": []}
        for r in range(30):
            msg, digests = proto.Alloc(f"r{n}-{r}", [256] * n), os.urandom(proto.DIGEST_BYTES * n)
            t0 = time.perf_counter()
            buf.alloc(msg, digests)
            t1 = time.perf_counter()
            buf.commit(msg.req_id)
            t2 = time.perf_counter()
            buf.release(msg.req_id)
            t3 = time.perf_counter()
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(dt)
        print(
            f"{n:4d} chunks: "
            + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items())
        )


if __name__ == "__main__":
    main()
