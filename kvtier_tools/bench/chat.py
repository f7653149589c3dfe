"""`kvtier bench chat`: multi-turn conversations at a steady request rate against an
OpenAI-compatible server (vLLM with any KV offloader, or none), the serving
workload offloaders are chosen by.

    conversations   each opens with one of a few long system prompts and goes
                    turn by turn: a turn's prompt is the conversation so far (the
                    previous prompt, an answer, a new user message), so every
                    turn after the first shares its previous prompt as a prefix
    arrivals        one request every 1/rate s; each is the next turn of a
                    conversation with none in flight, up to `concurrency` in
                    flight (a turn waits while every conversation is busy)
    a request       POST /v1/completions, the prompt as token ids, greedy,
                    streamed: TTFT is the first streamed token's arrival

Prompts are token ids made from a seed (no tokenizer needed), and the answer
that goes into the history is a fixed synthetic one, so two runs against two
servers send the same prompts in the same order, and their greedy outputs
can be compared request by request (`output_ids` in the record). The hit rate is
vLLM's own: its Prometheus counters of prompt tokens found by the KV connector
(`vllm:external_prefix_cache_hits` / `_queries`) and in its GPU prefix cache,
read before and after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from kvtier.errors import KvtierError


@dataclass(frozen=True)
class Workload:
    conversations: int = 16
    system_prompts: int = 4
    system_tokens: int = 2048
    turns: int = 4
    user_tokens: int = 128
    answer_tokens: int = 64  # the synthetic answer kept in the history
    max_tokens: int = 16  # generated per request (the mean, with output_spread)
    # Each request's output length drawn from max_tokens x [1 - spread, 1 + spread] (seeded, the
    # same in every run). One fixed length lets a closed loop at capacity fall into lockstep:
    # requests that start together finish together, their successors arrive at once and prefill in
    # the same steps.
    output_spread: float = 0.0
    rate: float = 2.0  # requests per second
    concurrency: int = 8
    vocab: int = 30000
    seed: int = 0

    def prompts(self) -> list[list[list[int]]]:
        """prompts[c][t]: conversation c's prompt at turn t (token ids)."""
        rng = random.Random(self.seed)
        ids = lambda n: [rng.randrange(100, self.vocab) for _ in range(n)]  # noqa: E731
        systems = [ids(self.system_tokens) for _ in range(self.system_prompts)]
        out = []
        for c in range(self.conversations):
            history, turns = list(systems[c % self.system_prompts]), []
            for _ in range(self.turns):
                history += ids(self.user_tokens)
                turns.append(list(history))
                history += ids(self.answer_tokens)
            out.append(turns)
        return out

    def output_lengths(self) -> list[list[int]]:
        """lengths[c][t]: how many tokens conversation c's turn t generates (`output_spread`)."""
        rng = random.Random(f"output-lengths-{self.seed}")  # apart from the prompts' draws
        low = max(1, round(self.max_tokens * (1 - self.output_spread)))
        high = max(low, round(self.max_tokens * (1 + self.output_spread)))
        return [
            [rng.randint(low, high) for _ in range(self.turns)] for _ in range(self.conversations)
        ]


@dataclass
class Result:
    conversation: int
    turn: int
    prompt_tokens: int
    sent_s: float  # from the run's start
    ttft_s: float | None = None
    latency_s: float | None = None
    output_ids: list[int] = field(default_factory=list)  # the greedy tokens
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token (when asked for)
    output_tokens: int = 0
    error: str = ""


@dataclass
class Record:
    workload: dict
    url: str
    results: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


