"""Where a warm layerwise prefill from `kvtier server` spends its time, next to
the same prefill from CPU RAM (GPU, the ttft bench's model and sessions).

    python3 scripts/gpu_layerwise_profile.py OUT_DIR [tokens]
    WHOLE_BEFORE=1 python3 scripts/gpu_layerwise_profile.py ...
        # a whole warm load before each, as the bench

Per prefill (medians of 9), host time: start_retrieve (lookup, lease, queuing
every layer's copies), the forward, finish(), and the time inside each of
TIMED (in_<name>_ms); device time: when the last layer's scatter ended and
when the prefill's work ended, from its start; cudaMallocs. Also the
one-token forward alone and beside a copy of the same bytes. Then the CUDA
timeline of one prefill of each (torch profiler: copy and kernel spans) and
cProfile of one from the server."""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvtier.engine as engine_mod  # noqa: E402
import kvtier.transfer.staging as staging  # noqa: E402
import kvtier.transfer.triton_copy as tc  # noqa: E402
from kvtier.bench.offload import timed  # noqa: E402
from kvtier.bench.ttft import build_model  # noqa: E402
from kvtier.bench.ttft_sources import BesideACopy  # noqa: E402
from kvtier.bench.ttft_sources import ServerSession as _ServerSession
from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.dev.localservers import kvtier_server  # noqa: E402
from kvtier.engine.mover import Mover  # noqa: E402
from kvtier.engine.storing import StorePath  # noqa: E402
from kvtier.integrations.hf import HFSession, KvtierCache  # noqa: E402
from kvtier.server.client import KVClient  # noqa: E402
from kvtier.tiers.remote import RemoteTier  # noqa: E402
from kvtier.tiers.store import TieredStore  # noqa: E402

WHOLE_BEFORE = bool(int(os.environ.get("WHOLE_BEFORE", "0")))
# Host time spent in each of these per prefill (in_<name>_ms), summed over calls.
TIMED = [
    (TieredStore, "locate", "locate"),
    (TieredStore, "lend_whole", "lend_whole"),
    (RemoteTier, "max_held", "max_held"),
    (KVClient, "borrow", "borrow_rpc"),
    (KVClient, "exists", "exists_rpc"),
    (RemoteTier, "borrow", "borrow_all"),
    (Mover, "scatter", "engine_scatter"),
    (Mover, "view", "chunk_views"),
    (staging.Staging, "__init__", "staging_init"),
    (staging.Staging, "copy", "staging_copies"),
    (tc.TritonTransfer, "_upload", "tables_upload"),
    (tc.TritonTransfer, "_kernel", "kernel_launches"),
    (staging.DigestTables, "__init__", "digest_tables"),
    (staging.DigestTables, "add", "digest_launches"),
    (engine_mod.CacheEngine, "start_store", "start_store"),
    (StorePath, "stream", "stream_store"),
]
marks: dict[str, float] = {}  # phase boundaries of the current prefill (perf_counter)
spent: dict[str, float] = {}  # seconds per TIMED name in the current prefill
landed_events: list = []  # per layerwise scatter: an event behind its last layer's kernel
runs: list[int] = []  # per layerwise scatter: strided copies per layer (-1: chunks read in place)

start_retrieve, finish, scatter_layerwise = (
    engine_mod.CacheEngine.start_retrieve,
    engine_mod.Loading.finish,
    tc.TritonTransfer.scatter_layerwise,
)


def timed_start(self, *a, **k):
    marks["retrieve0"] = time.perf_counter()
    out = start_retrieve(self, *a, **k)
    marks["retrieve1"] = time.perf_counter()
    return out


def timed_finish(self):
    marks.setdefault("finish0", time.perf_counter())
    out = finish(self)
    marks.setdefault("finish1", time.perf_counter())
    return out


def kept_scatter(self, slots, chunks, digests=None):
    handle = scatter_layerwise(self, slots, chunks, digests=digests)
    landed = torch.cuda.Event(enable_timing=True)
    landed.record(self._stream)  # behind every layer's scatter
    landed_events.append(landed)
    staging = handle._keepalive
    runs.append(sum(len(r) for r in staging.runs) if staging is not None else -1)
    return handle


def accumulate(owner, attr: str, name: str) -> None:
    inner = getattr(owner, attr)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

    setattr(owner, attr, wrapper)


for owner, attr, name in TIMED:
    accumulate(owner, attr, name)
engine_mod.CacheEngine.start_retrieve = timed_start
engine_mod.Loading.finish = timed_finish
tc.TritonTransfer.scatter_layerwise = kept_scatter


