"""`python -m kvtier.bench.h2d`: pinned host → GPU, by the copy engine or by a kernel,
and what each does to a small copy queued behind it (vLLM's inputs for its next step).

Both move the same rows (a prompt's chunks, one row per chunk and layer, as a
layerwise upload does); the row copies are timed alone, then again with a 128 KB
host-to-device copy queued on another stream 1 ms into them: how long that copy
waits is what the next forward of every request waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton

from kvtier.transfer import cudart
from kvtier.transfer.kernels import host_rows_kernel

BLOCK = 2048  # int64 words per program: 16 KB


def rows(total: int, row_bytes: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host.view(torch.int64).copy_(torch.arange(total // 8))
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    n = total // row_bytes
    offs = torch.arange(n, dtype=torch.int64) * row_bytes
    table = torch.stack([host.data_ptr() + offs, out.data_ptr() + offs.flip(0),
                         torch.full((n,), row_bytes // 8, dtype=torch.int64)], 1)
    return host, out, table.to(dev)


def by_engine(host, out, table_host, stream) -> None:
    for src, dst, words in table_host.tolist():
        cudart.memcpy2d(dst, words * 8, src, words * 8, words * 8, 1, stream)


def by_kernel(table, stream, row_words: int, block: int = BLOCK, warps: int = 4) -> None:
    with torch.cuda.stream(stream):
        host_rows_kernel[(table.shape[0], triton.cdiv(row_words, block))](table.data_ptr(), BLOCK=block,
                                                                           num_warps=warps)


def run(args) -> dict:
    dev = torch.device("cuda")
    host, out, table = rows(args.gb * 2**30 // args.row_mb // 2**20 * args.row_mb * 2**20, args.row_mb * 2**20, dev)
    table_host = table.cpu()
    bulk, side = torch.cuda.Stream(), torch.cuda.Stream()
    small_h = torch.ones(128 * 1024, dtype=torch.uint8, pin_memory=True)
    small_d = torch.empty_like(small_h, device=dev)
    ways = {"copy engine": lambda: by_engine(host, out, table_host, bulk),
            "kernel": lambda: by_kernel(table, bulk, table_host[0, 2].item())}
    for block, warps in args.variants:
        ways[f"kernel {block * 8 // 1024} KB/{warps}w"] = (
            lambda b=block, w=warps: by_kernel(table, bulk, table_host[0, 2].item(), b, w))
    result: dict = {"bytes": host.numel(), "row_bytes": args.row_mb * 2**20, "gpu": torch.cuda.get_device_name()}
    for name, go in ways.items():
        alone, behind, small_wait = [], [], []
        for _ in range(args.repeats + 1):
            out.zero_()
            torch.cuda.synchronize()
            t = time.perf_counter()
            go()
            torch.cuda.synchronize()
            alone.append(time.perf_counter() - t)
            assert torch.equal(out.view(torch.int64).view(-1, table_host[0, 2].item()).flip(0).reshape(-1)[:1000],
                               host.view(torch.int64)[:1000].to(dev)), name
            t = time.perf_counter()
            go()
            time.sleep(0.001)
            t_small = time.perf_counter()
            with torch.cuda.stream(side):
                small_d.copy_(small_h, non_blocking=True)
            side.synchronize()
            small_wait.append(time.perf_counter() - t_small)
            torch.cuda.synchronize()
            behind.append(time.perf_counter() - t)
        alone, behind, small_wait = alone[1:], behind[1:], small_wait[1:]
        result[name] = {"GBps": host.numel() / statistics.median(alone) / 1e9,
                        "ms": statistics.median(alone) * 1e3,
                        "small_copy_wait_ms": statistics.median(small_wait) * 1e3,
                        "ms_with_small_copy": statistics.median(behind) * 1e3}
        print(f"{name:12s} {result[name]['GBps']:.1f} GB/s ({result[name]['ms']:.1f} ms for "
              f"{host.numel() / 1e9:.2f} GB); a 128 KB copy queued 1 ms in waits "
              f"{result[name]['small_copy_wait_ms']:.2f} ms", flush=True)
    result["kernel_over_engine"] = result["kernel"]["GBps"] / result["copy engine"]["GBps"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gb", type=int, default=2)
    p.add_argument("--row-mb", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--variants", type=lambda v: tuple(map(int, v.split("/"))), nargs="*", default=[],
                   help="more kernel shapes, as words-per-program/warps (e.g. 8192/8)")
    args = p.parse_args()
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
