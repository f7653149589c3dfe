"""The faults `kvtier bench chaos` injects, and what it watches of the processes.

Each fault is injected at the start of its phase and cleared at its end (the
clearing may take a while: a restarted vLLM must load its model; the phase
lasts until it is done):

    store-killed      the store server SIGKILLed; restarted on the same port
    store-stopped     SIGSTOP (longer than blocking_timeout_secs); SIGCONT
    disk-full         the disk tier's file system (a tmpfs) filled; the filler removed
    chunks-corrupted  the chunk files on disk: half get bytes flipped, half cut short
    disk-read-only    the tmpfs remounted read-only; remounted writable
    lease-hog         another client leases values on the store server and never
                      releases them (it takes new ones as the server drops them)
    decoder-killed    PD: the decoder's vLLM SIGKILLed; restarted on its ports
    prefiller-killed  PD: the prefiller's vLLM SIGKILLed while it sends; restarted

The disk faults need the tier on a file system of its own: `private_mounts`
re-runs the command in a private mount namespace (`unshare -m`, as root), where
a tmpfs is mounted and vanishes with the run.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvtier_tools.dev.demo import Server
from kvtier_tools.dev.localservers import LocalServer

NAMESPACE_ENV = "IN_KVTIER_CHAOS_MOUNTS"  # not KVTIER_*: those are config keys
STORE_FAULTS = ("store-killed", "store-stopped", "lease-hog")
DISK_FAULTS = ("disk-full", "chunks-corrupted", "disk-read-only")
PD_FAULTS = ("decoder-killed", "prefiller-killed")


class Fault(Protocol):
    name: str

    def inject(self) -> None: ...

    def clear(self) -> None: ...


@dataclass
class StoreKilled:
    server: LocalServer
    name: str = "store-killed"

    def inject(self) -> None:
        self.server.kill()

    def clear(self) -> None:
        self.server.start()  # the same command: the same ports


@dataclass
class StoreStopped:
    server: LocalServer
    name: str = "store-stopped"

    def inject(self) -> None:
        for proc in self.server.procs:
            proc.send_signal(signal.SIGSTOP)

    def clear(self) -> None:
        for proc in self.server.procs:
            proc.send_signal(signal.SIGCONT)


@dataclass
class DiskFull:
    root: Path
    name: str = "disk-full"

    def inject(self) -> None:
        block = b"\0" * (1 << 20)
        with open(self.root / "chaos-filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(block)
            except OSError:  # ENOSPC: full
                pass

    def clear(self) -> None:
        (self.root / "chaos-filler").unlink(missing_ok=True)


@dataclass
class DiskReadOnly:
    root: Path
    name: str = "disk-read-only"

    def inject(self) -> None:
        """Remounted read-only between two writes (a write in flight makes the mount busy).
        Tried every 50 ms: a tighter loop of `mount` processes takes a core from vLLM, whose
        OpenMP threads then crawl, writes last longer and the mount stays busy."""
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(
                ["mount", "-o", "remount,ro", str(self.root)], capture_output=True, text=True
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot remount {self.root} read-only: {done.stderr.strip()}")
            time.sleep(0.05)

    def clear(self) -> None:
        subprocess.run(["mount", "-o", "remount,rw", str(self.root)], check=True)


@dataclass
class ChunksCorrupted:
    root: Path
    seed: int = 0
    name: str = "chunks-corrupted"
    damaged: int = 0

    def inject(self) -> None:
        rng = random.Random(self.seed)
        files = sorted(p for p in self.root.rglob("*.kvc"))
        for i, path in enumerate(files):
            try:
                size = path.stat().st_size
                if i % 2:  # cut short
                    os.truncate(path, size // 2)
                else:  # bytes flipped past the header
                    with open(path, "r+b") as f:
                        at = rng.randrange(64, size) if size > 64 else 0
                        f.seek(at)
                        byte = f.read(1)
                        f.seek(at)
                        f.write(bytes([byte[0] ^ 0xFF]) if byte else b"\xff")
                self.damaged += 1
            except OSError:  # evicted meanwhile
                pass

    def clear(self) -> None:
        pass


@dataclass
class LeaseHog:
    url: str  # kvtier://host:port
    connections: int = 4
    name: str = "lease-hog"
    proc: subprocess.Popen | None = None

    def inject(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier_tools.bench.chaos_faults",
                "hog",
                self.url,
                str(self.connections),
            ]
        )

    def clear(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class NodeKilled:
    server: Server
    name: str  # decoder-killed, prefiller-killed
    # when given: killed once it says the node is busy (or after 10 s)
    busy: Callable[[], bool] | None = None

    def inject(self) -> None:
        deadline = time.monotonic() + 10
        while self.busy is not None and not self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.server.kill()

    def clear(self) -> None:
        self.server.start()


def hog(url: str, connections: int, value_mb: int = 1) -> None:
    """Lease values on a kvtier server and never release them: each connection puts
    values and borrows them again and again (as the server drops old leases)."""
    from kvtier.errors import KvtierError
    from kvtier.server.client import KVClient

    host, port = url.split("://", 1)[1].rsplit(":", 1)
    value = bytes(value_mb << 20)
    clients = [KVClient(host, int(port), timeout=5) for _ in range(connections)]
    keys = [[f"chaos-hog-{c}-{i}".encode() for i in range(64)] for c in range(connections)]
    held = []
    while True:
        for client, ks in zip(clients, keys):
            try:
                client.put(ks, [value] * len(ks))
                lease = client.borrow(ks)
                if lease is not None:
                    held.append(lease)  # never released
            except KvtierError:
                pass
        time.sleep(1.0)


# -- what is watched -----------------------------------------------------------------------


def proxy_busy(url: str) -> bool:
    """`kvtier proxy` has a request in flight (its Prometheus gauge)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    return any(
        line.startswith("kvtier_proxy_inflight_requests ") and float(line.split()[1]) >= 1
        for line in text.splitlines()
    )


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


