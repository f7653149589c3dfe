"""The decoder's receiving pieces, built from the config: its buffer and its ports."""

from __future__ import annotations

from kvtier.config import KvtierConfig
from kvtier.keys import KVFormat
from kvtier.pd.buffer import PdBuffer
from kvtier.pd.channels import ReceiverChannel
from kvtier.pd.receiver import PdReceiver
from kvtier.transfer import PagedKV


def make_buffer(config: KvtierConfig, kv: PagedKV, fmt: KVFormat) -> PdBuffer:
    """The decoder's receive buffer: `pd_buffer_size` bytes, on the KV cache's GPU with
    `pd_buffer_device: cuda`."""
    device = "cpu"
    if config.pd_buffer_device == "cuda":
        device = str(kv.device) if kv.device.type == "cuda" else "cuda"
    return PdBuffer(
        config.pd_buffer_size,
        config.chunk_size * kv.bytes_per_token(),
        device,
        fmt,
        kv.bytes_per_token(),
        ttl=float(config.pin_timeout_sec),
    )


def start_receiver(config: KvtierConfig, buffer: PdBuffer, tp_rank: int) -> PdReceiver:
    assert config.pd_peer_host is not None and config.pd_peer_init_port is not None
    assert config.pd_peer_alloc_port is not None
    channel = ReceiverChannel(config.pd_channel, buffer.pool)
    return PdReceiver(
        buffer,
        channel,
        config.pd_peer_host,
        config.pd_peer_init_port + tp_rank,
        config.pd_peer_alloc_port + tp_rank,
        config.chunk_size,
    )
