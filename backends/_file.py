"""The ``file`` backend: one file per page under a per-namespace directory, on any filesystem.

Options and guarantees: ``docs/backends/file.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import override

from hicache_storage.errors import ConfigError
from hicache_storage.protocol import Capabilities
from hicache_storage.storekit.filestore import FileTreeOptions, FileTreeStore
from hicache_storage.storekit.pathsafety import user_dir

__all__ = ["FileBackend", "FileOptions"]


@dataclass(frozen=True)
class FileOptions(FileTreeOptions):
    """Options of the ``file`` backend (environment: ``HICACHE_STORAGE_FILE_<NAME>``).

    Attributes:
        root: directory under which every namespace gets its own subdirectory; default
            ``/tmp/hicache-storage-<uid>``, private to the user (0700). An existing root
            must be owned by the user and not writable by others.
        (and every option of :class:`~hicache_storage.storekit.filestore.FileTreeOptions`; here
        ``max_size=None`` means no cap and ``min_free_space=None`` means 0.)
    """

    root: str | None = None

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.root is not None and not self.root:
            raise ConfigError("root must not be empty")


class FileBackend(FileTreeStore[FileOptions]):
    """Pages as files on a local or shared filesystem (zero-copy ``writev``/``preadv``)."""

    name = "file"
    capabilities = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)
    options_class = FileOptions

    @override
    def _location(self, opts: FileOptions) -> str:
        return opts.root if opts.root is not None else user_dir("/tmp", "hicache-storage")
