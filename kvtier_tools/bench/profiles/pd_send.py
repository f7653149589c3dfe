"""Where a cuda_ipc send's host time goes: cProfile of `PdSender.send` (the sender's
thread: keys, Alloc, queueing the writes, the Commit) over repeated sends of 16k tokens of
Llama-3.1-8B-shaped KV, GPU0 -> GPU1, the receiver in its own process as in
`kvtier bench pd` (each send checked there). Prints the functions by own time and by
cumulative time; the GPU's share is what `waits` below the send shows.

    python3 -m kvtier_tools.bench.profiles.pd_send [--tokens 16384] [--sends 10] [--receiver cuda:1]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.pd.sender import PdSender
from kvtier_tools.bench.offload import OffloadShape
from kvtier_tools.bench.pd import FMT_MODEL, _config, _one_send, _paged, _PdBench, _Receiver


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sends", type=int, default=10)
    p.add_argument("--sender", default="cuda:0")
    p.add_argument("--receiver", default="cuda:1")
    args = p.parse_args()
    shape = OffloadShape()
    torch.cuda.set_device(torch.device(args.sender))
    kv, layers = _paged(shape, args.tokens, args.sender, fill=True)
    bench = _PdBench(shape, kv, layers, args.sender, args.receiver, args.sends)
    with _Receiver(shape, "cuda_ipc", args.receiver, args.tokens) as receiver:
        config = _config(shape, "sender", "cuda_ipc", args.sender, 0, receiver.init, receiver.alloc)
        engine = CacheEngine(config, kv, KVFormat(FMT_MODEL, "flash_attn", shape.dtype))
        sender = PdSender(engine, config, 0)
        # warm-up: connection, IPC mapping, kernels
        _one_send(bench, sender, receiver, args.tokens, 1)
        profile = cProfile.Profile()
        sends = []
        for r in range(args.sends):
            profile.enable()
            times = _one_send(bench, sender, receiver, args.tokens, 100 + r)
            profile.disable()
            stats = sender.stats
            sends.append((times["send_ms"], stats.last_ms, stats.last_keys_ms, stats.last_after_ms))
        sender.close()
        engine.close()
    for send_ms, (alloc, write, commit), keys, after in sends:
        print(
            f"send {send_ms:.2f} ms: keys {keys:.2f}, Alloc {alloc:.2f}, write {write:.2f}, "
            f"Commit {commit:.2f}, "
            f"after {after:.2f}, the rest {send_ms - keys - alloc - write - commit - after:.2f}"
        )
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(25)
        print(
            f"-- by {key}, {args.sends} sends of {args.tokens} tokens "
            "(the receiver's load and check included in _one_send) --"
        )
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
