"""`kvtier bench ...`: each benchmark's arguments and what runs it. kvtier's CLI loads this
module only for `kvtier bench`, and only the named benchmark's arguments (its module may need
triton or a GPU's libraries that `kvtier server` must start without)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvtier.cli import Command


def _bench_offload(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.offload import OffloadShape, run_offload, write_result

    shape = OffloadShape(
        tokens=args.tokens,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        block_size=args.block_size,
        layout=args.layout,
        chunk_size=args.chunk_size,
    )
    transfers = ["torch", "triton", "triton-direct"] if args.transfer == "all" else [args.transfer]
    for transfer in transfers:
        result = run_offload(shape, args.device, transfer, args.repeats)
        s = result.summary()
        print(
            f"{result.machine} | {result.transfer} | {shape.tokens} tokens, "
            f"{result.kv_bytes / 1e9:.2f} GB | "
            f"store {s['store_GBps']} GB/s ({s['store_ratio']:.2f} of copy {s['copy_d2h_GBps']}) | "
            f"retrieve {s['retrieve_GBps']} GB/s "
            f"({s['retrieve_ratio']:.2f} of copy {s['copy_h2d_GBps']})"
        )
        if args.output:
            write_result(result, Path(args.output), "kvtier " + shlex.join(sys.argv[1:]))
    return 0


def _bench_disk(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.disk import run_disk
    from kvtier_tools.bench.offload import OffloadShape, write_result

    shape = OffloadShape(
        tokens=args.tokens,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        chunk_size=args.chunk_size,
    )
    result = run_disk(shape, Path(args.dir), args.repeats)
    s = result.summary()
    print(
        f"{result.machine} | {shape.tokens} tokens, {result.kv_bytes / 1e9:.2f} GB in {args.dir} | "
        f"tier write {s['tier_write_GBps']} GB/s "
        f"({s['write_ratio_paired']:.2f} of file {s['file_write_GBps']}) | "
        f"read {s['tier_read_GBps']} GB/s "
        f"({s['read_ratio_paired']:.2f} of file {s['file_read_GBps']}) | "
        f"step waits {s['step_wait_sync_ms']} ms sync vs {s['step_wait_async_ms']} ms async "
        f"(request loaded in {s['request_load_async_ms']} ms)"
    )
    if args.output:
        write_result(result, Path(args.output), "kvtier " + shlex.join(sys.argv[1:]))
    return 0


def _bench_ttft(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.offload import need_gpu
    from kvtier_tools.bench.ttft import run_ttft

    need_gpu("bench ttft times a model's prefill on a GPU")
    run_ttft(
        args.lengths,
        args.repeats,
        Path(args.output),
        layers=args.layers,
        transfer=args.transfer,
        server=args.server,
        disk_dir=Path(args.disk) if args.disk else None,
        server_tcp=args.server_tcp,
        codecs=tuple(args.codecs),
    )
    return 0


def _chat_args(p: argparse.ArgumentParser) -> None:
    from kvtier_tools.bench.chat import add_args

    add_args(p)


def _chaos_args(p: argparse.ArgumentParser) -> None:
    from kvtier_tools.bench.chaos import add_args

    add_args(p)


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.chaos import main

    return main(args)


def _fleet_args(p: argparse.ArgumentParser) -> None:
    from kvtier_tools.bench.fleet import add_args

    add_args(p)


def _bench_fleet(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.fleet import main

    return main(args)


def _p2p_args(p: argparse.ArgumentParser) -> None:
    from kvtier_tools.bench.p2p import add_args

    add_args(p)


def _bench_p2p(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.p2p import main

    return main(args)


def _bench_chat(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.chat import main

    return main(args)


def _h2d_args(p: argparse.ArgumentParser) -> None:
    from kvtier_tools.bench.h2d import add_args

    add_args(p)


def _bench_h2d(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.h2d import run

    return run(args)


def _bench_pd(args: argparse.Namespace) -> int:
    import json

    from kvtier_tools.bench.offload import OffloadShape, bench_device
    from kvtier_tools.bench.pd import run_pd

    shape = OffloadShape(
        tokens=max(args.tokens), layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim
    )
    sender = str(bench_device(args.sender_device, "--sender-device"))
    receiver = str(bench_device(args.receiver_device, "--receiver-device"))
    result = run_pd(
        shape, args.tokens, args.channels, sender, receiver, args.repeats, tuple(args.pieces)
    )
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"command": "kvtier " + shlex.join(sys.argv[1:]), **result}, indent=1) + "\n"
        )
    return 0


def _bench_server(args: argparse.Namespace) -> int:
    from kvtier_tools.bench.server import TARGETS, ServerBenchConfig, run_server_bench, write_result

    cfg = ServerBenchConfig(
        sizes_mib=tuple(args.sizes),
        conns=tuple(args.conns),
        duration=args.duration,
        repeats=args.repeats,
        targets=tuple(args.targets or TARGETS),
        extras=not args.throughput_only,
    )
    result = run_server_bench(cfg)
    if args.output:
        write_result(result, Path(args.output), "kvtier " + shlex.join(sys.argv[1:]))
    return 0


def _shape_args(p: argparse.ArgumentParser, chunk: bool = True) -> None:
    """The model shape a synthetic benchmark moves (Llama-3.1-8B's by default)."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    if chunk:
        p.add_argument("--chunk-size", type=int, default=256)


def _offload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=16384)
    _shape_args(p)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--layout", default="flash_attn", choices=["flash_attn", "flashinfer", "mla", "vllm"]
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--transfer", default="auto", choices=["auto", "torch", "triton", "triton-direct", "all"]
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", help="append results to this JSON file")


