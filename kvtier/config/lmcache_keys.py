"""Every config key of LMCache 0.5.6, and what kvtier does with it.

An LMCache user brings their YAML and their LMCACHE_* environment. Each of
LMCache's 108 keys (its `_CONFIG_DEFINITIONS`) and its deprecated aliases
falls into exactly one class:

    built     a kvtier config field with the same meaning (config.py)
    mapped    an alias, or an effect kvtier reaches another way: one info line
    ignored   accepted with no effect (LMCache-internal, or not built and
              harmless to ignore): one warning naming the key and why
    refused   ignoring a non-default value would change results, safety, or
              which tiers hold the KV: a ConfigError saying kvtier does not do
              it yet (LMCache's default value is accepted silently)

`kvtier config --keys --lmcache` prints this table (the README carries it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.logs import get_logger

log = get_logger(__name__)

LMCACHE_VERSION = "0.5.6"
TRUE_TEXTS = frozenset({"1", "true", "yes", "on"})  # a boolean's true, as config text
CLASSES = ("built", "mapped", "ignored", "refused")


@dataclass(frozen=True)
class KeyRule:
    kind: str  # one of CLASSES
    default: Any  # LMCache's default
    note: str = ""
    target: str | None = None  # mapped: the kvtier key it sets
    # mapped: the target's value for each of this key's (lowercase text); others set nothing
    values: dict[str, Any] | None = None


def _b(default: Any, note: str = "") -> KeyRule:
    return KeyRule("built", default, note)


def _m(
    default: Any, note: str, target: str | None = None, values: dict[str, Any] | None = None
) -> KeyRule:
    return KeyRule("mapped", default, note, target, values)


def _i(default: Any, note: str) -> KeyRule:
    return KeyRule("ignored", default, note)


def _r(default: Any, note: str) -> KeyRule:
    return KeyRule("refused", default, note)


_TIER = "a storage backend kvtier does not have"
_INTERNAL = "an LMCache-internal setting; kvtier has no such mechanism"
_CONTROLLER = (
    "kvtier's ranks register over HTTP with controller_url (controller_worker_port: their API)"
)
_API = "LMCache's internal API server is not built in kvtier"
_BLEND = "used only with enable_blending, which kvtier does not do"
_P2P_PORTS = (
    "kvtier's instance serves peers on p2p_port (TP rank r: + r) and finds them through "
    "p2p_index_url"
)
_STATS = "LMCache's chunk statistics are not built in kvtier"
_LAZY = "kvtier allocates its CPU pool whole at start (max_local_cpu_size)"
_HIDDEN = "used only with enable_hidden_state_cache, which kvtier does not do"

RULES: dict[str, KeyRule] = {
    # -- the same meaning in kvtier ------------------------------------------------------
    "chunk_size": _b(256),
    "local_cpu": _b(True),
    "max_local_cpu_size": _b(5.0, "GiB, as LMCache allocates"),
    "local_cpu_use_hugepages": _b(False),
    "local_disk": _b(None),
    "max_local_disk_size": _b(0.0),
    "remote_url": _b(
        None, "kvtier:// infinistore:// redis:// rediss:// redis-cluster:// fs:// mooncakestore://"
    ),
    "remote_serde": _b(
        "naive", "naive or lz4; int8, fp8 or int4: a lossy codec on the GPU (not CacheGen's)"
    ),
    "use_layerwise": _b(False),
    "save_unfull_chunk": _b(
        False, "LMCache's default; kvtier's is true: a longer prompt finds the tail"
    ),
    "blocking_timeout_secs": _b(10),
    "extra_config": _b(None),
    "pin_timeout_sec": _b(300),
    "cache_policy": _b("LRU", "LRU, FIFO, MRU or LFU, for the CPU and disk tiers"),
    "lookup_timeout_ms": _b(3000, "the scheduler's wait for a worker's lookup"),
    "min_retrieve_tokens": _b(0, "a shorter hit is treated as a miss"),
    "save_decode_cache": _b(False, "the KV of generated tokens is stored too, in whole chunks"),
    "enable_kv_events": _b(False, "the CPU tier's stores and evictions, published by vLLM"),
    "enable_pd": _b(False),
    "pd_role": _b(None),
    "pd_buffer_size": _b(None),
    "pd_buffer_device": _b(None),
    "pd_peer_host": _b(None),
    "pd_peer_init_port": _b(None),
    "pd_peer_alloc_port": _b(None),
    "pd_proxy_host": _b(None),
    "pd_proxy_port": _b(None),
    "pd_allocation_timeout_sec": _b(
        float("inf"), "LMCache waits forever; kvtier keeps a bound (default 10 s)"
    ),
    "transfer_channel": _b(None, "tcp, nixl or cuda_ipc"),
    # -- reached another way -------------------------------------------------------------
    "local_disk_path_sharding": _m(
        "by_gpu", "kvtier gives each TP rank its own tp<r>of<n> directory"
    ),
    "enable_async_loading": _m(
        False,
        "true: every hit loads in the background (async_loading: always); kvtier "
        "loads hits below CPU RAM so anyway, and CPU-RAM hits larger than "
        "in_step_load_tokens so while other requests run (async_loading: busy, its default)",
        "async_loading",
        dict.fromkeys(TRUE_TEXTS, "always"),
    ),
    "pin_check_interval_sec": _m(30, "kvtier checks pin_timeout_sec at every lookup and step"),
    "pd_backend_mode": _m("async", "kvtier's sender sends after each prefill step"),
    "pd_skip_proxy_notification": _m(
        False, "leave pd_proxy_host unset and the sender tells no proxy"
    ),
    "nixl_buffer_device": _m(None, "deprecated NIXL name", "pd_buffer_device"),
    "enable_xpyd": _m(False, "deprecated alias", "enable_pd"),
    "nixl_peer_host": _m(None, "deprecated alias", "pd_peer_host"),
    "nixl_peer_init_port": _m(None, "deprecated alias", "pd_peer_init_port"),
    "nixl_peer_alloc_port": _m(None, "deprecated alias", "pd_peer_alloc_port"),
    "nixl_proxy_host": _m(None, "deprecated alias", "pd_proxy_host"),
    "nixl_proxy_port": _m(None, "deprecated alias", "pd_proxy_port"),
    "nixl_buffer_size": _m(None, "deprecated alias", "pd_buffer_size"),
    "nixl_role": _m(None, "deprecated alias", "pd_role"),
    # -- accepted with no effect ---------------------------------------------------------
    "reserve_local_cpu_size": _i(0.0, "kvtier's CPU pool is exactly max_local_cpu_size"),
    "pre_caching_hash_algorithm": _i(
        "builtin", "kvtier's chunk keys are always a seeded xxh3-128 chain"
    ),
    "numa_mode": _i(None, "kvtier does not bind its pool to NUMA nodes"),
    "py_enable_gc": _i(True, _INTERNAL),
    "use_gpu_connector_v3": _i(False, "kvtier has one GPU transfer path (Triton)"),
    "mp_host": _i(None, "LMCache's multiprocess mode is not built in kvtier"),
    "mp_port": _i(5555, "LMCache's multiprocess mode is not built in kvtier"),
    "retrieve_locations": _i(None, "kvtier looks in every configured tier"),
    "store_location": _i(None, "kvtier stores to every configured tier"),
    "blend_recompute_ratios": _i(None, _BLEND),
    "blend_thresholds": _i(None, _BLEND),
    "blend_check_layers": _i(None, _BLEND),
    "blend_min_tokens": _i(256, _BLEND),
    "blend_special_str": _i(" # # ", _BLEND),
    "p2p_init_ports": _i(None, _P2P_PORTS),
    "p2p_lookup_ports": _i(None, _P2P_PORTS),
    "lmcache_instance_id": _m(None, "the instance's name in the fleet", "instance_id"),
    "lmcache_worker_port": _m(None, "rank 0's controller API port", "controller_worker_port"),
    "lmcache_worker_heartbeat_time": _m(
        None, "s between registrations with the controller", "controller_heartbeat_s"
    ),
    "controller_pull_url": _i(None, _CONTROLLER),
    "controller_reply_url": _i(None, _CONTROLLER),
    "lmcache_worker_ports": _i(None, _CONTROLLER),
    "lmcache_worker_ids": _i(None, _CONTROLLER),
    "lmcache_worker_heartbeat_delay_time": _i(10, _CONTROLLER),
    "pd_peer_query_port": _i(
        None, "kvtier's decoder has no query port (the proxy names the decoder)"
    ),
    "pd_shutdown_timeout_sec": _i(
        5.0, "kvtier's receiver stops at once; senders see the connection close"
    ),
    "pd_condition_poll_interval_sec": _i(0.005, _INTERNAL),
    "pd_max_prefill_len": _i(
        0, "kvtier sends every prefill; what does not fit is recomputed by the decoder"
    ),
    "nixl_backends": _i(None, "kvtier's NIXL channel uses the UCX backend"),
    "gds_path_sharding": _i("by_gpu", "used only with gds_path, which kvtier does not do"),
    "gds_buffer_size": _i(None, "used only with gds_path, which kvtier does not do"),
    "use_gds": _i(True, "used only with gds_path, which kvtier does not do"),
    "gds_backend": _i("cufile", "used only with gds_path, which kvtier does not do"),
    "maru_pool_size": _i(4.0, "used only with maru_path, which kvtier does not do"),
    "audit_actual_remote_url": _i(None, _INTERNAL),
    "internal_api_server_host": _i("127.0.0.1", _API),
    "internal_api_server_enabled": _i(False, _API),
    "internal_api_server_port_start": _i(6999, _API),
    "internal_api_server_include_index_list": _i(None, _API),
    "internal_api_server_socket_path_prefix": _i(None, _API),
    "priority_limit": _i(None, "kvtier stores every request's KV"),
    "hit_miss_ratio": _i(None, "an LMCache testing knob"),
    "lookup_server_worker_ids": _i(None, _INTERNAL),
    "enable_scheduler_bypass_lookup": _i(False, "kvtier's scheduler always asks the workers"),
    "script_allowed_imports": _i(None, "LMCache's script API is not built in kvtier"),
    "run_script_api_enabled": _i(False, "LMCache's script API is not built in kvtier"),
    "enable_lazy_memory_allocator": _i(False, _LAZY),
    "lazy_memory_initial_ratio": _i(0.2, _LAZY),
    "lazy_memory_expand_trigger_ratio": _i(0.5, _LAZY),
    "lazy_memory_step_ratio": _i(0.1, _LAZY),
    "lazy_memory_safe_size": _i(0.0, _LAZY),
    "enable_chunk_statistics": _i(False, _STATS),
    "chunk_statistics_auto_start_statistics": _i(False, _STATS),
    "chunk_statistics_auto_exit_timeout_hours": _i(0.0, _STATS),
    "chunk_statistics_auto_exit_target_unique_chunks": _i(0, _STATS),
    "chunk_statistics_strategy": _i("memory_bloom_filter", _STATS),
    "app_id": _i(None, _INTERNAL),
    "max_hidden_state_cpu_size": _i(2.0, _HIDDEN),
    "hidden_state_layers": _i(None, _HIDDEN),
    "hidden_states_retrieve_mode": _i("prefix_strict", _HIDDEN),
    # -- refused unless left at LMCache's default ----------------------------------------
    "enable_p2p": _b(False),
    "p2p_host": _b(None),
    "enable_controller": _b(False),
    "controller_url": _b(None),
    "enable_blending": _r(False, "CacheBlend (it changes which tokens are recomputed)"),
    "pd_bidirectional": _r(False, "bidirectional disaggregated prefill"),
    "gds_path": _r(None, f"GPUDirect Storage, {_TIER}"),
    "maru_path": _r(None, f"Maru, {_TIER}"),
    "external_lookup_client": _r(
        None, "an external lookup client (it decides what counts as a hit)"
    ),
    "runtime_plugin_locations": _r(None, "LMCache runtime plugins"),
    "plugin_locations": _r(None, "LMCache runtime plugins (deprecated name)"),
    "storage_plugins": _r(None, f"storage plugins, {_TIER}"),
    "external_backends": _r(None, f"external backends (deprecated name), {_TIER}"),
    "remote_storage_plugins": _r(None, f"remote storage plugins, {_TIER}"),
    "remote_config_url": _r(
        None, "config fetched from a URL (kvtier would run another config than meant)"
    ),
    "enable_hidden_state_cache": _r(False, "the hidden-state cache"),
}

# LMCache's environment variables that are not config keys (os.getenv calls in
# LMCache 0.5.6, outside its config): an LMCache user's environment must not stop
# kvtier, so each is accepted with one line saying what kvtier does with it.
# LMCACHE_LOG_LEVEL is honoured by logs.py.
_TELEMETRY = "LMCache's usage telemetry; kvtier sends none"
_MP = (
    "LMCache's multi-process server mode, which kvtier does not have (its store server is "
    "`kvtier server`)"
)
ENV_VARS: dict[str, str] = {
    "LMCACHE_TRACK_USAGE": _TELEMETRY,
    "LMCACHE_USAGE_TRACK_URL": _TELEMETRY,
    "LMCACHE_USAGE_TRACK_INTERVAL": _TELEMETRY,
    "LMCACHE_REQUEST_TELEMETRY_TYPE": _TELEMETRY,
    "LMCACHE_DISABLE_BANNER": "LMCache's start banner; kvtier prints none",
    "LMCACHE_LOG_LEVEL": "kvtier's log level (as KVTIER_LOG_LEVEL, which wins)",
    "LMCACHE_FORCE_SKIP_SAVE": (
        "not honoured: kvtier still stores (kv_role kv_consumer stores nothing)"
    ),
    "LMCACHE_GPU_STAGING_BUFFER_BYTES": "LMCache's MUSA staging buffer; kvtier sizes its own",
    "LMCACHE_OFFLOAD_RPC_PORT": (
        "LMCache's offload server port; kvtier's sockets are named by vLLM's engine id"
    ),
    "LMCACHE_RUNTIME_PLUGIN_CONFIG": "LMCache runtime plugins, which kvtier does not run",
    "LMCACHE_SERVER_URL": _MP,
    "LMCACHE_MQ_TIMEOUT": _MP,
    "LMCACHE_COORDINATOR_URL": _MP,
    "LMCACHE_COORDINATOR_ADVERTISE_IP": _MP,
    "LMCACHE_COORDINATOR_HEARTBEAT_INTERVAL": _MP,
    "LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL": _MP,
    "LMCACHE_COORDINATOR_EVENT_REPORTING": _MP,
    "LMCACHE_RESP_HOST": (
        "LMCache's RESP (Redis protocol) backend settings; kvtier's is remote_url redis://"
    ),
    "LMCACHE_RESP_PORT": "LMCache's RESP backend settings; kvtier's is remote_url redis://",
    "LMCACHE_RESP_USERNAME": "LMCache's RESP backend settings; kvtier's is remote_url redis://",
    "LMCACHE_RESP_PASSWORD": "LMCache's RESP backend settings; kvtier's is remote_url redis://",
    "LMCACHE_AEROSPIKE_HOSTS": "LMCache's Aerospike backend, which kvtier does not have",
    "LMCACHE_AEROSPIKE_NAMESPACE": "LMCache's Aerospike backend, which kvtier does not have",
    "LMCACHE_AEROSPIKE_SET": "LMCache's Aerospike backend, which kvtier does not have",
    "LMCACHE_AEROSPIKE_USERNAME": "LMCache's Aerospike backend, which kvtier does not have",
    "LMCACHE_AEROSPIKE_PASSWORD": "LMCache's Aerospike backend, which kvtier does not have",
}
# LMCACHE_EC_<key>: LMCache's extra_config entries one by one.
EXTRA_CONFIG_ENV_PREFIX = "LMCACHE_EC_"

_told: set[str] = set()


def env_var_note(name: str) -> bool:
    """True (and one line, once) where `name` is one of LMCache's environment variables
    that are not config keys; False for any other name."""
    note = ENV_VARS.get(name)
    if note is None and name.startswith(EXTRA_CONFIG_ENV_PREFIX):
        note = (
            "LMCache's extra_config entry, which kvtier has no use for (its extra_config is "
            "read whole)"
        )
    if note is None:
        return False
    if name not in _told:
        _told.add(name)
        log.info("LMCache environment variable %s: %s", name, note)
    return True


def resolve(key: str, value: Any, source: str) -> tuple[str, Any] | None:
    """What a non-kvtier key means: (kvtier key, value) for a mapped alias, None when it
    only needs saying (logged once per key), ConfigError when kvtier refuses it, KeyError
    when LMCache does not have it either."""
    rule = RULES[key]
    if rule.kind == "refused":
        if _is_default(value, rule.default):
            return None
        raise ConfigError(
            key,
            value,
            f"{rule.default!r} (LMCache's default): kvtier does not do "
            f"{rule.note} yet; remove the key or set it to its default",
        )
    if key not in _told:
        _told.add(key)
        if rule.kind == "mapped":
            log.info(
                "LMCache key %s (from %s): %s%s",
                key,
                source,
                rule.note,
                f" -> {rule.target}" if rule.target else "",
            )
        else:
            log.warning(
                "LMCache key %s (from %s) is accepted and has no effect: %s", key, source, rule.note
            )
    if rule.target and rule.values is not None:
        value = rule.values.get(str(value).strip().lower())
        return None if value is None else (rule.target, value)
    return (rule.target, value) if rule.target else None


def _is_default(value: Any, default: Any) -> bool:
    if value is None or value == default:
        return True
    text = str(value).strip().lower()
    return text in ("", "none", "null") or text == str(default).lower()


def table() -> list[tuple[str, str, str, str]]:
    """(key, LMCache default, class, what kvtier does), for `kvtier config --keys --lmcache`."""
    return [
        (k, repr(r.default), r.kind, (f"→ `{r.target}`; " if r.target else "") + r.note)
        for k, r in sorted(RULES.items(), key=lambda kv: (CLASSES.index(kv[1].kind), kv[0]))
    ]
