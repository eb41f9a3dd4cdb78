"""The ``s3`` backend: pages as objects of an S3 bucket, or of any fsspec filesystem.

Built on :class:`~hicache_storage.storekit.blobstore.BlobStore` (every object is the
core header then the page, so a short, truncated, foreign or renamed object is a miss)
and on ``fsspec``: s3fs's async client for ``s3://`` (AWS, MinIO, Ceph, SeaweedFS,
moto...), and the same code over any other fsspec filesystem (``memory://``,
``file://``, ``gcs://``...). Every batch runs concurrently, at most ``max_concurrency``
requests at a time, on one event loop owned by the backend
(:class:`~hicache_storage.storekit.aioloop.LoopThread`); each call has a deadline.

On S3 a page is written with ``If-None-Match: *`` (first writer wins, atomically, in
the store), as one ``PutObject`` or, from ``multipart_threshold`` up, a multipart
upload whose completion carries the same condition. Options, guarantees and costs per
request: ``docs/backends/s3.md``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, cast

from typing_extensions import override

from hicache_storage.config import Size, redact_text, redacting_repr, scrub
from hicache_storage.config import secret as _secret
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ErrorMap,
)
from hicache_storage.keys import KEY_MAX_LEN
from hicache_storage.protocol import Capabilities
from hicache_storage.secrets import LogScrubber, secret_values
from hicache_storage.storekit.aioloop import LoopThread
from hicache_storage.storekit.blobstore import (
    PRESENT,
    Blob,
    BlobOptions,
    BlobStore,
    Foreign,
    Present,
    Segments,
)
from hicache_storage.storekit.header import HEADER_SIZE

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence

    from hicache_storage.config import StorageConfig
    from hicache_storage.keys import ObjectName

__all__ = ["S3Backend", "S3Options"]

T = TypeVar("T")

#: The longest object key S3 accepts, in bytes of UTF-8.
S3_KEY_MAX_BYTES = 1024
#: Error codes of answers worth asking again (throttling, a server's transient fault).
_RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
    "ServiceUnavailable", "ConditionalRequestConflict", "503", "500", "502", "504", "409",
})  # fmt: skip
#: Error codes that mean the credentials, not the store, are wrong.
_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
    "ExpiredToken", "AuthorizationHeaderMalformed", "403",
})  # fmt: skip
_16_MIB = Size(16 * 2**20)
#: Filesystems (fsspec protocols) whose writes publish a whole object at once.
_ATOMIC_PUT = frozenset({"memory", "gcs", "gs", "abfs", "az", "adl", "oss", "s3", "s3a"})


@redacting_repr
@dataclass(frozen=True)
class S3Options(BlobOptions):
    """Options of the ``s3`` backend (environment: ``HICACHE_STORAGE_S3_<NAME>``).

    Attributes:
        url: where the objects go: ``s3://bucket[/prefix]``, or any fsspec URL
            (``memory://root``, ``file:///path``, ``gcs://bucket/prefix``...). Instead
            of it, ``bucket`` (and ``prefix``) name an S3 location.
        bucket: the S3 bucket (when ``url`` is not given).
        prefix: what every object key starts with, before the object name (joined
            with a ``/``).
        endpoint_url: an S3-compatible server (MinIO, Ceph, SeaweedFS, moto...);
            default: AWS.
        region: the region of the bucket (default: the client's configuration).
        key, secret, token: credentials; default: the usual chain (environment,
            ``~/.aws``, instance role). Never logged or shown.
        path_style: address the bucket in the path (``host/bucket/key``), as most
            servers other than AWS want; default: the client's choice.
        max_concurrency: requests in flight at once, over all calls of this backend.
        exists_lookahead: ``batch_exists`` asks about this many keys ahead of the first
            unanswered one (twice as many each time that many in a row were present, up
            to ``max_concurrency``), and asks nothing more once it meets a miss.
        negative_cache_ttl: seconds a key found absent is answered absent without a
            request (0: off). Another writer's page can be missed for that long.
        multipart_threshold: objects of this size or more are written by multipart
            upload, in parts of half this size (S3 wants parts of at least 5 MiB).
        retries: times a request that met throttling (``503 SlowDown``) or a transient
            fault is sent again, with exponential backoff and jitter, within the deadline.
        deadline: seconds an engine-facing call may take, retries included.
        connect_timeout: seconds to connect to the server.
        read_timeout: seconds to wait for an answer on a connection.
        storage_options: more keyword arguments for the fsspec filesystem (a JSON
            object in the environment). Never shown: it may hold credentials.
    """

    url: str | None = None
    bucket: str | None = None
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    key: str | None = _secret()
    secret: str | None = _secret()
    token: str | None = _secret()
    path_style: bool = False
    max_concurrency: int = 32
    exists_lookahead: int = 16
    negative_cache_ttl: float = 0.0
    multipart_threshold: Size = _16_MIB
    retries: int = 4
    deadline: float = 30.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    storage_options: dict[str, Any] | str | None = _secret()  # noqa: RUF009 - a field

    def fs_options(self) -> dict[str, Any]:
        """``storage_options`` as a dict (a copy; empty when not given)."""
        return dict(self.storage_options) if isinstance(self.storage_options, dict) else {}

    def __post_init__(self) -> None:
        if (self.url is None) == (self.bucket is None):
            raise ConfigError("give either url (s3://bucket/prefix, or any fsspec URL) or bucket")
        if self.max_concurrency < 1 or self.exists_lookahead < 1:
            raise ConfigError("max_concurrency and exists_lookahead must be >= 1")
        if self.retries < 0:
            raise ConfigError("retries must be >= 0")
        for name in ("deadline", "connect_timeout", "read_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds")
        if self.negative_cache_ttl < 0:
            raise ConfigError("negative_cache_ttl must be >= 0")
        if self.multipart_threshold < 2:
            raise ConfigError("multipart_threshold must be at least 2 bytes")
        if isinstance(self.storage_options, str):
            import json

            try:
                parsed = json.loads(self.storage_options)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ConfigError("storage_options must be a JSON object")
            object.__setattr__(self, "storage_options", parsed)
        elif self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError("storage_options must be a mapping")


def _errors() -> ErrorMap:
    mapping: dict[type[BaseException], type[BackendError]] = {
        asyncio.TimeoutError: BackendTimeoutError,
        ConnectionError: BackendUnavailableError,
        PermissionError: BackendError,
        OSError: BackendUnavailableError,
    }
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - the tests install it
        return mapping
    mapping.update({
        bx.ConnectTimeoutError: BackendTimeoutError,
        bx.ReadTimeoutError: BackendTimeoutError,
        bx.EndpointConnectionError: BackendUnavailableError,
        bx.HTTPClientError: BackendUnavailableError,
        bx.ClientError: BackendError,
        bx.BotoCoreError: BackendError,
    })  # fmt: skip
    return mapping


class S3Backend(BlobStore[S3Options]):
    """Pages as objects, written and read concurrently on the backend's event loop."""

    name = "s3"
    capabilities = Capabilities(delete=True, persistent=True, shared=True)
    options_class = S3Options
    error_map: ClassVar[ErrorMap] = _errors()

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._loop = LoopThread(f"hicache-s3-{self.namespace.digest[:12]}", self._forget_session)
        self._fs: Any = None
        self._gate: asyncio.Semaphore | None = None
        self._absent: dict[str, float] = {}  # object path -> when it was found absent
        self._absent_lock = threading.Lock()
        self._writes = 0  # puts started so far (the negative cache's clock)
        self._written: dict[str, int] = {}  # object path -> the number of its last put
        self._closing = False
        opts = self.options
        protocol, self._bucket, root = self._location()
        self._s3 = protocol in ("s3", "s3a")
        self._protocol = protocol
        self._root = root  # "bucket/prefix" (S3) or the filesystem's path of the prefix
        self._where = (
            f"{redact_text(opts.endpoint_url or 'AWS S3')} bucket {self._bucket}"
            if self._s3
            else f"{protocol}://{root}"
        )
        self._secrets = sorted(secret_values(opts))  # storage_options' at any depth too
        _LOG_SCRUB.add(self._secrets)
        _LOG_SCRUB.attach(*_CLIENT_LOGGERS)
        self._check_key_length()
        if not self._s3 and protocol == "memory":
            self.capabilities = Capabilities(delete=True)  # this process only, not kept
        elif not self._s3 and protocol == "file":
            self.capabilities = Capabilities(delete=True, persistent=True, shared=True)
        try:
            self._loop.run(self._open(), opts.deadline)
        except (ConfigError, BackendError):
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - any client failure at construction
            self.close()
            raise BackendUnavailableError(f"cannot reach {self._where}: {self._why(exc)}") from None

    # ------------------------------------------------------------------ set-up

    def _location(self) -> tuple[str, str, str]:
        """(fsspec protocol, bucket or "", root path of this backend's objects)."""
        opts = self.options
        prefix = opts.prefix.strip("/")
        if opts.url is None:
            bucket = opts.bucket or ""
            _check_bucket(bucket)
            return "s3", bucket, "/".join(p for p in (bucket, prefix) if p)
        from fsspec.utils import get_protocol

        protocol = get_protocol(opts.url)
        if protocol in ("s3", "s3a"):
            rest = opts.url.split("://", 1)[1].strip("/")
            bucket = rest.split("/", 1)[0]
            _check_bucket(bucket)
            return "s3", bucket, "/".join(p for p in (rest, prefix) if p)
        try:
            import fsspec

            cls = fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"no fsspec filesystem for {protocol}://: {exc}") from None
        root = "/".join(p for p in (str(cls._strip_protocol(opts.url)).rstrip("/"), prefix) if p)
        if any(c in root for c in "*?["):  # fsspec expands them (clear() would reach others)
            raise ConfigError(f"the location must not hold glob characters (*?[): {root}")
        return protocol, "", root

    def _check_key_length(self) -> None:
        """The longest object key this backend can make fits S3's limit (1024 bytes)."""
        if not self._s3:
            return
        shard = self.config.shard
        longest = (
            len(self._key_prefix().encode())
            + len(self.namespace.digest) + 4 + KEY_MAX_LEN + (len(shard) + 1 if shard else 0)
        )  # fmt: skip
        if longest > S3_KEY_MAX_BYTES:
            raise ConfigError(
                f"prefix is too long: object keys would reach {longest} bytes, over S3's "
                f"{S3_KEY_MAX_BYTES} (keys of {KEY_MAX_LEN} characters)"
            )

    def _key_prefix(self) -> str:
        """What every object key starts with, inside the bucket (S3)."""
        rest = self._root[len(self._bucket) :].strip("/")
        return rest + "/" if rest else ""

    def _filesystem(self) -> Any:
        """The fsspec filesystem, built on the backend's loop (asynchronous where it can)."""
        opts = self.options
        extra = opts.fs_options()
        if self._s3:
            import s3fs

            config: dict[str, Any] = {
                "connect_timeout": opts.connect_timeout,
                "read_timeout": opts.read_timeout,
                "max_pool_connections": opts.max_concurrency,
                "retries": {"total_max_attempts": 1},  # ours, with the deadline in view
            }
            if opts.path_style:
                config["s3"] = {"addressing_style": "path"}
            client: dict[str, Any] = {}
            if opts.endpoint_url:
                client["endpoint_url"] = opts.endpoint_url
            if opts.region:
                client["region_name"] = opts.region
            creds = {k: v for k, v in (("key", opts.key), ("secret", opts.secret),
                                       ("token", opts.token)) if v}  # fmt: skip
            fs = s3fs.S3FileSystem(
                asynchronous=True, loop=self._loop.loop, skip_instance_cache=True,
                use_listings_cache=False, max_concurrency=1,
                config_kwargs=config, client_kwargs=client, **creds, **extra,
            )  # fmt: skip
            fs.retries = 1  # s3fs's own loop: one attempt (the retries are ours)
            return fs
        import fsspec

        cls = fsspec.get_filesystem_class(self._protocol)
        if getattr(cls, "async_impl", False):
            return cls(asynchronous=True, loop=self._loop.loop, skip_instance_cache=True, **extra)
        return cls(skip_instance_cache=True, **extra)

    async def _open(self) -> None:
        """Build the client on the loop and check the location: a clear error now."""
        self._gate = asyncio.Semaphore(self.options.max_concurrency)
        self._fs = self._filesystem()
        if not self._s3:
            await self._call(self._fs_call("makedirs", self._root, exist_ok=True))
            return
        await self._fs.set_session()
        client = await self._fs.get_s3(self._bucket)
        try:
            await client.list_objects_v2(Bucket=self._bucket, Prefix=self._key_prefix(), MaxKeys=1)
        except Exception as exc:
            code = _code(exc)
            if code in ("NoSuchBucket", "404"):
                raise ConfigError(f"{self._where}: the bucket does not exist") from None
            if code in _CREDENTIAL_CODES:
                raise ConfigError(
                    f"{self._where} refused the credentials: {self._why(exc)}"
                ) from None
            if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
                raise ConfigError(
                    f"{self._where}: no credentials (options key and secret, or the usual "
                    "chain: environment, ~/.aws, instance role)"
                ) from None
            raise

    def _forget_session(self) -> None:
        """In a forked child: the parent's client lived on the parent's loop."""
        self._fs = None
        self._gate = None

    async def _ready(self) -> tuple[Any, asyncio.Semaphore]:
        """The client and the concurrency gate (rebuilt in a forked child)."""
        if self._closing:
            raise BackendUnavailableError(f"{type(self).__name__} is closed")
        if self._fs is None or self._gate is None:
            self._gate = asyncio.Semaphore(self.options.max_concurrency)
            self._fs = self._filesystem()
            if self._s3:
                await self._fs.set_session()
        return self._fs, self._gate

    # ------------------------------------------------------------------ requests

    def _fs_call(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], Awaitable[Any]]:
        """A request on the filesystem: its async method, or its sync one in a thread."""

        async def request() -> Any:
            fs, _ = await self._ready()
            if getattr(fs, "async_impl", False) and getattr(fs, "asynchronous", False):
                return await getattr(fs, "_" + method)(*args, **kwargs)
            return await asyncio.to_thread(getattr(fs, method), *args, **kwargs)

        return request

    def _s3_call(self, method: str, **kwargs: Any) -> Callable[[], Awaitable[Any]]:
        async def request() -> Any:
            fs, _ = await self._ready()
            return await fs._call_s3(method, **kwargs)

        return request

    async def _call(self, request: Callable[[], Awaitable[Any]]) -> Any:
        """One request, at most ``max_concurrency`` at once, retried on transient faults."""
        _, gate = await self._ready()
        attempt = 0
        while True:
            async with gate:
                try:
                    return await request()
                except (FileNotFoundError, FileExistsError):
                    raise
                except Exception as exc:
                    if attempt >= self.options.retries or not _transient(exc):
                        raise
            # 50 ms, 100 ms, 200 ms... up to 2 s, with full jitter; the deadline cuts it
            await asyncio.sleep(random.uniform(0, min(2.0, 0.05 * 2**attempt)))
            attempt += 1

    def _path(self, name: ObjectName) -> str:
        return f"{self._root}/{name.path}"

    async def _get_one(self, path: str, limit: int | None) -> bytes | None:
        """The object's bytes, at most ``limit + 1`` of them (a ``Range`` on S3).

        On S3 they carry the object's ETag (:class:`_Read`), for a removal that takes
        that object only.
        """
        try:
            if self._s3:
                bucket, key = self._split(path)
                ranged = {} if limit is None else {"Range": f"bytes=0-{limit}"}

                async def read() -> _Read:
                    fs, _ = await self._ready()
                    try:
                        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **ranged)
                    except Exception as exc:
                        if ranged and _code(exc) in ("InvalidRange", "416"):
                            return _Read(b"")  # (no byte 0: an empty object)
                        raise
                    try:
                        # (at most limit + 1 bytes, even from a server that ignores Range)
                        body = resp["Body"]
                        if limit is None:
                            return _Read(await body.read(), resp.get("ETag"))
                        data = bytearray()
                        while len(data) <= limit:  # (a read may return fewer bytes than asked)
                            chunk = await body.read(limit + 1 - len(data))
                            if not chunk:
                                break
                            data += chunk
                        return _Read(bytes(data), resp.get("ETag"))
                    finally:
                        resp["Body"].close()

                return cast("_Read", await self._call(read))
            end = {} if limit is None else {"start": 0, "end": limit + 1}
            return bytes(await self._call(self._fs_call("cat_file", path, **end)))
        except FileNotFoundError as exc:
            if _code(exc) == "NoSuchBucket":  # not a miss: the store is gone
                raise BackendUnavailableError(f"{self._where}: the bucket does not exist") from None
            return None

    async def _stat(self, path: str) -> tuple[int, str | None] | None:
        """The size and ETag (S3) of the object at ``path``, or None where there is none."""
        try:
            if self._s3:
                bucket, key = self._split(path)
                info = await self._call(self._s3_call("head_object", Bucket=bucket, Key=key))
                return int(info.get("ContentLength", 0)), info.get("ETag")
            info = await self._call(self._fs_call("info", path))
            if info.get("type") not in (None, "file"):
                return None
            return int(info.get("size") or 0), None
        except FileNotFoundError:
            return None

    async def _head_one(self, path: str) -> bool:
        if self._negative(path):
            return False
        started = self._writes
        found = await self._stat(path)
        if found is None:
            if self._written.get(path, -1) < started:  # no put of it began since the HEAD
                self._remember_absent(path)
            return False
        return found[0] >= HEADER_SIZE  # shorter: not one of ours (a miss, as a read would say)

    async def _put_one(self, path: str, data: bytes, again: bool = False) -> bool | Present:
        stored = await self._put_once(path, data)
        if stored is PRESENT and not again:
            # Only another writer's copy of this page (as long as it: a page of this key
            # always is) makes the key stored; anything else there is removed (that
            # object only, by its ETag) and the page written.
            found = await self._stat(path)
            if found is not None and found[0] != len(data):
                await self._remove(path, found[1])
                return await self._put_one(path, data, again=True)
        return stored

    async def _put_once(self, path: str, data: bytes) -> bool | Present:
        self._writes += 1
        if self.options.negative_cache_ttl:
            self._written[path] = self._writes
            if len(self._written) > 65536:
                self._written.clear()  # (then no miss is remembered for a while: safe)
        self._forget_absent(path)
        try:
            if self._s3:
                return await self._put_s3(path, data)
            return await self._put_fs(path, data)
        except FileExistsError:
            return PRESENT
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "412"):  # (a 412 without its condition)
                return PRESENT
            raise

    async def _put_s3(self, path: str, data: bytes) -> bool:
        """One conditional PutObject, or a conditional multipart upload from the threshold."""
        bucket, key = self._split(path)
        if len(data) < self.options.multipart_threshold:
            await self._call(
                self._s3_call("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            )
            return True
        part = max(_MIN_PART, self.options.multipart_threshold // 2)
        made = await self._call(self._s3_call("create_multipart_upload", Bucket=bucket, Key=key))
        upload = made["UploadId"]
        try:
            answers = await asyncio.gather(*[
                self._call(self._s3_call("upload_part", Bucket=bucket, Key=key, UploadId=upload,
                                         PartNumber=n + 1, Body=data[off : off + part]))
                for n, off in enumerate(range(0, len(data), part))
            ])  # fmt: skip
            parts = [{"PartNumber": n + 1, "ETag": a["ETag"]} for n, a in enumerate(answers)]
            await self._call(
                self._s3_call("complete_multipart_upload", Bucket=bucket, Key=key,
                              UploadId=upload, MultipartUpload={"Parts": parts}, IfNoneMatch="*")
            )  # fmt: skip
        except BaseException:
            # Cut short (an error, the deadline, a key already there): abort it, even while
            # being cancelled, or its parts stay in the bucket (and are billed).
            await asyncio.shield(
                self._best_effort(
                    self._s3_call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
                )
            )
            raise
        return True

    async def _put_fs(self, path: str, data: bytes) -> bool | Present:
        """Any other fsspec filesystem: whole objects, first writer wins as far as it can."""
        if self._protocol == "memory":
            with _MEMORY_PUTS:  # this process's only: the check and the write are one step
                fs, _ = await self._ready()
                if fs.exists(path):
                    return PRESENT
                fs.pipe_file(path, data)
            return True
        if self._protocol == "file":
            return await asyncio.to_thread(_publish_local, path, data)
        # Elsewhere: the filesystem's exclusive create (as atomic as it makes it).
        await self._call(self._fs_call("pipe_file", path, data, mode="create"))
        return True

    async def _delete_one(self, path: str) -> bool:
        if await self._stat(path) is None:  # (any size: a short object is removed too)
            return False
        return await self._remove(path, None)

    async def _remove(self, path: str, etag: str | None) -> bool:
        """Remove the object at ``path``; on S3 with ``etag``, only if it is still that one.

        False when the object is gone or (``If-Match``) another one took its place. A
        server that refuses the condition gets the plain request.
        """
        try:
            if not self._s3:
                await self._call(self._fs_call("rm_file", path))
            elif etag is None:
                bucket, key = self._split(path)
                await self._call(self._s3_call("delete_object", Bucket=bucket, Key=key))
            else:
                bucket, key = self._split(path)
                try:
                    await self._call(
                        self._s3_call("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
                    )
                except FileNotFoundError:
                    raise
                except Exception as exc:
                    if _code(exc) in ("PreconditionFailed", "412"):
                        return False  # replaced since it was read: kept
                    if _code(exc) not in ("NotImplemented", "501", "InvalidArgument", "400"):
                        raise
                    return await self._remove(path, None)
        except FileNotFoundError:
            return False
        self._remember_absent(path)
        return True

    async def _best_effort(self, request: Callable[[], Awaitable[Any]]) -> None:
        try:
            await request()
        except Exception:  # noqa: BLE001, S110 - cleaning up after a failure
            pass

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    # ------------------------------------------------------------------ negative cache

    def _negative(self, path: str) -> bool:
        ttl = self.options.negative_cache_ttl
        if not ttl:
            return False
        with self._absent_lock:
            seen = self._absent.get(path)
            if seen is None:
                return False
            if time.monotonic() - seen < ttl:
                return True
            del self._absent[path]
            return False

    def _remember_absent(self, path: str) -> None:
        if not self.options.negative_cache_ttl:
            return
        with self._absent_lock:
            if len(self._absent) >= 65536:  # bounded: drop the oldest half
                for stale in list(self._absent)[:32768]:
                    del self._absent[stale]
            self._absent[path] = time.monotonic()

    def _forget_absent(self, path: str) -> None:
        if self._absent:
            with self._absent_lock:
                self._absent.pop(path, None)

    # ------------------------------------------------------------------ BlobStore's part

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro, self.options.deadline)

    @staticmethod
    async def _each(coros: Sequence[Awaitable[Any]]) -> list[Any]:
        """Every coroutine's result or exception, in order (the gate bounds them)."""
        return list(await asyncio.gather(*coros, return_exceptions=True))

    @override
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | Exception | None]:
        return self._run(self._each([self._get_one(self._path(n), None) for n in names]))

    @override
    def _get_blobs_within(
        self, names: list[ObjectName], limits: list[int | None]
    ) -> Sequence[bytes | Exception | None]:
        coros = [self._get_one(self._path(n), m) for n, m in zip(names, limits, strict=True)]
        return self._run(self._each(coros))

    @override
    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> list[bool | Present | Exception]:
        # One copy: an object body is one buffer (the segments are views of the pool).
        coros = [
            self._put_one(self._path(n), b"".join(s)) for n, s in zip(names, blobs, strict=True)
        ]
        return self._run(self._each(coros))

    @override
    def _exists_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        return self._run(self._each([self._head_one(self._path(n)) for n in names]))

    @override
    def _delete_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        return self._run(self._each([self._delete_one(self._path(n)) for n in names]))

    @override
    def _delete_blobs_if_bad(
        self, names: list[ObjectName], seen: list[Blob | Foreign], limits: list[int | None]
    ) -> list[bool | Exception]:
        # (S3: If-Match the ETag of the object read; other filesystems cannot compare)
        coros = [
            self._remove(self._path(n), getattr(b, "etag", None))
            for n, b in zip(names, seen, strict=True)
        ]
        return self._run(self._each(coros))

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading keys present, asked ``exists_lookahead`` keys ahead.

        Requests go out in order, at most a window beyond the first key not yet
        answered (``exists_lookahead``, doubled while every key is present, up to
        ``max_concurrency``); the first miss (or failure) ends the call, and the requests still
        in flight are cancelled. At the deadline the call answers the run confirmed so
        far.
        """
        paths = [self._path(self.object_name(k)) for k in keys]
        until = time.monotonic() + 0.9 * self.options.deadline
        with self._errors():
            count, error = self._run(self._leading_run(paths, until))
        if error is not None:
            self._item_failed("batch_exists", error)
            self._add_item_errors(1)
        return int(count)

    async def _leading_run(
        self, paths: list[str], until: float
    ) -> tuple[int, BaseException | None]:
        # The window starts at exists_lookahead and doubles each time that many keys in a
        # row were present, up to max_concurrency: a short run wastes few requests, a
        # long one runs at full concurrency.
        window = self.options.exists_lookahead
        widest = max(window, self.options.max_concurrency)
        pending: collections.deque[asyncio.Task[bool]] = collections.deque()
        nxt = count = 0
        try:
            while True:
                while len(pending) < window and nxt < len(paths):
                    pending.append(asyncio.ensure_future(self._head_one(paths[nxt])))
                    nxt += 1
                if not pending:
                    return count, None
                head = pending.popleft()
                try:
                    present = await asyncio.wait_for(head, max(0.0, until - time.monotonic()))
                except TimeoutError:
                    return count, BackendTimeoutError(
                        f"batch_exists: the deadline passed after {count} keys"
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the run ends at a failed key
                    return count, exc
                if not present:
                    return count, None
                count += 1
                if count >= window:
                    window = min(2 * window, widest)
        finally:
            for task in pending:
                task.cancel()

    @override
    def _clear_namespace(self) -> None:
        """Remove every object of this namespace, 1000 at a time.

        Each round (one listing and one delete) has a deadline of its own, so a large
        namespace is cleared in one call; unfinished multipart uploads under the prefix
        are aborted too. Only objects of this namespace's shape go: those of a prefix
        nested in it (``<prefix>/<digest>/...``) are listed, and stay.
        """
        base = f"{self._root}/{self.namespace_prefix}"
        with self._absent_lock:
            self._absent.clear()
        if not self._s3:
            self._run(self._clear_fs(base.rstrip("/")))
            return
        token: str | None = ""
        while token is not None:
            token = self._run(self._clear_round(base, token))
        marker: tuple[str, str] | None = ("", "")
        while marker is not None:
            marker = self._run(self._abort_uploads(base, marker))

    async def _clear_fs(self, base: str) -> None:
        if not await self._call(self._fs_call("exists", base)):
            return
        found = await self._call(self._fs_call("find", base))
        skip = len(self._root) + 1
        mine = [p for p in found if self._is_own_name(p[skip:])]
        if mine:
            await self._call(self._fs_call("rm", mine))

    async def _clear_round(self, base: str, token: str) -> str | None:
        """One listing of up to 1000 keys and their removal; the next token, or None."""
        bucket, prefix = self._split(base)
        listing: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        if token:
            listing["ContinuationToken"] = token
        page = await self._call(self._s3_call("list_objects_v2", **listing))
        skip = len(self._key_prefix())
        keys = [
            {"Key": o["Key"]}
            for o in page.get("Contents", [])
            if self._is_own_name(o["Key"][skip:])
        ]
        if keys:
            done = await self._call(
                self._s3_call(
                    "delete_objects", Bucket=bucket, Delete={"Objects": keys, "Quiet": True}
                )
            )
            if done.get("Errors"):
                first = done["Errors"][0]
                raise BackendError(
                    f"{self._where}: {len(done['Errors'])} objects not removed "
                    f"({first.get('Code')}: {first.get('Message')})"
                )
        more = page.get("IsTruncated") and page.get("NextContinuationToken")
        return str(more) if more else None

    async def _abort_uploads(self, base: str, marker: tuple[str, str]) -> tuple[str, str] | None:
        """Abort one listing of unfinished multipart uploads under ``base``."""
        bucket, prefix = self._split(base)
        listing: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxUploads": 1000}
        if marker[0]:
            listing.update(KeyMarker=marker[0], UploadIdMarker=marker[1])
        page = await self._call(self._s3_call("list_multipart_uploads", **listing))
        skip = len(self._key_prefix())
        await asyncio.gather(*[
            self._call(self._s3_call("abort_multipart_upload", Bucket=bucket, Key=u["Key"],
                                     UploadId=u["UploadId"]))
            for u in page.get("Uploads", []) if self._is_own_name(u["Key"][skip:])
        ])  # fmt: skip
        if not page.get("IsTruncated"):
            return None
        return str(page.get("NextKeyMarker") or ""), str(page.get("NextUploadIdMarker") or "")

    # ------------------------------------------------------------------ the rest

    def _why(self, exc: BaseException) -> str:
        """An error's text without secrets (a client may echo them)."""
        return scrub(f"{type(exc).__name__}: {exc}", self._secrets)

    @override
    def _secret_values(self) -> list[str]:
        # (the base would take storage_options whole: its values are what may leak)
        return [*super()._secret_values(), *self._secrets]

    @override
    def close(self) -> None:
        self._closing = True
        _LOG_SCRUB.forget(self._secrets)
        fs, self._fs = self._fs, None
        final = None
        if fs is not None and self._s3 and getattr(fs, "_s3", None) is not None:
            final = fs._s3.close()
        self._loop.close(final)

    @override
    def __repr__(self) -> str:
        return f"S3Backend(location={self._where!r}, namespace={self.namespace.digest})"


class _Read(bytes):
    """An object's bytes as read from S3, with the ETag of the object they came from."""

    def __new__(cls, data: bytes, etag: str | None = None) -> Self:
        read = super().__new__(cls, data)
        read.etag = etag
        return read

    etag: str | None


_MEMORY_PUTS = threading.Lock()
#: The smallest part of a multipart upload S3 accepts (but the last).
_MIN_PART = 5 * 2**20


def _publish_local(path: str, data: bytes) -> bool | Present:
    """Write ``data`` to a temporary file beside ``path``, then link it there.

    ``link`` fails when ``path`` exists: the first writer wins, and no reader ever sees
    part of a value (a rename would replace one).
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(temp, path)
        except FileExistsError:
            return PRESENT
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


#: The S3 client's loggers. botocore logs request headers at DEBUG: the access key in
#: ``Authorization``, the session token, the SSE-C customer key (base64) and its MD5.
_CLIENT_LOGGERS = ("botocore", "botocore.endpoint", "botocore.auth", "botocore.hooks",
                   "botocore.parsers", "botocore.retryhandler", "botocore.credentials",
                   "botocore.httpsession", "botocore.awsrequest", "botocore.client",
                   "botocore.utils", "botocore.regions", "botocore.handlers", "botocore.signers",
                   "botocore.httpchecksum", "aiobotocore", "aiobotocore.endpoint",
                   "aiobotocore.httpsession", "aiobotocore.credentials", "aiobotocore.client",
                   "aiobotocore.httpchecksum", "s3fs", "fsspec")  # fmt: skip
#: Cuts live backends' secrets out of those loggers' records.
_LOG_SCRUB = LogScrubber()


def _check_bucket(bucket: str) -> None:
    if not 3 <= len(bucket) <= 63 or bucket != bucket.lower() or "/" in bucket:
        raise ConfigError(
            f"bad bucket name {bucket!r}: 3 to 63 lower-case letters, digits, '.' and '-'"
        )


def _code(exc: BaseException) -> str:
    """The S3 error code of ``exc`` or of what caused it ("" when it has none)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return ""
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            code = str(error.get("Code") or "")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code or (str(status) if status else "")
        seen = seen.__cause__ or seen.__context__
    return ""


def _transient(exc: BaseException) -> bool:
    """True if ``exc`` is worth a retry: throttling, a 5xx, a dropped connection."""
    if _code(exc) in _RETRY_CODES:
        return True
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover
        return False
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, (bx.HTTPClientError, bx.ConnectionError, asyncio.TimeoutError)):
            return True
        name = type(seen).__name__
        if name in ("ClientPayloadError", "ServerDisconnectedError", "ClientOSError"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