async def request(
    session,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    r: Result,
    t0: float,
    timeout: float = 600,
    logprobs: int = 0,
) -> None:
    """One streamed greedy completion; its figures (or its error) into `r`; with
    `logprobs`, each token's top ones by token id."""
    import aiohttp

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # vLLM's: the ids, also where it has no tokenizer
    if logprobs:
        body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}  # keys "token_id:N"
    start = time.perf_counter()
    r.sent_s = start - t0
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[6:])
                if chunk.get("error"):  # a failure after the stream began (a proxy's upstream died)
                    r.error = f"in the stream: {json.dumps(chunk['error'])[:200]}"
                    return
                if chunk.get("choices"):
                    if r.ttft_s is None:
                        r.ttft_s = time.perf_counter() - start
                    r.output_ids += chunk["choices"][0].get("token_ids") or []
                    for top in (chunk["choices"][0].get("logprobs") or {}).get(
                        "top_logprobs"
                    ) or []:
                        r.top_logprobs.append({int(k.rsplit(":", 1)[1]): v for k, v in top.items()})
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
        if r.ttft_s is None:
            r.error = "no token streamed"
    except Exception as exc:  # noqa: BLE001 - any failure of a request is the figure
        r.error = f"{type(exc).__name__}: {exc}"
    finally:
        r.latency_s = time.perf_counter() - start  # also of a failure: how long it took to fail


async def drive(url: str, model: str, w: Workload) -> list[Result]:
    """Send every turn of every conversation at the workload's rate; one Result each."""
    import aiohttp

    prompts, lengths = w.prompts(), w.output_lengths()
    next_turn = [0] * w.conversations
    busy: set[int] = set()
    slots = asyncio.Semaphore(w.concurrency)
    results: list[Result] = []
    tasks = []
    t0 = time.perf_counter()

    async def one(c: int, t: int) -> None:
        r = Result(c, t, len(prompts[c][t]), 0.0)
        results.append(r)
        try:
            await request(session, url, model, prompts[c][t], lengths[c][t], r, t0)
        finally:
            busy.discard(c)
            slots.release()

    async with aiohttp.ClientSession() as session:
        for k in range(w.conversations * w.turns):
            await asyncio.sleep(max(0.0, t0 + k / w.rate - time.perf_counter()))
            await slots.acquire()
            while True:  # the next turn of a conversation with nothing in flight, oldest turn first
                ready = [
                    c for c in range(w.conversations) if c not in busy and next_turn[c] < w.turns
                ]
                if ready:
                    break
                await asyncio.sleep(0.005)
            c = min(ready, key=lambda c: (next_turn[c], c))
            busy.add(c)
            tasks.append(asyncio.create_task(one(c, next_turn[c])))
            next_turn[c] += 1
        await asyncio.gather(*tasks)
    return sorted(results, key=lambda r: (r.conversation, r.turn))


# vLLM's own split of a request's time to its first token (histograms, summed per run): from its
# arrival at the scheduler to its first step (waiting, an offloader's load beside the steps
# included: a request waiting for its KV is not scheduled yet), and from there to its first token
# (the steps that compute what was not loaded); and its TTFT as the server saw it.
# And its inter-token latency (a decode step's time, as the requests saw it).
PHASES = {
    "queue": "request_queue_time",
    "prefill": "request_prefill_time",
    "server_ttft": "time_to_first_token",
    "itl": "inter_token_latency",
}
# vLLM's steps (its iteration_tokens histogram): how many, their tokens, and how many had more than
# 512, the most vLLM 0.26 captures in a CUDA graph by default (a larger step runs outside the
# graphs, the host launching every kernel: several prefills in one step).
STEPS = "vllm:iteration_tokens_total"
GRAPHED = 'le="512.0"'


