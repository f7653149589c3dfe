"""An engine's parts, built from its config: codec, pool, tiers, transfer, holds.

The store server's pool, when it lends chunks on this host, is registered with
CUDA here, so that a GPU copies lent chunks out of it by DMA.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier.codec import HEADER, KV_CODECS, Codec
from kvtier.config import KvtierConfig
from kvtier.engine.events import EventLog
from kvtier.engine.mover import Mover
from kvtier.engine.records import EngineStats
from kvtier.errors import ConfigError, KvtierError
from kvtier.fleet.holders import Holders
from kvtier.fleet.peer_reads import NixlLender, NixlReader
from kvtier.fleet.peers import PeerServer
from kvtier.keys import KVFormat, SpanMemo
from kvtier.logs import get_logger
from kvtier.memory import HostPool
from kvtier.remote import LendingStore, RegisteringStore, open_store
from kvtier.tiers.base import ChunkSource
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.holds import Holds
from kvtier.tiers.peer import PeerSource
from kvtier.tiers.registry import TierContext, registered_tiers
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.reshard import DiskFiles, HeadGeometry, ReshardedSource, share_sizes
from kvtier.tiers.store import TieredStore
from kvtier.transfer import PagedKV, Quant
from kvtier.transfer.factory import make_transfer

log = get_logger(__name__)


@dataclass
class Parts:
    quant: Quant | None  # a lossy codec (remote_serde int8 | fp8 | int4)
    fmt: KVFormat  # what a chunk's key names: the KV's format (and the lossy codec)
    spans: SpanMemo
    mover: Mover
    tiers: TieredStore
    holds: Holds
    events: EventLog
    stats: EngineStats
    peers: PeerSource | None  # P2P sharing (enable_p2p), also among tiers.sources


def build(
    config: KvtierConfig, kv: PagedKV, fmt: KVFormat, transfer: str, cpu: CpuTier | None
) -> Parts:
    """`cpu`: a CPU tier to use instead of a new pool of `max_local_cpu_size` (a PD
    receiver's buffer: the chunks senders commit there are this engine's hits)."""
    # A lossy codec decides the bytes of every chunk, in every tier: the key names it,
    # so its chunks and lossless ones never meet.
    quant = (
        Quant(config.remote_serde, kv.heads, kv.head_size)
        if config.remote_serde in KV_CODECS
        else None
    )
    fmt = fmt if quant is None else dataclasses.replace(fmt, dtype=f"{fmt.dtype}+{quant.name}")
    moves = make_transfer(
        kv, transfer, quant, upload=config.gpu_upload, store_piece=config.gpu_store_piece_mb << 20
    )
    mover = Mover(kv, moves, quant)
    shared_tier = cpu is not None
    if cpu is None:
        cpu = CpuTier(
            HostPool(
                config.cpu_pool_bytes,
                config.chunk_size * mover.bytes_per_token,
                hugepages=config.local_cpu_use_hugepages,
                shared=config.enable_p2p and config.p2p_shared_memory,  # peers on this host map it
            ),
            config.cache_policy,
        )
    # Registered tiers first: a factory's error then leaves no disk lock or connection open.
    registered = registered_tiers(TierContext(config, fmt, mover.bytes_per_token))
    remote = _remote_tier(config, kv, quant)
    if remote is not None:
        remote.digests_on_device = mover.digests
        if isinstance(remote.store, RegisteringStore) and cpu.pool.device.type == "cpu":
            remote.store.register_memory(cpu.pool.arena.data_ptr(), cpu.pool.capacity)
    disk = _disk_tier(config, mover.bytes_per_token, fmt)
    readers: list[ChunkSource] = []
    if config.share_across_tp:
        readers += _other_tp_sizes(config, kv, fmt, disk, remote)
    peers = _peers(config, cpu, fmt, mover.bytes_per_token)
    if peers is not None:
        readers.append(peers)
    lower = [t for t in (disk, *registered, remote) if t is not None]
    tiers = TieredStore(
        cpu,
        keep_cpu=config.local_cpu or shared_tier,
        bytes_per_token=mover.bytes_per_token,
        lower=lower,
        wait_s=config.blocking_timeout_secs,
        readers=readers,
    )
    return Parts(
        quant,
        fmt,
        SpanMemo(fmt, config.chunk_size, config.save_unfull_chunk),
        mover,
        tiers,
        Holds(tiers, config.pin_timeout_sec),
        EventLog(tiers, config.enable_kv_events),
        EngineStats(),
        peers,
    )


def _peers(
    config: KvtierConfig, cpu: CpuTier, fmt: KVFormat, bytes_per_token: int
) -> PeerSource | None:
    """P2P sharing: this rank's chunks served to peers, and the index told of them (as the CPU
    tier stores and evicts); other instances' chunks found through it."""
    if not config.enable_p2p:
        return None
    assert config.p2p_index_url is not None and config.p2p_port is not None  # _check_p2p
    port = config.p2p_port + fmt.tp_rank if config.p2p_port else 0
    token = config.remote_auth_token
    timeout = config.blocking_timeout_secs
    codec = Codec("naive")
    nixl = config.p2p_channel == "nixl"  # peers on other hosts read this pool, and it theirs
    lender = NixlLender(cpu.pool) if nixl else None
    server = PeerServer(
        cpu, fmt, codec, bytes_per_token, config.p2p_host, port, token, timeout, lender
    )
    try:
        reader = NixlReader(cpu.pool, timeout) if nixl else None
        store = open_store(config.p2p_index_url, timeout, token, config.extra_config)
    except BaseException:
        server.close()
        raise
    holders = Holders(store, config.p2p_index_url, server.address)
    cpu.on_stored.append(holders.announce)
    cpu.on_removed.append(holders.withdraw)
    shared = config.p2p_shared_memory
    return PeerSource(holders, server, codec, timeout, token, shared, reader)


