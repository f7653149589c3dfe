"""The load and the figures of `kvtier bench chaos` (chaos.py runs it).

Conversations   the prompts: `live` conversations open at once, request k
                the next turn of conversation slot k % live; each turn's
                prompt is the previous one plus an answer and a new message
Run             an async client sending greedy streamed completions at
                `rate`, at most `concurrency` in flight, while the phases
                pass: a no-fault phase, then each fault (injected at the
                phase's start, cleared at its end) and a no-fault phase
                after it; vLLM's and the proxy's /metrics sampled each second
phase_figures   per phase: sent / succeeded / failed (and why), TTFT p50/p99
                against the no-fault phase, kvtier's hit rate, the longest
                waits on kvtier (its `kvtier_longest_*_seconds` gauges), RSS
                and open files of every process
recovery        after the store server's restart: seconds until the hit rate
                is back, and until kvtier stores remotely again
violations      where the promise broke: a failed request outside the
                decoder-killed phase (where each failure must be the proxy's
                502, at once), an output unlike plain vLLM's, RSS growth over
                5 % or 16 more open files after warm-up, a wait on kvtier
                past the bound its timeouts set
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

from kvtier_tools.bench import chaos_faults as cf
from kvtier_tools.bench.chat import Result, request, series

TIERS_FAULTS = (*cf.STORE_FAULTS[:2], *cf.DISK_FAULTS, cf.STORE_FAULTS[2])
LOOKUP_TIMEOUT_MS = 3000


@dataclass(frozen=True)
class ChaosConfig:
    phase_s: float = 90.0
    rate: float = 2.0  # requests per second (tiers)
    # requests per second through the PD proxy (one core each for prefiller and decoder here)
    pd_rate: float = 0.5
    concurrency: int = 4
    system_prompts: int = 4
    system_tokens: int = 1024
    turns: int = 4
    user_tokens: int = 64
    answer_tokens: int = 32
    live: int = 8  # conversations open at once
    max_tokens: int = 8
    sample_per_phase: int = 8  # requests per phase whose outputs are compared with plain vLLM's
    blocking_timeout_secs: float = 2.0
    request_timeout_s: float = 180.0  # a request past it counts as failed (a hang)
    # an answered request whose first token took longer is a violation (a stall)
    stall_s: float = 30.0
    faults: tuple[str, ...] = (*TIERS_FAULTS, *cf.PD_FAULTS)
    vocab: int = 4000
    seed: int = 0

    def bound_s(self) -> float:
        """The longest any wait on kvtier may last: a lookup (lookup_timeout_ms), or a tier's
        call (blocking_timeout_secs) for each of disk and remote, plus 1 s of scheduling."""
        return max(LOOKUP_TIMEOUT_MS / 1000, 2 * self.blocking_timeout_secs) + 1.0


SHORT = dict(phase_s=8.0, sample_per_phase=3)  # CI: every phase compared, 3 answers each


# -- the prompts -----------------------------------------------------------------------------


class Conversations:
    """Prompt k of the run, the same in every run of a config: `live` conversations
    open at once, request k going to conversation slot k % live; a conversation's
    turn t is its system prompt plus t+1 user messages and t answers."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        self.systems = [
            [rng.randrange(100, cfg.vocab) for _ in range(cfg.system_tokens)]
            for _ in range(cfg.system_prompts)
        ]

    def order(self, k: int) -> tuple[int, int]:
        """(conversation, turn) of request k."""
        live, turns = self.cfg.live, self.cfg.turns
        slot, round_ = k % live, k // live
        return (round_ // turns) * live + slot, round_ % turns

    def prompt(self, conv: int, turn: int) -> list[int]:
        c = self.cfg
        rng = random.Random(c.seed * 1_000_003 + conv + 1)
        out = list(self.systems[conv % c.system_prompts])
        for t in range(turn + 1):
            out += [rng.randrange(100, c.vocab) for _ in range(c.user_tokens)]
            answer = [rng.randrange(100, c.vocab) for _ in range(c.answer_tokens)]
            if t < turn:
                out += answer
        return out


# -- the load --------------------------------------------------------------------------------


@dataclass
class ChaosResult(Result):
    phase: str = ""  # when it was sent
    index: int = 0
    # when it ended: a failure counts there (a fault may strike a request sent before it)
    end_phase: str = ""


@dataclass
class Sample:
    t: float
    values: dict[str, float]


@dataclass
class Phase:
    name: str
    fault: str | None
    start_s: float = 0.0
    injected_s: float = 0.0  # the fault in place
    cleared_s: float = 0.0  # the fault's clearing done (the phase's end)
    usage_start: dict = field(default_factory=dict)
    usage_end: dict = field(default_factory=dict)


class Run:
    """One part of the run: the load against `url` while the phases pass."""

    def __init__(
        self, cfg: ChaosConfig, url: str, model: str, metrics_urls: list[str], watched: cf.Watched
    ) -> None:
        self.cfg = cfg
        self.url = url
        self.model = model
        self.metrics_urls = metrics_urls
        self.watched = watched
        self.prompts = Conversations(cfg)
        self.rate = cfg.rate
        self.results: list[ChaosResult] = []
        self.samples: list[Sample] = []
        self.phases: list[Phase] = []
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def go(self, faults: list[cf.Fault]) -> None:
        import aiohttp

        self.t0 = time.perf_counter()
        done = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            sampler = asyncio.create_task(self._sample(session, done))
            sender = asyncio.create_task(self._send(session, done))
            try:
                await self._phase("warm-up", None, self.cfg.phase_s / 2)
                await self._phase("no fault", None)
                for fault in faults:
                    await self._phase(fault.name, fault)
                    await self._phase(f"after {fault.name}", None)
            finally:
                done.set()
                await asyncio.gather(sender, sampler)

    async def _phase(self, name: str, fault: cf.Fault | None, seconds: float | None = None) -> None:
        phase = Phase(name, fault.name if fault else None, self.now())
        self.phases.append(phase)
        phase.usage_start = await asyncio.to_thread(self.watched.snapshot)
        if fault is not None:
            await asyncio.to_thread(fault.inject)
        phase.injected_s = self.now()
        await asyncio.sleep(max(0.0, phase.start_s + (seconds or self.cfg.phase_s) - self.now()))
        if fault is not None:
            await asyncio.to_thread(fault.clear)
        phase.cleared_s = self.now()
        phase.usage_end = await asyncio.to_thread(self.watched.snapshot)

    async def _send(self, session, done: asyncio.Event) -> None:
        slots = asyncio.Semaphore(self.cfg.concurrency)
        tasks = set()

        async def one(r: ChaosResult, prompt: list[int]) -> None:
            try:
                await request(
                    session,
                    self.url,
                    self.model,
                    prompt,
                    self.cfg.max_tokens,
                    r,
                    self.t0,
                    self.cfg.request_timeout_s,
                )
            finally:
                r.end_phase = self.phases[-1].name
                slots.release()

        k = 0
        while not done.is_set():
            await asyncio.sleep(max(0.0, k / self.rate - self.now()))
            await slots.acquire()
            if done.is_set():
                slots.release()
                break
            conv, turn = self.prompts.order(k)
            prompt = self.prompts.prompt(conv, turn)
            r = ChaosResult(conv, turn, len(prompt), 0.0, phase=self.phases[-1].name, index=k)
            self.results.append(r)
            task = asyncio.create_task(one(r, prompt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
        await asyncio.gather(*tasks)

    async def _sample(self, session, done: asyncio.Event) -> None:
        while not done.is_set():
            t, values = self.now(), {}
            try:
                for url in self.metrics_urls:
                    async with session.get(url + "/metrics", timeout=5) as resp:
                        for k, v in parse_metrics(await resp.text()).items():
                            _add(values, k, v)
                self.samples.append(Sample(t, values))
            # a node being restarted answers nothing: no sample then
            except Exception:  # noqa: BLE001
                pass
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)


GAUGES = "kvtier_longest_"
KEEP = (
    "vllm:external_prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "kvtier_loaded_tokens",
    "kvtier_stored_tokens",
    GAUGES,
    "kvtier_load_failure_tokens",
    "kvtier_proxy_prefill_fallbacks",
    "kvtier_proxy_kv_not_ready",
)


def parse_metrics(text: str) -> dict[str, float]:
    """The figures the run follows, summed over labels but `tier`."""
    out: dict[str, float] = {}
    for name, head, value in series(text):
        if not head.startswith(KEEP):
            continue
        if 'tier="' in head:
            name += ":" + head.split('tier="')[1].split('"')[0]
        _add(out, name, value)
    return out


def _add(figures: dict[str, float], name: str, value: float) -> None:
    """One more series of `name` (another label, another node): counters add up, gauges keep
    the larger."""
    figures[name] = (
        max(figures.get(name, 0.0), value)
        if name.startswith(GAUGES)
        else figures.get(name, 0.0) + value
    )


# -- the figures -----------------------------------------------------------------------------


def at(samples: list[Sample], t: float) -> dict[str, float]:
    """The last sample at or before t (the first one if none)."""
    best = samples[0].values if samples else {}
    for s in samples:
        if s.t > t:
            break
        best = s.values
    return best


def hit_rate(a: dict[str, float], b: dict[str, float]) -> float | None:
    q = b.get("vllm:external_prefix_cache_queries", 0) - a.get(
        "vllm:external_prefix_cache_queries", 0
    )
    h = b.get("vllm:external_prefix_cache_hits", 0) - a.get("vllm:external_prefix_cache_hits", 0)
    return h / q if q > 0 else None


def _pct(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def phase_figures(run: Run, phase: Phase, base_ttft: list[float]) -> dict:
    rs = [r for r in run.results if r.phase == phase.name]
    ok = [r for r in rs if not r.error]
    ended = [r for r in run.results if r.end_phase == phase.name]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    a, b = at(run.samples, phase.start_s), at(run.samples, phase.cleared_s)
    base50, base99 = _pct(base_ttft, 0.5), _pct(base_ttft, 0.99)
    p50, p99 = _pct(ttft, 0.5), _pct(ttft, 0.99)
    errors: dict[str, int] = {}
    for r in ended:
        if r.error:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "phase": phase.name,
        "fault": phase.fault,
        "start_s": round(phase.start_s, 2),
        "seconds": round(phase.cleared_s - phase.start_s, 2),
        "inject_s": round(phase.injected_s - phase.start_s, 2),
        "sent": len(rs),
        "succeeded": len(ok),
        "failed": sum(bool(r.error) for r in ended),
        "errors": errors,
        "slowest_failure_s": max((_failed_after(r, phase) for r in ended if r.error), default=None),
        "ttft_p50_ms": p50,
        "ttft_p99_ms": p99,
        "ttft_p50_vs_no_fault": p50 / base50 if p50 and base50 else None,
        "ttft_p99_vs_no_fault": p99 / base99 if p99 and base99 else None,
        "longest_request_s": max((r.latency_s or 0.0 for r in ok), default=None),
        "slowest_ttft_s": max(ttft, default=0.0) / 1e3 if ttft else None,
        "hit_rate": hit_rate(a, b),
        "longest_waits_s": {
            k.removeprefix("kvtier_longest_"): v
            for k, v in b.items()
            if k.startswith("kvtier_longest_")
        },
        "usage_start": phase.usage_start,
        "usage_end": phase.usage_end,
    }


def _failed_after(r: ChaosResult, phase: Phase) -> float:
    """Seconds from the fault (or the request's sending, if later) to the request's failure:
    a request sent before the fault had its own work before it, not a wait on the fault."""
    return r.sent_s + (r.latency_s or 0.0) - max(r.sent_s, phase.injected_s)


def recovery(run: Run, fault: str, base_rate: float | None) -> dict:
    """After `fault` is cleared: seconds until the hit rate (5 s windows) is back to 90 % of
    the no-fault phase's, and until kvtier stores remotely again."""
    phase = next((p for p in run.phases if p.fault == fault), None)
    if phase is None:
        return {}
    t_clear = phase.cleared_s
    after = [s for s in run.samples if s.t >= t_clear]
    back = stored = None
    for s in after:
        earlier = at(run.samples, s.t - 5.0)
        rate = hit_rate(earlier, s.values)
        if back is None and rate is not None and base_rate is not None and rate >= 0.9 * base_rate:
            back = s.t - t_clear
        if stored is None and s.values.get("kvtier_stored_tokens:remote", 0) > at(
            run.samples, t_clear
        ).get("kvtier_stored_tokens:remote", 0):
            stored = s.t - t_clear
    return {"hit_rate_back_s": back, "stores_remotely_again_s": stored}


def violations(record: dict, cfg: ChaosConfig) -> list[str]:
    """Where the run broke kvtier's promise (empty: kept)."""
    out = []
    for part in record["parts"].values():
        for ph in part["phases"]:
            where = f"{part['name']} / {ph['phase']}"
            if ph["fault"] == "decoder-killed":
                bad = {
                    e: n for e, n in ph["errors"].items() if "502" not in e or "decoder" not in e
                }
                if bad:
                    out.append(
                        f"{where}: failures other than the proxy's 502 for a dead decoder: {bad}"
                    )
                if ph["slowest_failure_s"] is not None and ph["slowest_failure_s"] > 5.0:
                    out.append(
                        f"{where}: a dead decoder's 502 took {ph['slowest_failure_s']:.1f} s"
                    )
            elif ph["failed"]:
                out.append(f"{where}: {ph['failed']} failed requests: {ph['errors']}")
            if (ph.get("slowest_ttft_s") or 0.0) > cfg.stall_s:
                out.append(
                    f"{where}: a request waited {ph['slowest_ttft_s']:.1f} s for its first token "
                    f"(> {cfg.stall_s:g} s: a stall)"
                )
            waits = ph["longest_waits_s"]
            if waits and max(waits.values()) > cfg.bound_s():
                out.append(
                    f"{where}: a wait on kvtier of {max(waits.values()):.2f} s "
                    f"> {cfg.bound_s():.1f} s"
                )
        eq = part["outputs"]
        if eq["equal"] != eq["compared"]:
            out.append(
                f"{part['name']}: {eq['compared'] - eq['equal']} of {eq['compared']} outputs "
                f"differ from plain vLLM's: {eq['differing'][:5]}"
            )
        for role, growth in part["growth"].items():
            if growth.get("rss") is not None and growth["rss"] > 0.05:
                out.append(f"{part['name']}: {role} RSS grew {growth['rss']:.1%} after warm-up")
            if growth.get("fds") is not None and growth["fds"] > 16:
                out.append(f"{part['name']}: {role} has {growth['fds']} more open files at the end")
    return out


def growth(first: dict, last: dict, roles: list[str]) -> dict[str, dict]:
    """RSS and descriptors at the end against the end of the first phase (after warm-up),
    for processes never restarted (the same pid)."""
    out = {}
    for role in roles:
        a, b = first.get(role), last.get(role)
        if a and b and a["pid"] == b["pid"]:
            out[role] = {
                "rss": b["rss_mb"] / a["rss_mb"] - 1,
                "fds": b["fds"] - a["fds"],
                "rss_mb": [a["rss_mb"], b["rss_mb"]],
                "open_files": [a["fds"], b["fds"]],
            }
    return out