def scrape(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens): GPU cache and KV connector, queries and hits;
    its request phases (`PHASES`); and kvtier's lookups with the time vLLM's scheduler waited
    on them, its longest lookup and longest step in kvtier since the server's start, and how
    long steps' forwards waited for their loads (0 for other connectors)."""
    import httpx

    names = (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
        *(f"vllm:{h}_seconds_{part}" for h in PHASES.values() for part in ("sum", "count")),
        f"{STEPS}_sum",
        f"{STEPS}_count",
        f"{STEPS}_graphed",
        "vllm:num_preemptions",
        "kvtier_lookups",
        "kvtier_lookups_skipped",
        "kvtier_lookup_seconds",
        "kvtier_longest_lookup_seconds",
        "kvtier_longest_step_wait_seconds",
        "kvtier_load_wait_seconds",
        "kvtier_load_wait_steps",
        "kvtier_step_loads",
        "kvtier_step_loads_ahead",
    )
    out = dict.fromkeys(names, 0.0)
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).raise_for_status().text
    except httpx.HTTPError as e:
        raise KvtierError(
            f"bench chat: cannot read {url}/metrics ({e}); is vLLM's OpenAI server "
            "(with its metrics) up there?"
        ) from None
    for name, labelled, value in series(text):
        if name == f"{STEPS}_bucket" and GRAPHED in labelled:
            name = f"{STEPS}_graphed"
        if name in out:
            out[name] += value
    return out


def series(text: str) -> Iterator[tuple[str, str, float]]:
    """Prometheus' text format: each sample's name (less `_total`), its name with its labels,
    and its value."""
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            yield head.split("{")[0].removesuffix("_total"), head, float(value)


def in_flight(results: list[Result], wall_s: float) -> tuple[float, int, float]:
    """Requests in flight: on average over the run (Little's law), at most, and the share
    of requests sent while another was in flight (a rate the server finishes each request
    within leaves it serving one at a time, whatever `concurrency` allows)."""
    spans = [(r.sent_s, r.sent_s + r.latency_s) for r in results if r.latency_s is not None]
    # an end before a send at one instant
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    now = most = joined = 0
    for _, step in edges:
        joined += step > 0 and now > 0  # sent while another ran
        now += step
        most = max(most, now)
    return (
        sum(b - a for a, b in spans) / wall_s if wall_s else 0.0,
        most,
        joined / len(spans) if spans else 0.0,
    )


def bunched(results: list[Result], within_s: float = 0.01) -> float:
    """The share of requests sent within `within_s` of the one before: near 0 when requests
    arrive spread out; high when the run fell into lockstep (a batch of requests finishing in
    one step frees their slots at once, and their successors arrive and prefill together). On
    an H200 at the 8B shape a run's mean TTFT followed it (correlation 0.966 over 64 runs,
    results/gpu-h200-vllm-2026-11-29/README.md), whichever the offloader."""
    sent = sorted(r.sent_s for r in results)
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    return sum(g < within_s for g in gaps) / len(gaps) if gaps else 0.0


def summarize(results: list[Result], wall_s: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if not r.error]
    mean_in_flight, max_in_flight, joined = in_flight(results, wall_s)
    ttft = sorted(r.ttft_s for r in ok)
    d = {k: after[k] - before[k] for k in after}
    q = d["vllm:prefix_cache_queries"] or 1.0
    ext_q = d["vllm:external_prefix_cache_queries"] or 1.0
    return {
        "requests": len(results),
        "succeeded": len(ok),
        "failed": len(results) - len(ok),
        "ttft_mean_ms": statistics.fmean(ttft) * 1e3 if ttft else None,
        "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3 if ttft else None,
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3 if ttft else None,
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s,
        "gpu_prefix_hit_rate": d["vllm:prefix_cache_hits"] / q,
        "connector_hit_rate": d["vllm:external_prefix_cache_hits"] / ext_q,
        "connector_hit_tokens": d["vllm:external_prefix_cache_hits"],
        # kvtier's: the scheduler's wait per lookup, and its share of the run
        "lookup_ms_mean": d["kvtier_lookup_seconds"] / d["kvtier_lookups"] * 1e3
        if d["kvtier_lookups"]
        else None,
        "lookup_share": d["kvtier_lookup_seconds"] / wall_s if wall_s else None,
        "lookups": d["kvtier_lookups"],
        "lookups_skipped": d["kvtier_lookups_skipped"],
        # since the server's start (gauges): a lookup or a step that waited on the GPU shows here
        "lookup_ms_longest": after["kvtier_longest_lookup_seconds"] * 1e3,
        "step_wait_ms_longest": after["kvtier_longest_step_wait_seconds"] * 1e3,
        # the forwards' waits on the GPU for the loads queued in their step (metrics.py)
        "load_wait_steps": d["kvtier_load_wait_steps"],
        "load_wait_ms_mean": d["kvtier_load_wait_seconds"] / d["kvtier_load_wait_steps"] * 1e3
        if d["kvtier_load_wait_steps"]
        else None,
        "step_loads": d["kvtier_step_loads"],
        "step_loads_ahead": d["kvtier_step_loads_ahead"],
        "mean_in_flight": mean_in_flight,
        "max_in_flight": max_in_flight,
        "sent_while_another_ran": joined,
        "sent_bunched": bunched(results),
        "steps": d[f"{STEPS}_count"],
        "tokens_per_step_mean": _mean(d, STEPS),
        "steps_over_512_tokens": d[f"{STEPS}_count"] - d[f"{STEPS}_graphed"],
        "preemptions": d["vllm:num_preemptions"],
    } | {f"{phase}_ms_mean": _mean_ms(d, f"vllm:{h}_seconds") for phase, h in PHASES.items()}


