"""The config object: every key declared once, with its type, default and a one-line meaning,
then what makes a config valid beyond each key's type (ranges, and keys that must agree: PD's
roles and channels, P2P's index and port, the controller's URL), each failure a ConfigError
naming the key, its value and what was expected. kvtier/config/load.py derives the parsing from
the fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from kvtier.codec import KV_CODECS, SERDES
from kvtier.errors import ConfigError
from kvtier.remote import TOKEN_SCHEMES, check_url
from kvtier.tiers.policy import POLICIES


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True)
class KvtierConfig:
    """All of kvtier's settings. Field names are LMCache's config keys."""

    chunk_size: int = _doc(
        "tokens per KV chunk (a hybrid model in vLLM: within its smallest sliding window, "
        "a divisor of its Mamba block size; logged where changed)",
        default=256,
    )
    local_cpu: bool = _doc(
        "keep KV chunks in the CPU RAM tier (false: the pool is only the staging area of the "
        "disk and remote tiers)",
        default=True,
    )
    max_local_cpu_size: float = _doc(
        "CPU RAM pool size, GiB (allocated once at start, page-locked where CUDA is present)",
        default=5.0,
    )
    local_cpu_use_hugepages: bool = _doc(
        "back the CPU pool with 2 MiB huge pages (fails at start, naming the sysctl to run, "
        "when too few are reserved)",
        default=False,
    )
    save_unfull_chunk: bool = _doc(
        "also store the partial last chunk of a prompt (a tail); a later prompt that "
        "continues it, a conversation's next turn, loads it (LMCache's default is false: "
        "its longer prompts never find one)",
        default=True,
    )
    use_layerwise: bool = _doc(
        "load KV layer by layer, overlapped with compute (the transformers integration "
        "stores so too; inside vLLM a step's store follows its forward)",
        default=False,
    )
    local_disk: str | None = _doc(
        "directory of the disk tier: file:///path (or a plain path)", default=None
    )
    max_local_disk_size: float = _doc("disk tier size, GiB (needed with local_disk)", default=0.0)
    local_disk_min_stores: int = _doc(
        "write a chunk to disk once it has been stored this many times (spares SSD wear, as "
        "Dynamo's KVBM does)",
        default=1,
    )
    pin_timeout_sec: int = _doc(
        "longest a looked-up hit stays protected (pinned) waiting for its load, s", default=300
    )
    remote_url: str | None = _doc(
        "remote store: kvtier:// infinistore:// redis:// rediss:// redis-cluster:// fs:// "
        "mooncakestore://",
        default=None,
    )
    remote_auth_token: str | None = _doc(
        "token for a kvtier store server that wants one (or ?token_env=VAR in remote_url)",
        default=None,
        repr=False,
    )
    remote_serde: str = _doc(
        "chunk codec: naive | lz4 (lossless, remote only) | int8 | fp8 | int4 (lossy, on the GPU, "
        "every tier)",
        default="naive",
    )
    blocking_timeout_secs: float = _doc("longest wait on a tier before a miss, s", default=10.0)
    gpu_upload: str = _doc(
        "what copies loads from CPU RAM into GPU memory: kernel (the GPU's SMs read the pinned "
        "pool; vLLM's own small copies never wait behind a load) | copy_engine (DMA, a few % "
        "faster; its queue holds vLLM's next-step inputs until the whole load has crossed) | "
        "auto (kernel for layerwise loads, whose overlap needs vLLM's inputs through; copy "
        "engine for whole ones)",
        default="auto",
    )
    gpu_store_piece_mb: int = _doc(
        "stores' copies from GPU memory to CPU RAM go one piece of this many MiB at a time, "
        "each queued once the last has landed, so vLLM's copy of a step's sampled tokens, "
        "which its engine waits for, waits for at most one piece (the copy engine serves one "
        "stream's queue until it is empty); 0: a store's copies all queued at once (~20 % "
        "faster; vLLM's copy waits for the whole store)",
        default=32,
    )
    async_loading: str = _doc(
        "when a hit all in CPU RAM loads inside vLLM: busy (in the step that needs it while no "
        "other request runs, or when small: in_step_load_tokens; else in the background, the "
        "request joining a later step, so running requests' steps do not wait for its "
        "copies) | always (in the background) | "
        "never (in the step); hits below CPU RAM always load in the background",
        default="busy",
    )
    in_step_load_tokens: int = _doc(
        "async_loading busy: while other requests run, a CPU-RAM hit still loads in its own "
        "step if at most this many of its prompt's tokens are not in vLLM's cache, until the "
        "step's such loads reach this many tokens; larger hits load beside the steps (a "
        "chat turn's evicted tail joins its step, not one or two later; a burst of long "
        "prompts does not stall the running requests' steps behind its copies); 0: none",
        default=4096,
    )
    share_across_tp: bool = _doc(
        "also read chunks that instances of another tensor-parallel size (1, 2, 4, 8) stored "
        "(disk and remote tiers), cut or joined to this rank's KV heads (MLA: the one latent); "
        "a miss then asks the tiers for each other size too; not with a lossy codec",
        default=False,
    )
    enable_pd: bool = _doc(
        "disaggregated prefill: this instance sends (prefiller) or receives (decoder) KV",
        default=False,
    )
    pd_role: str | None = _doc(
        "sender (vLLM kv_producer) | receiver (vLLM kv_consumer)", default=None
    )
    transfer_channel: str | None = _doc(
        "PD transfer channel: tcp | nixl | cuda_ipc (unset: tcp); with enable_p2p, how peers "
        "on other hosts read this instance's CPU RAM: tcp (bytes) | nixl (NIXL READs)",
        default=None,
    )
    pd_buffer_size: int = _doc("receiver: bytes of the buffer the sender writes KV into", default=0)
    pd_buffer_device: str = _doc("receiver: where the PD buffer lives, cpu | cuda", default="cpu")
    pd_peer_host: str | None = _doc(
        "receiver: host it listens on; sender: a fixed decoder (else the proxy names one per "
        "request)",
        default=None,
    )
    pd_peer_init_port: int | None = _doc(
        "decoder's handshake port (TP rank r listens on port + r)", default=None
    )
    pd_peer_alloc_port: int | None = _doc(
        "decoder's allocation port (TP rank r listens on port + r)", default=None
    )
    pd_proxy_host: str | None = _doc(
        "sender: host of the proxy told when a prefill's KV has arrived", default=None
    )
    pd_proxy_port: int | None = _doc(
        "sender: that proxy's notification port (kvtier proxy --proxy-port)", default=None
    )
    pd_allocation_timeout_sec: float = _doc(
        "sender: longest wait for room in the decoder's buffer before the decoder recomputes, s "
        "(LMCache waits forever)",
        default=10.0,
    )
    cache_policy: str = _doc(
        "eviction order of the CPU and disk tiers: LRU | FIFO | MRU | LFU", default="LRU"
    )
    lookup_timeout_ms: int = _doc(
        "longest the vLLM scheduler waits for a worker's lookup, ms (then a miss)", default=3000
    )
    min_retrieve_tokens: int = _doc(
        "a hit shorter than this many tokens is treated as a miss", default=0
    )
    save_decode_cache: bool = _doc(
        "also store the KV of generated tokens (whole chunks, as decoding goes)", default=False
    )
    enable_kv_events: bool = _doc(
        "publish what the CPU tier stores and evicts as vLLM KV events (BlockStored, "
        "BlockRemoved, medium CPU, with the LoRA adapter; start vLLM with --kv-events-config)",
        default=False,
    )
    enable_p2p: bool = _doc(
        "peer-to-peer sharing: a local miss is fetched from the instance that holds the chunk "
        "in CPU RAM (found in p2p_index_url), and this instance serves its own",
        default=False,
    )
    p2p_host: str = _doc(
        "P2P: the address this instance serves its chunks on (peers connect to it)",
        default="127.0.0.1",
    )
    p2p_port: int | None = _doc(
        "P2P: the port it serves them on (TP rank r listens on port + r); 0: any free port",
        default=None,
    )
    p2p_shared_memory: bool = _doc(
        "P2P: a peer on this host is lent chunks in place (it maps this instance's CPU pool, "
        "a memfd, and copies them out) and lends its own; false: every peer is read as one on "
        "another host (transfer_channel)",
        default=True,
    )
    p2p_index_url: str | None = _doc(
        "P2P: the store that indexes which instance holds which chunk (kvtier:// redis:// ...); "
        "only addresses are written there",
        default=None,
    )
    enable_controller: bool = _doc(
        "answer `kvtier controller`: each rank serves a small API and registers it at "
        "controller_url",
        default=False,
    )
    controller_url: str | None = _doc(
        "the controller ranks register with (http://host:port of `kvtier controller serve`)",
        default=None,
    )
    instance_id: str | None = _doc(
        "this instance's name in the fleet (default: host-pid of the process above its ranks)",
        default=None,
    )
    controller_worker_host: str = _doc(
        "the address each rank's controller API listens on", default="127.0.0.1"
    )
    controller_worker_port: int = _doc(
        "rank 0's controller API port (rank r: + r); 0: any free port", default=0
    )
    controller_heartbeat_s: float = _doc(
        "s between a rank's registrations with the controller", default=5.0
    )
    extra_config: Mapping[str, Any] = _doc(
        "free-form settings for extensions", default_factory=dict
    )

    def __post_init__(self) -> None:
        _check(self)

    @property
    def pd_channel(self) -> str:
        return self.transfer_channel or "tcp"

    @property
    def p2p_channel(self) -> str:
        return self.transfer_channel or "tcp"

    @property
    def cpu_pool_bytes(self) -> int:
        return int(self.max_local_cpu_size * 1024**3)

    @property
    def disk_path(self) -> Path | None:
        """The disk tier's directory (`local_disk` without its file:// scheme)."""
        if self.local_disk is None:
            return None
        return Path(unquote(self.local_disk.removeprefix("file://")))

    @property
    def disk_bytes(self) -> int:
        return int(self.max_local_disk_size * 1024**3)


