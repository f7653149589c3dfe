"""What identifies a LoRA adapter's KV: its name, its path and a digest of its files (vLLM's
int id of an adapter is per process: two instances must agree on a key). The vLLM integration
keys its requests with it (integrations/vllm/identity.py), and `kvtier controller
--lora-name/--lora-path` names a prompt's chunks with it.
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from kvtier.keys import Identity

_DIGEST_SEED = 0x6B7674696572_3001
_FILE_BLOCK = 1 << 22

Stamp = tuple[tuple[int, int], ...]


def adapter_bytes(name: str, path: str, digest: bytes) -> bytes:
    """The bytes of an adapter in its requests' identity (keys.Identity.of's `adapter`)."""
    return b"\0".join([name.encode(), path.encode(), digest])


def identity_of(lora_name: str = "", lora_path: str = "", cache_salt: str = "") -> Identity:
    """The identity of a request with this adapter (by name and path, its files hashed here)
    and cache_salt, as the vLLM integration makes it (without multimodal items)."""
    adapter = b""
    if lora_name:
        files = adapter_files(Path(lora_path)) if lora_path else []
        adapter = adapter_bytes(lora_name, lora_path, files_digest(Path(lora_path), files))
    return Identity.of(adapter, cache_salt)


def stamp(files: list[Path]) -> Stamp | None:
    """Each file's size and modification time; None if one is gone."""
    try:
        return tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except OSError:
        return None


def adapter_files(path: Path) -> list[Path]:
    """The regular files of an adapter's directory (or the file itself), in a fixed order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def files_digest(path: Path, files: list[Path]) -> bytes:
    """xxh3-128 over each file's name (relative to the adapter's directory), its size, its
    bytes; b"" where there are none."""
    if not files:
        return b""
    root = path if path.is_dir() else path.parent
    hasher = xxhash.xxh3_128(seed=_DIGEST_SEED)
    for file in files:
        hasher.update(
            os.path.relpath(file, root).encode() + b"\0" + str(file.stat().st_size).encode() + b"\0"
        )
        with open(file, "rb") as f:
            while block := f.read(_FILE_BLOCK):
                hasher.update(block)
    return hasher.digest()
