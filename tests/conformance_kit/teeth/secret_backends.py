"""A correct backend with secret options, for the conformance kit's secret-leak test.

``CanaryFile`` is the ``file`` backend plus the options a networked store has: a
``password``, an ``upstream`` URL with a password in it, ``auth``, a secret only its
options class marks (:func:`hicache_storage.config.secret`), and secrets nested in a list
option (``endpoints``: URLs and passwords) and a dict option (``extra``). Each process that builds it
writes a trace (its command line, what is on its stdin, digests of the secrets it got)
into ``trace_dir``, so a test can check what worker processes were started with.
With ``workers_unreachable``, building it in a conformance worker process fails the way a
careless client library fails: with the URL and the passwords in the error message.
``fail`` makes it fail that way everywhere: ``"build"`` when it is built (a
``BackendUnavailableError``), ``"writes"`` on every ``set`` (a ``ConnectionError``, which
the protocol layer logs), ``"refuse"`` on every ``batch_exists`` (an
``InvalidArgumentError``, which reaches the caller).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from hicache_storage import StorageConfig
from hicache_storage.backends import FileBackend, FileOptions
from hicache_storage.config import secret
from hicache_storage.errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["CanaryFile", "CanaryOptions", "digest"]


def digest(value: str | None) -> str | None:
    """What a trace records of a secret."""
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()


@dataclass(frozen=True)
class CanaryOptions(FileOptions):
    password: str | None = None
    upstream: str | None = None
    auth: str | None = secret()
    endpoints: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None
    trace_dir: str | None = None
    workers_unreachable: bool = False
    fail: str = ""

    def careless(self) -> str:
        """What a careless client says when it fails: every secret it was given."""
        return (
            f"Error 111 connecting to {self.upstream}. Connection refused (AUTH {self.password} "
            f"{self.auth}; endpoints {self.endpoints}; extra {json.dumps(self.extra)})"
        )


def _in_worker() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", "") == "hicache_storage.conformance._worker"


class CanaryFile(FileBackend):
    name = "canary-file"
    options_class = CanaryOptions

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        opts = self.options
        assert isinstance(opts, CanaryOptions)  # options_class above
        worker = _in_worker()
        if opts.trace_dir:
            with open("/proc/self/cmdline", "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            try:
                stdin = os.readlink("/proc/self/fd/0")
            except OSError as exc:
                stdin = f"unreadable: {exc}"
            trace = {
                "pid": os.getpid(),
                "worker": worker,
                "cmdline": cmdline,
                "stdin": stdin,
                "password": digest(opts.password),
                "upstream": digest(opts.upstream),
                "auth": digest(opts.auth),
            }
            path = os.path.join(opts.trace_dir, f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json")
            with open(path + ".part", "w") as f:  # a worker killed meanwhile leaves no trace
                json.dump(trace, f)
            os.replace(path + ".part", path)
        if opts.workers_unreachable and worker:
            self.close()
            raise ConnectionError(opts.careless())
        if opts.fail == "build":
            self.close()
            raise BackendUnavailableError(opts.careless())

    @property
    def _opts(self) -> CanaryOptions:
        assert isinstance(self.options, CanaryOptions)
        return self.options

    @override
    def set(self, key: str, value: Any) -> bool:
        if self._opts.fail == "writes":
            raise ConnectionError(self._opts.careless())
        return super().set(key, value)

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if self._opts.fail == "refuse":
            raise InvalidArgumentError(self._opts.careless())
        return super().batch_exists(keys, extra_info)
