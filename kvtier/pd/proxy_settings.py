"""The PD proxy's settings (LMCache's proxy flags), its prefill-time statistics
and its Prometheus metrics."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.fleet.upstreams import csv_ints, ports_for
from kvtier.pd.notify import ENGINES


@dataclass(frozen=True)
class Decoder:
    url: str
    host: str
    init_ports: list[int]  # per TP rank
    alloc_ports: list[int]


@dataclass(frozen=True)
class ProxySettings:
    host: str
    port: int
    prefillers: list[str]  # base URLs
    decoders: list[Decoder]
    proxy_host: str
    proxy_port: int
    prefill_timeout: float = 300.0  # s for the whole prefill request
    decode_timeout: float = 300.0  # s of silence from the decoder (before and between chunks)
    kv_ready_timeout: float = 30.0  # s to wait for PrefillDone after the prefill answered
    connect_timeout: float = 5.0
    stats_interval: float = 5.0
    # s between the watch's probes of every node (kvtier.fleet.upstreams)
    health_interval: float = 0.5
    pd_engine: str = "kvtier"  # the nodes' PD backend: a key of kvtier.pd.notify.ENGINES
    route: str = "round-robin"  # or "kv": kvtier.fleet.routing
    prefiller_kv_events: list[str] = field(default_factory=list)  # ZMQ endpoints, per prefiller
    route_load_tokens: int = 2048  # a request in flight on a prefiller counts as this many


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """LMCache's proxy flags: node i of each kind listens on base port + i."""
    pre_ports = ports_for(args.prefiller_port, args.num_prefillers)
    dec_ports = ports_for(args.decoder_port, args.num_decoders)
    init, alloc = csv_ints(args.decoder_init_port), csv_ints(args.decoder_alloc_port)
    decoders = [
        Decoder(
            f"http://{args.decoder_host}:{p}",
            args.decoder_host,
            [x + i for x in init],
            [x + i for x in alloc],
        )
        for i, p in enumerate(dec_ports)
    ]
    listened = {"--port": [args.port], "--proxy-port": [args.proxy_port]}  # 0: any free port
    peers = {
        "--prefiller-port": pre_ports,
        "--decoder-port": dec_ports,
        "--decoder-init-port": [p for d in decoders for p in d.init_ports],
        "--decoder-alloc-port": [p for d in decoders for p in d.alloc_ports],
    }
    for flag, ports in (listened | peers).items():
        if not all((0 if flag in listened else 1) <= p <= 65535 for p in ports):
            raise ValueError(f"{flag} {','.join(map(str, ports))}: expected ports, up to 65535")
    return ProxySettings(
        args.host,
        args.port,
        [f"http://{args.prefiller_host}:{p}" for p in pre_ports],
        decoders,
        args.proxy_host,
        args.proxy_port,
        args.prefill_timeout,
        args.decode_timeout,
        args.kv_ready_timeout,
        health_interval=args.health_interval,
        pd_engine=args.pd_engine,
        route=args.route,
        prefiller_kv_events=_kv_events(args, len(pre_ports)),
        route_load_tokens=args.route_load_tokens,
    )


