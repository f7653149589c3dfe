"""How a chunk's bytes cross from the sender into the receiver's buffer.

    tcp       built in. The sender gathers KV into its staging pool (the CPU
              pool) and streams each block as a Write frame on the alloc
              connection; the receiver reads it straight into the reserved
              block (through a bounce block when the buffer is on a GPU).
    nixl      the NIXL package (`pip install nixl`; UCX over NVLink, RDMA or
              TCP). The receiver registers its buffer with a NIXL agent and
              sends the agent's metadata in Welcome; the sender registers its
              staging pool and WRITEs staged blocks into the reserved blocks.
    cuda_ipc  built in, GPUs of one host. The receiver's buffer is cudaMalloc'd
              GPU memory and Welcome carries its CUDA IPC handle; the sender
              maps it into its own GPU's context. Its gather kernel collects a
              group of chunks from the paged cache into a small ring of
              buffers in its own GPU memory, and the copy engine moves each
              group into the reserved blocks (over NVLink when the GPUs
              differ) while the kernel gathers the next: `IpcWriter`
              (ipc_writes.py; its first groups are gathered while the Alloc
              is on the wire). All of it is queued on the sender's streams
              behind the forward that wrote the KV; nothing waits on the CPU
              until the request's Commit.

Each channel has a receiver half (`registration()`: the Welcome payload;
`expect_writes()`/`writes_ended()` around each reservation) and a sender
half (`connect()` per peer, then `push()` staged blocks or `views()` of
remote blocks).

NIXL agents run without NIXL's progress thread (kvtier/nixl.py says why). The sender
drives its side while it waits for a write; the receiver's side is driven by `nixl.Progress`
only while a reservation is open (UCX over TCP needs the target to progress).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier import framing, nixl
from kvtier.errors import KvtierError
from kvtier.logs import get_logger
from kvtier.memory import HostPool, MemoryBlock
from kvtier.pd import protocol as proto
from kvtier.pd.ipc_writes import IpcWriter

log = get_logger(__name__)


class ChannelUnavailable(KvtierError):
    """The configured transfer channel cannot run here (a missing package or device)."""


@dataclass
class Placement:
    """One chunk to write: the receiver's block, and (staged channels) the local block holding
    its bytes."""

    remote_block: int
    nbytes: int
    staged: MemoryBlock | None = None


# -- receiver half -------------------------------------------------------------------------


class ReceiverChannel:
    def __init__(self, name: str, pool: HostPool) -> None:
        self.name, self.pool = name, pool
        self._agent: Any = None
        self._progress: nixl.Progress | None = None
        if name == "nixl":
            self._agent = nixl.agent("kvtier-receiver")
            nixl.register(self._agent, pool.arena)
            self._progress = nixl.Progress(self._agent)
        elif name == "cuda_ipc" and pool.device.type != "cuda":
            raise ChannelUnavailable("transfer_channel cuda_ipc needs pd_buffer_device: cuda")

    def expect_writes(self) -> None:
        """A reservation was made: its sender may write into it until `writes_ended`."""
        if self._progress is not None:
            self._progress.hold()

    def writes_ended(self) -> None:
        if self._progress is not None:
            self._progress.release()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    def registration(self) -> bytes:
        """What the sender needs to write into the buffer (Welcome's payload)."""
        if self.name == "nixl":
            return bytes(self._agent.get_agent_metadata())
        # the arena is a cudaMalloc'd buffer (memory.py): its own IPC handle
        if self.name == "cuda_ipc":
            from kvtier.transfer.cudart import ipc_handle

            return ipc_handle(self.pool.arena.data_ptr())
        return b""

    def agent_name(self) -> str:
        return self._agent.name if self._agent is not None else ""


# -- sender half ---------------------------------------------------------------------------


class TcpBounce:
    """tcp into a GPU buffer: a Write's bytes land in pinned host memory, then are
    copied on this connection's own stream (a Commit waits for that stream only,
    never for the decoder's forward passes on its GPU)."""

    def __init__(self, pool: HostPool) -> None:
        self.host = torch.empty(pool.block_bytes, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream(pool.device)

    def receive(self, conn: socket.socket, target: torch.Tensor) -> None:
        self.stream.synchronize()  # the last copy out of the host block is done
        view = self.host[: target.numel()]
        framing.recv_into(conn, view.numpy().data)
        with torch.cuda.stream(self.stream):
            target.copy_(view, non_blocking=True)

    def wait(self) -> None:
        self.stream.synchronize()


@dataclass
class Peer:
    """A receiver as the sender's channel sees it, from its Welcome."""

    welcome: proto.Welcome
    nixl_name: str = ""
    remote: torch.Tensor | None = None  # cuda_ipc: the receiver's buffer, mapped here


class SenderChannel:
    """The sender's side of one channel; `staged` channels need the KV in host blocks first."""

    def __init__(self, name: str, staging: HostPool) -> None:
        self.name, self.staging = name, staging
        self.staged = name != "cuda_ipc"
        self.ipc: IpcWriter | None = None  # cuda_ipc: made at the first peer (its chunk size)
        self._agent: Any = None
        if name == "nixl":
            self._agent = nixl.agent("kvtier-sender")
            nixl.register(self._agent, staging.arena)
        elif name == "cuda_ipc" and not torch.cuda.is_available():
            raise ChannelUnavailable("transfer_channel cuda_ipc needs CUDA on the sender")

    def connect(self, welcome: proto.Welcome, registration: bytes) -> Peer:
        peer = Peer(welcome)
        if self.name == "nixl":
            peer.nixl_name = nixl.as_str(self._agent.add_remote_agent(registration))
        elif self.name == "cuda_ipc":  # mapped for this process's GPU: its kernels write into it
            from kvtier.transfer.cudart import map_ipc_buffer

            peer.remote = map_ipc_buffer(registration, welcome.num_blocks * welcome.block_bytes)
            if self.ipc is None:
                self.ipc = IpcWriter(
                    torch.device("cuda", torch.cuda.current_device()), welcome.block_bytes
                )
        return peer

    def views(
        self, peer: Peer, blocks: Sequence[int], nbytes: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """cuda_ipc: the remote blocks as local uint8 tensors to copy into (None for block
        -1: the decoder holds that chunk already)."""
        assert peer.remote is not None
        size = peer.welcome.block_bytes
        return [
            peer.remote[b * size : b * size + n] if b >= 0 else None for b, n in zip(blocks, nbytes)
        ]

    def push(self, peer: Peer, sock: socket.socket, req_id: str, items: Sequence[Placement]) -> Any:
        """Start writing staged blocks into the peer's reserved blocks; `finish` waits for
        them (tcp has sent them when this returns; a NIXL write is under way)."""
        if self.name == "tcp":
            for item in items:
                assert item.staged is not None
                data = item.staged.data[: item.nbytes]
                if data.device.type != "cpu":
                    data = data.cpu()
                proto.send(sock, proto.Write(req_id, item.remote_block), data.numpy().data)
            return None
        if self.name == "nixl":
            try:
                return self._nixl_start(peer, items)
            except nixl.errors() as exc:  # the decoder gone (NIXL_ERR_REMOTE_DISCONNECT), ...
                raise proto.PdPeerError(f"NIXL write failed: {exc}") from exc
        raise ValueError(f"{self.name} writes in place (views), not by push")

    def finish(self, pending: Any, deadline: float) -> None:
        """Wait for a `push` (its staged blocks may be reused after this)."""
        if pending is None:
            return
        agent = self._agent
        try:
            state = agent.check_xfer_state(pending)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise proto.PdPeerError("NIXL write did not complete in time")
                time.sleep(0.0002)
                state = agent.check_xfer_state(pending)
            if state == "ERR":
                raise proto.PdPeerError("NIXL write failed")
        except nixl.errors() as exc:
            raise proto.PdPeerError(f"NIXL write failed: {exc}") from exc
        finally:
            agent.release_xfer_handle(pending)

    def _nixl_start(self, peer: Peer, items: Sequence[Placement]) -> Any:
        agent, w = self._agent, peer.welcome
        local_dev = 0 if self.staging.device.type == "cpu" else self.staging.device.index or 0
        remote_dev = 0 if w.device == "cpu" else int(w.device.split(":")[1])
        src = agent.get_xfer_descs(
            [(it.staged.data.data_ptr(), it.nbytes, local_dev) for it in items],
            nixl.mem_type(self.staging.device.type),
        )
        dst = agent.get_xfer_descs(
            [(w.base_ptr + it.remote_block * w.block_bytes, it.nbytes, remote_dev) for it in items],
            nixl.mem_type(w.device),
        )
        handle = agent.initialize_xfer("WRITE", src, dst, peer.nixl_name)
        if agent.transfer(handle) == "ERR":
            agent.release_xfer_handle(handle)
            raise proto.PdPeerError("NIXL write failed")
        return handle
