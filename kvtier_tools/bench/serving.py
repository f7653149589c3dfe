"""`python -m kvtier_tools.bench.serving`: the chat workload (chat.py) against vLLM's OpenAI
server with each KV offloader in turn: same vLLM, model, prompts and CPU memory, one
server at a time on this machine.

    plain          no offloader (vLLM's own prefix cache only, if on)
    plain-gpu-all  no offloader, and a GPU KV cache that holds every conversation at its last
                   turn (with --gpu-kv-share): each turn after the first a GPU hit, the floor
                   of the turns an offloader serves
    kvtier         KvtierConnector, its defaults (gpu_upload auto, async_loading busy)
    kvtier-kernel  KvtierConnector, gpu_upload kernel (no load holds the copy engine)
    kvtier-in-step KvtierConnector, async_loading never (every CPU-RAM hit loads in its step)
    kvtier-layerwise KvtierConnector, use_layerwise (a load in its step waits layer by layer)
    kvtier-consumer KvtierConnector as a kv_consumer: looks up and loads, never stores (what
                   the stores cost the requests beside them, against kvtier)
    kvtier-dma     KvtierConnector, gpu_upload copy_engine (a hit beside the steps crosses by DMA
                   too)
    kvtier-int4    KvtierConnector, remote_serde int4 (lossy: 0.28 of the bytes in every tier)
    kvtier-fp8     KvtierConnector, remote_serde fp8 (lossy: about half the bytes in every tier)
    kvtier-unpaced KvtierConnector, gpu_store_piece_mb 0 (a store's copies down all queued at
                   once, ahead of vLLM's copy of its next sampled tokens)
    kvtier-piece8  KvtierConnector, gpu_store_piece_mb 8 (a quarter of the default piece: vLLM's
                   copy of its sampled tokens waits behind less of a store)
    kvtier-switch  KvtierConnector, every server process's GIL switch interval 0.5 ms (Python's
                   5 ms; bench/step_trace.py): do vLLM's threads that take requests in and send
                   tokens out wait less for the engine thread? (No: 1.164x kvtier's mean TTFT,
                   results/gpu-h200-steps-2026-12-03)
    kvtier-base    KvtierConnector from the tree at $BENCH_BASE_TREE (an earlier commit's kvtier/,
                   `git archive REV kvtier | tar -x -C DIR`): before and after in one call
    lmcache        LMCacheConnectorV1, CPU RAM
    native         vLLM's OffloadingConnector (--kv-offloading-size, backend native)

One JSON record per setup (`<out>/<setup>.json`), `<out>/serving.svg` (TTFT over the
run, every setup) and a table on stdout: mean / p99 TTFT, throughput, hit rates,
failed requests, and how many greedy outputs equal the first setup's. `--gpu-kv-share S`
sizes vLLM's GPU KV cache to hold S of the conversations at their last turn, whatever the
GPU (`ServerSpec.gpu_kv_bytes`): the offloaders serve the rest. With `--rounds N`
the setups run N times over in turn (`<setup>#<k>`), and a second table gives each one's
mean TTFT by round and its median ratio to the first setup's in the same round; with
`--resident` too, every setup's server stays up through the rounds (started once), and
each round sends new conversations. With
`--profile`, py-spy samples the server and its engine core during the workload
(`<out>/<setup>-pyspy.txt`, collapsed stacks; `kvtier_tools.bench.stacks` sums them).

With `--bench-serve JSON` it runs the InfiniStore guide's flow instead: per setup,
`vllm bench serve` twice against one server (by default with a prefix-sharing dataset,
vLLM's prefix_repetition, when the JSON sets num_prefixes), and a table of each run's
median / mean / p99 TTFT, the second's ratio to the first, throughput and failed
requests (`<out>/<setup>-bench-serve.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvtier_tools.bench.chat import Record, Workload, plot, run
from kvtier_tools.bench.report_serving import by_round, by_turn, serve_twice_table, table
from kvtier_tools.bench.stores_vllm import LMCACHE_CONNECTOR, bench_serve, served_outputs
from kvtier_tools.bench.stores_vllm import Workload as BenchServe
from kvtier_tools.dev.cpu_dtype import model_dtype
from kvtier_tools.dev.demo import vllm_server
from kvtier_tools.dev.tinymodel import TinyLlama, make_tiny_llama

KVTIER = {"kv_connector": "KvtierConnector", "kv_role": "kv_both"}


def base_tree() -> dict[str, str]:
    """The environment that has a server import kvtier from $BENCH_BASE_TREE first. Python puts
    a `-m` run's working directory (here the repository, with this tree's kvtier/) ahead of
    PYTHONPATH unless PYTHONSAFEPATH is set: without it the base setup ran this tree's kvtier
    (results/gpu-h200-ab-2026-12-02/README.md)."""
    base = os.environ.get("BENCH_BASE_TREE")
    if not base or not (Path(base) / "kvtier").is_dir():
        raise SystemExit("setup kvtier-base needs BENCH_BASE_TREE=<a folder that holds kvtier/>")
    tree = str(Path(base).resolve())
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{tree}:{rest}" if rest else tree, "PYTHONSAFEPATH": "1"}


def setup(name: str, cpu_gb: float) -> tuple[dict | None, dict, list[str]]:
    """(kv-transfer-config, environment, more server arguments) of a setup."""
    size = {"LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gb), "LMCACHE_CHUNK_SIZE": "256"}
    if name == "kvtier-base":
        return KVTIER, {**size, **base_tree()}, []
    return {
        "plain": (None, {}, []),
        "plain-gpu-all": (None, {}, []),
        "kvtier": (KVTIER, size, []),
        "kvtier-kernel": (KVTIER, {**size, "KVTIER_GPU_UPLOAD": "kernel"}, []),
        "kvtier-in-step": (KVTIER, {**size, "KVTIER_ASYNC_LOADING": "never"}, []),
        "kvtier-layerwise": (KVTIER, {**size, "LMCACHE_USE_LAYERWISE": "true"}, []),
        "kvtier-consumer": ({**KVTIER, "kv_role": "kv_consumer"}, size, []),
        "kvtier-dma": (KVTIER, {**size, "KVTIER_GPU_UPLOAD": "copy_engine"}, []),
        "kvtier-int4": (KVTIER, {**size, "LMCACHE_REMOTE_SERDE": "int4"}, []),
        "kvtier-fp8": (KVTIER, {**size, "LMCACHE_REMOTE_SERDE": "fp8"}, []),
        "kvtier-unpaced": (KVTIER, {**size, "KVTIER_GPU_STORE_PIECE_MB": "0"}, []),
        "kvtier-piece8": (KVTIER, {**size, "KVTIER_GPU_STORE_PIECE_MB": "8"}, []),
        "kvtier-switch": (KVTIER, {**size, "BENCH_SWITCH_INTERVAL_MS": "0.5"}, []),
        "lmcache": (LMCACHE_CONNECTOR, {**size, "LMCACHE_LOCAL_CPU": "true"}, []),
        "native": (
            None,
            {},
            ["--kv-offloading-size", str(cpu_gb), "--kv-offloading-backend", "native"],
        ),
    }[name]


@dataclass(frozen=True)
class ServerSpec:
    """How every setup's vLLM server runs: the same for each offloader."""

    cpu_gb: float = 20.0  # CPU memory each offloader gets
    # vLLM's share of the GPU (its KV cache what is left of it after the model)
    gpu_util: float = 0.2
    eager: bool = False
    prefix_caching: bool = True
    max_model_len: int = 32768
    dtype: str = "auto"
    # vLLM's GPU KV cache, exactly (--kv-cache-memory-bytes; gpu_util then
    gpu_kv_bytes: int | None = None
    # only bounds the rest)
    gpu_kv_all_bytes: int | None = None  # the same for the setups of ALL_ON_GPU


