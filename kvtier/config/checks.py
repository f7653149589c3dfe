"""What makes a config valid beyond each key's type: ranges, and keys that must agree (PD's
roles and channels, P2P's index and port, the controller's URL). Each failure is a ConfigError
naming the key, its value and what was expected."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvtier.codec import KV_CODECS, SERDES
from kvtier.errors import ConfigError
from kvtier.remote import TOKEN_SCHEMES, check_url
from kvtier.tiers.policy import POLICIES

if TYPE_CHECKING:
    from kvtier.config.model import KvtierConfig

GPU_UPLOADS = ("auto", "kernel", "copy_engine")
ASYNC_LOADINGS = ("busy", "always", "never")
PD_ROLES = ("sender", "receiver")
PD_CHANNELS = ("tcp", "nixl", "cuda_ipc")
P2P_CHANNELS = ("tcp", "nixl")  # peers read CPU RAM: no GPU buffer to write into


def check(cfg: KvtierConfig) -> None:
    _check_ranges(cfg)
    _check_pd(cfg)
    _check_p2p(cfg)
    _check_controller(cfg)


def _check_ranges(cfg: KvtierConfig) -> None:
    if cfg.chunk_size <= 0:
        raise ConfigError("chunk_size", cfg.chunk_size, "a positive number of tokens")
    if cfg.max_local_cpu_size <= 0:
        # The CPU pool is also the staging buffer of every other tier, so it
        # must exist even with local_cpu: false (as in LMCache).
        raise ConfigError("max_local_cpu_size", cfg.max_local_cpu_size, "a size in GB > 0")
    if cfg.remote_url is not None and (expected := check_url(cfg.remote_url)):
        raise ConfigError("remote_url", cfg.remote_url, expected)
    if (
        cfg.remote_auth_token is not None
        # with P2P or the controller it is the fleet's token too (kvtier/fleet/)
        and not (cfg.enable_p2p or cfg.enable_controller)
        and urlsplit(cfg.remote_url or "").scheme not in TOKEN_SCHEMES
    ):
        raise ConfigError(
            "remote_auth_token",
            "<hidden>",
            "a remote_url of a kvtier store server ("
            + ", ".join(f"{s}://" for s in TOKEN_SCHEMES)
            + "); Redis takes its password in the URL",
        )
    if cfg.remote_serde not in (*SERDES, *KV_CODECS):
        raise ConfigError("remote_serde", cfg.remote_serde, " | ".join((*SERDES, *KV_CODECS)))
    if cfg.share_across_tp and cfg.remote_serde in KV_CODECS:
        raise ConfigError(
            "share_across_tp",
            cfg.share_across_tp,
            f"false with the lossy codec {cfg.remote_serde} (its rows carry per-head scales)",
        )
    if cfg.gpu_upload not in GPU_UPLOADS:
        raise ConfigError("gpu_upload", cfg.gpu_upload, " | ".join(GPU_UPLOADS))
    if cfg.async_loading not in ASYNC_LOADINGS:
        raise ConfigError("async_loading", cfg.async_loading, " | ".join(ASYNC_LOADINGS))
    if cfg.blocking_timeout_secs <= 0:
        raise ConfigError("blocking_timeout_secs", cfg.blocking_timeout_secs, "seconds > 0")
    if cfg.local_disk is not None:
        if (
            "://" in cfg.local_disk
            and not cfg.local_disk.startswith("file://")
            or cfg.local_disk in ("", "file://")
        ):
            raise ConfigError(
                "local_disk", cfg.local_disk, "file:///path/to/dir (or a plain directory path)"
            )
        if cfg.max_local_disk_size <= 0:
            raise ConfigError(
                "max_local_disk_size",
                cfg.max_local_disk_size,
                "a size in GiB > 0 (local_disk is set)",
            )
    if cfg.local_disk_min_stores < 1:
        raise ConfigError("local_disk_min_stores", cfg.local_disk_min_stores, "an integer >= 1")
    if cfg.pin_timeout_sec <= 0:
        raise ConfigError("pin_timeout_sec", cfg.pin_timeout_sec, "seconds > 0")
    if cfg.cache_policy.upper() not in POLICIES:
        raise ConfigError("cache_policy", cfg.cache_policy, " | ".join(POLICIES))
    if cfg.lookup_timeout_ms <= 0:
        raise ConfigError("lookup_timeout_ms", cfg.lookup_timeout_ms, "milliseconds > 0")
    if cfg.min_retrieve_tokens < 0:
        raise ConfigError("min_retrieve_tokens", cfg.min_retrieve_tokens, "a number of tokens >= 0")


def _check_p2p(cfg: KvtierConfig) -> None:
    if not cfg.enable_p2p:
        return
    if cfg.p2p_index_url is None or check_url(cfg.p2p_index_url):
        raise ConfigError(
            "p2p_index_url",
            cfg.p2p_index_url,
            "the URL of a store for the P2P index (enable_p2p is true): kvtier:// redis:// ...",
        )
    if cfg.p2p_port is None or not 0 <= cfg.p2p_port < 65536:
        raise ConfigError("p2p_port", cfg.p2p_port, "a port (enable_p2p is true)")
    if not cfg.local_cpu:
        raise ConfigError(
            "local_cpu", cfg.local_cpu, "true when enable_p2p is true: peers read CPU RAM's chunks"
        )
    if cfg.p2p_channel not in P2P_CHANNELS:
        raise ConfigError(
            "transfer_channel",
            cfg.transfer_channel,
            " | ".join(P2P_CHANNELS) + " when enable_p2p is true (peers read CPU RAM)",
        )


def _check_controller(cfg: KvtierConfig) -> None:
    if not cfg.enable_controller:
        return
    if cfg.controller_url is None or urlsplit(cfg.controller_url).scheme not in ("http", "https"):
        raise ConfigError(
            "controller_url",
            cfg.controller_url,
            "http://host:port of `kvtier controller serve` (enable_controller is true)",
        )
    if not 0 <= cfg.controller_worker_port < 65536:
        raise ConfigError("controller_worker_port", cfg.controller_worker_port, "a port, or 0")
    if cfg.controller_heartbeat_s <= 0:
        raise ConfigError("controller_heartbeat_s", cfg.controller_heartbeat_s, "seconds > 0")


def _check_pd(cfg: KvtierConfig) -> None:
    """Disaggregated prefill: the keys must describe one working role."""
    if not cfg.enable_pd:
        return
    if cfg.enable_p2p:
        raise ConfigError(
            "enable_p2p",
            cfg.enable_p2p,
            "false when enable_pd is true (PD and P2P exclude each other)",
        )
    if cfg.remote_serde in KV_CODECS:
        raise ConfigError(
            "remote_serde",
            cfg.remote_serde,
            "a lossless codec (naive | lz4) when enable_pd is true: PD moves the KV as computed",
        )
    if cfg.pd_role not in PD_ROLES:
        raise ConfigError("pd_role", cfg.pd_role, "sender or receiver (enable_pd is true)")
    if cfg.transfer_channel is not None and cfg.transfer_channel not in PD_CHANNELS:
        raise ConfigError("transfer_channel", cfg.transfer_channel, " | ".join(PD_CHANNELS))
    if cfg.pd_buffer_device not in ("cpu", "cuda"):
        raise ConfigError("pd_buffer_device", cfg.pd_buffer_device, "cpu or cuda")
    if cfg.pd_allocation_timeout_sec <= 0:
        raise ConfigError(
            "pd_allocation_timeout_sec",
            cfg.pd_allocation_timeout_sec,
            "seconds > 0 (kvtier keeps a bound: a sender never waits forever)",
        )
    peer = (cfg.pd_peer_host, cfg.pd_peer_init_port, cfg.pd_peer_alloc_port)
    if cfg.pd_role == "receiver":
        if cfg.pd_buffer_size <= 0:
            raise ConfigError(
                "pd_buffer_size",
                cfg.pd_buffer_size,
                "the receiver's buffer size in bytes > 0 (pd_role is receiver)",
            )
        if None in peer:
            raise ConfigError(
                "pd_peer_host/pd_peer_init_port/pd_peer_alloc_port",
                peer,
                "the host and the two ports the receiver listens on",
            )
        if cfg.pd_channel == "cuda_ipc" and cfg.pd_buffer_device != "cuda":
            raise ConfigError(
                "pd_buffer_device",
                cfg.pd_buffer_device,
                "cuda: transfer_channel cuda_ipc writes into GPU memory",
            )
    else:
        if any(peer) and None in peer:
            raise ConfigError(
                "pd_peer_host/pd_peer_init_port/pd_peer_alloc_port",
                peer,
                "all three (a fixed decoder) or none (the proxy names the decoder)",
            )
        proxy = (cfg.pd_proxy_host, cfg.pd_proxy_port)
        if None in peer and None in proxy:
            raise ConfigError(
                "pd_proxy_host/pd_proxy_port",
                proxy,
                "the proxy to tell, or pd_peer_host and its ports: a sender needs a peer",
            )
