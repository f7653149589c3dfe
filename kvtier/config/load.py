"""Where a config's values come from, later ones winning: defaults < the YAML file < env vars
< engine overrides. Each value is coerced to its field's type (from the field's hint); an
LMCache key is resolved through lmcache_keys.py; an unknown key is refused with the closest
known one."""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvtier.config.lmcache_keys import RULES, TRUE_TEXTS, env_var_note, resolve
from kvtier.config.model import FIELDS, KvtierConfig
from kvtier.errors import ConfigError, UnknownConfigKey

ENV_PREFIXES = ("LMCACHE_", "KVTIER_")
CONFIG_FILE_VARS = ("LMCACHE_CONFIG_FILE", "KVTIER_CONFIG_FILE")
# kvtier's environment variables that are not config keys: read where they act.
OWN_ENV_VARS = (
    "KVTIER_LOG_LEVEL",  # logs.py
    "KVTIER_SERVER_TOKEN",  # kvtier server's and its clients' bearer token (server/state.py)
    "KVTIER_TRACE_STALLS_MS",  # slow calls on the engine's thread, logged (stalls.py)
)
# LMCache env vars that carry no meaning here (they select LMCache code paths
# that kvtier has only one of). Accepted so that old launch scripts still run.
IGNORED_LMCACHE_KEYS = frozenset({"use_experimental"})

_TRUE = TRUE_TEXTS
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}

_HINTS = typing.get_type_hints(KvtierConfig)


def _expected(key: str) -> str:
    hint = _HINTS[key]
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    return names.get(base, "a mapping") + (" or null" if optional else "")


def _coerce(key: str, value: Any) -> Any:
    """Turn a YAML value or env string into the field's type, or fail."""
    hint = _HINTS[key]
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if isinstance(value, str) and optional and value.strip().lower() in _NONE:
        return None
    if value is None:
        if optional:
            return None
        raise ConfigError(key, value, _expected(key))
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(key, value, _expected(key))
    if base in (int, float):
        if isinstance(value, bool):
            raise ConfigError(key, value, _expected(key))
        try:
            number = base(value) if isinstance(value, str) else value
        except ValueError:
            raise ConfigError(key, value, _expected(key)) from None
        if base is int and (not isinstance(number, int)):
            raise ConfigError(key, value, _expected(key))
        if not isinstance(number, (int, float)):
            raise ConfigError(key, value, _expected(key))
        return base(number)
    if base is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(key, value, _expected(key))
        return str(value)
    # extra_config: a mapping, or JSON text of one from an env var.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(key, value, "a JSON object") from None
    if not isinstance(value, dict):
        raise ConfigError(key, value, "a mapping")
    return dict(value)


def _unknown(key: str, source: str) -> UnknownConfigKey:
    close = difflib.get_close_matches(key, list(FIELDS) + list(RULES), n=1, cutoff=0.5)
    return UnknownConfigKey(key, source, close[0] if close else None)


def _put(out: dict[str, Any], key: str, value: Any, source: str) -> None:
    """One key's value into `out`: a kvtier key, or an LMCache key resolved (lmcache_keys.py)."""
    if key not in FIELDS:
        if key not in RULES:
            raise _unknown(key, source)
        mapped = resolve(key, value, source)
        if mapped is None:
            return
        key, value = mapped
    out[key] = _coerce(key, value)


def _from_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config file", path, "an existing YAML file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("config file", path, f"valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("config file", path, "a YAML mapping of key: value")
    out: dict[str, Any] = {}
    for key, value in data.items():
        _put(out, str(key), value, path)
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for prefix in ENV_PREFIXES:  # KVTIER_ last, so it wins over LMCACHE_
        for name, value in sorted(env.items()):
            if (
                not name.startswith(prefix)
                or name in CONFIG_FILE_VARS + OWN_ENV_VARS
                or env_var_note(name)
            ):
                continue
            key = name[len(prefix) :].lower()
            if key in IGNORED_LMCACHE_KEYS:
                continue
            _put(out, key, value, f"environment variable {name}")
    return out


def load_config(
    env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> KvtierConfig:
    """Build the config from file, env and engine overrides (in that order)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for var in CONFIG_FILE_VARS:
        if env.get(var):
            values.update(_from_file(env[var]))
    values.update(_from_env(env))
    for key, value in (overrides or {}).items():
        _put(values, key, value, "engine overrides")
    return KvtierConfig(**values)