# Setups whose GPU KV cache holds the whole workload (ServerSpec.gpu_kv_all_bytes).
ALL_ON_GPU = {"plain-gpu-all"}


# vLLM keeps one block of its KV cache back (its null block): 16 tokens on the GPU backends, 128 on
# its CPU build (with exactly max_model_len tokens the CPU build refused: "estimated maximum model
# length is 1920" for 2048); a bound for both.
NULL_BLOCK_TOKENS = 256


def gpu_kv_bytes(
    spec: TinyLlama, w: Workload, share: float, max_model_len: int, dtype_bytes: int = 2
) -> int:
    """A GPU KV cache that holds `share` of the workload's conversations at their last turn
    (prompt and answer), so that the workload means the same on any GPU; at least one
    request of `max_model_len` tokens and vLLM's null block (it will not start with less). KV
    in 16-bit floats unless `dtype_bytes` says otherwise."""
    last_turn = (
        w.system_tokens + w.turns * w.user_tokens + (w.turns - 1) * w.answer_tokens + w.max_tokens
    )
    least = max_model_len + NULL_BLOCK_TOKENS
    return spec.kv_bytes_per_token(dtype_bytes) * max(
        round(share * w.conversations * last_turn), least
    )


def served(model: Path, name: str, workdir: Path, server: ServerSpec):
    """vLLM's OpenAI server with setup `name`'s offloader (a context manager)."""
    connector, env, extra = setup(name, server.cpu_gb)
    kv_bytes = server.gpu_kv_all_bytes if name in ALL_ON_GPU else server.gpu_kv_bytes
    if kv_bytes is not None:  # on CPU too: vLLM's CPU platform takes its whole GiB from
        # VLLM_CPU_KVCACHE_SPACE over the flag, so the variable goes
        extra = [*extra, "--kv-cache-memory-bytes", str(kv_bytes)]
        env = {**env, "VLLM_CPU_KVCACHE_SPACE": None}
    return vllm_server(
        model,
        workdir,
        env=env,
        kv_connector=connector,
        extra_args=extra,
        gpu_memory_utilization=server.gpu_util,
        eager=server.eager,
        prefix_caching=server.prefix_caching,
        max_model_len=server.max_model_len,
        dtype=server.dtype,
    )


