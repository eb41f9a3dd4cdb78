"""An example vendor backend: KV pages stored as rows of one SQLite database."""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

from hicache_storage import Capabilities, HiCacheStorage, StorageConfig
from hicache_storage.buffers import source_views, target_views, total_nbytes
from hicache_storage.config import parse_options
from hicache_storage.errors import BackendError, ConfigError, CorruptObjectError
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)

__all__ = ["SQLiteBackend", "SQLiteOptions"]

_SCHEMA = "CREATE TABLE IF NOT EXISTS pages (ns TEXT NOT NULL, name TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (ns, name)) WITHOUT ROWID"


@dataclass(frozen=True)
class SQLiteOptions:
    """Options (environment: ``HICACHE_STORAGE_SQLITE_KV_<NAME>``).

    Attributes:
        path: the database file; every process using the same file shares the pages.
        timeout: seconds to wait for another process's write lock.
    """

    path: str = "/tmp/hicache-sqlite-kv.db"
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("path must not be empty")


class SQLiteBackend(HiCacheStorage):
    """Pages as rows; every write is one transaction, so a page appears whole or not at all."""

    name = "sqlite-kv"
    capabilities = Capabilities(delete=True, persistent=True, shared=True)

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self.options = parse_options(SQLiteOptions, "sqlite-kv", options)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._db().execute(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        """One connection per thread (sqlite3 connections are not shared across threads)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(
                    self.options.path,
                    timeout=self.options.timeout,
                    isolation_level=None,
                    check_same_thread=False,
                )
                conn.execute("PRAGMA journal_mode=WAL")
            except sqlite3.Error as exc:
                raise BackendError(f"cannot open {self.options.path}: {exc}") from exc
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _name(self, key: str) -> str:
        return self.object_name(key).path

    def get(self, key: str, target: Any = None) -> Any:
        row = (
            self._db()
            .execute(
                "SELECT data FROM pages WHERE ns = ? AND name = ?",
                (self.namespace.digest, self._name(key)),
            )
            .fetchone()
        )
        if row is None:
            return None
        blob = memoryview(row[0])
        try:
            header = decode_header(blob[:HEADER_SIZE], self._name(key))
            payload = blob[HEADER_SIZE:]
            verify_payload(header, [payload])
        except CorruptObjectError:
            return None
        if target is None:
            import torch

            if not payload.nbytes:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        views = target_views(target)
        if total_nbytes(views) != payload.nbytes:
            return None  # never a partial fill
        offset = 0
        for view in views:
            view[:] = payload[offset : offset + view.nbytes]
            offset += view.nbytes
        return target

    def set(self, key: str, value: Any) -> bool:
        views = source_views(value)
        header = encode_header(total_nbytes(views), checksum(views, 1), 1, self._name(key))
        blob = b"".join([header, *views])
        # INSERT OR IGNORE: the first writer wins, an existing page is never replaced.
        self._db().execute(
            "INSERT OR IGNORE INTO pages (ns, name, data) VALUES (?, ?, ?)",
            (self.namespace.digest, self._name(key), blob),
        )
        return True

    def exists(self, key: str) -> bool:
        row = (
            self._db()
            .execute(
                "SELECT 1 FROM pages WHERE ns = ? AND name = ?",
                (self.namespace.digest, self._name(key)),
            )
            .fetchone()
        )
        return row is not None

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        names = [self._name(k) for k in keys]
        marks = ",".join("?" * len(names))
        rows = (
            self._db()
            .execute(
                f"SELECT name FROM pages WHERE ns = ? AND name IN ({marks})",
                (self.namespace.digest, *names),
            )
            .fetchall()
        )
        present = {r[0] for r in rows}
        count = 0
        for name in names:
            if name not in present:
                break
            count += 1
        return count

    def delete(self, key: str) -> bool:
        cur = self._db().execute(
            "DELETE FROM pages WHERE ns = ? AND name = ?", (self.namespace.digest, self._name(key))
        )
        return cur.rowcount > 0

    def clear(self) -> None:
        self._db().execute("DELETE FROM pages WHERE ns = ?", (self.namespace.digest,))

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
