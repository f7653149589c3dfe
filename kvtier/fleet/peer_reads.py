"""P2P sharing over NIXL (`transfer_channel: nixl`): a peer on another host lends chunks in
place, and the asker's NIXL agent READs them from the peer's CPU pool straight into its own
pool's blocks (UCX: RDMA where the hosts have it, else TCP or shared memory). The socket of
kvtier/fleet/peers.py then carries only keys, places and the lease's DONE / HELD.

    holder   `NixlLender`: its CPU pool registered with an agent; while a lease is open the
             agent's worker is driven (UCX over TCP needs the target to progress)
    asker    `NixlReader`: its CPU pool registered with an agent of its own; `read` moves the
             lent chunks into their blocks and waits for them (bounded by `timeout`)

The reply to a NIXL asker carries the holder's pool address and its agent's metadata
(`NIXL_POOL`, then the metadata), then each chunk's place as a shared-memory lend does. As for
that lend, the asker keeps what it read only when the holder answers HELD: it retained every
block until the asker said DONE.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvtier import nixl
from kvtier.logs import get_logger
from kvtier.memory import HostPool

log = get_logger(__name__)

NIXL_POOL = struct.Struct("<QI")  # the holder's pool address in its process, metadata length
POLL_S = 0.0002  # between checks of a read's state (each one progresses the asker's worker)


class NixlLender:
    """A holder's CPU pool, registered with a NIXL agent for peers to read from."""

    def __init__(self, pool: HostPool) -> None:
        self._agent = nixl.agent("kvtier-p2p-holder")
        nixl.register(self._agent, pool.arena)
        metadata = bytes(self._agent.get_agent_metadata())
        self._header = NIXL_POOL.pack(pool.arena.data_ptr(), len(metadata)) + metadata
        self._progress = nixl.Progress(self._agent)

    def header(self) -> bytes:
        """What a reply carries before the places: the pool's address and the metadata."""
        return self._header

    def hold(self) -> None:
        """A lease is open: peers may read until `release`."""
        self._progress.hold()

    def release(self) -> None:
        self._progress.release()

    def close(self) -> None:
        self._progress.close()


class NixlReader:
    """An asker's CPU pool, registered with a NIXL agent: lent chunks are read into its
    blocks. One read at a time (the agent is driven by the thread waiting for it)."""

    def __init__(self, pool: HostPool, timeout: float) -> None:
        self._agent = nixl.agent("kvtier-p2p")
        nixl.register(self._agent, pool.arena)
        self._start = pool.arena.data_ptr()
        self._end = self._start + pool.arena.numel()
        self._timeout = timeout
        self._peers: dict[bytes, str] = {}  # a holder agent's metadata -> its name here
        self._lock = threading.Lock()
        self.reads = 0  # chunks read from peers

    def covers(self, outs: Sequence[memoryview]) -> bool:
        """Whether every destination lies in the registered pool (a read can land there)."""
        return all(self._start <= at and at + len(out) <= self._end for at, out in _at(outs))

    def read(
        self,
        metadata: bytes,
        base: int,
        places: Sequence[tuple[int, int]],
        outs: Sequence[memoryview],
    ) -> None:
        """Each place (offset in the holder's pool, bytes) read into its `outs` entry;
        ConnectionError when NIXL fails or the read outlasts the timeout (then nothing in
        `outs` may be used)."""
        if not places:
            return
        agent = self._agent
        with self._lock:
            try:
                local = agent.get_xfer_descs([(at, len(out), 0) for at, out in _at(outs)], "DRAM")
                remote = agent.get_xfer_descs([(base + at, n, 0) for at, n in places], "DRAM")
                handle = agent.initialize_xfer("READ", local, remote, self._peer(metadata))
                try:
                    self._wait(handle)
                finally:
                    agent.release_xfer_handle(handle)  # a read still under way is cancelled
            except nixl.errors() as exc:  # the holder's agent gone, refused, ...
                raise ConnectionError(f"NIXL read failed: {exc}") from exc
            self.reads += len(places)

    def _peer(self, metadata: bytes) -> str:
        """The holder's agent's name here, added the first time its metadata comes."""
        name = self._peers.get(metadata)
        if name is None:
            name = self._peers[metadata] = nixl.as_str(self._agent.add_remote_agent(metadata))
        return name

    def _wait(self, handle: object) -> None:
        agent = self._agent
        state = agent.transfer(handle)
        deadline = time.monotonic() + self._timeout
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise ConnectionError(f"NIXL read not done in {self._timeout:.1f} s")
            time.sleep(POLL_S)
            state = agent.check_xfer_state(handle)
        if state == "ERR":
            raise ConnectionError("NIXL read failed")


def _at(outs: Sequence[memoryview]) -> list[tuple[int, memoryview]]:
    """Each destination with its address."""
    return [(np.frombuffer(out, np.uint8).ctypes.data, out) for out in outs]
