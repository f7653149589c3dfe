"""Disaggregated prefill as hooks of the connector's two sides (kvtier/pd/).

On a prefiller (`pd_role: sender`, kv_producer) the scheduler reads the decoder a
proxy named in the request's `kv_transfer_params.disagg_spec` (or the fixed peer
of the config), and each save also pushes its chunks into that decoder's buffer
(`wait_for_save` → PdSender.send). On a decoder (`pd_role: receiver`,
kv_consumer) the engine's CPU tier is the PD buffer, so received chunks are
ordinary hits; once loaded they are freed (`kv_transfer_params.pd_req_id`).
"""

from __future__ import annotations

from typing import Any

from kvtier.config import KvtierConfig
from kvtier.engine import CacheEngine
from kvtier.engine.states import StateLayers
from kvtier.integrations.vllm.spec import TransferSpec
from kvtier.keys import KVFormat
from kvtier.logs import get_logger
from kvtier.pd.buffer import PdBuffer
from kvtier.pd.build import make_buffer, start_receiver
from kvtier.pd.receiver import PdReceiver
from kvtier.pd.sender import PdSender, Target
from kvtier.transfer import PagedKV

log = get_logger(__name__)


def pd_target(params: dict[str, Any] | None) -> Target | None:
    """The decoder a proxy named for this request (LMCache's `disagg_spec`), if any."""
    spec = (params or {}).get("disagg_spec")
    if not isinstance(spec, dict):
        return None
    try:
        init, alloc = spec["receiver_init_port"], spec["receiver_alloc_port"]
        return Target(
            str(spec["receiver_host"]),
            int(init[0] if isinstance(init, list) else init),
            int(alloc[0] if isinstance(alloc, list) else alloc),
            str(spec["req_id"]),
        )
    except (KeyError, TypeError, ValueError, IndexError):
        log.warning(
            "kv_transfer_params.disagg_spec %r is malformed: this request's KV is not sent", spec
        )
        return None


class SchedulerPd:
    """The scheduler's PD state: each request's decoder (sender) or proxy id (receiver),
    until planned."""

    def __init__(self, config: KvtierConfig) -> None:
        self.config = config
        self.sends = config.enable_pd and config.pd_role == "sender"
        self.receives = config.enable_pd and config.pd_role == "receiver"
        self._targets: dict[str, Target] = {}
        self._ids: dict[str, str] = {}

    def looked_up(self, request_id: str, params: dict[str, Any] | None) -> None:
        if self.sends:
            target = pd_target(params) or self._fixed_peer(request_id)
            if target is not None:
                self._targets[request_id] = target
        if self.receives:
            pd_id = str((params or {}).get("pd_req_id", ""))
            if pd_id:
                self._ids[request_id] = pd_id

    def _fixed_peer(self, request_id: str) -> Target | None:
        c = self.config
        if c.pd_peer_host is None or c.pd_peer_init_port is None or c.pd_peer_alloc_port is None:
            return None
        return Target(c.pd_peer_host, c.pd_peer_init_port, c.pd_peer_alloc_port, request_id)

    def target(self, request_id: str) -> Target | None:
        return self._targets.pop(request_id, None) if self.sends else None

    def proxy_id(self, request_id: str) -> str:
        return self._ids.pop(request_id, "")

    def forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self._ids.pop(request_id, None)


class WorkerPd:
    """A worker's PD parts: the buffer it receives into, or the sender it pushes with."""

    def __init__(self, config: KvtierConfig) -> None:
        self.config = config
        self.buffer: PdBuffer | None = None
        self._receiver: PdReceiver | None = None
        self.sender: PdSender | None = None

    def make_engine(
        self, kv: PagedKV, fmt: KVFormat, rank: int, states: StateLayers | None = None
    ) -> CacheEngine:
        """The worker's engine (with a hybrid model's Mamba layers, `states`); a receiver's
        CPU tier is its PD buffer."""
        c = self.config
        if c.enable_pd and c.pd_role == "receiver":
            self.buffer = make_buffer(c, kv, fmt)
            engine = CacheEngine(c, kv, fmt, cpu=self.buffer.tier)
            self._receiver = start_receiver(c, self.buffer, rank)
        else:
            engine = CacheEngine(c, kv, fmt, states=states)
        if c.enable_pd and c.pd_role == "sender":
            self.sender = PdSender(engine, c, rank)
        return engine

    def loaded(self, pd_req_id: str) -> None:
        """Receiver: the request's chunks are in vLLM's pages now; free them in the buffer."""
        if self.buffer is not None and pd_req_id:
            self.buffer.release(pd_req_id)

    def expire(self) -> None:
        if self.buffer is not None:
            self.buffer.expire()

    def send(self, spec: TransferSpec, block_size: int) -> None:
        """Sender: a save also goes to its request's decoder."""
        if self.sender is not None and spec.pd_target is not None:
            self.sender.send(
                spec.pd_target,
                spec.token_ids,
                spec.slots(block_size),
                start=spec.start,
                last=spec.last,
                identity=spec.identity,
            )

    def dropped(self, pd_req_ids: list[str]) -> None:
        """Sender: vLLM freed these requests' pages before their last step."""
        if self.sender is not None:
            for rid in pd_req_ids:
                self.sender.drop(rid)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self.sender is not None:
            self.sender.close()
