"""`kvtier bench chaos`: faults under load, with real vLLM, the store server, disk and PD.

Two parts, each with vLLM's OpenAI server (here the CPU build) and the tiny
Llama of kvtier_tools/dev/tinymodel.py (seeded N(0, 0.02) weights, float32, so
greedy outputs follow the prompt and batching does not flip them):

    tiers   kvtier on all three tiers: a small CPU pool, a disk tier on a tmpfs
            of the run's own, `remote_url` to a `kvtier server`; vLLM's prefix
            cache off, so every reuse is kvtier's
    pd      a prefiller, a decoder and `kvtier proxy` (transfer_channel tcp)

Each part runs its phases under load (chaos_load.py: the client, the
figures, the promise) with its faults (chaos_faults.py). Then a plain vLLM
(no kvtier) replays a sample of each phase's requests, and their greedy
outputs are compared. Written: `<out>/chaos.json` (the record, its
`violations` empty when the promise held), `<out>/chaos-requests.jsonl` (every
request: phase, sent at, TTFT, latency, error), `<out>/chaos-<part>.svg` (the
timelines), a table on stdout. The exit status is 1 if a violation was found.

    kvtier bench chaos --short          every fault once, 8 s phases (CI)
    kvtier bench chaos --phase-s 75     about 30 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from kvtier_tools.bench import chaos_faults as cf
from kvtier_tools.bench.chaos_load import (
    LOOKUP_TIMEOUT_MS,
    SHORT,
    ChaosConfig,
    ChaosResult,
    Conversations,
    Run,
    at,
    growth,
    hit_rate,
    phase_figures,
    recovery,
    violations,
)
from kvtier_tools.bench.chat import request
from kvtier_tools.bench.plot import panels
from kvtier_tools.bench.server import host

DTYPE = "float32"
DISK_MB = 256  # the tmpfs; kvtier's disk tier is told it has 150 MB of it
WINDOW_S = 5.0  # of the timeline's rates


def tiers_part(cfg: ChaosConfig, model_dir: Path, work: Path, names: list[str]) -> Run:
    from kvtier_tools.dev.demo import vllm_server
    from kvtier_tools.dev.localservers import kvtier_server

    with cf.tmpfs(work / "disk", DISK_MB) as disk, kvtier_server(0.5, log_dir=work) as store:
        env = {
            "LMCACHE_CHUNK_SIZE": "256",
            "LMCACHE_LOCAL_CPU": "true",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.02",
            "LMCACHE_LOCAL_DISK": f"file://{disk}",
            "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.15",
            "LMCACHE_REMOTE_URL": store.url,
            "LMCACHE_BLOCKING_TIMEOUT_SECS": str(cfg.blocking_timeout_secs),
            "KVTIER_LOOKUP_TIMEOUT_MS": str(LOOKUP_TIMEOUT_MS),
        }
        with vllm_server(model_dir, work / "vllm", env=env, dtype=DTYPE, max_model_len=4096) as srv:
            faults: dict[str, cf.Fault] = {
                "store-killed": cf.StoreKilled(store),
                "store-stopped": cf.StoreStopped(store),
                "disk-full": cf.DiskFull(disk),
                "chunks-corrupted": cf.ChunksCorrupted(disk, cfg.seed),
                "disk-read-only": cf.DiskReadOnly(disk),
                "lease-hog": cf.LeaseHog(store.url),
            }
            watched = cf.Watched(
                {
                    "vllm": lambda: srv.proc.pid,
                    "store server": lambda: store.procs[0].pid,
                    "harness": os.getpid,
                }
            )
            run = Run(cfg, srv.url, str(model_dir), [srv.url], watched)
            asyncio.run(run.go([faults[n] for n in names]))
    return run


def pd_part(cfg: ChaosConfig, model_dir: Path, work: Path, names: list[str]) -> Run:
    from kvtier_tools.dev.pdcluster import pd_cluster

    with pd_cluster(model_dir, work, "tcp", split_cores=True) as c:
        faults: dict[str, cf.Fault] = {
            "decoder-killed": cf.NodeKilled(c.decoder, "decoder-killed"),
            "prefiller-killed": cf.NodeKilled(
                c.prefiller, "prefiller-killed", lambda: cf.proxy_busy(c.url)
            ),
        }
        watched = cf.Watched(
            {
                "prefiller": lambda: c.prefiller.proc.pid,
                "decoder": lambda: c.decoder.proc.pid,
                "proxy": lambda: c.proxy.pid,
                "harness": os.getpid,
            }
        )
        run = Run(cfg, c.url, str(model_dir), [c.url, c.decoder.url], watched)
        run.rate = cfg.pd_rate
        asyncio.run(run.go([faults[n] for n in names]))
    return run


def sample(run: Run, per_phase: int) -> list[ChaosResult]:
    """Up to `per_phase` answered requests of each phase, spread over it."""
    out = []
    for phase in run.phases:
        ok = [r for r in run.results if r.phase == phase.name and not r.error]
        step = max(1, len(ok) // per_phase)
        out += ok[::step][:per_phase]
    return out


REPLAY_IN_FLIGHT = 4  # plain vLLM batches them (one at a time: 2.2 s each, 2 cores, 2026-11-30)


def replay(cfg: ChaosConfig, model_dir: Path, work: Path, runs: dict[str, Run]) -> dict[str, dict]:
    """Each run's sample on plain vLLM (no kvtier), REPLAY_IN_FLIGHT at a time, as the runs
    themselves sent them under load: equal greedy outputs?"""
    import aiohttp

    from kvtier_tools.dev.demo import vllm_server

    samples = {name: sample(run, cfg.sample_per_phase) for name, run in runs.items()}
    plain = {
        name: [
            ChaosResult(r.conversation, r.turn, r.prompt_tokens, 0.0, phase=r.phase, index=r.index)
            for r in rs
        ]
        for name, rs in samples.items()
    }
    prompts = Conversations(cfg)

    async def go(url: str) -> None:
        slots = asyncio.Semaphore(REPLAY_IN_FLIGHT)
        async with aiohttp.ClientSession() as session:

            async def one(p: ChaosResult) -> None:
                async with slots:
                    await request(
                        session,
                        url,
                        str(model_dir),
                        prompts.prompt(p.conversation, p.turn),
                        cfg.max_tokens,
                        p,
                        time.perf_counter(),
                        cfg.request_timeout_s,
                    )

            await asyncio.gather(*(one(p) for ps in plain.values() for p in ps))

    with vllm_server(
        model_dir, work / "plain", kv_connector=None, dtype=DTYPE, max_model_len=4096
    ) as srv:
        asyncio.run(go(srv.url))
    out = {}
    for name, rs in samples.items():
        differing = [
            {"index": r.index, "phase": r.phase, "kvtier": r.output_ids, "plain": p.output_ids}
            for r, p in zip(rs, plain[name])
            if p.error or r.output_ids != p.output_ids
        ]
        out[name] = {
            "compared": len(rs),
            "equal": len(rs) - len(differing),
            "differing": differing,
            "per_phase": {ph.name: sum(r.phase == ph.name for r in rs) for ph in runs[name].phases},
        }
    return out


def part_record(name: str, run: Run, outputs: dict) -> dict:
    base = [
        r.ttft_s * 1e3 for r in run.results if r.phase == "no fault" and r.ttft_s and not r.error
    ]
    phases = [phase_figures(run, ph, base) for ph in run.phases]
    no_fault = next(p for p in phases if p["phase"] == "no fault")
    roles = list(run.watched.pids)
    rec = {
        "name": name,
        "phases": phases,
        "outputs": outputs,
        "growth": growth(run.phases[0].usage_end, run.phases[-1].usage_end, roles),
        "recovery": {
            f: recovery(run, f, no_fault["hit_rate"])
            for f in ("store-killed", "store-stopped")
            if any(p.fault == f for p in run.phases)
        },
        "requests": [
            {
                "i": r.index,
                "phase": r.phase,
                "sent_s": round(r.sent_s, 3),
                "ttft_s": r.ttft_s and round(r.ttft_s, 4),
                "latency_s": r.latency_s and round(r.latency_s, 4),
                "error": r.error,
            }
            for r in run.results
        ],
    }
    return rec


def timeline(run: Run, title: str) -> str:
    ok = [(r.sent_s, r.ttft_s * 1e3) for r in run.results if not r.error and r.ttft_s]
    failed = [(r.sent_s, 0.0) for r in run.results if r.error]
    end = max((r.sent_s for r in run.results), default=0.0)
    windows = [k * WINDOW_S for k in range(int(end // WINDOW_S) + 1)]
    rate = {"answered": [], "failed": []}
    for w in windows:
        rs = [r for r in run.results if w <= r.sent_s < w + WINDOW_S]
        rate["answered"].append((w + WINDOW_S / 2, sum(not r.error for r in rs) / WINDOW_S))
        rate["failed"].append((w + WINDOW_S / 2, sum(bool(r.error) for r in rs) / WINDOW_S))
    hits = []
    for s in run.samples:
        h = hit_rate(at(run.samples, s.t - WINDOW_S), s.values)
        if h is not None:
            hits.append((s.t, h))
    spans = [(p.start_s, p.cleared_s, p.fault) for p in run.phases if p.fault]
    return panels(
        [
            ("TTFT (ms)", {"TTFT": ok, "failed (at 0)": failed}),
            ("requests/s", rate),
            ("kvtier hit rate", {f"hit rate ({WINDOW_S:g} s)": hits}),
        ],
        title,
        "time (s)",
        spans,
    )


def table(record: dict) -> str:
    lines = []
    for part in record["parts"].values():
        lines += [
            f"\n{part['name']}: outputs equal to plain vLLM's {part['outputs']['equal']}/"
            f"{part['outputs']['compared']}; recovery {part['recovery']}",
            "| phase | s | sent | failed | TTFT p50 ms | TTFT p99 ms | p99 vs no fault | "
            "hit rate | longest wait on kvtier s |",
            "|---" * 9 + "|",
        ]
        for ph in part["phases"]:
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            lines.append(
                f"| {ph['phase']} | {ph['seconds']:.0f} | {ph['sent']} | {ph['failed']} | "
                f"{fmt(ph['ttft_p50_ms'], '.0f')} | {fmt(ph['ttft_p99_ms'], '.0f')} | "
                f"{fmt(ph['ttft_p99_vs_no_fault'], '.2f')} | {fmt(ph['hit_rate'], '.2f')} | "
                f"{fmt(max(ph['longest_waits_s'].values(), default=None), '.2f')} |"
            )
    return "\n".join(lines)


def run_chaos(cfg: ChaosConfig, out: Path, model_dir: Path, work: Path) -> dict:
    from kvtier_tools.dev.tinymodel import TinyLlama, make_tiny_llama

    model = make_tiny_llama(model_dir, TinyLlama())  # vocab 4096 > cfg.vocab
    tiers = [n for n in cfg.faults if n not in cf.PD_FAULTS]
    pd = [n for n in cfg.faults if n in cf.PD_FAULTS]
    runs: dict[str, Run] = {}
    if tiers or not pd:
        runs["tiers"] = tiers_part(cfg, model, work / "tiers", tiers)
    if pd:
        runs["pd"] = pd_part(cfg, model, work / "pd", pd)
    outputs = replay(cfg, model, work, runs)
    record = {
        "command": " ".join(["kvtier bench chaos", *sys.argv[3:]]),
        "machine": host(),
        "date": time.strftime("%Y-%m-%d"),
        "config": asdict(cfg),
        "bound_s": cfg.bound_s(),
        "parts": {name: part_record(name, run, outputs[name]) for name, run in runs.items()},
    }
    record["violations"] = violations(record, cfg)
    out.mkdir(parents=True, exist_ok=True)
    requests = {name: part.pop("requests") for name, part in record["parts"].items()}
    (out / "chaos.json").write_text(json.dumps(record, indent=1) + "\n")
    # one line per request: the record stays readable
    with open(out / "chaos-requests.jsonl", "w") as f:
        for name, rs in requests.items():
            for r in rs:
                f.write(json.dumps({"part": name, **r}) + "\n")
    for name, run in runs.items():
        (out / f"chaos-{name}.svg").write_text(
            timeline(run, f"kvtier bench chaos: {name}, {host()}, {record['date']}")
        )
    return record


def add_args(p: argparse.ArgumentParser) -> None:
    for f in fields(ChaosConfig):
        if f.name == "faults":
            p.add_argument("--faults", nargs="+", default=list(f.default), choices=list(f.default))
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--short", action="store_true", help="the CI variant: " + json.dumps(SHORT))
    p.add_argument("--out", default="results/chaos")
    p.add_argument("--model-dir", default="/tmp/kvtier-chaos-model")
    p.add_argument(
        "--work",
        default="",
        help="logs and the disk tier's mount point (default: a temporary folder)",
    )


def main(args: argparse.Namespace) -> int:
    why = cf.private_mounts_available()
    if why:
        print(
            f"kvtier bench chaos: {why}; the disk faults need a tmpfs of the run's own",
            file=sys.stderr,
        )
        return 2
    status = cf.in_private_mounts([sys.executable, "-m", "kvtier.cli", *sys.argv[1:]])
    if status is not None:
        return status
    cfg = ChaosConfig(
        **{f.name: getattr(args, f.name) for f in fields(ChaosConfig) if f.name != "faults"},
        faults=tuple(args.faults),
    )
    if args.short:
        cfg = replace(cfg, **SHORT)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvtier-chaos-") as tmp:
        record = run_chaos(cfg, Path(args.out), Path(args.model_dir), Path(args.work or tmp))
    print(table(record))
    for v in record["violations"]:
        print("VIOLATION:", v)
    print(f"record: {Path(args.out) / 'chaos.json'}; {len(record['violations'])} violations")
    return 1 if record["violations"] else 0
