"""kvtier's figures in vLLM's `/metrics` and its periodic "KV Transfer metrics" log.

vLLM's connector stats API carries them: each worker step and each scheduler
step return a `KvtierStats` of what changed since the last one (counters as
deltas, gauges as current values); vLLM aggregates them and hands the dict to
`KvtierPromMetrics.observe` in its API server, which feeds Prometheus:

    kvtier_lookups_total, kvtier_lookups_skipped_total, kvtier_lookup_tokens_total,
    kvtier_lookup_seconds_total, kvtier_hit_tokens_total, kvtier_hit_rate
    kvtier_stored_tokens_total{tier}, kvtier_loaded_tokens_total{tier}   (and _bytes_total)
    kvtier_store_seconds_total, kvtier_load_seconds_total, kvtier_store_gbps, kvtier_load_gbps
    kvtier_load_wait_seconds_total, kvtier_load_wait_steps_total, kvtier_step_loads_total,
    kvtier_step_loads_ahead_total
    kvtier_evictions_total{tier}, kvtier_dropped_writes_total{tier},
    kvtier_skipped_store_tokens_total, kvtier_load_failure_tokens_total,
    kvtier_uncached_requests_total{kind}, kvtier_pool_used_bytes, kvtier_pool_capacity_bytes,
    kvtier_write_queue_depth, kvtier_longest_{lookup,step_wait,background_load}_seconds

Keys of the data dict are the metric names without `kvtier_` and `_total`;
a per-tier one is `name:tier` (`uncached_requests:kind`, by the kind of request kvtier
cannot key: identity.py).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvtier.integrations.vllm.forward_wait import ForwardWaits

COUNTERS = {
    "lookups": "lookups the vLLM scheduler made",
    "lookups_skipped": (
        "requests not looked up: vLLM's GPU cache had every span this engine saved of them "
        "(stored.py)"
    ),
    "lookup_tokens": "prompt tokens looked up",
    "lookup_seconds": "time vLLM's scheduler waited on lookups (its steps wait meanwhile)",
    "hit_tokens": "prompt tokens vLLM was told kvtier holds (the log line's hit tokens)",
    "stored_tokens": "tokens of KV stored, by tier",
    "stored_bytes": "bytes of KV stored, by tier",
    "loaded_tokens": "tokens of KV loaded into vLLM, by the tier they came from",
    "loaded_bytes": "bytes of KV loaded into vLLM, by tier",
    "store_seconds": "time spent storing (gather and put)",
    "load_seconds": "time spent loading",
    "load_wait_seconds": (
        "time the steps' forwards waited on the GPU for the loads queued in their step (copies "
        "not over when the forward reached them, and the scatter; CUDA events, whole loads)"
    ),
    "load_wait_steps": "steps whose forward waited for loads queued in it (load_wait_seconds)",
    "step_loads": "loads from CPU RAM queued in the step that needs them (not beside the steps)",
    "step_loads_ahead": "of those, the loads whose copies to the GPU had started at the lookup",
    "evictions": "chunks evicted, by tier",
    "dropped_writes": "chunks not written to a lower tier (its queue stayed full)",
    "skipped_store_tokens": "tokens not stored: every CPU block was in use",
    "load_failure_tokens": "promised tokens that could not be loaded (vLLM recomputed them)",
    "uncached_requests": (
        "requests served without kvtier: nothing identifies their KV (prompt embeddings, "
        "multimodal items without a content hash), by kind"
    ),
}
# counters with a label: its name
LABELLED = {
    **dict.fromkeys(
        (
            "stored_tokens",
            "stored_bytes",
            "loaded_tokens",
            "loaded_bytes",
            "evictions",
            "dropped_writes",
        ),
        "tier",
    ),
    "uncached_requests": "kind",
}
GAUGES = {
    "pool_used_bytes": "bytes of the CPU pool holding chunks",
    "pool_capacity_bytes": "bytes of the CPU pool",
    "write_queue_depth": "chunks waiting for the disk and remote writers",
    # the longest waits on kvtier since the start (bounded by its timeouts: docs/configuration.md)
    "longest_lookup_seconds": (
        "the longest scheduler lookup (a request waits on it before it is scheduled)"
    ),
    "longest_step_wait_seconds": "the longest time one engine step spent in kvtier (loads, stores) "
    "besides its forward",
    "longest_background_load_seconds": "the longest load from disk/remote a request waited on",
}


class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data: dict[str, int | float] = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        """Counters add up; gauges keep the larger value (the latest is as good)."""
        for key, value in other.data.items():
            if key.split(":")[0] in GAUGES:
                self.data[key] = max(self.data.get(key, 0), value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items()) if v
        }
        lookups = self.data.get("lookup_tokens", 0)
        if lookups:
            out["hit_rate"] = round(self.data.get("hit_tokens", 0) / lookups, 4)
        for what in ("store", "load"):
            seconds = self.data.get(f"{what}_seconds", 0)
            nbytes = sum(v for k, v in self.data.items() if k.startswith(f"{what}ed_bytes:"))
            if seconds:
                out[f"{what}_GBps"] = round(nbytes / seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k.split(":")[0] not in GAUGES)


def deltas(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters as what changed since `before`; gauges as they are now."""
    out = {}
    for key, value in now.items():
        change = value if key.split(":")[0] in GAUGES else value - before.get(key, 0)
        if change:
            out[key] = change
    return out


