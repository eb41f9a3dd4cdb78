"""An example vendor backend: KV pages stored as rows of one SQLite database.

Built on the SDK's :class:`~hicache_storage.storekit.blobstore.BlobStore`, so all it
writes is SQL: read many rows, insert many rows unless present, test many rows, delete
rows, delete a namespace's rows. The base frames every value with the checksummed object
header, verifies reads, fills the engine's targets and counts failures.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache_storage import Capabilities, ObjectName, StorageConfig
from hicache_storage.errors import BackendError, BackendUnavailableError, ConfigError
from hicache_storage.storekit.blobstore import PRESENT, BlobOptions, BlobStore, Segments

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["SQLiteBackend", "SQLiteOptions"]

_SCHEMA = "CREATE TABLE IF NOT EXISTS pages (ns TEXT NOT NULL, name TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (ns, name)) WITHOUT ROWID"
#: Names per statement (SQLite's default limit on ``?`` parameters is 999 before 3.32).
_CHUNK = 500


@dataclass(frozen=True)
class SQLiteOptions(BlobOptions):
    """Options (environment: ``HICACHE_STORAGE_SQLITE_KV_<NAME>``).

    Attributes:
        path: the database file; every process using the same file shares the pages.
        timeout: seconds to wait for another process's write lock.
        (and ``checksum`` / ``verify_checksum`` of :class:`BlobOptions`.)
    """

    path: str = "/tmp/hicache-sqlite-kv.db"
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("path must not be empty")
        if self.path == ":memory:" or self.path.startswith("file:"):
            # Each thread's connection would get its own private database.
            raise ConfigError("path must be a database file, not :memory: or a URI")


def _chunks(names: list[ObjectName]) -> Iterator[list[str]]:
    for i in range(0, len(names), _CHUNK):
        yield [n.path for n in names[i : i + _CHUNK]]


class SQLiteBackend(BlobStore[SQLiteOptions]):
    """Pages as rows; each insert is atomic, so a page appears whole or not at all."""

    name = "sqlite-kv"
    capabilities = Capabilities(delete=True, persistent=True, shared=True)
    options_class = SQLiteOptions
    # "database is locked", "unable to open", disk I/O errors: the store is unavailable.
    error_map = {sqlite3.OperationalError: BackendUnavailableError, sqlite3.Error: BackendError}

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._local = threading.local()
        self._all: dict[int, tuple[threading.Thread, sqlite3.Connection]] = {}
        self._lock = threading.Lock()
        with self._errors():
            self._db().execute(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        """One connection per thread (sqlite3 connections are not shared across threads)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self.options.path,
                timeout=self.options.timeout,
                isolation_level=None,
                check_same_thread=False,
            )
            conn.execute("PRAGMA journal_mode=WAL")
            self._local.conn = conn
            me = threading.current_thread()
            with self._lock:
                # Close the connections of threads that have ended (short-lived callers
                # would otherwise each leave one open until close()).
                gone = [k for k, (t, _) in self._all.items() if not t.is_alive()]
                stale = [self._all.pop(k)[1] for k in gone]
                self._all[id(me)] = (me, conn)
            for old in stale:
                old.close()
        return conn

    def _select(self, what: str, names: list[ObjectName]) -> dict[str, Any]:
        """``{name: what}`` for the stored rows among ``names``."""
        found: dict[str, Any] = {}
        for part in _chunks(names):
            marks = ",".join("?" * len(part))
            found.update(
                self._db().execute(
                    f"SELECT name, {what} FROM pages WHERE ns = ? AND name IN ({marks})",
                    (self.namespace.digest, *part),
                )
            )
        return found

    def _get_blobs(self, names: list[ObjectName]) -> list[bytes | None]:
        rows = self._select("data", names)
        return [rows.get(n.path) for n in names]

    def _put_blobs_if_absent(self, names: list[ObjectName], blobs: list[Segments]) -> list[object]:
        db = self._db()
        out: list[object] = []
        db.execute("BEGIN")
        try:
            # INSERT OR IGNORE: the first writer wins, an existing page is never replaced;
            # no row inserted means the page was already there (PRESENT: nothing written).
            for n, b in zip(names, blobs, strict=True):
                cur = db.execute(
                    "INSERT OR IGNORE INTO pages (ns, name, data) VALUES (?, ?, ?)",
                    (self.namespace.digest, n.path, b"".join(b)),
                )
                out.append(True if cur.rowcount == 1 else PRESENT)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return out

    def _exists_blobs(self, names: list[ObjectName]) -> list[bool]:
        rows = self._select("1", names)
        return [n.path in rows for n in names]

    def _delete_blobs(self, names: list[ObjectName]) -> list[bool]:
        db = self._db()
        return [
            db.execute(
                "DELETE FROM pages WHERE ns = ? AND name = ?", (self.namespace.digest, n.path)
            ).rowcount
            > 0
            for n in names
        ]

    def _clear_namespace(self) -> None:
        # Every name of the namespace starts with namespace_prefix; its rows carry its ns.
        self._db().execute("DELETE FROM pages WHERE ns = ?", (self.namespace.digest,))

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, {}
        for _thread, conn in conns.values():
            conn.close()