def _disk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=16384)
    _shape_args(p)
    p.add_argument("--dir", default=".kvtier/bench-disk", help="a directory on the disk to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", help="append results to this JSON file")


def _ttft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, help="fewer layers than 32, for a quick look")
    p.add_argument("--output", default="results/ttft", help="folder for ttft.json and ttft.png")
    p.add_argument(
        "--transfer", default="auto", choices=["auto", "triton", "triton-direct", "torch"]
    )
    p.add_argument(
        "--server", action="store_true", help="also warm from a kvtier server on this host"
    )
    p.add_argument(
        "--server-tcp",
        action="store_true",
        help="with --server: also over TCP (?shm=0), against raw loopback TCP",
    )
    p.add_argument(
        "--codecs",
        nargs="*",
        default=[],
        choices=["int8", "fp8", "int4"],
        help="with --server-tcp: also over TCP with these lossy KV codecs (remote_serde)",
    )
    p.add_argument("--disk", help="also warm from the disk tier in this directory")


def _pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument(
        "--channels", nargs="+", default=["cuda_ipc"], choices=["tcp", "nixl", "cuda_ipc"]
    )
    p.add_argument(
        "--sender-device", default="auto", help="auto: cuda:0 where there is a GPU, else cpu"
    )
    p.add_argument(
        "--receiver-device", default="auto", help="auto: as the sender's; cuda:1 for two GPUs"
    )
    _shape_args(p, chunk=False)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--pieces",
        nargs="+",
        default=["default"],
        help="cuda_ipc, each in turn, paired: default, F,M, step, sync-commit, gather-after-alloc, "
        "group=MiB, first=MiB, forward=MS (behind a forward, as in vLLM); see bench.pd.run_pd",
    )
    p.add_argument("--output", help="write the results to this JSON file")


def _server_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="value sizes, MiB")
    p.add_argument("--conns", type=int, nargs="+", default=[1, 2, 8], help="client connections")
    p.add_argument("--duration", type=float, default=1.0, help="seconds per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--targets",
        nargs="+",
        help="what to measure: raw raw-ring kvtier kvtier-shm kvtier-auth kvtier-tls "
        "redis redis-unix mooncake mooncake-py",
    )
    p.add_argument(
        "--throughput-only", action="store_true", help="skip latency, shared memory and serdes"
    )
    p.add_argument("--output", help="write the results to this JSON file")


BENCHMARKS: list[Command] = [
    ("offload", "store/retrieve GB/s vs plain copy bandwidth", _offload_args, _bench_offload),
    (
        "disk",
        "disk tier vs sequential file I/O; engine step wait on a disk hit",
        _disk_args,
        _bench_disk,
    ),
    ("ttft", "cold vs warm TTFT of a Llama-3.1-8B-shaped model (GPU)", _ttft_args, _bench_ttft),
    (
        "pd",
        "disaggregated prefill: sender process -> receiver's buffer -> its pages, "
        "vs a plain device copy",
        _pd_args,
        _bench_pd,
    ),
    (
        "server",
        "store server vs raw loopback TCP, redis-server and Mooncake Store",
        _server_bench_args,
        _bench_server,
    ),
    (
        "h2d",
        "a load's host-to-GPU copies by the copy engine or by a kernel, "
        "and what waits behind each (GPU)",
        _h2d_args,
        _bench_h2d,
    ),
    (
        "chat",
        "multi-turn conversations at a steady rate against a vLLM server: "
        "TTFT, throughput, hit rate",
        _chat_args,
        _bench_chat,
    ),
    (
        "fleet",
        "N vLLM instances behind kvtier router: round robin, with P2P, KV-aware routing with P2P",
        _fleet_args,
        _bench_fleet,
    ),
    (
        "p2p",
        "a peer's chunks fetched over TCP and out of its shared pool, against loopback TCP "
        "and memcpy",
        _p2p_args,
        _bench_p2p,
    ),
    (
        "chaos",
        "faults under load (store server, disk, PD) with real vLLM: no request lost, outputs equal",
        _chaos_args,
        _bench_chaos,
    ),
]