def _disk_tier(config: KvtierConfig, bytes_per_token: int, fmt: KVFormat) -> DiskTier | None:
    root = config.disk_path
    if root is None:
        return None
    chunk_file = HEADER.size + config.chunk_size * bytes_per_token
    if config.disk_bytes < chunk_file:
        raise ConfigError(
            "max_local_disk_size",
            config.max_local_disk_size,
            f"room for at least one chunk file ({chunk_file / 1e6:.2f} MB)",
        )
    return DiskTier(
        _rank_dir(root, fmt.tp_rank, fmt.tp_size),
        config.disk_bytes,
        Codec("naive"),
        config.cache_policy,
        min_stores=config.local_disk_min_stores,
    )


def _rank_dir(root: Path, rank: int, size: int) -> Path:
    return root / f"tp{rank}of{size}" if size > 1 else root  # one directory (and one lock) per rank


def _other_tp_sizes(
    config: KvtierConfig,
    kv: PagedKV,
    fmt: KVFormat,
    disk: DiskTier | None,
    remote: RemoteTier | None,
) -> list[ReshardedSource]:
    """share_across_tp: per other tensor-parallel size, the chunks its ranks left in the remote
    store and in their disk directories, as this rank's (kvtier/tiers/reshard.py)."""
    # one latent per token (no K and V): MLA
    geo = HeadGeometry(
        kv.num_layers, kv.kv, kv.heads, kv.head_size * kv.dtype.itemsize, mla=kv.kv == 1
    )
    root, sizes = config.disk_path, share_sizes(fmt, geo)
    out: list[ReshardedSource] = []
    for size in sizes:
        if remote is not None:  # one store: every size's keys are in it
            out.append(ReshardedSource(fmt, size, geo, lambda rank: remote, f"remote-tp{size}"))
        # each rank of that size: its directory under the root
        if disk is not None and root is not None:

            def rank_files(rank: int, size: int = size) -> DiskFiles:
                return DiskFiles(_rank_dir(root, rank, size), Codec("naive"))

            out.append(ReshardedSource(fmt, size, geo, rank_files, f"disk-tp{size}"))
    log.info("share_across_tp: also reading chunks of tensor-parallel sizes %s", sizes)
    return out


def _remote_tier(config: KvtierConfig, kv: PagedKV, quant: Quant | None) -> RemoteTier | None:
    if config.remote_url is None:
        return None
    # Quantized chunks (kvtier/transfer/quant.py) are stored as their bytes are.
    codec = (
        Codec("naive")
        if quant is not None
        else Codec(config.remote_serde, itemsize=kv.dtype.itemsize)
    )
    log.info("remote tier: %s (serde %s)", config.remote_url, config.remote_serde)
    store = open_store(
        config.remote_url,
        config.blocking_timeout_secs,
        config.remote_auth_token,
        config.extra_config,
    )
    if kv.device.type == "cuda" and isinstance(store, LendingStore):
        # The server's pool, mapped here, is what the GPU copies lent chunks from:
        # page-locked, the copy is a DMA; unregistered it could not be lent.
        store.on_map = _register_pool
        store.on_unmap = functools.partial(_unregister_pool, device=kv.device)
    if isinstance(store, LendingStore):
        # Its pool is mapped (and registered with CUDA) at the first connection: seconds for a
        # pool of tens of GB, which the first requests waited for (2026-11-27, two vLLM
        # instances sharing a server: p99 TTFT 3.0 s against a median of 0.26 s). Now at start,
        # on this thread: vLLM registers its KV caches before it captures CUDA graphs, and a
        # cudaHostRegister from another thread during a capture would be refused.
        _connect_early(store, config.remote_url)
    return RemoteTier(store, codec, config.remote_url)


def _connect_early(store: LendingStore, url: str) -> None:
    t0 = time.perf_counter()
    try:
        store.server_info()
    except KvtierError as e:  # down now: the tier reconnects at its first use
        log.warning("remote tier %s: not reachable at start (%s)", url, e)
        return
    log.info("remote tier %s: connected at start in %.2f s", url, time.perf_counter() - t0)


def _pool_address(mapping) -> int:
    view = np.frombuffer(mapping, np.uint8)
    try:
        return view.ctypes.data
    finally:
        del view


def _register_pool(mapping) -> bool:
    from kvtier.transfer import cudart

    t0 = time.perf_counter()
    try:
        cudart.host_register(_pool_address(mapping), len(mapping))
    except RuntimeError as e:  # locked-memory limits, permissions, an old driver
        log.warning(
            "store server pool not registered with CUDA (%s): its chunks are copied through the "
            "CPU pool instead",
            e,
        )
        return False
    log.info(
        "store server pool (%.2f GB) registered with CUDA in %.2f s: chunks go from it to the "
        "GPU by DMA",
        len(mapping) / 1e9,
        time.perf_counter() - t0,
    )
    return True


def _unregister_pool(mapping, device: torch.device) -> None:
    """Before the pool's mapping goes (its connection closed, maybe under a load
    on another thread): no copy out of it may still be in flight on the GPU."""
    from kvtier.transfer import cudart

    torch.cuda.synchronize(device)
    try:
        cudart.host_unregister(_pool_address(mapping))
    except RuntimeError as e:
        log.warning("store server pool: cudaHostUnregister failed (%s)", e)
