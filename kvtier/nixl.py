"""NIXL agents as kvtier uses them: disaggregated prefill's nixl channel (kvtier/pd/channels.py)
and P2P sharing's reads from a peer's CPU pool (kvtier/fleet/peer_reads.py).

    agent(role)              an agent with the UCX backend and no progress thread of its own
    register(agent, arena)   a pool's memory, registered for transfers
    Progress(agent)          drives a target agent's worker while transfers are expected
    errors()                 NIXL's exception classes (they share no base but Exception)

NIXL's own progress thread polls UCX without a pause: an idle agent burnt a whole core (on a
2-core host, a vLLM starting beside one took minutes longer). So an agent that starts transfers
drives its worker while it waits for them, and a target's is driven by `Progress` only while
a transfer may come (UCX over TCP needs the target to progress).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Any

import torch

from kvtier.errors import KvtierError
from kvtier.logs import get_logger

log = get_logger(__name__)


class NixlUnavailable(KvtierError):
    """The NIXL package is not installed here."""


def agent(role: str) -> Any:
    _ucx_skip_ib_without_rdma()
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise NixlUnavailable(
            "transfer_channel nixl needs the NIXL package: pip install nixl (after torch; "
            f"on a machine without GPU, UCX_TLS=tcp,self,sm) — {exc}"
        ) from None
    name = f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def register(agent: Any, arena: torch.Tensor) -> None:
    dev = 0 if arena.device.type == "cpu" else arena.device.index or 0
    descs = agent.get_reg_descs(
        [(arena.data_ptr(), arena.numel(), dev, "")], mem_type(arena.device.type)
    )
    agent.register_memory(descs)


def errors() -> tuple[type[Exception], ...]:
    """NIXL's exceptions (nixlRemoteDisconnectError, nixlBackendError, ...; they share no base
    class but Exception): a transfer that meets one fails that transfer, not vLLM's step."""
    import nixl._bindings as bindings

    return tuple(
        v for k, v in vars(bindings).items() if k.startswith("nixl") and k.endswith("Error")
    )


def mem_type(device: str) -> str:
    return "DRAM" if device.startswith("cpu") else "VRAM"


def as_str(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class Progress:
    """Drives a target agent's UCX worker while transfers are expected (`hold` .. `release`,
    nested); idle, it waits on a condition and costs nothing."""

    PAUSE_S = 0.0001  # between progress calls: lets the GIL go to the process's other threads

    def __init__(self, agent: Any) -> None:
        self._agent, self._open, self._closed = agent, 0, False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvtier-nixl-progress")
        self._thread.start()

    def hold(self) -> None:
        with self._cond:
            self._open += 1
            self._cond.notify()

    def release(self) -> None:
        with self._cond:
            self._open = max(0, self._open - 1)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._open > 0 or self._closed)
                if self._closed:
                    return
            self._agent.get_new_notifs()  # with no progress thread, this progresses the UCX worker
            time.sleep(self.PAUSE_S)


def _ucx_skip_ib_without_rdma() -> None:
    """UCX_MODULES=^ib on a host without an RDMA device, unless the user set UCX_MODULES.

    With Debian's libibverbs1 installed (Mooncake's wheel needs it) and no RDMA
    device, UCX's ib module pulls in the libnl that the nixl wheel bundles, and
    the process dies with SIGSEGV at exit (tests/test_pd.py::test_nixl_agent_exits_cleanly).
    With no device there is nothing for that module to drive; where one
    exists, UCX's IB transport is left as it is."""
    if "UCX_MODULES" in os.environ or _rdma_devices():
        return
    os.environ["UCX_MODULES"] = "^ib"
    log.info(
        "no RDMA device here: UCX_MODULES=^ib for NIXL "
        "(UCX's ib module would crash the process at exit)"
    )


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []
