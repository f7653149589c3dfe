"""`kvtier bench h2d`: a load's copies from pinned host memory into GPU
staging, by the copy engine or by a kernel, and what each does to the GPU's other work;
with `--down`, a store's copies the other way.

The geometry is a layerwise upload's: a pool of adjacent chunks [L, K, T, H, D];
per layer, layer l of every chunk (one strided run) into layer-major staging: one
cudaMemcpy2DAsync per layer, or one launch of host_runs_kernel per layer with
`programs` programs, or (down, `--piece-mb`) the copies cut in pieces and queued one at
a time as a store not waited for has them (kvtier/transfer/pacing.py). Timed alone,
then twice more with other work queued 1 ms into it on another stream: a 128 KB copy
the same way (up: vLLM's inputs for its next step; down: its sampled tokens, which its
engine waits for before the step after the next: how long it waits), and bf16 matmuls
(a forward beside the copies: how much longer they take than alone). The bytes that
arrived are checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.transfer import InFlight, cudart
from kvtier.transfer.pacing import PacedCopies
from kvtier.transfer.staging import copy_runs, run_table
from kvtier_tools.bench.offload import need_gpu


class Load:
    def __init__(
        self, chunks: int, layers: int, layer_mb: float, dev: torch.device, down: bool = False
    ) -> None:
        self.layers, self.down = layers, down
        self.layer_bytes = int(layer_mb * 2**20) // 8 * 8
        self.chunk_bytes = self.layer_bytes * layers
        self.chunks = chunks
        self.pool = torch.empty(chunks * self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.pool.view(torch.int64).copy_(torch.arange(self.pool.numel() // 8))
        self.staging = torch.empty_like(self.pool, device=dev)
        # Per layer one run, as Staging.run_table has it: (host, device, host pitch, device pitch,
        # bytes, rows).
        self.runs = [
            [
                (
                    self.pool.data_ptr() + layer * self.layer_bytes,
                    self.staging.data_ptr() + layer * chunks * self.layer_bytes,
                    self.chunk_bytes,
                    self.layer_bytes,
                    self.layer_bytes,
                    chunks,
                )
            ]
            for layer in range(layers)
        ]
        self.table = run_table(self.runs, to_host=down)
        # what the copies are checked for, at both ends: the pool's bytes (up), or back (down)
        self.ends = (self.pool[:4096].clone(), self.pool[-4096:].clone())
        if down:  # staging holds the pool's bytes in its layer-major order, to be copied back
            self.staging.copy_(self._layer_major(self.pool))

    def by_engine(self, stream) -> None:
        for [(host, dev, hp, dp, width, rows)] in self.runs:
            if self.down:
                cudart.memcpy2d(host, hp, dev, dp, width, rows, stream)
            else:
                cudart.memcpy2d(dev, dp, host, hp, width, rows, stream)

    def paced(self, pacer: PacedCopies, stream) -> InFlight:
        """Down only: the copies as a store not waited for queues them (pacing.py)."""
        after = stream.record_event()
        return pacer.add([(run, after) for [run] in self.runs], keep=None)

    def by_kernel(self, stream, programs: int) -> None:
        with torch.cuda.stream(stream):
            for part in self.table:
                copy_runs(*part, programs=programs)

    def reset(self) -> None:
        """Clear where the copies write."""
        (self.pool if self.down else self.staging).zero_()

    def check(self) -> None:
        got = self.pool if self.down else self._chunk_major(self.staging)
        head, tail = self.ends
        assert torch.equal(got[:4096].cpu(), head) and torch.equal(got[-4096:].cpu(), tail)

    def _layer_major(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(self.chunks, self.layers, self.layer_bytes).transpose(0, 1).reshape(-1)

    def _chunk_major(self, staged: torch.Tensor) -> torch.Tensor:
        return staged.view(self.layers, self.chunks, self.layer_bytes).transpose(0, 1).reshape(-1)


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def measure(load: Load, go, repeats: int, dev: torch.device) -> dict:
    side = torch.cuda.Stream()
    small_h = torch.ones(128 * 1024, dtype=torch.uint8, pin_memory=True)
    small_d = torch.ones_like(small_h, device=dev)
    small = (
        (lambda: small_h.copy_(small_d, non_blocking=True))
        if load.down
        else (lambda: small_d.copy_(small_h, non_blocking=True))
    )
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def matmuls():
        for _ in range(20):
            a @ a

    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            fn()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    matmul_alone = [timed(matmuls) for _ in range(repeats + 1)][1:]
    alone, waits, beside = [], [], []
    for _ in range(repeats + 1):
        load.reset()
        torch.cuda.synchronize()
        t = time.perf_counter()
        landed(go())
        alone.append(time.perf_counter() - t)
        load.check()
        flight = go()
        time.sleep(0.001)
        waits.append(timed(small))
        landed(flight)
        flight = go()
        time.sleep(0.001)
        beside.append(timed(matmuls))
        landed(flight)
    alone, waits, beside = alone[1:], waits[1:], beside[1:]
    return {
        "GBps": load.pool.numel() / statistics.median(alone) / 1e9,
        "ms": _median_ms(alone),
        "small_copy_wait_ms": _median_ms(waits),
        "matmuls_beside_ms": _median_ms(beside),
        "matmuls_alone_ms": _median_ms(matmul_alone),
    }


def landed(flight: InFlight | None) -> None:
    """Wait for the copies `go` queued: a paced store's held pieces too, without queuing them
    at once (as `flight.done` would)."""
    while flight is not None and not flight.arrived():
        time.sleep(0.0001)
    torch.cuda.synchronize()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=int, default=64, help="chunks of 256 tokens (64: 16k tokens)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--layer-mb", type=float, default=1.0, help="MB of one layer of one chunk (8B model: 1)"
    )
    p.add_argument("--programs", type=int, nargs="*", default=[16, 32, 64, 132])
    p.add_argument(
        "--piece-mb",
        type=int,
        nargs="*",
        default=[],
        help="with --down: also paced as a store not waited for, one piece of this many MiB at "
        "a time (config gpu_store_piece_mb; 0: all its pieces at once)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--down",
        action="store_true",
        help="GPU to pinned host, as a store copies (and the small copy)",
    )
    p.add_argument("--output", default="", help="write the JSON record here")


def run(args: argparse.Namespace) -> int:
    need_gpu("bench h2d times host-to-GPU copies")
    dev = torch.device("cuda")
    load = Load(args.chunks, args.layers, args.layer_mb, dev, down=args.down)
    stream = torch.cuda.current_stream()
    ways: dict[str, Callable[[], InFlight | None]] = {"copy engine": lambda: load.by_engine(stream)}
    ways.update({f"kernel x{n}": (lambda n=n: load.by_kernel(stream, n)) for n in args.programs})
    for mb in args.piece_mb if args.down else ():
        pacer = PacedCopies(torch.cuda.Stream(), piece_bytes=mb << 20)
        ways[f"paced {mb} MiB"] = lambda pacer=pacer: load.paced(pacer, stream)
    result: dict = {
        "bytes": load.pool.numel(),
        "direction": "GPU to host" if args.down else "host to GPU",
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
    }
    for name, go in ways.items():
        r = result[name] = measure(load, go, args.repeats, dev)
        print(
            f"{name:14s} {r['GBps']:5.1f} GB/s "
            f"({r['ms']:.1f} ms for {load.pool.numel() / 1e9:.2f} GB); "
            f"a 128 KB copy queued 1 ms in waits {r['small_copy_wait_ms']:.2f} ms; "
            f"20 matmuls beside "
            f"{r['matmuls_beside_ms']:.1f} ms (alone {r['matmuls_alone_ms']:.1f})",
            flush=True,
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(parser)
    raise SystemExit(run(parser.parse_args()))
