"""A fault-injecting ``file`` backend, for the vLLM connector's fault tests.

``FlakyFile`` is the real ``file`` backend with a process-wide fault switch
(:data:`MODE`, changed by the test between requests of one engine):

* ``"ok"``: no fault;
* ``"torn"``: every other page read reports failure after filling its buffer with
  garbage (a read torn halfway), so a connector that used a failed block would change
  the output;
* ``"lie"``: ``batch_exists`` says every key is stored (a stale index), so every load
  of a page that is not there fails;
* ``"raise"``: every call raises (the SDK's guard turns that into failure results);
* ``"nosave"``: stores fail;
* ``"hang"``: every call waits for :data:`RELEASE` (a store that hangs), then goes on;
* ``"hangread"``: reads wait for :data:`RELEASE`, lookups and stores do not;
* ``"hangwrite"``: stores wait for :data:`RELEASE`, lookups and reads do not.

Loaded by the connector as ``backend_name="vllm_faults:FlakyFile"``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from hicache_storage.backends._file import FileBackend
from hicache_storage.buffers import PageBuffer

#: The fault in force (see the module docs).
MODE = ["ok"]
#: What hung calls wait for (set it to let them finish; clear it for the next hang).
RELEASE = threading.Event()
#: Set when a call starts to hang (clear it before the call a test waits for).
ENTERED = threading.Event()


def _hang(*modes: str) -> None:
    if MODE[0] in modes:
        ENTERED.set()
        RELEASE.wait()


class FlakyFile(FileBackend):
    """``file`` with the fault of :data:`MODE`."""

    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        _hang("hang", "hangread")
        if MODE[0] == "raise":
            raise RuntimeError("injected read fault")
        out = super().batch_get_pages(keys, pages)
        if MODE[0] == "torn":
            for i, page in enumerate(pages):
                if i % 2 == 0:
                    for view in page.views:
                        view[:] = b"\xff" * len(view)
                    out[i] = False
        return out

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        _hang("hang")
        if MODE[0] == "raise":
            raise RuntimeError("injected lookup fault")
        if MODE[0] == "lie":
            return len(keys)
        return super().batch_exists(keys, extra_info)

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        _hang("hang", "hangwrite")
        if MODE[0] == "raise":
            raise RuntimeError("injected write fault")
        if MODE[0] == "nosave":
            return [False] * len(keys)
        return super().batch_set_pages(keys, pages)


#: Per-key faults of :class:`KeyFaults`: calls touching a key in ``HANG`` wait for
#: :data:`RELEASE`; reads of a key in ``FAIL_READ`` fail while ``exists`` says it is there.
KEY_FAULTS: dict[str, set[str]] = {"HANG": set(), "FAIL_READ": set()}


class KeyFaults(FileBackend):
    """``file`` with faults on chosen keys only (others answer normally)."""

    def _hang(self, keys: Sequence[str]) -> None:
        if KEY_FAULTS["HANG"] & set(keys):
            RELEASE.wait()

    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        self._hang(keys)
        out = super().batch_get_pages(keys, pages)
        return [
            False if k in KEY_FAULTS["FAIL_READ"] else x for k, x in zip(keys, out, strict=True)
        ]

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        self._hang(keys)
        return super().batch_set_pages(keys, pages)

    def exists(self, key: str) -> bool:
        self._hang([key])
        return super().exists(key)
