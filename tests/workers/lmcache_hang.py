"""``file`` backends that hang or crawl on cue, for the LMCache plugin's fault tests."""

from __future__ import annotations

import threading
import time
from typing import Any

from typing_extensions import override

from hicache_storage.backends import FileBackend


class HangingFile(FileBackend):
    """``batch_exists`` sleeps 30 s (a store that stopped answering queries)."""

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        time.sleep(30)
        return 0


#: Set: CueFile's writes block until it is cleared. READ_DELAY: seconds added to reads.
WRITES_HANG = threading.Event()
READ_DELAY = [0.0]
WRITE_DELAY = [0.0]


class CueFile(FileBackend):
    """A ``file`` backend whose writes hang while :data:`WRITES_HANG` is set, and whose
    reads and writes take :data:`READ_DELAY` / :data:`WRITE_DELAY` seconds more."""

    @override
    def batch_set(self, keys: list[str], values: Any) -> list[bool]:
        while WRITES_HANG.is_set():
            time.sleep(0.01)
        time.sleep(WRITE_DELAY[0])
        return super().batch_set(keys, values)

    @override
    def batch_get(self, keys: list[str], targets: Any = None) -> list[Any]:
        time.sleep(READ_DELAY[0])
        return super().batch_get(keys, targets)