@contextlib.contextmanager
def sampled(pid: int, path: Path | None, rate: int = 200, idle: bool = True) -> Iterator[None]:
    """py-spy sampling process `pid` and its children (vLLM's engine core) into `path`, as
    collapsed stacks, while the block runs (nothing where `path` is None); `rate` samples a
    second, with the threads' idle waits (`idle`) or their busy time only."""
    if path is None:
        yield
        return
    spy = shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("--profile needs py-spy on PATH (pip install py-spy)")
    proc = subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--threads",
            *(["--idle"] if idle else []),
            "--nonblocking",
            "-o",
            str(path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        proc.wait(timeout=60)


WARM_UP_SEED = 1_000_003  # past any round's


def warm_up(w: Workload) -> Workload:
    """One request before a server's rounds (its first compile and graphs), of a seed no round
    uses (round k's is seed + k; random.Random takes -s as s): with round 1's own, that round
    had one cold system prompt less than the others (results/gpu-h200-floor-2026-12-03)."""
    return replace(w, rate=100.0, conversations=1, turns=1, seed=w.seed + WARM_UP_SEED)


def compare(
    model: Path,
    names: list[str],
    w: Workload,
    out: Path,
    server: ServerSpec,
    profile: bool = False,
    rounds: int = 1,
    servers: str = "per-run",
) -> dict[str, Record]:
    """Each setup in turn, `rounds` times over (setup "x" of round 2 is "x#2"): a machine's
    drift then falls on every setup alike, and each round compares setups side by side.

    `servers`: "per-run", a server a run. "resident": every setup's server up at once (the
    GPU holds each one's model and KV cache: size `gpu_util` for that), started once; round
    k then sends new conversations (seed + k), so nothing an earlier round left is a hit,
    and runs the setups in reverse order every other round. A start costs ~100 s at the 8B
    shape on an H200 and a run ~10 s, so one call holds many paired rounds this way.
    "alone": the same rounds, but one setup's server at a time (the machine's drift between
    the blocks is not paired out); results/gpu-h200-vllm-2026-11-28/README.md, 21:47 UTC,
    says why."""
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, Record] = {}

    def measure(key: str, srv, workload: Workload) -> None:
        assert srv.proc is not None
        with sampled(srv.proc.pid, out / f"{key}-pyspy.txt" if profile else None):
            records[key] = rec = run(srv.url, str(model), workload)
        (out / f"{key}.json").write_text(json.dumps(asdict(rec), indent=1))
        print(f"[{key}] {json.dumps(rec.summary)}", flush=True)

    def warm(srv) -> None:
        run(srv.url, str(model), warm_up(w))

    def key(name: str, r: int) -> str:
        return name if rounds == 1 else f"{name}#{r + 1}"

    if servers == "alone":
        for name in names:
            with served(model, name, out / name, server) as srv:
                warm(srv)
                for r in range(rounds):
                    measure(key(name, r), srv, replace(w, seed=w.seed + r))
    elif servers == "resident":
        with contextlib.ExitStack() as stack:
            up = {
                name: stack.enter_context(served(model, name, out / name, server)) for name in names
            }
            for srv in up.values():
                warm(srv)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    measure(key(name, r), up[name], replace(w, seed=w.seed + r))
    else:
        for r in range(rounds):
            for name in names:
                with served(model, name, out / key(name, r), server) as srv:
                    warm(srv)
                    measure(key(name, r), srv, w)
    (out / "serving.svg").write_text(plot({n: asdict(r) for n, r in records.items()}))
    return records


