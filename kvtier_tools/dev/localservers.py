"""Start store servers on free loopback ports, for tests, benchmarks and the demo.

    with kvtier_server(prealloc_gb=0.5) as srv:  srv.url == "kvtier://127.0.0.1:<port>"
    with redis_server() as srv:                  srv.url == "redis://127.0.0.1:<port>",
                                                 also on srv.unix_socket
    with redis_cluster(masters=3) as srv:        srv.url == "redis-cluster://127.0.0.1:<p1>,..."
    with mooncake_store(segments=2) as srv:      srv.url ==
                                                 "mooncakestore://127.0.0.1:<master port>"
    with lmcache_server() as srv:                srv.url == "lm://127.0.0.1:<port>" (LMCache's own)
    cert, key = self_signed_cert(directory)      for --tls-cert/--tls-key (and the client's tls_ca)

Each yields a `LocalServer` whose processes are stopped (SIGTERM, then
SIGKILL) when the block ends; `kill()` and `start()` exist for fault tests.
A free port can be taken by another process before the server binds it: a
server whose log says so is started again on fresh ports (`_running`).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# What kvtier server, redis-server and mooncake say when their port is taken.
_PORT_TAKEN = re.compile(r"in use by another process|address already in use", re.I)
_START_ATTEMPTS = 3


class ServerDidNotStart(RuntimeError):
    """A local server exited, or did not listen, before its ports answered."""

    def __init__(self, reason: str, log: str) -> None:
        self.port_taken = bool(_PORT_TAKEN.search(log))
        tail = "\n".join(log.splitlines()[-20:])
        super().__init__(f"{reason}; its log ends:\n{tail}" if tail else reason)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (all held at once while picked),
    below the kernel's ephemeral range: a port picked here and bound later (by a server that
    starts after others, or one named in a config ahead of time) is never the one the kernel
    hands meanwhile to another process's bind(0) or outgoing connection. (A vLLM started
    after such a pick once took the PD proxy's notification port, CI 2026-11-28.)"""
    with contextlib.ExitStack() as held:
        return [s.getsockname()[1] for s in _bound(n, held)]


@contextlib.contextmanager
def refusing_ports(n: int) -> Iterator[list[socket.socket]]:
    """`n` loopback sockets bound, never listening, held until the block ends: a node that
    is down. A connection to one is refused, and no other process can take its port
    meanwhile, as it could a port that `free_ports` picked and nobody bound. (CI
    2026-12-03: a proxy test's request to a prefiller "down" on such a port waited 30 s,
    most likely at another test's server that took the port, read the request and never
    answered.) `listen()` on one brings its node up."""
    with contextlib.ExitStack() as held:
        yield _bound(n, held)


def _bound(n: int, held: contextlib.ExitStack) -> list[socket.socket]:
    low = _ephemeral_low()
    sockets: list[socket.socket] = []
    while len(sockets) < n:
        s = held.enter_context(socket.socket())
        try:
            s.bind(
                (
                    "127.0.0.1",
                    random.randrange(PORTS_FROM, low) if low > PORTS_FROM + 1000 else 0,
                )
            )
        except OSError:
            continue
        sockets.append(s)
    return sockets


