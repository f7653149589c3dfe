"""Every LMCache 0.5.6 key is classified, and an LMCache user's YAML starts kvtier."""

import logging
from pathlib import Path

import pytest

from kvtier.config import FIELDS, load_config
from kvtier.config.lmcache_keys import CLASSES, LMCACHE_VERSION, RULES
from kvtier.errors import ConfigError, UnknownConfigKey

DATA = Path(__file__).parent / "data" / f"lmcache-{LMCACHE_VERSION}-keys.txt"


def lmcache_keys():
    lines = [x for x in DATA.read_text().splitlines() if x and not x.startswith("#")]
    split = lines.index("aliases")
    return lines[:split], lines[split + 1 :]


def test_every_lmcache_key_and_alias_is_classified_once():
    keys, aliases = lmcache_keys()
    assert len(keys) == 108 and len(aliases) == 12
    missing = [k for k in keys + aliases if k not in RULES]
    assert not missing, f"LMCache keys with no class: {missing}"
    assert not set(RULES) - set(keys) - set(aliases), "a rule for a key LMCache does not have"
    assert all(rule.kind in CLASSES for rule in RULES.values())


def test_built_keys_are_kvtier_fields_and_mapped_ones_name_one():
    for key, rule in RULES.items():
        if rule.kind == "built":
            assert key in FIELDS, key
        if rule.target is not None:
            assert rule.kind == "mapped" and rule.target in FIELDS, key


COMMON = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 0.01
local_disk: null
max_local_disk_size: 0
remote_url: null
remote_serde: naive
save_unfull_chunk: false
use_layerwise: false
blocking_timeout_secs: 10
cache_policy: LRU
enable_async_loading: true
min_retrieve_tokens: 64
lookup_timeout_ms: 2000
numa_mode: auto
enable_kv_events: true
save_decode_cache: true
reserve_local_cpu_size: 1.0
local_disk_path_sharding: by_gpu
pd_allocation_timeout_sec: 5
pin_timeout_sec: 120
enable_controller: false
enable_blending: false
"""


def test_an_lmcache_yaml_with_common_keys_starts_kvtier_with_the_right_warnings(tmp_path, caplog):
    import kvtier.config.lmcache_keys as lk

    lk._told.clear()
    f = tmp_path / "lmcache.yaml"
    f.write_text(COMMON)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        cfg = load_config(env={"LMCACHE_CONFIG_FILE": str(f)})
    assert (
        cfg.min_retrieve_tokens,
        cfg.lookup_timeout_ms,
        cfg.cache_policy,
        cfg.pin_timeout_sec,
        cfg.enable_kv_events,
    ) == (64, 2000, "LRU", 120, True)
    warned = {r.getMessage().split()[2] for r in caplog.records if r.levelno == logging.WARNING}
    assert warned == {"numa_mode", "reserve_local_cpu_size"}  # enable_controller: built
    informed = {
        r.getMessage().split()[2]
        for r in caplog.records
        if r.levelno == logging.INFO and "LMCache key" in r.getMessage()
    }
    assert informed == {"enable_async_loading", "local_disk_path_sharding"}
    assert cfg.async_loading == "always"  # LMCache's async loading: every hit in the background


@pytest.mark.parametrize("value, expected", [("true", "always"), ("false", "busy"), ("0", "busy")])
def test_lmcache_s_async_loading_switch_sets_kvtier_s_and_its_false_keeps_the_default(
    value, expected
):
    assert load_config(env={"LMCACHE_ENABLE_ASYNC_LOADING": value}).async_loading == expected
    # kvtier's own key, later, wins
    assert (
        load_config(
            env={"LMCACHE_ENABLE_ASYNC_LOADING": value, "KVTIER_ASYNC_LOADING": "never"}
        ).async_loading
        == "never"
    )


def test_deprecated_nixl_names_set_the_pd_keys():
    env = {
        "LMCACHE_ENABLE_XPYD": "true",
        "LMCACHE_NIXL_ROLE": "receiver",
        "LMCACHE_NIXL_BUFFER_SIZE": "1024",
        "LMCACHE_NIXL_PEER_HOST": "h",
        "LMCACHE_NIXL_PEER_INIT_PORT": "1",
        "LMCACHE_NIXL_PEER_ALLOC_PORT": "2",
    }
    cfg = load_config(env=env)
    assert (cfg.enable_pd, cfg.pd_role, cfg.pd_buffer_size, cfg.pd_peer_alloc_port) == (
        True,
        "receiver",
        1024,
        2,
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("enable_blending", "true"),
        ("gds_path", "/mnt/gds"),
        ("remote_config_url", "http://x"),
        ("pd_bidirectional", "true"),
    ],
)
def test_keys_kvtier_refuses_say_so_and_their_defaults_pass(key, value):
    with pytest.raises(ConfigError, match=f"{key}.*kvtier does not do"):
        load_config(env={f"LMCACHE_{key.upper()}": value})
    load_config(env={f"LMCACHE_{key.upper()}": str(RULES[key].default).lower()})


def test_lmcaches_cache_policies_are_taken_and_others_refused():
    for policy in ("LRU", "FIFO", "MRU", "LFU", "lru"):
        assert load_config(env={"LMCACHE_CACHE_POLICY": policy}).cache_policy == policy
    with pytest.raises(ConfigError, match="cache_policy.*LRU \\| FIFO \\| MRU \\| LFU"):
        load_config(env={"LMCACHE_CACHE_POLICY": "ARC"})


def test_lmcaches_own_environment_variables_start_kvtier_with_a_line_each(caplog):
    """LMCACHE_TRACK_USAGE and the like are LMCache's switches, not config keys:
    an LMCache user's environment starts kvtier, and each says what kvtier does."""
    import kvtier.config.lmcache_keys as lk

    lk._told.clear()
    env = {name: "false" for name in lk.ENV_VARS} | {
        "LMCACHE_EC_FOO": "1",
        "LMCACHE_CHUNK_SIZE": "512",
    }
    with caplog.at_level(logging.INFO, logger="kvtier"):
        cfg = load_config(env=env)
    assert cfg.chunk_size == 512
    told = {
        r.getMessage().split()[3].rstrip(":")
        for r in caplog.records
        if "LMCache environment variable" in r.getMessage()
    }
    assert told == set(lk.ENV_VARS) | {"LMCACHE_EC_FOO"}


