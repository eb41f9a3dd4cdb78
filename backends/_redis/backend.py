"""The ``redis`` backend's store: :class:`RedisBackend` (see the package docs)."""

from __future__ import annotations

import hashlib
import os
import re
import ssl
import time
from typing import TYPE_CHECKING, Any, ClassVar, cast

from typing_extensions import override

from hicache_storage.config import scrub
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ErrorMap,
)
from hicache_storage.protocol import Capabilities
from hicache_storage.storekit.blobstore import (
    Blob,
    BlobStore,
    Foreign,
    Present,
    Segments,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.config import StorageConfig
    from hicache_storage.keys import ObjectName
try:  # the client is an extra: without it the backend says how to install it
    from redis import exceptions as _rx
except ImportError:  # pragma: no cover - the tests install it
    _rx = None  # type: ignore[assignment]
from hicache_storage.backends._redis.options import RedisOptions
from hicache_storage.backends._redis.wire import (
    LONGEST,
    Value,
    count_reply,
    long_enough,
    packing,
    packing_pool,
    queued,
    read_reply,
    stored_reply,
)

__all__ = ["RedisBackend"]


_GLOB = re.compile(r"([*?\[\]\\])")


#: Removes KEYS[1] if it holds what is not a string, or a string that is still bad:
#: ``longer <n>`` (over n bytes), ``other <n>`` (not n bytes) or ``same <n> <sha1>``
#: (the n-byte value seen, by its SHA-1; read only when the length matches). One step on
#: the server, so a good page that another writer stored after the bad one was seen stays.
#: (Bytes, as sent: Lua source, not a message.)
_REMOVE_BAD = b"""
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind == 'string' then
  local n, m = redis.call('STRLEN', KEYS[1]), tonumber(ARGV[2])
  local bad
  if ARGV[1] == 'longer' then bad = n > m
  elseif ARGV[1] == 'other' then bad = n ~= m
  else bad = n == m and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[3] end
  if not bad then return 0 end
end
return redis.call('UNLINK', KEYS[1])
"""


#: redis-py's exceptions as store failures.
_ERRORS: ErrorMap = (
    {
        _rx.TimeoutError: BackendTimeoutError,
        _rx.ConnectionError: BackendUnavailableError,
        _rx.BusyLoadingError: BackendUnavailableError,
        _rx.RedisError: BackendError,
        _rx.RedisClusterException: BackendUnavailableError,  # not a RedisError
        OSError: BackendUnavailableError,
    }
    if _rx is not None
    else {}
)


class RedisBackend(BlobStore[RedisOptions]):
    """Pages in a Redis server: one value per page, one round trip per batch."""

    name = "redis"
    capabilities = Capabilities(delete=True, persistent=True, shared=True)
    options_class = RedisOptions
    error_map: ClassVar[ErrorMap] = _ERRORS

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._client: Any = None
        self._down: dict[str, float] = {}  # cluster node -> until when it is left alone
        try:
            import redis
            from redis.connection import parse_url
        except ImportError as exc:
            raise ConfigError(
                "the redis backend needs the redis client: pip install 'hicache-storage[redis]'"
            ) from exc
        opts = self.options
        # The URL's parts, then the options over them (redis-py's from_url would let the
        # URL win). Messages name the server from these parts, never from the URL text
        # (a password with a '#' or a '/' in it would defeat any pattern).
        try:
            parts: dict[str, Any] = parse_url(opts.url)  # type: ignore[no-untyped-call]
        except (ValueError, TypeError):
            raise ConfigError(
                "bad redis url: expected redis://[user[:password]@]host[:port][/db], "
                "rediss://... or unix:///path"
            ) from None
        for name in ("username", "password", "db"):
            if getattr(opts, name) is not None:
                parts[name] = getattr(opts, name)
        parts.update(self._tls(parts))
        self._where = (
            f"unix:{parts['path']}"
            if "path" in parts
            else f"{parts.get('host', 'localhost')}:{parts.get('port', 6379)}"
        ) + f" db {parts.get('db', 0)}"
        self._secrets = [v for v in (parts.get("password"), opts.password) if v]
        self._prefix = opts.prefix
        self._px = max(1, round(opts.ttl * 1000)) if opts.ttl else None
        try:
            # (a cluster client reads the slot map from the URL's node here already)
            self._client = self._cluster(parts) if opts.cluster else self._standalone(parts)
            self._client.ping()
            if not opts.cluster and self._is_cluster_node():
                raise ConfigError(
                    f"redis at {self._where} is a Redis Cluster node: set the redis option "
                    "cluster to true"
                )
        except ConfigError:
            self._shutdown()
            raise
        except redis.exceptions.AuthenticationError as exc:
            self._shutdown()
            raise ConfigError(
                f"redis at {self._where} refused the credentials: {self._why(exc)}"
            ) from None
        except redis.exceptions.ResponseError as exc:  # NOAUTH, WRONGPASS, ACL denials
            self._shutdown()
            raise ConfigError(
                f"redis at {self._where} refused the connection: {self._why(exc)}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - no server, or one that is not Redis
            self._shutdown()
            if _tls_refused(exc):
                raise ConfigError(
                    f"redis at {self._where}: the TLS handshake failed: {self._why(exc)}"
                ) from None
            raise BackendUnavailableError(
                f"no redis server answers at {self._where}: {self._why(exc)}"
            ) from None

    def _tls(self, parts: dict[str, Any]) -> dict[str, Any]:
        """The client's TLS arguments from the ``ssl_*`` options (a ``rediss://`` URL only)."""
        from redis.connection import SSLConnection

        opts = self.options
        files = {
            "ssl_ca_certs": opts.ssl_ca_certs,
            "ssl_certfile": opts.ssl_certfile,
            "ssl_keyfile": opts.ssl_keyfile,
        }
        asked = {k: v for k, v in files.items() if v is not None}
        if parts.get("connection_class") is not SSLConnection:
            # (any of them over plaintext would be ignored: the client would not use TLS)
            named = [*asked] + [
                n for n in ("ssl_cert_reqs", "ssl_check_hostname") if getattr(opts, n) is not None
            ]
            named += [f"{k} (in the url)" for k in sorted(parts) if k.startswith("ssl_")]
            if named:
                raise ConfigError(
                    f"{', '.join(named)}: TLS options need a rediss:// url (TLS); this url "
                    "is plaintext: use rediss://host:port"
                )
            return {}
        for name, path in asked.items():
            if not os.path.isfile(path):
                raise ConfigError(f"{name}: not a file: {path}")
        out: dict[str, Any] = dict(asked)
        reqs = opts.ssl_cert_reqs if opts.ssl_cert_reqs is not None else parts.get("ssl_cert_reqs")
        if reqs is not None:
            out["ssl_cert_reqs"] = reqs
        if opts.ssl_check_hostname is not None:
            out["ssl_check_hostname"] = opts.ssl_check_hostname
        elif reqs == "none" and "ssl_check_hostname" not in parts:
            out["ssl_check_hostname"] = False  # nothing is checked: nor is the name
        return out

    def _is_cluster_node(self) -> bool:
        """True if the server says it runs in cluster mode (False if it may not say)."""
        from redis.exceptions import ResponseError

        try:
            info = self._client.info("cluster")
        except ResponseError:  # an ACL user not allowed INFO: cannot tell
            return False
        return bool(info.get("cluster_enabled"))

    def _standalone(self, parts: dict[str, Any]) -> Any:
        """A client of one server.

        Its pool waits for a free connection (up to the socket timeout) rather than
        failing a call made while all are busy.
        """
        import redis

        opts = self.options
        pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            max_connections=opts.max_concurrency,
            timeout=opts.socket_timeout,
            socket_timeout=opts.socket_timeout,
            socket_connect_timeout=opts.connect_timeout,
            health_check_interval=30,
            **{
                **parts,
                "connection_class": packing(parts.get("connection_class", redis.Connection)),
            },
        )
        return redis.Redis(connection_pool=pool)

    def _cluster(self, parts: dict[str, Any]) -> Any:
        """A Redis Cluster client that starts from the node of the URL.

        The client is given a URL of the node alone (scheme, host, port: the URL's own
        options would override ours) and a pool class that gives each node's connections
        the page packer.
        """
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.connection import SSLConnection
        from redis.retry import Retry

        if parts.pop("db", 0) or "path" in parts:
            raise ConfigError("a Redis Cluster is reached over TCP and has only db 0")
        opts = self.options
        host, port = parts.pop("host", "localhost"), parts.pop("port", 6379)
        scheme = "rediss" if parts.pop("connection_class", None) is SSLConnection else "redis"
        return RedisCluster(
            url=f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}",
            connection_pool_class=packing_pool(),
            socket_timeout=opts.socket_timeout,
            socket_connect_timeout=opts.connect_timeout,
            # No retries: a dead node is a failure shape within the timeouts, not rounds
            # of them (the engine recomputes; the next call finds the node again).
            retry=Retry(NoBackoff(), 0),
            **parts,
        )

    def _pipeline(self) -> Any:
        """A pipeline without MULTI (a cluster's splits itself by the owner of each key)."""
        if self.options.cluster:
            return self._client.pipeline()
        return self._client.pipeline(transaction=False)

    def _execute(self, pipe: Any) -> list[Any]:
        """Run a pipeline: one answer or error per command, in order.

        Standalone, it raises only when the server cannot be reached. In a cluster it
        raises only for a command that could not be routed, and:

        * redis-py re-sends each command that met a timeout alone, one more timeout
          each, so a frozen node (a stopped process, a silent network) would hold a
          batch for as many timeouts as it has keys there. The commands go out once
          without redirections; only those answered ``MOVED`` or ``ASK`` go again,
          through the client, which follows the redirection (``TRYAGAIN`` is left to
          the caller: see :meth:`_cluster_mget`).
        * redis-py fails the whole batch when it cannot connect to one node (refused,
          or a handshake that timed out); then the commands go again one node at a
          time, so only that node's pages fail; and for :meth:`_pause` seconds that
          node's commands fail at once, without a connection attempt.
        """
        if not self.options.cluster:
            return list(pipe.execute(raise_on_error=False))
        queue = queued(pipe)
        if queue is None:  # a redis-py without it: its own handling
            return list(pipe.execute(raise_on_error=False))
        from redis.exceptions import AskError, MovedError
        from redis.exceptions import ConnectionError as Unreachable
        from redis.exceptions import TimeoutError as TimedOut

        if self._paused_nodes():
            pipe.reset()
            replies = self._node_by_node(queue)
        else:
            try:
                replies = self._send_once(pipe, queue)
            except (Unreachable, TimedOut):  # a node could not be reached
                replies = self._node_by_node(queue)
            else:
                for command, reply in zip(queue, replies, strict=True):
                    if isinstance(reply, (Unreachable, TimedOut)):
                        self._pause_node(self._node_of(command))
        redirected = [i for i, r in enumerate(replies) if isinstance(r, (MovedError, AskError))]
        if redirected:
            again = self._client.pipeline()
            for i in redirected:
                again.execute_command(*queue[i].args, **queue[i].options)
            for i, reply in zip(redirected, again.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        return replies

    @staticmethod
    def _send_once(pipe: Any, queue: list[Any]) -> list[Any]:
        """A cluster pipeline's commands sent once, without following redirections."""
        try:
            return list(
                pipe.send_cluster_commands(queue, raise_on_error=False, allow_redirections=False)
            )
        finally:
            pipe.reset()

    def _node_of(self, command: Any) -> str:
        args = command.args
        node = self._client.get_node_from_key(args[3] if args[0] == "EVAL" else args[1])
        return str(node.name) if node is not None else ""

    def _node_by_node(self, queue: list[Any]) -> list[Any]:
        """The commands of ``queue``, one pipeline per node, one node after another.

        A node that cannot be reached fails its own commands only, and is paused.
        """
        from redis.exceptions import ConnectionError as Unreachable
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as TimedOut

        groups: dict[str, list[int]] = {}
        for i, command in enumerate(queue):
            groups.setdefault(self._node_of(command), []).append(i)
        replies: list[Any] = [None] * len(queue)
        paused = self._paused_nodes()
        for node, idx in groups.items():
            got: list[Any]
            if node in paused:
                got = [BackendUnavailableError(f"redis node {node} did not answer lately")] * len(
                    idx
                )
            else:
                pipe = self._client.pipeline()
                for i in idx:
                    pipe.execute_command(*queue[i].args, **queue[i].options)
                part = queued(pipe)
                try:
                    got = self._send_once(pipe, part if part is not None else [])
                except (Unreachable, TimedOut) as exc:
                    self._pause_node(node)
                    got = [exc] * len(idx)
                except RedisError as exc:
                    got = [exc] * len(idx)
            for i, reply in zip(idx, got, strict=True):
                replies[i] = reply
        return replies

    def _pause(self) -> float:
        """Seconds a cluster node that did not answer is left alone: twice the timeout."""
        return min(30.0, max(1.0, 2 * self.options.socket_timeout))

    def _pause_node(self, node: str) -> None:
        self._down[node] = time.monotonic() + self._pause()

    def _paused_nodes(self) -> set[str]:
        if not self._down:
            return set()
        now = time.monotonic()
        for node, until in list(self._down.items()):
            if until <= now:
                self._down.pop(node, None)  # its next command tries it again
        return set(self._down)

    def _why(self, exc: BaseException) -> str:
        """An error's text without secrets (the server or the client may echo them)."""
        return scrub(f"{type(exc).__name__}: {exc}", self._secrets)

    def _keys(self, names: list[ObjectName]) -> list[str]:
        prefix = self._prefix
        return [prefix + n.path for n in names]

    @override
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | Exception | None]:
        # (no decode_responses: the client returns bytes, or None for a missing key)
        keys = self._keys(names)
        if self.options.cluster:
            return self._cluster_mget(keys)
        return cast("list[bytes | None]", self._client.mget(keys))

    @override
    def _get_blobs_within(
        self, names: list[ObjectName], limits: list[int | None]
    ) -> Sequence[bytes | Foreign | Exception | None]:
        """One ``GETRANGE key 0 <limit>`` per key, in one pipeline (``MGET`` without limits).

        A value longer than its limit comes back cut to one byte more (then refused): a
        planted huge value costs the page's size, not its own.
        """
        if all(limit is None for limit in limits):
            return self._get_blobs(names)
        pipe = self._pipeline()
        for key, limit in zip(self._keys(names), limits, strict=True):
            if limit is None:
                pipe.get(key)
            else:
                pipe.getrange(key, 0, limit)  # (both ends included: at most limit + 1 bytes)
        return [read_reply(r) for r in self._execute(pipe)]

    def _cluster_mget(self, keys: list[str]) -> list[bytes | Exception | None]:
        """One ``MGET`` per slot, in one pipeline per node; a failed node fails its pages.

        (redis-py's ``mget_nonatomic`` fails the whole batch for one node, and after a
        timeout re-sends each slot's ``MGET`` alone, one timeout after another.) A slot
        in the middle of a migration answers ``TRYAGAIN`` to an ``MGET`` of keys on both
        sides: its keys are read again one ``GET`` each.
        """
        from redis.exceptions import TryAgainError

        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(self._client.keyslot(key), []).append(i)
        pipe = self._pipeline()
        for idx in by_slot.values():
            pipe.execute_command("MGET", *[keys[i] for i in idx])
        out: list[bytes | Exception | None] = [None] * len(keys)
        split: list[int] = []  # keys of slots being migrated, part here and part there
        for idx, reply in zip(by_slot.values(), self._execute(pipe), strict=True):
            if isinstance(reply, TryAgainError):
                split += idx
            elif isinstance(reply, Exception):
                for i in idx:
                    out[i] = reply
            else:
                for i, value in zip(idx, reply, strict=True):
                    out[i] = value
        if split:  # one GET per key: each follows its own ASK
            pipe = self._pipeline()
            for i in split:
                pipe.get(keys[i])
            for i, value in zip(split, self._execute(pipe), strict=True):
                out[i] = value
        return out

    @override
    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> list[bool | Present | Exception]:
        keys = self._keys(names)
        # (sent as the header, then views of the page buffers: see PagePacker)
        values = [Value(segments) for segments in blobs]
        answers = self._put(keys, values, clean=False)
        # A key held by what cannot be this page (another type, a value of another
        # length: a page of this key is always as long) is cleaned and the page stored:
        # one more round trip, for those only.
        again = [i for i, answer in enumerate(answers) if answer is None]
        if again:
            retried = self._put([keys[i] for i in again], [values[i] for i in again], clean=True)
            for i, answer in zip(again, retried, strict=True):
                answers[i] = answer
        return [
            BackendError("the key holds a value that is not a page") if a is None else a
            for a in answers
        ]

    def _put(
        self, keys: list[str], values: list[Value], *, clean: bool
    ) -> list[bool | Present | Exception | None]:
        """``SET NX`` then ``STRLEN`` of each key, in one pipeline.

        With ``clean``, what is not this page (another type, another length) is removed
        first. Each answer: stored, present (a value as long as this one: another
        writer's copy of the page), failed, or None (taken by what is not this page).
        """
        pipe = self._pipeline()
        for key, value in zip(keys, values, strict=True):
            if clean:
                pipe.execute_command("EVAL", _REMOVE_BAD, 1, key, "other", value.nbytes)
            pipe.set(key, value, nx=True, px=self._px)
            pipe.strlen(key)
        replies = self._execute(pipe)
        step = 3 if clean else 2
        return [
            stored_reply(replies[i + step - 2], replies[i + step - 1], values[i // step].nbytes)
            for i in range(0, len(replies), step)
        ]

    @override
    def _exists_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        # STRLEN, not EXISTS: a key of another type, or a value shorter than any header, is
        # not a page (a read could never load it). One answer per key, in one pipeline.
        pipe = self._pipeline()
        for key in self._keys(names):
            pipe.strlen(key)
        return [long_enough(r) for r in self._execute(pipe)]

    @override
    def _delete_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        pipe = self._pipeline()
        for key in self._keys(names):
            pipe.unlink(key)
        return [count_reply(r) for r in self._execute(pipe)]

    @override
    def _delete_blobs_if_bad(
        self, names: list[ObjectName], seen: list[Blob | Foreign], limits: list[int | None]
    ) -> list[bool | Exception]:
        """Each key removed by :data:`_REMOVE_BAD`, in one pipeline, only if still bad.

        That is: while it holds the value seen (the same length and SHA-1), or, for one
        seen cut or of another type, while it is not a string or is longer than its limit.
        """
        pipe = self._pipeline()
        for key, blob, limit in zip(self._keys(names), seen, limits, strict=True):
            if isinstance(blob, Foreign):  # (of another type: any string is left alone)
                args: tuple[object, ...] = ("longer", LONGEST if limit is None else limit)
            elif limit is not None and memoryview(blob).nbytes > limit:
                args = ("longer", limit)
            else:
                args = ("same", memoryview(blob).nbytes, hashlib.sha1(blob).hexdigest())
            pipe.execute_command("EVAL", _REMOVE_BAD, 1, key, *args)
        return [count_reply(r) for r in self._execute(pipe)]

    @override
    def _clear_namespace(self) -> None:
        """``SCAN`` this namespace's keys and ``UNLINK`` them, a batch at a time.

        The server never runs a command longer than one batch (``KEYS`` or ``FLUSHDB``
        would block it, or remove what is not ours). Only keys of this namespace's shape
        go: the keys of a prefix nested in it (``<prefix><digest>/...``) stay.
        """
        pattern = _GLOB.sub(r"\\\1", self._prefix + self.namespace_prefix) + "[0-9a-f][0-9a-f]/*"
        skip = len(self._prefix.encode())
        batch: list[bytes] = []
        # (a cluster client scans every primary)
        for key in self._client.scan_iter(match=pattern, count=self.options.clear_batch):
            if not self._is_own_name(key[skip:].decode("ascii", "replace")):
                continue
            batch.append(key)
            if len(batch) >= self.options.clear_batch:
                self._unlink(batch)
                batch = []
        if batch:
            self._unlink(batch)

    def _unlink(self, keys: list[bytes]) -> None:
        if not self.options.cluster:
            self._client.unlink(*keys)
            return
        pipe = self._pipeline()  # keys of many slots: one command per key, split by node
        for key in keys:
            pipe.unlink(key)
        for reply in self._execute(pipe):
            if isinstance(reply, Exception):
                raise reply

    @override
    def usage(self) -> dict[str, int]:
        """The protocol's figures, and ``connections``.

        The figures are -1 (a server shared with others is not counted here);
        ``connections`` are this instance's open connections (every node's, in a cluster).
        """
        out = super().usage()
        out["connections"] = self._open_connections()
        return out

    def _open_connections(self) -> int:
        """Connections of this instance's pools with a live socket (-1: cannot tell)."""
        client = self._client
        if client is None:
            return 0
        try:
            if self.options.cluster:
                pools = [
                    n.redis_connection.connection_pool
                    for n in client.get_nodes()
                    if n.redis_connection is not None
                ]
            else:
                pools = [client.connection_pool]
            total = 0
            for pool in pools:
                # (redis-py keeps them in _connections, or _available/_in_use lists)
                conns = list(getattr(pool, "_connections", None) or ())
                conns += list(getattr(pool, "_available_connections", None) or ())
                conns += list(getattr(pool, "_in_use_connections", None) or ())
                total += sum(getattr(c, "_sock", None) is not None for c in set(conns))
            return total
        except Exception:  # noqa: BLE001 - a figure for the metrics, never a failure
            return -1

    @override
    def close(self) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        """Close the client and every connection of its pool (the client does not own it)."""
        if self._client is None:
            return
        if self.options.cluster:  # every node's pool: the nodes' clients do not own them
            for node in self._client.get_nodes():
                if node.redis_connection is not None:
                    node.redis_connection.connection_pool.disconnect()
            self._client.close()
            return
        self._client.close()
        self._client.connection_pool.disconnect()

    @override
    def __repr__(self) -> str:
        return (
            f"RedisBackend(server={self._where!r}, prefix={self._prefix!r}, "
            f"namespace={self.namespace.digest})"
        )


def _tls_refused(exc: BaseException) -> bool:
    """True if ``exc`` (or what caused it) is a TLS failure that configuration causes.

    A certificate that does not verify, one the server wants and did not get, or a
    certificate or key file that cannot be used; not a connection cut during the
    handshake (a busy server), which is the server's state, not the configuration.
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        if isinstance(seen, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
            return False
        if isinstance(seen, ssl.SSLError):
            text = f"{seen.reason or ''} {seen}".upper()
            return any(w in text for w in ("CERTIFICATE", "PEM", "KEY", "X509", "CA_MD"))
        seen = seen.__cause__ or seen.__context__
    return False