FIELDS = {f.name: f for f in dataclasses.fields(KvtierConfig)}


def describe_keys() -> list[tuple[str, str, str]]:
    """(key, default, meaning) rows, for the README and `kvtier config`."""
    rows = []
    for f in FIELDS.values():
        default = f.default if f.default is not dataclasses.MISSING else {}
        rows.append((f.name, repr(default), f.metadata["doc"]))
    return rows


GPU_UPLOADS = ("auto", "kernel", "copy_engine")
ASYNC_LOADINGS = ("busy", "always", "never")
PD_ROLES = ("sender", "receiver")
PD_CHANNELS = ("tcp", "nixl", "cuda_ipc")
P2P_CHANNELS = ("tcp", "nixl")  # peers read CPU RAM: no GPU buffer to write into


def _check(cfg: KvtierConfig) -> None:
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
    if cfg.gpu_store_piece_mb < 0:
        raise ConfigError("gpu_store_piece_mb", cfg.gpu_store_piece_mb, "MiB >= 0")
    if cfg.async_loading not in ASYNC_LOADINGS:
        raise ConfigError("async_loading", cfg.async_loading, " | ".join(ASYNC_LOADINGS))
    if cfg.in_step_load_tokens < 0:
        raise ConfigError("in_step_load_tokens", cfg.in_step_load_tokens, "tokens >= 0")
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
