"""A ``file`` backend whose existence queries hang, for the LMCache plugin's deadline test."""

from __future__ import annotations

import time
from typing import Any

from typing_extensions import override

from hicache_storage.backends import FileBackend


class HangingFile(FileBackend):
    """``batch_exists`` sleeps 30 s (a store that stopped answering)."""

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        time.sleep(30)
        return 0
