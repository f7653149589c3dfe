"""fs:///dir — values as files in a directory that the nodes share (NFS, a mounted volume).

    <dir>/<2 hex>/<sha256 of the key, hex>

A put writes a temporary file and renames it over the final name, so a
reader sees a value whole or not at all, also across machines on NFS.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvtier.buffers import Value, as_parts
from kvtier.errors import RemoteUnavailable


class FSStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RemoteUnavailable(f"fs://{root}: {e}") from e

    def __repr__(self) -> str:
        return f"FSStore({self.root})"

    def _path(self, key: bytes) -> Path:
        name = hashlib.sha256(key).hexdigest()
        return self.root / name[:2] / name

    def put(self, keys: Sequence[bytes], values: Sequence[Value]) -> None:
        for key, value in zip(keys, values):
            path = self._path(key)
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".put-")
                try:
                    with os.fdopen(fd, "wb") as f:
                        for part in as_parts(value):
                            f.write(part)
                    os.replace(tmp, path)
                except BaseException:
                    os.unlink(tmp)
                    raise
            except OSError as e:
                raise RemoteUnavailable(f"fs://{self.root}: {e}") from e

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out = []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise RemoteUnavailable(f"fs://{self.root}: {e}") from e
        return out

    def get_into(self, keys: Sequence[bytes], dests: Sequence[Value]) -> list[bool]:
        out = []
        for key, dest in zip(keys, dests):
            parts = as_parts(dest)
            try:
                with open(self._path(key), "rb", buffering=0) as f:
                    if os.fstat(f.fileno()).st_size != sum(len(x) for x in parts):
                        out.append(False)
                        continue
                    out.append(all(_read_exactly(f, part) for part in parts))
            except FileNotFoundError:
                out.append(False)
            except OSError as e:
                raise RemoteUnavailable(f"fs://{self.root}: {e}") from e
        return out

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._path(k).exists() for k in keys]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            if not self._path(key).exists():
                return i
        return len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            try:
                self._path(key).unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n

    def close(self) -> None:
        pass


def _read_exactly(f, view: memoryview) -> bool:
    """False if the file ends early (it was replaced while being read)."""
    while len(view):
        n = f.readinto(view)
        if not n:
            return False
        view = view[n:]
    return True


def open_fs(url: str, timeout: float) -> FSStore:
    return FSStore(Path(unquote(urlsplit(url).path)))