def _mean(d: dict[str, float], histogram: str) -> float | None:
    count = d[f"{histogram}_count"]
    return d[f"{histogram}_sum"] / count if count else None


def _mean_ms(d: dict[str, float], histogram: str) -> float | None:
    mean = _mean(d, histogram)
    return None if mean is None else mean * 1e3


def run(url: str, model: str, w: Workload) -> Record:
    before = scrape(url)
    t = time.perf_counter()
    results = asyncio.run(drive(url, model, w))
    wall = time.perf_counter() - t
    rec = Record(asdict(w), url, [asdict(r) for r in results])
    rec.summary = summarize(results, wall, before, scrape(url))
    return rec


def same_outputs(a: Record, b: Record) -> tuple[int, int]:
    """(requests both answered with equal greedy tokens, requests both answered)."""
    pairs = [(x, y) for x, y in zip(a.results, b.results) if not x["error"] and not y["error"]]
    return sum(bool(x["output_ids"]) and x["output_ids"] == y["output_ids"] for x, y in pairs), len(
        pairs
    )


def plot(records: dict[str, dict]) -> str:
    """SVG: each request's TTFT against when it was sent, one series per record (e.g.
    per offloader, same workload); failed requests as their own series at 0."""
    from kvtier_tools.bench.plot import scatter

    series: dict[str, list[tuple[float, float]]] = {}
    for name, rec in records.items():
        series[name] = [(r["sent_s"], r["ttft_s"] * 1e3) for r in rec["results"] if not r["error"]]
        failed = [(r["sent_s"], 0.0) for r in rec["results"] if r["error"]]
        if failed:
            series[f"{name}: failed"] = failed
    w = next(iter(records.values()))["workload"] if records else {}
    title = (
        f"{w.get('conversations')} conversations x {w.get('turns')} turns, {w.get('rate')} req/s, "
        f"up to {w.get('concurrency')} in flight"
    )
    return scatter(series, title, "sent at (s)", "TTFT (ms)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", required=True, help="the OpenAI-compatible server, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--model", required=True, help="the model name the server serves")
    for f, default in asdict(Workload()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--output", default="", help="write the JSON record here")
    p.add_argument("--name", default="this run", help="the run's name in the plot")
    p.add_argument(
        "--plot", default="", help="write an SVG of TTFT over the run here (with --compare: of all)"
    )
    p.add_argument(
        "--compare", nargs="*", default=[], help="earlier records (JSON) to plot beside this run"
    )


def main(args: argparse.Namespace) -> int:
    w = Workload(**{f: getattr(args, f) for f in asdict(Workload())})
    rec = run(args.url, args.model, w)
    print(json.dumps(rec.summary, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(asdict(rec), f, indent=1)
    if args.plot:
        records = {path: json.load(open(path)) for path in args.compare}
        records[args.name] = asdict(rec)
        with open(args.plot, "w") as f:
            f.write(plot(records))
    return 1 if rec.summary["failed"] else 0