def report(out: Path, names: list[str]) -> dict[str, Record]:
    """The records a chat run left in `out` ("x#k" by round, each round in the order of
    `names`, other setups after them), and their plot written again: a run cut by its time
    limit leaves its records but prints no table."""
    found = {
        q.stem: Record(**json.loads(q.read_text()))
        for q in out.glob("*.json")
        if "#" in q.stem or q.stem in names
    }
    setups = {k.partition("#")[0] for k in found}
    order = [n for n in names if n in setups] + sorted(setups - set(names))
    records = {
        k: found[k]
        for k in sorted(
            found, key=lambda k: (int(k.partition("#")[2] or 0), order.index(k.partition("#")[0]))
        )
    }
    (out / "serving.svg").write_text(plot({n: asdict(r) for n, r in records.items()}))
    return records


def serve_twice(
    model: Path,
    names: list[str],
    work: BenchServe,
    out: Path,
    server: ServerSpec,
    profile: bool = False,
) -> dict[str, dict]:
    """The InfiniStore guide's flow per setup: `vllm bench serve` twice against one server,
    the second run sending the first's prompts (a prefix-sharing dataset where `work` says
    so); `profile`: py-spy on the server during each (`<out>/<setup>-first-pyspy.txt`,
    `-second-`). A setup whose run fails is recorded with its error; the others still run. Each
    run's greedy outputs are kept (`outputs`; vLLM's per-request records in `<out>/<setup>/`): an
    offloader's second run, served from its KV, should give what the first setup's first run
    computed."""
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for name in names:
        try:
            with served(model, name, out / name, server) as srv:
                assert srv.proc is not None
                runs = {}
                for run_ in ("first", "second"):
                    with sampled(
                        srv.proc.pid, out / f"{name}-{run_}-pyspy.txt" if profile else None
                    ):
                        runs[run_] = bench_serve(
                            srv.url, str(model), work, save=out / name / f"{run_}.json"
                        )
            first, second = runs["first"], runs["second"]
            rows[name] = {
                "first": first,
                "second": second,
                "second_vs_first_median": second["Median TTFT (ms)"] / first["Median TTFT (ms)"],
                "outputs": {r: served_outputs(out / name / f"{r}.json") for r in runs},
            }
        except (
            RuntimeError,
            TimeoutError,
            subprocess.SubprocessError,
        ) as exc:  # a start or a run that failed
            rows[name] = {"error": str(exc)[-2000:]}
        (out / f"{name}-bench-serve.json").write_text(
            json.dumps({"workload": asdict(work), **rows[name]}, indent=1)
        )
        print(f"[{name}] {json.dumps(rows[name])[:400]}", flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--setups", nargs="+", default=["plain", "kvtier", "kvtier-kernel", "lmcache", "native"]
    )
    p.add_argument("--model-dir", default="/tmp/kvtier-serving-model")
    p.add_argument(
        "--model",
        type=json.loads,
        default={},
        help="TinyLlama fields of the model made there (JSON)",
    )
    p.add_argument("--out", default="results/serving")
    p.add_argument("--cpu-gb", type=float, default=20.0, help="CPU memory each offloader gets (GB)")
    p.add_argument(
        "--gpu-util",
        type=float,
        default=0.2,
        help="small, so that vLLM's own KV cache holds a part",
    )
    p.add_argument(
        "--gpu-kv-share",
        type=float,
        default=None,
        help="vLLM's GPU KV cache sized to hold this share of the chat's conversations at their "
        "last turn (--kv-cache-memory-bytes): the same workload on any GPU, "
        "whatever --gpu-util leaves",
    )
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--workload", type=json.loads, default={}, help="Workload fields (JSON)")
    p.add_argument("--profile", action="store_true", help="py-spy the server during each workload")
    p.add_argument(
        "--rounds", type=int, default=1, help="run the setups this many times over, in turn"
    )
    started = p.add_mutually_exclusive_group()
    started.add_argument(
        "--resident",
        dest="servers",
        action="store_const",
        const="resident",
        default="per-run",
        help="every setup's server up at once, started once; each round new conversations "
        "(many paired rounds a call; --gpu-util small enough for all of them)",
    )
    started.add_argument(
        "--alone",
        dest="servers",
        action="store_const",
        const="alone",
        help="as --resident, but one setup's server at a time, through all its rounds",
    )
    p.add_argument(
        "--report",
        metavar="DIR",
        help="print the tables of the chat records in DIR (a run cut by its "
        "time limit printed none), in the order of --setups, and write their plot again; "
        "run nothing",
    )
    p.add_argument(
        "--bench-serve",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="instead of the chat workload, `vllm bench serve` twice per setup: fields of "
        "kvtier_tools.bench.stores_vllm.Workload (num_prefixes > 0: the prefix_repetition dataset)",
    )
    return p


