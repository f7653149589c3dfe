"""kvtier configuration: one frozen, typed object, parsed once at start.

Sources, later ones win:

    defaults  <  YAML file ($KVTIER_CONFIG_FILE or $LMCACHE_CONFIG_FILE)
              <  env vars (LMCACHE_<KEY>, then KVTIER_<KEY>)
              <  engine overrides (vLLM's kv_connector_extra_config)

Every key is declared once, in `KvtierConfig`, with its type, default and a
one-line meaning; the parser derives everything else from those fields.
Bad input raises `ConfigError` naming the key, the value and what was
expected, before anything is allocated.
"""

from kvtier.config.load import load_config
from kvtier.config.model import FIELDS, KvtierConfig, describe_keys

__all__ = ["FIELDS", "KvtierConfig", "describe_keys", "load_config"]