@dataclass
class Usage:
    pid: int
    rss_mb: float
    fds: int
    processes: int


def usage(pid: int, tree: bool = True) -> Usage | None:
    """RSS and open file descriptors of a process (and its descendants); None if it is gone."""
    rss, fds, n = 0, 0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    for p in _tree(pid) if tree else [pid]:
        try:
            rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
            fds += len(os.listdir(f"/proc/{p}/fd"))
            n += 1
        except OSError:
            continue
    return Usage(pid, rss / 2**20, fds, n) if n else None


@dataclass
class Watched:
    """The processes of a run by role; a role's pid changes when it is restarted."""

    pids: dict[str, Callable[[], int]] = field(default_factory=dict)  # role -> its current pid
    # roles counted without their children (the servers it started)
    alone: tuple[str, ...] = ("harness",)

    def snapshot(self) -> dict[str, dict]:
        out = {}
        for role, pid_of in self.pids.items():
            pid = pid_of()
            u = usage(pid, tree=role not in self.alone) if pid else None
            out[role] = u.__dict__ if u else None
        return out


# -- a file system of the run's own ----------------------------------------------------------


def private_mounts_available() -> str:
    """'' if this process may mount a tmpfs in a private mount namespace; else why not."""
    if os.environ.get(NAMESPACE_ENV) == "1":
        return ""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", "/mnt"],
        capture_output=True,
    )
    return (
        ""
        if probe.returncode == 0
        else f"cannot mount in a mount namespace: {probe.stderr.decode().strip()}"
    )


def in_private_mounts(argv: list[str]) -> int | None:
    """Re-run `argv` (this command) in a private mount namespace and return its exit
    status; None if this process already runs in one."""
    if os.environ.get(NAMESPACE_ENV) == "1":
        return None
    env = {**os.environ, NAMESPACE_ENV: "1"}
    return subprocess.run(["unshare", "-m", "--propagation", "private", *argv], env=env).returncode


@contextlib.contextmanager
def tmpfs(root: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs at `root` for the block; unmounted after it (a temporary folder holding a
    mount point cannot be removed: the 30-minute run failed at its very end)."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(root)], check=True
    )
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


if __name__ == "__main__" and sys.argv[1:2] == ["hog"]:
    hog(sys.argv[2], int(sys.argv[3]))
