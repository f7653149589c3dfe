"""`python -m kvtier_tools.bench.host_time`: the host time of kvtier's per-request calls on an
inference engine's thread, at a chat turn's sizes: what a serving run's decode steps pay
for them (results/gpu-h200-vllm-2026-11-29/README.md: vLLM's inter-token latency 0.1-0.35 ms
higher with kvtier than with vLLM's native offloading).

Per request, as vLLM runs one (a conversation's turn: one request id, one block table drawn at
random, as a busy vLLM's are), on a history of `--history` tokens growing by `--turn` a turn:

    lookup    find(hold) + upload_ahead(beside): the scheduler's lookup, its hit's copies queued
              (since 2026-11-29 on the ahead slot's thread: the call's time is the engine thread's)
    (step)    `--step-ms` of sleep, the engine thread waiting for its step on the GPU
    load      start_retrieve(beside) (the queueing) and its finish (the wait), a load beside the
              steps
    store     start_store(...).finish(wait=False): the turn's new chunks, as wait_for_save queues
              them

Each call is timed on the host (perf_counter; the GPU is idle between turns, so no call
waits behind an earlier turn's work), medians and p90 over `--requests`, and a lookup's and a
store's CPU time on their thread (`*_cpu`: what the wall time has beyond it was spent
waiting, e.g. for the GIL while another thread ran: the store's pacer); then whole turns
again under cProfile, and a store alone: the top functions by own time, and kvtier's and
Triton's by time inside them (the profiler's overhead inflates them alike; it sees the calling
thread only, so not an upload queued on the ahead slot's thread).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import kvtier
from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.transfer import PagedKV

BLOCK = 16


class Chat:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.layers = [
            torch.zeros(
                2, args.blocks, BLOCK, args.heads, args.head_size, dtype=dtype, device=device
            )
            for _ in range(args.layers)
        ]
        # kvtier's defaults otherwise
        config = KvtierConfig(
            chunk_size=args.chunk, max_local_cpu_size=args.cpu_gb, gpu_store_piece_mb=args.piece_mb
        )
        self.engine = CacheEngine(
            config,
            PagedKV.wrap(self.layers, "flash_attn"),
            KVFormat("host-time", "flash_attn", str(dtype).removeprefix("torch.")),
        )
        self.rng = np.random.default_rng(0)
        self.args, self.device = args, device
        system = self.rng.integers(100, 30000, args.history)
        self.histories = [
            np.concatenate([system[: args.history - 256], self.rng.integers(100, 30000, 256)])
            for _ in range(args.requests)
        ]
        self.stored = [0] * args.requests
        self.turns = [0] * args.requests
        self.table = [self.slots(len(h)) for h in self.histories]

    def slots(self, n: int) -> torch.Tensor:
        blocks = self.rng.permutation(self.args.blocks)[: -(-n // BLOCK)]
        return torch.from_numpy(
            (blocks[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n].astype(np.int64)
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.engine.flush()

    def grow(self, i: int) -> None:
        """Conversation i's next turn: a new request (its id, its block table) on a longer
        history."""
        self.histories[i] = np.concatenate(
            [self.histories[i], self.rng.integers(100, 30000, self.args.turn)]
        )
        self.turns[i] += 1
        self.table[i] = self.slots(len(self.histories[i]))

    def rid(self, i: int) -> str:
        return f"c{i}t{self.turns[i]}"

    def lookup(self, i: int) -> int:
        """The scheduler's lookup, with its upload ahead of a hit all in CPU RAM."""
        tokens = self.histories[i]
        hit = self.engine.find(tokens, hold_for=self.rid(i), limit=len(tokens) - 1)
        if hit.tokens:
            self.engine.upload_ahead(tokens[: hit.tokens], self.rid(i), beside=True)
        return hit.tokens

    def load(self, i: int, hit: int) -> Callable[[], object]:
        """The hit's load beside the steps, queued; its finish returned."""
        loading = self.engine.start_retrieve(
            self.histories[i][:hit], self.table[i][:hit], request_id=self.rid(i), beside=True
        )
        return loading.finish

    def store(self, i: int) -> None:
        """The request's store after its forward: its chunks not stored yet, copies not waited
        for."""
        tokens = self.histories[i]
        self.engine.start_store(
            tokens, self.table[i], start=self.stored[i], request_id=self.rid(i)
        ).finish(wait=False)
        self.stored[i] = len(tokens)

    def turn(self, i: int) -> None:
        """A whole turn, as vLLM runs it: lookup, load, store (for the profile)."""
        self.grow(i)
        hit = self.lookup(i)
        self.step()
        self.load(i, hit)()
        self.store(i)

    def step(self) -> None:
        """vLLM's engine thread between a lookup and the load: waiting for its step on the GPU."""
        time.sleep(self.args.step_ms / 1e3)


