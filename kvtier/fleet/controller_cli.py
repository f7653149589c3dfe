"""`kvtier controller`: serve the controller, or ask a running one (one verb a call).

    kvtier controller serve --port 9000 [--auth-token T]
    kvtier controller health [--instance ID]
    kvtier controller totals
    kvtier controller lookup --tokens 1,2,3          (or --tokens-file ids.json, or
                                                     --prompt TEXT --tokenizer MODEL_DIR;
                                                     --lora-name/--lora-path, --cache-salt)
    kvtier controller clear --instance ID [--tier disk] [--tokens ...]
    kvtier controller pin|unpin --instance ID --tokens ...
    kvtier controller move --from ID[:TIER] --to ID[:TIER] --tokens ... [--copy]

A verb prints the controller's JSON answer and exits 0, or prints its error and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.adapters import identity_of
from kvtier.errors import KvtierError

TOKEN_ENV = "KVTIER_SERVER_TOKEN"  # the fleet's token, as the store server reads it
DEFAULT_URL = "http://127.0.0.1:9000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    verbs = p.add_subparsers(dest="verb", required=True)
    serve = verbs.add_parser("serve", help="run the controller")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=9000, help="HTTP port")
    serve.add_argument(
        "--worker-timeout",
        type=float,
        default=30.0,
        help="s after its last registration that a rank counts as gone",
    )
    _token(serve)
    health = _verb(verbs, "health", "the fleet's ranks, or one instance's (LMCache's /health)")
    health.add_argument("--instance", help="one instance: each rank's error code")
    _verb(verbs, "totals", "chunks per tier, over the fleet and per instance")
    _tokens(_verb(verbs, "lookup", "which instance holds how many tokens of a prompt, where"))
    clear = _verb(verbs, "clear", "drop an instance's chunks: all, one tier's, or a prompt's")
    clear.add_argument("--instance", required=True)
    clear.add_argument("--tier", help="cpu, disk (or LMCache's location names)")
    _tokens(clear, required=False)
    for name, what in (("pin", "keep a prompt's chunks in CPU RAM"), ("unpin", "let them go")):
        one = _verb(verbs, name, what)
        one.add_argument("--instance", required=True)
        _tokens(one)
    move = _verb(verbs, "move", "copy a prompt's chunks to another instance or tier")
    move.add_argument("--from", dest="source", required=True, help="ID or ID:TIER (tier: cpu)")
    move.add_argument("--to", dest="target", required=True, help="ID or ID:TIER (tier: cpu)")
    move.add_argument("--copy", action="store_true", help="keep them where they were too")
    _tokens(move)


def _verb(verbs: Any, name: str, help_: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = verbs.add_parser(name, help=help_)
    p.add_argument("--url", default=DEFAULT_URL, help="the controller")
    _token(p)
    return p


def _token(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--auth-token", default=os.environ.get(TOKEN_ENV), help=f"the fleet's token (${TOKEN_ENV})"
    )


def _tokens(p: argparse.ArgumentParser, required: bool = True) -> None:
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--tokens", help="token ids, comma separated")
    group.add_argument("--tokens-file", type=Path, help="a JSON list of token ids")
    group.add_argument(
        "--prompt",
        help="a prompt's text, made token ids by --tokenizer as vLLM's completions endpoint "
        "makes them (special tokens added)",
    )
    p.add_argument("--tokenizer", help="the model's folder or name, whose tokenizer --prompt uses")
    p.add_argument("--lora-name", default="", help="the prompt's LoRA adapter, as vLLM names it")
    p.add_argument("--lora-path", default="", help="that adapter's folder (its files are hashed)")
    p.add_argument("--cache-salt", default="", help="the prompt's cache_salt")


def run(args: argparse.Namespace) -> int:
    if args.verb == "serve":
        return _serve(args)
    try:
        path, body = _request(args)
        answer = _ask(args.url + path, body, args.auth_token)
    except KvtierError as exc:
        print(f"kvtier controller {args.verb}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvtier.fleet.controller import Controller
    from kvtier.server.state import is_loopback

    if not args.auth_token and not is_loopback(args.host):
        raise KvtierError(
            f"kvtier controller: --host {args.host} is not a loopback address: pass --auth-token "
            f"or set {TOKEN_ENV} (the instances' remote_auth_token)"
        )
    controller = Controller(args.auth_token, args.worker_timeout)
    print(f"kvtier controller on http://{args.host}:{args.port}", flush=True)
    web.run_app(controller.app(), host=args.host, port=args.port, print=None, shutdown_timeout=1.0)
    return 0


def _request(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None]:
    if args.verb == "health":
        return ("/health", {"instance_id": args.instance}) if args.instance else ("/health", None)
    if args.verb == "totals":
        return "/totals", None
    body: dict[str, Any] = {}
    if any(getattr(args, name, None) for name in ("tokens", "tokens_file", "prompt")):
        body["tokens"] = _token_ids(args)
        if args.lora_name or args.cache_salt:  # the root of its chunk keys, as vLLM's requests'
            body["identity"] = identity_of(
                args.lora_name, args.lora_path, args.cache_salt
            ).root.hex()
    if args.verb == "lookup":
        return "/lookup", body
    if args.verb == "move":
        body["old_position"] = _position(args.source)
        body["new_position"] = _position(args.target)
        body["should_copy"] = args.copy
        return "/move", body
    body["instance_id"] = args.instance
    if args.verb == "clear" and args.tier:
        body["location"] = args.tier
    return f"/{args.verb}", body


def _token_ids(args: argparse.Namespace) -> list[int]:
    if args.prompt is not None:
        return _tokenized(args.prompt, args.tokenizer)
    try:
        if args.tokens_file is not None:
            ids = json.loads(args.tokens_file.read_text())
        else:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
    except (OSError, ValueError) as exc:
        raise KvtierError(f"the token ids: {exc}") from exc
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise KvtierError("--tokens-file must hold a JSON list of token ids")
    return ids


def _tokenized(prompt: str, tokenizer: str | None) -> list[int]:
    """`prompt`'s token ids by the tokenizer of `tokenizer` (a model's folder or a name in the
    local Hugging Face cache), as vLLM's /v1/completions makes them."""
    if not tokenizer:
        raise KvtierError("--prompt needs --tokenizer (the model's folder)")
    from transformers import AutoTokenizer

    try:
        ids = AutoTokenizer.from_pretrained(tokenizer).encode(prompt)
    except (OSError, ValueError) as exc:
        raise KvtierError(f"the tokenizer of {tokenizer}: {exc}") from exc
    return [int(t) for t in ids]


def _position(text: str) -> list[str]:
    instance, _, tier = text.partition(":")
    return [instance, tier or "cpu"]


def _ask(url: str, body: dict[str, Any] | None, token: str | None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("detail", detail)
        except ValueError:
            pass
        raise KvtierError(f"HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise KvtierError(f"{url}: {exc}") from exc