def test_a_key_neither_has_is_still_unknown_with_a_suggestion():
    with pytest.raises(UnknownConfigKey, match="did you mean 'min_retrieve_tokens'"):
        load_config(env={"LMCACHE_MIN_RETRIEVE_TOKEN": "3"})


@pytest.mark.parametrize(
    "hit, prompt, granularity, minimum, usable",
    [
        (700, 700, 1, 0, 699),
        (700, 700, 128, 0, 640),
        (100, 700, 1, 256, 0),
        (300, 700, 1, 256, 300),
        (0, 10, 1, 0, 0),
        (5, 1, 1, 0, 0),
    ],
)
def test_usable_hit(hit, prompt, granularity, minimum, usable):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.spec import usable_hit

    assert usable_hit(hit, prompt, granularity, minimum) == usable


@pytest.mark.parametrize(
    "stored, prompt, computed, load",
    [
        # 15 tokens past vLLM's GPU hit: computed with the last one, not loaded
        (4352, 4352, 4336, 0),
        (4608, 4736, 4352, 256),
        (4352, 4352, 0, 4351),
        (10, 100, 0, 10),
        (4352, 4352, 4320, 31),
        (4352, 4352, 4352, 0),
    ],
)
def test_fewer_tokens_than_a_block_past_vllms_own_hit_are_not_loaded(
    stored, prompt, computed, load
):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.spec import Shape

    assert Shape(16, 256, False, 0).to_load(stored, prompt, computed) == load


@pytest.mark.parametrize(
    "stored, prompt, computed, load",
    [
        (4352, 4352, 4336, 15),  # the step then computes the last token alone: a full graph
        (4340, 4352, 4336, 0),  # it computes 12 anyway
        (4352, 4352, 4320, 31),
        (4352, 4352, 4351, 0),
    ],
)
def test_under_full_cuda_graphs_the_tail_past_vllms_hit_is_loaded_where_it_leaves_one_token(
    stored, prompt, computed, load
):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.spec import Shape

    assert Shape(16, 256, False, 0, full_graphs=True).to_load(stored, prompt, computed) == load


def test_full_graphs_are_vllms_compiled_mode_without_eager_or_speculative_decoding():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from kvtier.integrations.vllm.spec import _full_graphs

    def config(mode, eager=False, speculative=None):
        return SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
            model_config=SimpleNamespace(enforce_eager=eager),
            speculative_config=speculative,
        )

    assert _full_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE))
    assert _full_graphs(config(CUDAGraphMode.FULL_DECODE_ONLY))
    assert not _full_graphs(config(CUDAGraphMode.PIECEWISE))
    assert not _full_graphs(config(CUDAGraphMode.NONE))
    assert not _full_graphs(config(None))
    assert not _full_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE, eager=True))
    assert not _full_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE, speculative=object()))