def one(session, ids) -> dict:
    marks.clear()
    landed_events.clear()
    spent.clear()
    if (
        WHOLE_BEFORE
    ):  # as the ttft bench does: a whole (not layerwise) warm load before each layerwise one
        session.prefill(ids, layerwise=False)
        marks.clear()
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    hit = session.prefill(ids, layerwise=True).hit_tokens
    end.record()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    assert hit > 0
    last = landed_events[-1] if landed_events else None
    return {
        "total_ms": (t1 - t0) * 1e3,
        "before_retrieve_ms": (marks["retrieve0"] - t0) * 1e3,
        "start_retrieve_ms": (marks["retrieve1"] - marks["retrieve0"]) * 1e3,
        "forward_host_ms": (marks["finish0"] - marks["retrieve1"]) * 1e3,
        "finish_ms": (marks["finish1"] - marks["finish0"]) * 1e3,
        "after_finish_ms": (t1 - marks["finish1"]) * 1e3,
        "last_layer_landed_ms": begin.elapsed_time(last) if last is not None else None,
        "device_end_ms": begin.elapsed_time(end),
        "cuda_mallocs": torch.cuda.memory_stats()["segment.all.allocated"] - segments,
        **{f"in_{k}_ms": v * 1e3 for k, v in spent.items()},
    }


def summary(rows: list[dict]) -> dict:
    return {
        k: round(statistics.median(r.get(k, 0.0) for r in rows), 2)
        for k in rows[0]
        if rows[0][k] is not None
    }


def timeline(session, ids) -> dict:
    """Spans (ms from the first device event) of the H2D copies, the transfer's kernels and the
    rest."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        session.prefill(ids, layerwise=True)
        torch.cuda.synchronize()
    spans: dict[str, list[float]] = {}
    t_min = None
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        kind = (
            "h2d"
            if "HtoD" in name
            else "d2h"
            if "DtoH" in name
            else "kv_copy"
            if "kv_copy" in name or "kv_quant" in name
            else "digest"
            if "digest" in name
            else "forward"
        )
        s, t = e.time_range.start, e.time_range.end
        t_min = s if t_min is None else min(t_min, s)
        span = spans.setdefault(kind, [s, t, 0.0, 0])
        span[0], span[1], span[2], span[3] = (
            min(span[0], s),
            max(span[1], t),
            span[2] + (t - s),
            span[3] + 1,
        )
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    return {
        "spans_ms": {
            k: {
                "first": round((v[0] - t_min) / 1e3, 2),
                "last": round((v[1] - t_min) / 1e3, 2),
                "busy": round(v[2] / 1e3, 2),
                "count": v[3],
            }
            for k, v in spans.items()
        },
        "table": table,
    }


def profiled(session, ids) -> str:
    prof = cProfile.Profile()
    prof.enable()
    session.prefill(ids, layerwise=True)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    return s.getvalue()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    model = build_model()
    ids = torch.randint(
        0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens)
    )
    chunk = 256
    pool_gib = (tokens + chunk) * 131072 * 1.05 / 1024**3
    cpu = HFSession(
        model, KvtierConfig(chunk_size=chunk, max_local_cpu_size=pool_gib), max_len=tokens
    )
    cpu.prefill(ids)
    report: dict = {"tokens": tokens}
    with kvtier_server(2.5 * pool_gib) as srv:
        remote = _ServerSession(model, ids, chunk, pool_gib, srv.url, "auto")
        for s in (cpu, remote.session):  # warm up: connect, map, register, compile
            for _ in range(2):
                one(s, ids)
        hit = tokens - 1
        last = ids[:, -1:].cuda()

        def forward_one() -> None:
            with torch.inference_mode():
                model(
                    input_ids=last,
                    past_key_values=KvtierCache(cpu.buffers, hit),
                    use_cache=True,
                    logits_to_keep=1,
                )

        beside_a_copy = BesideACopy(hit * 131072)

        rows: dict[str, list[dict]] = {
            "cpu": [],
            "server": [],
            "forward_1": [],
            "forward_1_beside_a_copy": [],
        }
        run_counts: dict[str, int] = {}
        for _ in range(9):
            for name, s in (("cpu", cpu), ("server", remote.session)):
                rows[name].append(one(s, ids))
                run_counts[name] = runs[-1]
            rows["forward_1"].append({"total_ms": timed(forward_one, torch.device("cuda")) * 1e3})
            rows["forward_1_beside_a_copy"].append(
                {"total_ms": beside_a_copy.timed(forward_one) * 1e3}
            )
        report["median"] = {k: summary(v) for k, v in rows.items()}
        report["staging_runs_per_layer"] = run_counts
        print(json.dumps(report, indent=1), flush=True)
        for name, s in (("cpu", cpu), ("server", remote.session)):
            tl = timeline(s, ids)
            report.setdefault("timeline", {})[name] = tl["spans_ms"]
            (out / f"profiler-{name}.txt").write_text(tl["table"])
            print(name, json.dumps(tl["spans_ms"]), flush=True)
        text = profiled(remote.session, ids)
        (out / "cprofile-server.txt").write_text(text)
        print(text[:6000])
        remote.close()
    (out / "layerwise-profile.json").write_text(json.dumps(report, indent=1) + "\n")
