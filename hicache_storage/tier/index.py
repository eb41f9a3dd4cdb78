"""The prefix index: every page the tiers know, keyed by its place in the page-hash chain.

A page is named by its chained hash (:func:`~hicache_storage.keys.page_hashes`), so a
prompt's pages are found by walking its hashes in order. Each entry says where the page
lives now: a device page, a host page, and whether L3 storage holds it. A prompt's
**device-ready** prefix (pages that attention can use at once) and its **logical**
prefix (pages held anywhere, host and storage included) are different answers and are
never conflated: the second may need a prefetch and a load first.

Not thread-safe by itself: :class:`~hicache_storage.tier.controller.TieredCache` holds its
lock around every use.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["PageEntry", "PrefixIndex", "PrefixMatch"]


@dataclass(slots=True)
class PageEntry:
    """Where one page lives.

    Attributes:
        key: the page's hash (its L3 key).
        device: its device page, or None.
        host: its host page, or None.
        stored: L3 storage holds it (written by us, or found there).
        hits: how many prompts used it (``write_through_selective`` backs up after N).
        pins: requests using it now (neither of its pages is evicted meanwhile).
        host_pins: backups reading its host page now (that page is not evicted).
        ready: False while its device page is being filled (computed or loaded).
    """

    key: str
    device: int | None = None
    host: int | None = None
    stored: bool = False
    hits: int = 0
    pins: int = 0
    host_pins: int = 0
    ready: bool = True


@dataclass(frozen=True)
class PrefixMatch:
    """The answer to :meth:`PrefixIndex.match` (in pages; multiply by page_size for tokens).

    Attributes:
        keys: the prompt's page hashes, all of them.
        device_pages: length of the leading run on the device (ready for attention).
        host_pages: length of the leading run on the device or the host.
        logical_pages: length of the leading run held anywhere (device, host, storage).
    """

    keys: list[str]
    device_pages: int
    host_pages: int
    logical_pages: int = 0


@dataclass
class PrefixIndex:
    """Page entries by key, with a least-recently-used order per tier."""

    entries: dict[str, PageEntry] = field(default_factory=dict)
    #: device/host pages in use order, oldest first (key -> None)
    device_lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    host_lru: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def get(self, key: str) -> PageEntry:
        """The entry of ``key`` (made empty if the page is new)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = PageEntry(key)
        return entry

    def match(self, keys: list[str]) -> PrefixMatch:
        """The leading runs of ``keys`` on the device, on device or host, and known stored.

        ``logical_pages`` counts only what this index knows to be stored; the controller
        asks the store about the rest.
        """
        device = host = logical = 0
        on_device = on_host = True
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            on_device = on_device and entry.device is not None
            on_host = on_host and (entry.device is not None or entry.host is not None)
            if not (on_host or entry.stored):
                break
            device += on_device
            host += on_host
            logical += 1
        return PrefixMatch(keys, device, host, logical)

    def touch(self, entry: PageEntry) -> None:
        """Mark ``entry``'s device and host pages as just used."""
        if entry.device is not None:
            self.device_lru[entry.key] = None
            self.device_lru.move_to_end(entry.key)
        if entry.host is not None:
            self.host_lru[entry.key] = None
            self.host_lru.move_to_end(entry.key)

    def set_device(self, entry: PageEntry, page: int | None) -> None:
        """``entry`` is on device page ``page`` now (None: not on the device)."""
        entry.device = page
        if page is None:
            self.device_lru.pop(entry.key, None)
        else:
            self.device_lru[entry.key] = None
            self.device_lru.move_to_end(entry.key)
        self._forget_if_empty(entry)

    def set_host(self, entry: PageEntry, page: int | None) -> None:
        """``entry`` is on host page ``page`` now (None: not on the host)."""
        entry.host = page
        if page is None:
            self.host_lru.pop(entry.key, None)
        else:
            self.host_lru[entry.key] = None
            self.host_lru.move_to_end(entry.key)
        self._forget_if_empty(entry)

    def victims(self, tier: str) -> list[PageEntry]:
        """Unpinned entries of ``tier`` (``"device"`` or ``"host"``), oldest use first."""
        if tier == "device":
            return [e for e in (self.entries[k] for k in self.device_lru) if e.pins == 0]
        entries = (self.entries[k] for k in self.host_lru)
        return [e for e in entries if e.pins == 0 and e.host_pins == 0]

    def _forget_if_empty(self, entry: PageEntry) -> None:
        if entry.device is None and entry.host is None and not entry.stored:
            self.entries.pop(entry.key, None)
