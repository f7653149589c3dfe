import dataclasses

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError, UnknownConfigKey


def test_defaults_match_lmcache():
    cfg = load_config(env={})
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size, cfg.local_cpu_use_hugepages) == (
        256,
        True,
        5.0,
        False,
    )
    assert cfg.cpu_pool_bytes == 5 * 1024**3


def test_lmcache_env_vars(tmp_path):
    cfg = load_config(
        env={
            "LMCACHE_CHUNK_SIZE": "128",
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.5",
            "LMCACHE_SAVE_UNFULL_CHUNK": "yes",
        }
    )
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size, cfg.save_unfull_chunk) == (
        128,
        True,
        2.5,
        True,
    )


def test_file_then_env_then_kvtier_env(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 64\nmax_local_cpu_size: 1.0\nlocal_cpu: true\n")
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": str(f)})
    assert (cfg.chunk_size, cfg.max_local_cpu_size) == (64, 1.0)
    cfg = load_config(env={"KVTIER_CONFIG_FILE": str(f), "LMCACHE_CHUNK_SIZE": "32"})
    assert cfg.chunk_size == 32  # env overrides the file
    cfg = load_config(
        env={"LMCACHE_CONFIG_FILE": str(f), "LMCACHE_CHUNK_SIZE": "32", "KVTIER_CHUNK_SIZE": "16"}
    )
    assert cfg.chunk_size == 16  # KVTIER_ wins over LMCACHE_


def test_unknown_key_in_file_names_closest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_sise: 64\n")
    with pytest.raises(
        UnknownConfigKey, match=r"unknown key 'chunk_sise'.*did you mean 'chunk_size'"
    ):
        load_config(env={"LMCACHE_CONFIG_FILE": str(f)})


def test_unknown_env_key_names_closest():
    with pytest.raises(UnknownConfigKey, match="max_local_cpu_size"):
        load_config(env={"LMCACHE_MAX_LOCAL_CPU_SIZ": "1"})


def test_kvtiers_own_env_vars_are_not_config_keys():
    """KVTIER_LOG_LEVEL, KVTIER_SERVER_TOKEN and KVTIER_TRACE_STALLS_MS act where they are
    read (logs, the store server's token, the stall trace): set beside vLLM, they must not
    stop the connector as unknown keys."""
    env = {
        "KVTIER_LOG_LEVEL": "DEBUG",
        "KVTIER_SERVER_TOKEN": "s3cret",
        "KVTIER_TRACE_STALLS_MS": "5",
        "KVTIER_CHUNK_SIZE": "64",
    }
    assert load_config(env=env).chunk_size == 64


def test_legacy_lmcache_switch_is_accepted():
    assert load_config(env={"LMCACHE_USE_EXPERIMENTAL": "True"}).chunk_size == 256


@pytest.mark.parametrize(
    "env, key, expected",
    [
        ({"LMCACHE_CHUNK_SIZE": "0"}, "chunk_size", "positive"),
        ({"LMCACHE_CHUNK_SIZE": "-5"}, "chunk_size", "positive"),
        ({"LMCACHE_CHUNK_SIZE": "abc"}, "chunk_size", "an integer"),
        ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "0"}, "max_local_cpu_size", "> 0"),
        ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"}, "max_local_cpu_size", "> 0"),
        ({"LMCACHE_LOCAL_CPU": "maybe"}, "local_cpu", "true or false"),
        ({"LMCACHE_LOCAL_CPU_USE_HUGEPAGES": "2"}, "local_cpu_use_hugepages", "true or false"),
    ],
)
def test_bad_values_name_key_value_and_expectation(env, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    msg = str(info.value)
    assert key in msg and list(env.values())[0] in msg and expected in msg


def test_wrong_yaml_type(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 2.5\nlocal_cpu: maybe\n")
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config(env={"LMCACHE_CONFIG_FILE": str(f)})


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="existing YAML file"):
        load_config(env={"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(env={"LMCACHE_CONFIG_FILE": str(f)})


@pytest.mark.parametrize(
    "env, key",
    [
        ({"LMCACHE_ENABLE_P2P": "true", "LMCACHE_P2P_PORT": "8200"}, "p2p_index_url"),
        ({"LMCACHE_ENABLE_P2P": "true", "LMCACHE_P2P_INDEX_URL": "kvtier://h:1"}, "p2p_port"),
        (
            {
                "LMCACHE_ENABLE_P2P": "true",
                "LMCACHE_P2P_PORT": "8200",
                "LMCACHE_P2P_INDEX_URL": "nosuch://h:1",
            },
            "p2p_index_url",
        ),
    ],
)
def test_p2p_without_an_index_or_a_port_is_refused_by_name(env, key):
    with pytest.raises(ConfigError, match=key):
        load_config(env=env)


def test_p2p_with_its_keys_parses_and_takes_the_fleets_token():
    cfg = load_config(
        env={
            "LMCACHE_ENABLE_P2P": "true",
            "LMCACHE_P2P_PORT": "8200",
            "LMCACHE_P2P_INDEX_URL": "redis://h:6379",
            "LMCACHE_REMOTE_AUTH_TOKEN": "t",
        }
    )
    assert (cfg.enable_p2p, cfg.p2p_port, cfg.p2p_index_url) == (True, 8200, "redis://h:6379")
    assert cfg.p2p_host == "127.0.0.1"


def test_p2p_takes_lmcaches_nixl_channel_and_refuses_cuda_ipc_by_name():
    env = {
        "LMCACHE_ENABLE_P2P": "true",
        "LMCACHE_P2P_PORT": "8200",
        "LMCACHE_P2P_INDEX_URL": "redis://h:6379",
    }
    nixl = load_config(env={**env, "LMCACHE_TRANSFER_CHANNEL": "nixl"})
    assert (nixl.p2p_channel, load_config(env=env).p2p_channel) == ("nixl", "tcp")
    with pytest.raises(ConfigError, match="transfer_channel.*tcp \\| nixl when enable_p2p"):
        load_config(env={**env, "LMCACHE_TRANSFER_CHANNEL": "cuda_ipc"})


@pytest.mark.parametrize(
    "url",
    [
        "kvtier://127.0.0.1:12345",
        "infinistore://127.0.0.1:12345/?device=mlx5_1",
        "redis://localhost:6379",
        "rediss://:pw@cache.example:6380/0",
        "redis-cluster://10.0.0.1:7000,10.0.0.2:7000",
        "fs:///mnt/kv",
    ],
)
def test_remote_urls_of_every_scheme_parse(url):
    assert (
        load_config(env={"LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "lz4"}).remote_url
        == url
    )


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LMCACHE_REMOTE_URL": "mongodb://x:1"}, "scheme"),
        ({"LMCACHE_REMOTE_URL": "redis://localhost"}, "redis://host:port"),
        ({"LMCACHE_REMOTE_URL": "fs://"}, "fs:///path"),
        ({"LMCACHE_REMOTE_SERDE": "cachegen"}, "naive | lz4"),
    ],
)
def test_bad_remote_settings_fail_at_start(env, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(env=env)


@pytest.mark.parametrize("value", ["file:///tmp/kv disk", "/tmp/kv disk", "file:///tmp/kv%20disk"])
def test_local_disk_takes_lmcache_form_and_plain_paths(value):
    cfg = load_config(env={"LMCACHE_LOCAL_DISK": value, "LMCACHE_MAX_LOCAL_DISK_SIZE": "2"})
    assert str(cfg.disk_path) == "/tmp/kv disk" and cfg.disk_bytes == 2 * 1024**3


@pytest.mark.parametrize(
    "env, key, expected",
    [
        ({"LMCACHE_LOCAL_DISK": "file:///tmp/kv"}, "max_local_disk_size", "> 0"),
        (
            {"LMCACHE_LOCAL_DISK": "s3://bucket/kv", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"},
            "local_disk",
            "file:///",
        ),
        ({"KVTIER_LOCAL_DISK_MIN_STORES": "0"}, "local_disk_min_stores", ">= 1"),
        ({"LMCACHE_PIN_TIMEOUT_SEC": "0"}, "pin_timeout_sec", "> 0"),
    ],
)
def test_bad_disk_and_pin_settings_fail_at_start(env, key, expected):
    with pytest.raises(ConfigError, match=f"{key}.*{expected}"):
        load_config(env=env)


def test_all_design_keys_parse():
    for key in [
        "chunk_size",
        "local_cpu",
        "max_local_cpu_size",
        "local_cpu_use_hugepages",
        "local_disk",
        "max_local_disk_size",
        "remote_url",
        "remote_serde",
        "save_unfull_chunk",
        "blocking_timeout_secs",
        "enable_pd",
        "pd_role",
        "transfer_channel",
        "pd_buffer_size",
        "pd_buffer_device",
        "pd_peer_host",
        "pd_peer_init_port",
        "pd_peer_alloc_port",
        "pd_proxy_host",
        "pd_proxy_port",
        "enable_p2p",
        "extra_config",
    ]:
        assert key in KvtierConfig.__dataclass_fields__


def test_extra_config_json_from_env_and_frozen():
    cfg = load_config(env={"KVTIER_EXTRA_CONFIG": '{"a": 1}'})
    assert cfg.extra_config == {"a": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 3  # frozen


def test_overrides_apply_last():
    assert load_config(
        env={"LMCACHE_SAVE_UNFULL_CHUNK": "false"}, overrides={"save_unfull_chunk": True}
    ).save_unfull_chunk
