"""redis://, rediss:// and redis-cluster:// through redis-py (with hiredis).

Values are plain Redis strings under the chunk key. Batches go out as one
pipeline (one round trip on one server; one per node in a cluster).

redis-py is fast only with hiredis parsing replies *and* its pure-Python
command packer, which sends large values as separate buffers; the packer
it picks with hiredis copies every value into one bytes (several times
slower: results/README.md, "Figures behind constants"). So the Python packer
is passed explicitly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from kvtier.buffers import Value, fill, joined
from kvtier.errors import RemoteUnavailable

_FAULTS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
)


def _packer() -> PythonRespSerializer:
    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


class RedisStore:
    """`connect` makes the client on first use (a cluster client contacts its
    nodes when made), so a store that is down at start is a miss, not a crash."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis | RedisCluster],
        url: str,
        max_value: int = 512 << 20,
    ) -> None:
        self.connect = connect
        self.url = url
        self.max_value = max_value  # Redis strings stop at 512 MB
        self._client: redis.Redis | RedisCluster | None = None
        # Made once: two threads making one each at first use (the P2P index's writer and a
        # lookup) dropped one, whose pool closed the socket a pipeline of it was reading.
        self._connecting = threading.Lock()

    @property
    def client(self) -> redis.Redis | RedisCluster:
        with self._connecting:
            if self._client is None:
                try:
                    self._client = self.connect()
                except _FAULTS as e:
                    raise RemoteUnavailable(f"{self.url}: {e}") from e
            return self._client

    def __repr__(self) -> str:
        return f"RedisStore({self.url})"

    def put(self, keys: Sequence[bytes], values: Sequence[Value]) -> None:
        bufs = [joined(v) for v in values]
        big = [len(b) for b in bufs if len(b) > self.max_value]
        if big:
            raise ValueError(
                f"value of {big[0]} bytes is over Redis's string limit ({self.max_value})"
            )
        self._pipeline(lambda pipe: [pipe.set(k, b) for k, b in zip(keys, bufs)])

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._pipeline(lambda pipe: [pipe.get(k) for k in keys])

    def get_into(self, keys: Sequence[bytes], dests: Sequence[Value]) -> list[bool]:
        # redis-py hands out each reply as a new bytes object: one copy is unavoidable.
        return [fill(d, v) for d, v in zip(dests, self.get(keys))]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(n) for n in self._pipeline(lambda pipe: [pipe.exists(k) for k in keys])]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        found = self.exists(keys)
        return found.index(False) if False in found else len(found)

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self._pipeline(lambda pipe: [pipe.delete(k) for k in keys]))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _pipeline(self, fill) -> list:
        try:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()
        except _FAULTS as e:
            raise RemoteUnavailable(f"{self.url}: {e}") from e


def open_redis(url: str, timeout: float) -> RedisStore:
    return RedisStore(
        lambda: redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, command_packer=_packer()
        ),
        url,
    )


def open_redis_cluster(url: str, timeout: float) -> RedisStore:
    """redis-cluster://host:port[,host:port...]: seed nodes; the rest are discovered."""
    parts = urlsplit(url)
    seeds = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, port = hostport.rsplit(":", 1)
        seeds.append(ClusterNode(host, int(port)))
    return RedisStore(
        lambda: RedisCluster(
            startup_nodes=seeds,
            password=parts.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            command_packer=_packer(),
            retry=Retry(NoBackoff(), 1),
        ),
        url,
    )
