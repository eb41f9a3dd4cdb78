"""The ``s3`` backend's store: :class:`S3Backend` (see the package docs)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from typing_extensions import override

from hicache_storage.config import redact_text, scrub
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ErrorMap,
)
from hicache_storage.keys import KEY_MAX_LEN
from hicache_storage.protocol import Capabilities
from hicache_storage.secrets import secret_values
from hicache_storage.storekit.aioloop import LoopThread
from hicache_storage.storekit.blobstore import (
    PRESENT,
    Blob,
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
from hicache_storage.backends._s3.faults import (
    CLIENT_LOGGERS,
    CREDENTIAL_CODES,
    LOG_SCRUB,
    error_code,
    is_transient,
    s3_error_map,
)
from hicache_storage.backends._s3.objects import MEMORY_PUTS, MIN_PART, Read, publish_local
from hicache_storage.backends._s3.options import S3Options, check_bucket

__all__ = ["S3Backend"]


T = TypeVar("T")


logger = logging.getLogger(__name__)

#: The longest object key S3 accepts, in bytes of UTF-8.
S3_KEY_MAX_BYTES = 1024

#: Tries at aborting a multipart upload that was cut short.
ABORT_TRIES = 4
#: Seconds an abort waits for the cut parts to stop, and close() for aborts under way.
ABORT_WAIT = 5.0


class S3Backend(BlobStore[S3Options]):
    """Pages as objects, written and read concurrently on the backend's event loop."""

    name = "s3"
    capabilities = Capabilities(delete=True, persistent=True, shared=True)
    options_class = S3Options
    error_map: ClassVar[ErrorMap] = s3_error_map()

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
        self._closing_fs: Any = None  # the client, for the aborts that close() waits for
        self._cleanups: set[asyncio.Task[None]] = set()  # aborts under way
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
        LOG_SCRUB.add(self._secrets)
        LOG_SCRUB.attach(*CLIENT_LOGGERS)
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
            check_bucket(bucket)
            return "s3", bucket, "/".join(p for p in (bucket, prefix) if p)
        from fsspec.utils import get_protocol

        protocol = get_protocol(opts.url)
        if protocol in ("s3", "s3a"):
            rest = opts.url.split("://", 1)[1].strip("/")
            bucket = rest.split("/", 1)[0]
            check_bucket(bucket)
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
            code = error_code(exc)
            if code in ("NoSuchBucket", "404"):
                raise ConfigError(f"{self._where}: the bucket does not exist") from None
            if code in CREDENTIAL_CODES:
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

    async def _ready(self, cleanup: bool = False) -> tuple[Any, asyncio.Semaphore]:
        """The client and the concurrency gate (rebuilt in a forked child).

        Closing refuses new requests, except the ``cleanup`` of what was cut (aborts).
        """
        if self._closing:
            if cleanup and self._closing_fs is not None and self._gate is not None:
                return self._closing_fs, self._gate  # (until the loop ends)
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

    def _s3_call(
        self, method: str, *, cleanup: bool = False, **kwargs: Any
    ) -> Callable[[], Awaitable[Any]]:
        async def request() -> Any:
            fs, _ = await self._ready(cleanup)
            return await fs._call_s3(method, **kwargs)

        return request

    async def _call(self, request: Callable[[], Awaitable[Any]], cleanup: bool = False) -> Any:
        """One request, at most ``max_concurrency`` at once, retried on transient faults.

        ``cleanup``: an abort, which closing lets through (see :meth:`_ready`).
        """
        _, gate = await self._ready(cleanup)
        attempt = 0
        while True:
            async with gate:
                try:
                    return await request()
                except (FileNotFoundError, FileExistsError):
                    raise
                except Exception as exc:
                    if attempt >= self.options.retries or not is_transient(exc):
                        raise
            # 50 ms, 100 ms, 200 ms... up to 2 s, with full jitter; the deadline cuts it
            await asyncio.sleep(random.uniform(0, min(2.0, 0.05 * 2**attempt)))
            attempt += 1

    def _path(self, name: ObjectName) -> str:
        return f"{self._root}/{name.path}"

    async def _get_one(self, path: str, limit: int | None) -> bytes | None:
        """The object's bytes, at most ``limit + 1`` of them (a ``Range`` on S3).

        On S3 they carry the object's ETag (:class:`Read`), for a removal that takes
        that object only.
        """
        try:
            if self._s3:
                bucket, key = self._split(path)
                ranged = {} if limit is None else {"Range": f"bytes=0-{limit}"}

                async def read() -> Read:
                    fs, _ = await self._ready()
                    try:
                        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **ranged)
                    except Exception as exc:
                        if ranged and error_code(exc) in ("InvalidRange", "416"):
                            return Read(b"")  # (no byte 0: an empty object)
                        raise
                    try:
                        # (at most limit + 1 bytes, even from a server that ignores Range)
                        body = resp["Body"]
                        if limit is None:
                            return Read(await body.read(), resp.get("ETag"))
                        data = bytearray()
                        while len(data) <= limit:  # (a read may return fewer bytes than asked)
                            chunk = await body.read(limit + 1 - len(data))
                            if not chunk:
                                break
                            data += chunk
                        return Read(bytes(data), resp.get("ETag"))
                    finally:
                        resp["Body"].close()

                return cast("Read", await self._call(read))
            end = {} if limit is None else {"start": 0, "end": limit + 1}
            return bytes(await self._call(self._fs_call("cat_file", path, **end)))
        except FileNotFoundError as exc:
            if error_code(exc) == "NoSuchBucket":  # not a miss: the store is gone
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
            if error_code(exc) in ("PreconditionFailed", "412"):  # (a 412 without its condition)
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
        part = max(MIN_PART, self.options.multipart_threshold // 2)
        # The create is shielded: cut while it is on the wire, it may still make an
        # upload on the server, which is then aborted as soon as its answer names it.
        creating = asyncio.ensure_future(
            self._call(self._s3_call("create_multipart_upload", Bucket=bucket, Key=key))
        )
        try:
            made = await asyncio.shield(creating)
        except BaseException:
            if not creating.cancelled():
                self._keep(self._abort_once_made(creating, bucket, key))
            raise
        upload = made["UploadId"]
        parts_sent = [
            asyncio.ensure_future(
                self._call(self._s3_call("upload_part", Bucket=bucket, Key=key, UploadId=upload,
                                         PartNumber=n + 1, Body=data[off : off + part]))
            )
            for n, off in enumerate(range(0, len(data), part))
        ]  # fmt: skip
        try:
            answers = await asyncio.gather(*parts_sent)
            parts = [{"PartNumber": n + 1, "ETag": a["ETag"]} for n, a in enumerate(answers)]
            await self._call(
                self._s3_call("complete_multipart_upload", Bucket=bucket, Key=key,
                              UploadId=upload, MultipartUpload={"Parts": parts}, IfNoneMatch="*")
            )  # fmt: skip
        except BaseException:
            # Cut short (an error, the deadline, a key already there): stop the other
            # parts, then abort, even while being cancelled, or its parts stay in the
            # bucket (and are billed).
            for task in parts_sent:
                task.cancel()
            await self._outlast(self._keep(self._abort_after(parts_sent, bucket, key, upload)))
            raise
        return True

    def _keep(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` on the loop to its end, whoever stops waiting for it."""
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _abort_once_made(self, creating: asyncio.Future[Any], bucket: str, key: str) -> None:
        try:
            made = await creating
        except BaseException:  # noqa: BLE001 - no upload was made
            return
        await self._abort_upload(bucket, key, made["UploadId"])

    @staticmethod
    async def _outlast(task: asyncio.Task[None]) -> None:
        """Wait for ``task`` through any number of cancellations.

        A closing loop cancels every task it sees, and gather cancels its children
        again; bounded, since a cleanup ends on its own.
        """
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    async def _abort_after(
        self, parts: Sequence[asyncio.Future[Any]], bucket: str, key: str, upload: str
    ) -> None:
        """Abort once the cancelled parts have stopped (none lands after the abort)."""
        await asyncio.wait(parts, timeout=ABORT_WAIT)
        await self._abort_upload(bucket, key, upload)

    async def _drain_cleanups(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the aborts under way, at close."""
        for _ in range(3):  # (a call cut just now may still be starting its cleanup)
            await asyncio.sleep(0)
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=timeout)

    async def _abort_upload(self, bucket: str, key: str, upload: str) -> None:
        """Abort a multipart upload, retried (its parts are billed while it stays).

        Any failure is retried a few times, not only transient ones: the connection
        that carried the cut parts may be the one that answers. What still fails is
        left to :meth:`clear`, which aborts every upload of the namespace.
        """
        request = self._s3_call(
            "abort_multipart_upload", cleanup=True, Bucket=bucket, Key=key, UploadId=upload
        )
        for attempt in range(ABORT_TRIES):
            try:
                await self._call(request, cleanup=True)
                return
            except FileNotFoundError:
                return  # (NoSuchUpload: already gone)
            except Exception as exc:  # noqa: BLE001 - cleaning up after a failure
                if error_code(exc) == "NoSuchUpload":
                    return
                last = exc
                if isinstance(exc, BackendUnavailableError) or attempt + 1 == ABORT_TRIES:
                    break
                await asyncio.sleep(0.1 * 2**attempt)
        logger.warning(
            "S3Backend: a cut multipart upload of %s could not be aborted (%s); its parts "
            "stay until clear() or a bucket lifecycle rule (AbortIncompleteMultipartUpload) "
            "removes them",
            key,
            type(last).__name__,
        )

    async def _put_fs(self, path: str, data: bytes) -> bool | Present:
        """Any other fsspec filesystem: whole objects, first writer wins as far as it can."""
        if self._protocol == "memory":
            with MEMORY_PUTS:  # this process's only: the check and the write are one step
                fs, _ = await self._ready()
                if fs.exists(path):
                    return PRESENT
                fs.pipe_file(path, data)
            return True
        if self._protocol == "file":
            return await asyncio.to_thread(publish_local, path, data)
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
                    if error_code(exc) in ("PreconditionFailed", "412"):
                        return False  # replaced since it was read: kept
                    if error_code(exc) not in ("NotImplemented", "501", "InvalidArgument", "400"):
                        raise
                    return await self._remove(path, None)
        except FileNotFoundError:
            return False
        self._remember_absent(path)
        return True

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
        self._closing_fs = self._fs
        self._closing = True
        if self._cleanups or self._fs is not None:
            # Aborts under way finish first (bounded): the loop's end would cancel them.
            wait = min(self.options.deadline, ABORT_WAIT)
            with contextlib.suppress(Exception):
                self._loop.run(self._drain_cleanups(wait), wait + 1.0)
        LOG_SCRUB.forget(self._secrets)
        fs, self._fs = self._fs, None
        final = None
        if fs is not None and self._s3 and getattr(fs, "_s3", None) is not None:
            final = fs._s3.close()
        self._loop.close(final)

    @override
    def __repr__(self) -> str:
        return f"S3Backend(location={self._where!r}, namespace={self.namespace.digest})"