def _kv_events(args: argparse.Namespace, count: int) -> list[str]:
    """The prefillers' KV event publishers (vLLM's `--kv-events-config` endpoints)."""
    if args.prefiller_kv_events_port is None:
        if args.route == "kv":
            raise ValueError(
                "--route kv needs --prefiller-kv-events-port: where each prefiller's vLLM "
                "publishes its KV events (--kv-events-config's endpoint)"
            )
        return []
    ports = ports_for(args.prefiller_kv_events_port, count)
    return [f"tcp://{args.prefiller_host}:{p}" for p in ports]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="localhost", help="address the proxy's HTTP API listens on")
    a("--port", type=int, default=9000)
    a("--prefiller-host", default="localhost")
    a(
        "--prefiller-port",
        default="8100",
        help="first prefiller's port (prefiller i: + i), or a comma list",
    )
    a("--num-prefillers", type=int, default=1)
    a("--decoder-host", default="localhost")
    a(
        "--decoder-port",
        default="8200",
        help="first decoder's port (decoder i: + i), or a comma list",
    )
    a(
        "--decoder-init-port",
        default="8300",
        help="decoder's pd_peer_init_port (comma list: one per TP rank)",
    )
    a(
        "--decoder-alloc-port",
        default="8400",
        help="decoder's pd_peer_alloc_port (comma list: one per TP rank)",
    )
    a("--num-decoders", type=int, default=1)
    a(
        "--proxy-host",
        default="localhost",
        help="where senders' PrefillDone arrive (their pd_proxy_host)",
    )
    a("--proxy-port", type=int, default=8500, help="their pd_proxy_port")
    a("--prefill-timeout", type=float, default=300.0, help="s for a prefill request")
    a("--decode-timeout", type=float, default=300.0, help="s of silence from a decoder")
    a("--kv-ready-timeout", type=float, default=30.0, help="s to wait for a sender's PrefillDone")
    a(
        "--health-interval",
        type=float,
        default=0.5,
        help="s between TCP probes of every node: "
        "one that does not answer gets no requests until it does",
    )
    a(
        "--route",
        choices=("round-robin", "kv"),
        default="round-robin",
        help="which prefiller a request goes to: in turn, or the one holding the longest prefix "
        "of its prompt (from the prefillers' KV events), weighed against its load",
    )
    a(
        "--prefiller-kv-events-port",
        default=None,
        help="with --route kv: the port of each prefiller's KV event publisher (vLLM's "
        "--kv-events-config endpoint, publisher zmq): a base port (node i on port + i) or "
        "one a node",
    )
    a(
        "--route-load-tokens",
        type=int,
        default=2048,
        help="with --route kv: how many prompt tokens held one request in flight on a prefiller "
        "is worth",
    )
    a(
        "--pd-engine",
        choices=tuple(ENGINES),
        default="kvtier",
        help="the PD backend the prefillers and decoders run: kvtier's, "
        "or LMCache's (its senders' ProxyNotif "
        "over ZMQ on --proxy-port; requests go to its decoders as they came)",
    )


class TtftStats:
    """Prefill times, printed every `interval` s as LMCache's proxy prints them."""

    def __init__(self, interval: float) -> None:
        self.values: list[float] = []
        self.interval, self._last = interval, time.monotonic()

    def add(self, ms: float) -> None:
        self.values.append(ms)
        if time.monotonic() - self._last > self.interval:
            self.report()

    def report(self) -> None:
        self._last = time.monotonic()
        v = sorted(self.values[-100_000:])
        if not v:
            return
        p99 = v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]
        print(
            "===============================\n"
            f"Num requests: {len(self.values)}\nPrefill node TTFT stats:\n"
            f" - Average (ms): {statistics.fmean(v)}\n - Median (ms): {statistics.median(v)}\n"
            f" - 99th Percentile (ms): {p99}\n===============================",
            flush=True,
        )


@dataclass
class ProxyMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "kvtier_proxy_requests",
            "requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvtier_proxy_upstream_errors", "failed calls to a node", ["node", "kind"], registry=r
        )
        self.prefill = Histogram(
            "kvtier_proxy_prefill_seconds",
            "prefill request time (prefill TTFT)",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.kv_wait = Histogram(
            "kvtier_proxy_kv_ready_wait_seconds",
            "wait for PrefillDone after the prefill",
            registry=r,
            buckets=(0.0001, 0.001, 0.01, 0.1, 1, 10, 30),
        )
        self.routed = Counter(
            "kvtier_proxy_routed",
            "prefills routed by a prefix a prefiller holds (kv) or in turn (round-robin)",
            ["how"],
            registry=r,
        )
        self.kv_not_ready = Counter(
            "kvtier_proxy_kv_not_ready",
            "requests decoded without their KV sent (the sender failed or said nothing in time)",
            registry=r,
        )
        self.prefill_fallbacks = Counter(
            "kvtier_proxy_prefill_fallbacks",
            "requests the decoder prefilled itself: the prefiller was down, broken or too slow",
            registry=r,
        )
        self.node_up = Gauge(
            "kvtier_proxy_node_up",
            "1 while the node accepts connections",
            ["node", "url"],
            registry=r,
        )
        self.inflight = Gauge("kvtier_proxy_inflight_requests", "requests in progress", registry=r)