class WorkerFigures:
    """A worker's own figures beside its engine's (`counters`), and what changed since its
    last report to vLLM (`report`)."""

    def __init__(self) -> None:
        self.failed_tokens = 0  # promised tokens that could not be loaded
        self.forward_waits = ForwardWaits()  # the forward's waits on the GPU for its step's loads
        self._longest = {"longest_step_wait_seconds": 0.0, "longest_background_load_seconds": 0.0}
        self._reported: dict[str, float] = {}  # counters as last reported to vLLM

    def note_longest(self, name: str, seconds: float) -> None:
        self._longest[name] = max(self._longest[name], seconds)

    def counters(self) -> dict[str, float]:
        self.forward_waits.read()
        return {
            "load_failure_tokens": self.failed_tokens,
            "load_wait_seconds": self.forward_waits.seconds,
            "load_wait_steps": self.forward_waits.steps,
            **self._longest,
        }

    def report(self, now: dict[str, float]) -> KvtierStats | None:
        """`now` (the worker's cumulative counters and gauges) as vLLM's stats: what changed."""
        changed = deltas(now, self._reported)
        self._reported = now
        stats = KvtierStats(changed)
        return None if stats.is_empty() else stats


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, doc in COUNTERS.items():
            label = [LABELLED[name]] if name in LABELLED else []
            self._metrics[name] = self._counter_cls(
                name=f"kvtier_{name}", documentation=f"kvtier: {doc}", labelnames=labelnames + label
            )
        for name, doc in {
            **GAUGES,
            "hit_rate": "hit tokens / lookup tokens since start",
            "store_gbps": "GB/s of the stores in the last interval",
            "load_gbps": "GB/s of the loads in the last interval",
        }.items():
            self._metrics[name] = self._gauge_cls(
                name=f"kvtier_{name}", documentation=f"kvtier: {doc}", labelnames=labelnames
            )
        self._totals: dict[int, dict[str, float]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        totals = self._totals.setdefault(engine_idx, {})
        for key, value in transfer_stats_data.items():
            name, _, label = key.partition(":")
            metric = self._metrics.get(name)
            if metric is None:
                continue
            child = metric.labels(*labels, label) if label else metric.labels(*labels)
            if name in GAUGES:
                child.set(value)
            else:
                child.inc(value)
                totals[name] = totals.get(name, 0) + value
        if totals.get("lookup_tokens"):
            self._metrics["hit_rate"].labels(*labels).set(
                totals.get("hit_tokens", 0) / totals["lookup_tokens"]
            )
        reduced = KvtierStats(dict(transfer_stats_data)).reduce()
        for what in ("store", "load"):
            if f"{what}_GBps" in reduced:
                self._metrics[f"{what}_gbps"].labels(*labels).set(reduced[f"{what}_GBps"])
