"""The redis tier's connection: one client for a single server or a Redis Cluster, and the one
path every write takes, which can wait for replicas.

A cluster client (redis-py's ``RedisCluster``) finds each key's master from the slot map and
follows MOVED/ASK and failovers by itself; a pipeline is split per master and sent to all of them
before any answer is read. That is the write path, unless ``wait_replicas`` is set: then each
master's share of the writes goes over one connection followed by ``WAIT n timeout`` on that same
connection (WAIT counts the replicas that acknowledged *this connection's* writes), and a write
fails unless every master touched reports ``n`` replicas in time. A redirect or a lost connection
meanwhile refreshes the slot map and sends the whole batch again (every write is idempotent), so
no write ever escapes its WAIT by being retried elsewhere.

Every Redis failure becomes a TierError. Timeouts are short; on one server a connection error is
retried once at once (the pooled socket of a restarted server is dead, the retry reconnects).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, TryAgainError
from redis.retry import Retry

from kvstore.tiers.base import TierError
from kvstore.tiers.config import RedisTierConfig

#: One write: a key (it routes the command to its master in a cluster) and the command's words.
Command = tuple[bytes, tuple[Any, ...]]
_REROUTE = (AskError, TryAgainError, ClusterDownError, redis.ConnectionError, redis.TimeoutError)
_WAIT_ATTEMPTS = 3
#: What redis-py raises: its errors, and a cluster client's (not RedisError subclasses).
_FAILURES = (redis.RedisError, RedisClusterException)


class NotReplicated(TierError):
    """Fewer replicas than ``wait_replicas`` acknowledged a write in time: it is applied on the
    master but not acknowledged, and a failover now may lose it."""


def describe(url: str, cluster: bool) -> str:
    """Where the tier points, for messages: host, port and database; never a password."""
    u = urlsplit(url)
    where = u.path if u.scheme == "unix" else f"{u.hostname}:{u.port or 6379}{u.path or '/0'}"
    return f"redis {'cluster ' if cluster else ''}tier ({where})"


class RedisLink:
    """The tier's client, its error mapping and its write path."""

    def __init__(self, config: RedisTierConfig) -> None:
        self.config = config
        self.cluster = config.cluster
        self.where = describe(config.url, config.cluster)
        timeouts = {"socket_timeout": config.socket_timeout_s, "socket_connect_timeout": config.socket_timeout_s}
        self.client: Any
        if config.cluster:
            # No connection yet would be nicer, but the cluster client reads the slot map at once:
            # a cluster that is down fails here, and the tier reports it (TierError).
            try:
                self.client = redis.RedisCluster.from_url(config.url, **timeouts)
            except _FAILURES as exc:
                raise TierError(f"{self.where}: cannot read the cluster's slot map: {type(exc).__name__}: "
                                f"{exc}") from exc
        else:
            self.client = redis.Redis.from_url(
                config.url, retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)), **timeouts)
        self.closed = False

    @contextlib.contextmanager
    def errors(self, op: str) -> Iterator[None]:
        if self.closed:
            raise TierError(f"{self.where}: {op} after close()")
        try:
            yield
        except _FAILURES as exc:
            raise TierError(f"{self.where}: {op} failed: {type(exc).__name__}: {exc}") from exc

    def pipeline(self) -> Any:
        """A non-transactional pipeline: one round trip (per master, in parallel, on a cluster)."""
        return self.client.pipeline(transaction=False)

    def pipelined(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run commands in one pipeline, waiting for no replica; their answers in order. Reads
        take this path; writes take ``write``."""
        if not commands:
            return []
        pipe = self.pipeline()
        for args in commands:
            pipe.execute_command(*args)
        return list(pipe.execute())

    def write(self, commands: Sequence[Command]) -> list[Any]:
        """Run write commands in one pipeline (each atomic, the batch not); their answers in order.
        With ``wait_replicas``, returns only once that many replicas of every master touched
        acknowledged them (else NotReplicated)."""
        if not commands:
            return []
        if not self.config.wait_replicas:
            return self.pipelined([args for _, args in commands])
        if not self.cluster:
            return self._write_waiting(self.client, list(enumerate(commands)), "the server")[1]
        return self._write_cluster_waiting(commands)

    def _write_cluster_waiting(self, commands: Sequence[Command]) -> list[Any]:
        last: Exception | None = None
        for _ in range(_WAIT_ATTEMPTS):
            groups: dict[str, tuple[ClusterNode, list[tuple[int, Command]]]] = {}
            for i, cmd in enumerate(commands):
                node = self.client.get_node_from_key(cmd[0])
                groups.setdefault(node.name, (node, []))[1].append((i, cmd))
            out: list[Any] = [None] * len(commands)
            try:
                for node, share in groups.values():
                    positions, answers = self._write_waiting(self.client.get_redis_connection(node), share,
                                                             f"master {node.name}")
                    for i, answer in zip(positions, answers):
                        out[i] = answer
                return out
            except _REROUTE as exc:  # MOVED is an AskError: the slot map changed under us
                last = exc
                self.client.nodes_manager.initialize()
        assert last is not None
        raise last

    def _write_waiting(self, client: Any, share: list[tuple[int, Command]], who: str
                       ) -> tuple[list[int], list[Any]]:
        pipe = client.pipeline(transaction=False)  # one connection: the WAIT covers these writes
        for _, (_, args) in share:
            pipe.execute_command(*args)
        want, timeout_ms = self.config.wait_replicas, self.config.wait_timeout_ms
        pipe.execute_command("WAIT", want, timeout_ms)
        *answers, acked = pipe.execute()
        if int(acked) < want:
            raise NotReplicated(f"{self.where}: {who} had {acked} of {want} replicas acknowledge the write "
                                f"within {timeout_ms} ms: not acknowledged (it may still be applied)")
        return [i for i, _ in share], answers

    def scan(self, pattern: bytes, count: int) -> set[bytes]:
        """Every key matching ``pattern`` (on every master of a cluster), deduplicated."""
        return {bytes(k) for k in self.client.scan_iter(match=pattern, count=count)}

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(*_FAILURES):
                self.client.close()
