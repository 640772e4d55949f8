"""The remote tier's client: connecting, and pipelined commands that survive a dead node.

:func:`connect` makes a client that never retries on its own (the tier's breaker
decides). :class:`Pipelines` sends one pipeline per round trip to a single server,
or one per node to a cluster, each node with a breaker of its own: a node that
fails or is late costs the keys it owns, the others are answered.

Threads: a :class:`Pipelines` is used by one thread at a time per round trip (the
tier's reader, prober or writer thread); redis-py's connection pools are thread-safe.
"""

from __future__ import annotations

from typing import Any, Callable

from kvstrata.config.credentials import redact_url
from kvstrata.system.breaker import Breaker

__all__ = ["connect", "Pipelines", "UNANSWERED", "shown"]

UNANSWERED = ConnectionError("the cluster node that owns the key did not answer")


def connect(url: str, *, cluster: bool = False, timeout: float = 0.5, connect_timeout: float = 1.0,
            password: str | None = None) -> Any:
    """A client for ``url`` that never retries on its own (the breaker decides) and gives
    up on a socket after ``timeout`` seconds (``password``: instead of the URL's).
    Imports ``redis`` (the ``remote`` extra)."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as exc:  # pragma: no cover - the extra is installed with the tests
        raise ImportError("the remote tier needs the redis client: pip install 'kvstrata[remote]'") from exc
    for alias, scheme in (("valkeys://", "rediss://"), ("valkey://", "redis://")):
        if url.startswith(alias):
            url = scheme + url[len(alias):]
    kwargs: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=connect_timeout,
                                  retry=Retry(NoBackoff(), 0), health_check_interval=0)
    if password is not None:
        kwargs["password"] = password
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, retry_on_timeout=False, **kwargs)


class Pipelines:
    """Pipelined commands over ``client`` (a cluster client when ``cluster``);
    ``log_once(what, msg, *args)`` reports a node's failure once."""

    def __init__(self, client: Any, cluster: bool, log_once: Callable[..., None]) -> None:
        self.client = client
        self.cluster = cluster
        self._log_once = log_once
        self._breakers: dict[str, Breaker] = {}

    def run(self, nskeys: list[bytes], add: Any, per_key: int, missing: Any, strict: bool = True) -> list[Any]:
        """``add(pipe, key)`` for each key (``per_key`` commands each) in one pipeline, or on a
        cluster one per node: the answers of a node that fails or whose breaker is open are
        ``missing`` (the node's breaker counts the failure; the others go on). ``strict``: a
        pipeline whose every command failed is a failure (see :func:`_answers`)."""
        if not self.cluster:
            pipe = self.client.pipeline(transaction=False)
            for k in nskeys:
                add(pipe, k)
            return _answers(pipe, strict)
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, k in enumerate(nskeys):
            node = self.client.get_node_from_key(k)
            nodes[node.name] = node
            by_node.setdefault(node.name, []).append(i)
        out: list[Any] = [missing] * (len(nskeys) * per_key)
        for name, idx in by_node.items():
            breaker = self._breakers.setdefault(name, Breaker())
            if not breaker.allow():
                continue
            try:
                pipe = self.client.get_redis_connection(nodes[name]).pipeline(transaction=False)
                for i in idx:
                    add(pipe, nskeys[i])
                answers = _answers(pipe, strict)
            except Exception as exc:  # this node is down or late: its keys miss
                if breaker.failure():
                    self._log_once(f"node {name}", "remote tier: cluster node %s failed (%s); its keys miss until "
                                   "it answers", name, shown(exc))
                continue
            breaker.success()
            for j, i in enumerate(idx):
                out[i * per_key:(i + 1) * per_key] = answers[j * per_key:(j + 1) * per_key]
        return out


def _answers(pipe: Any, strict: bool = True) -> list[Any]:
    """A pipeline's answers, an error answer in place of a command that failed on its own
    (another type under the key, a write refused for memory); ``strict``: raises when every
    command failed otherwise (the server refuses them all: a protocol or authentication
    problem, for the breaker)."""
    answers = pipe.execute(raise_on_error=False)
    errors = [a for a in answers if isinstance(a, Exception)]
    if strict and errors and len(errors) == len(answers) and not any(str(e).startswith("WRONGTYPE") for e in errors):
        raise errors[0]
    return answers


def shown(exc: BaseException) -> str:
    """An error from the client or the server as a log line shows it: one line, printable,
    bounded, with any URL's password redacted (a server's reply is not trusted text)."""
    text = redact_url(str(exc)) if "://" in str(exc) else str(exc)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text[:200] + ("..." if len(text) > 200 else "")