PORTS_FROM = 10000  # above the well-known and most registered services' ports


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (0: unknown, the kernel picks then)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 <= 65535:
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
                return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args[0]} exited with {proc.returncode} before listening on {port}"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class LocalServer:
    url: str
    ports: list[int]
    commands: list[list[str]]
    procs: list[subprocess.Popen] = field(default_factory=list)
    log_path: Path | None = None
    manage_port: int | None = None
    unix_socket: str | None = None  # redis-server's, besides its TCP port
    # what a client needs besides the URL to join it
    extra_config: dict = field(default_factory=dict)
    start_timeout: float = 30.0  # s each port may take to answer

    def start(self) -> None:
        with open(self.log_path or os.devnull, "ab") as log:  # the children keep their own copies
            self.procs = [
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT) for cmd in self.commands
            ]
        try:
            for port, proc in zip(self.ports, self.procs):
                wait_for_port(port, self.start_timeout, proc)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise ServerDidNotStart(str(e), self.log()) from None

    def kill(self) -> None:
        """SIGKILL: the server gets no chance to say goodbye."""
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log(self) -> str:
        return (
            self.log_path.read_text(errors="replace")
            if self.log_path and self.log_path.exists()
            else ""
        )

    def metrics(self, token: str | None = None) -> dict[str, float]:
        """`kvtier server`'s counters from its management API's /metrics, by name without the
        `kvtier_server_` prefix and `_total` suffix."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.manage_port}/metrics")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
        return {
            m[1]: float(m[2])
            for m in re.finditer(r"^kvtier_server_(\w+?)(?:_total)? (\S+)$", text, re.M)
        }


@contextlib.contextmanager
def _running(make: Callable[[], LocalServer]) -> Iterator[LocalServer]:
    """Start the server `make()` builds (on ports it picks); again, on fresh ones, while
    another process took a port first."""
    for attempt in range(1, _START_ATTEMPTS + 1):
        server = make()
        try:
            server.start()
            break
        except ServerDidNotStart as e:
            if not e.port_taken or attempt == _START_ATTEMPTS:
                raise
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def kvtier_command(*args: str, log: Path | None = None) -> Iterator[str]:
    """`kvtier ARGS --port P` (a proxy, a router, a controller) on a free loopback port, its
    output into `log` (else a temporary file), until the block exits; yields
    http://127.0.0.1:P. Started again on a fresh port while another process took one first
    (`_running`: test_proxy met that race in CI, 2026-12-03)."""
    with tempfile.TemporaryDirectory() as tmp:

        def make() -> LocalServer:
            port = free_port()
            cmd = [sys.executable, "-m", "kvtier.cli", *args, "--port", str(port)]
            return LocalServer(
                f"http://127.0.0.1:{port}",
                [port],
                [cmd],
                log_path=log or Path(tmp) / f"{port}.log",
                start_timeout=60,
            )

        with _running(make) as server:
            yield server.url


@contextlib.contextmanager
def kvtier_server(
    prealloc_gb: float = 0.5, *extra: str, log_dir: Path | None = None
) -> Iterator[LocalServer]:
    def make() -> LocalServer:
        port, manage = free_ports(2)
        cmd = [
            sys.executable,
            "-m",
            "kvtier.server",
            "--service-port",
            str(port),
            "--manage-port",
            str(manage),
            "--prealloc-size",
            str(prealloc_gb),
            *extra,
        ]
        log = Path(log_dir or tmp) / f"kvtier-server-{port}.log"
        return LocalServer(
            f"kvtier://127.0.0.1:{port}", [port, manage], [cmd], log_path=log, manage_port=manage
        )

    with tempfile.TemporaryDirectory(prefix="kvtier-server-") as tmp, _running(make) as srv:
        yield srv


@contextlib.contextmanager
def lmcache_server(log_dir: Path | None = None) -> Iterator[LocalServer]:
    """LMCache's own store server (`python -m lmcache.v1.server HOST PORT cpu`, its `lm://`
    remote backend), where the lmcache package is installed (the GPU bundle's add-on)."""

    def make() -> LocalServer:
        port = free_port()
        cmd = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]
        log = Path(log_dir or tmp) / f"lmcache-server-{port}.log"
        return LocalServer(f"lm://127.0.0.1:{port}", [port], [cmd], log_path=log)

    with tempfile.TemporaryDirectory(prefix="lmcache-server-") as tmp, _running(make) as srv:
        yield srv


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for localhost and 127.0.0.1 (its own CA), by the openssl command."""
    cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name) or (
        f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None
    )
    if path is None:
        raise FileNotFoundError(
            f"{name} not found: install Debian's redis-server package (scripts/setup.sh does)"
        )
    return path


def _redis_cmd(port: int, workdir: str, *extra: str) -> list[str]:
    return [
        redis_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--protected-mode",
        "no",
        *extra,
    ]


@contextlib.contextmanager
def redis_server() -> Iterator[LocalServer]:
    def make() -> LocalServer:
        port, sock = free_port(), f"{tmp}/redis.sock"
        cmd = _redis_cmd(port, tmp, "--unixsocket", sock, "--unixsocketperm", "700")
        return LocalServer(
            f"redis://127.0.0.1:{port}",
            [port],
            [cmd],
            log_path=Path(tmp) / f"redis-{port}.log",
            unix_socket=sock,
        )

    with tempfile.TemporaryDirectory(prefix="kvtier-redis-") as tmp, _running(make) as srv:
        yield srv


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[LocalServer]:
    """`masters` redis-server processes in cluster mode, slots spread, no replicas."""

    def make() -> LocalServer:
        ports = [_cluster_port() for _ in range(masters)]
        cmds = [
            _redis_cmd(
                p,
                tmp,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{p}.conf",
                "--cluster-node-timeout",
                "5000",
            )
            for p in ports
        ]
        url = "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        return LocalServer(url, ports, cmds, log_path=Path(tmp) / f"redis-{ports[0]}.log")

    with tempfile.TemporaryDirectory(prefix="kvtier-redis-cluster-") as tmp, _running(make) as srv:
        subprocess.run(
            [
                redis_binary("redis-cli"),
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in srv.ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _wait_cluster_ok(srv.ports[0])
        yield srv


def _wait_cluster_ok(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [redis_binary("redis-cli"), "-p", str(port), "cluster", "info"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        if "cluster_state:ok" in out:
            return
        time.sleep(0.1)
    raise TimeoutError(f"Redis cluster on port {port} not ok after {timeout} s")


# How a kvtier client on this host joins a local pool: over loopback, giving it no RAM
# of its own (the pool's mooncake_client segments hold the values), so each costs none.
MOONCAKE_JOIN = {
    "local_hostname": "127.0.0.1",
    "global_segment_size": 0,
    "local_buffer_size": 16 << 20,
}


def mooncake_binary(name: str) -> str:
    """A program of Mooncake's wheel (beside this Python's, or on PATH)."""
    beside = Path(sys.executable).parent / name
    path = str(beside) if beside.exists() else shutil.which(name)
    if path is None:
        raise FileNotFoundError(
            f"{name} not found: pip install mooncake-transfer-engine-non-cuda "
            "(scripts/setup.sh does)"
        )
    return path


@contextlib.contextmanager
def mooncake_store(
    segments: int = 2, segment_mb: int = 256, client_ttl: int = 10
) -> Iterator[LocalServer]:
    """mooncake_master, and `segments` mooncake_client processes that each give the
    pool `segment_mb` MiB of RAM (P2PHANDSHAKE metadata: no metadata server).
    `client_ttl`: seconds the master keeps a silent client's segments."""

    def make() -> LocalServer:
        rpc, metrics, *clients = free_ports(2 + segments)
        master = [
            mooncake_binary("mooncake_master"),
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={metrics}",
            f"--client_ttl={client_ttl}",
            "--logtostderr=true",
        ]
        cmds = [master] + [
            [
                mooncake_binary("mooncake_client"),
                f"--master_server_address=127.0.0.1:{rpc}",
                "--metadata_server=P2PHANDSHAKE",
                "--host=127.0.0.1",
                f"--port={port}",
                f"--global_segment_size={segment_mb} MB",
                "--protocol=tcp",
                "--logtostderr=true",
            ]
            for port in clients
        ]
        return LocalServer(
            f"mooncakestore://127.0.0.1:{rpc}",
            [rpc, *clients],
            cmds,
            log_path=Path(tmp) / f"mooncake-{rpc}.log",
            extra_config=MOONCAKE_JOIN,
        )

    with tempfile.TemporaryDirectory(prefix="kvtier-mooncake-") as tmp, _running(make) as srv:
        yield srv