def main() -> None:
    args = _parser().parse_args()
    if args.report:
        records = report(Path(args.report), args.setups)
        print("\n".join(table(records) + [""] + by_round(records) + [""] + by_turn(records)))
        return
    spec = TinyLlama(**args.model)
    model = make_tiny_llama(args.model_dir, spec)
    server = ServerSpec(
        args.cpu_gb, args.gpu_util, args.eager, args.prefix_caching, args.max_model_len
    )
    if args.bench_serve is not None:
        rows = serve_twice(
            model,
            args.setups,
            BenchServe(**args.bench_serve),
            Path(args.out),
            server,
            profile=args.profile,
        )
        print("\n".join(serve_twice_table(rows)))
        return
    # Token ids within the model's vocabulary (vLLM refuses others with a 400).
    workload = Workload(**{"vocab": spec.vocab_size, **args.workload})
    # KV in the dtype vLLM runs the model in (float32 on an AMX CPU)
    if args.gpu_kv_share is not None:
        dtype_bytes = 4 if model_dtype().dtype == "float32" else 2
        server = replace(
            server,
            gpu_kv_bytes=gpu_kv_bytes(
                spec, workload, args.gpu_kv_share, args.max_model_len, dtype_bytes
            ),
            gpu_kv_all_bytes=gpu_kv_bytes(spec, workload, 1.0, args.max_model_len, dtype_bytes),
        )
        print(
            f"vLLM's GPU KV cache: {server.gpu_kv_bytes / 2**30:.2f} GiB, "
            f"{args.gpu_kv_share:.0%} of the "
            f"{workload.conversations} conversations at their last turn",
            flush=True,
        )
    records = compare(
        model,
        args.setups,
        workload,
        Path(args.out),
        server,
        profile=args.profile,
        rounds=args.rounds,
        servers=args.servers,
    )
    print("\n".join(table(records) + [""] + by_round(records) + [""] + by_turn(records)))
    for name, rec in records.items():
        s = rec.summary
        if workload.concurrency > 1 and s["sent_while_another_ran"] < 0.5:
            print(
                f"note: {name}: {s['sent_while_another_ran']:.0%} of the requests were sent while "
                f"another ran "
                f"({s['mean_in_flight']:.1f} in flight on average): at {workload.rate} req/s "
                f"the server "
                f"served them about one at a time, not up to {workload.concurrency}; raise the rate"
            )


if __name__ == "__main__":
    main()