def timed(fn: Callable[[], object], cpu: list[float] | None = None) -> tuple[float, object]:
    """The call's wall time; its thread's CPU time appended to `cpu` (where they differ, the
    thread waited: for the GIL, a lock, the GPU)."""
    c0, t0 = time.thread_time(), time.perf_counter()
    out = fn()
    spent = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.thread_time() - c0)
    return spent, out


def profiled(fns: list[Callable[[], object]], chat: Chat, top: int) -> list[str]:
    """The calls under cProfile: the top functions by own time, then kvtier's and Triton's
    by time inside them (what each layer of the call costs)."""
    prof = cProfile.Profile()
    for fn in fns:
        prof.enable()
        fn()
        prof.disable()
        chat.sync()
    lines = []
    for order, only in (
        ("tottime", ()),
        ("cumulative", ("kvtier/", "kvtier_tools/", "triton/runtime")),
    ):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(
            *[f"({'|'.join(only)})"] if only else [], top
        )
        lines += [f"by {order}:"] + [line for line in text.getvalue().splitlines() if line.strip()][
            -top - 1 :
        ]
    return lines


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median_us": statistics.median(xs) * 1e6,
        "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6,
        "n": len(xs),
    }


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chat = Chat(args, device)
    n = args.requests
    for i in range(n):  # the histories stored (and the kernels compiled) before anything is timed
        chat.store(i)
        chat.sync()
    names = ("lookup", "lookup_cpu", "load_queue", "load_finish", "store", "store_cpu")
    times: dict[str, list[float]] = {name: [] for name in names}
    hits = []
    for i in range(n):  # a turn of each conversation: its lookup, its load, its store
        chat.grow(i)
        spent, hit = timed(lambda: chat.lookup(i), times["lookup_cpu"])
        times["lookup"].append(spent)
        hits.append(hit)
        chat.step()
        spent, finish = timed(lambda: chat.load(i, hit))
        times["load_queue"].append(spent)
        spent, _ = timed(finish)
        times["load_finish"].append(spent)
        spent, _ = timed(lambda: chat.store(i), times["store_cpu"])
        times["store"].append(spent)
        chat.sync()
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "kvtier": kvtier.__file__.rsplit("/", 2)[
            0
        ],  # the tree timed (an earlier commit's: HOSTTIME_BASE)
        "args": vars(args),
        "calls": {k: summary(v) for k, v in times.items()},
        "hit_tokens_median": statistics.median(hits),
    }
    out["profile_turn"] = profiled([lambda i=i: chat.turn(i) for i in range(n)], chat, args.top)
    for i in range(n):  # a store alone, of a turn's new chunks
        chat.grow(i)
    out["profile_store"] = profiled([lambda i=i: chat.store(i) for i in range(n)], chat, args.top)
    chat.engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument(
        "--blocks", type=int, default=3160, help="vLLM's GPU KV cache in blocks of 16 tokens"
    )
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument(
        "--history", type=int, default=4352, help="a conversation's first prompt (tokens)"
    )
    p.add_argument(
        "--turn", type=int, default=384, help="tokens a turn adds (its answer and the next message)"
    )
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--cpu-gb", type=float, default=8.0)
    p.add_argument(
        "--step-ms",
        type=float,
        default=3.0,
        help="the engine thread's wait for its step between a lookup and the load (sleep)",
    )
    p.add_argument(
        "--piece-mb",
        type=int,
        default=KvtierConfig().gpu_store_piece_mb,
        help="config gpu_store_piece_mb (0: a store's copies down queued at once)",
    )
    p.add_argument("--top", type=int, default=18, help="profile lines per call kind")
    p.add_argument("--out", default="")
    args = p.parse_args()
    # room for four turns of growth (three run)
    if args.blocks * BLOCK < args.history + 4 * args.turn:
        p.error(
            f"--blocks {args.blocks} hold {args.blocks * BLOCK} tokens: the histories grow to "
            f"{args.history + 4 * args.turn}"
        )
    out = run(args)
    print(f"kvtier from {out['kvtier']}")
    for name, s in out["calls"].items():
        print(f"{name}: median {s['median_us']:.0f} us, p90 {s['p90_us']:.0f} us ({s['n']} calls)")
    print("\nprofile of whole turns (lookup, load, store):\n" + "\n".join(out["profile_turn"]))
    print("\nprofile of stores alone:\n" + "\n".join(out["profile_store"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
