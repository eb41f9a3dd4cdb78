"""The ``mmap`` backend: a persistent slab store in one preallocated, memory-mapped file.

Files (``path`` is the arena):

``<path>``            superblock (4 KiB, with a random creation nonce), slab table (the
                      size class of each slab), slot table (64 B per unit), then the
                      slabs; writers lock this file (``flock``)
``<path>.index``      a header naming the arena's nonce, then an append-only log of PUT /
                      DEL / CLEAR records and, after a compaction, BULK records (many
                      PUTs in columns), each with a CRC-32

The arena is a row of equal slabs; a slab is cut into slots of one size class when a
writer first needs that class, so objects of any size up to a slab share one arena. A
page lives in one slot of the smallest class that holds it. A write reserves a free slot
of its class (cutting an unused or empty slab if the class has none; marking it *writing*
with its token in the shared slot table, under the lock), copies the page into the mapping
without the lock, then appends a PUT record (under the lock). A key is visible only once
its record is in the log, so a writer killed at any point leaves no visible torn page,
and a torn record at the end of the log (a crash mid-append) fails its CRC and is
ignored. Other processes learn new keys by reading the log's new records.

A writer holds an open-file-description lock (``F_OFD_SETLK``) on its slot's byte of the
arena file while it copies; the kernel drops it if the writer dies, which is how other
processes tell a crashed writer's slot (reclaimable) from a live one, whatever pid
namespace either runs in. Eviction is LRU over the slot table's last-access times
(updated by readers in every process): objects of the class that needs room, or a whole
slab of another class whose newest object is older. An evicted slot is logged (DEL), given a new
random generation, and *retired*: it
is reused only after ``reuse_delay`` seconds, so no reader can still be copying out of it;
readers also re-check the slot's generation after their copy and report a miss if it
changed. The log is compacted (live records to a temporary, then renamed over it) when it
grows to several times the live set; other processes notice the new inode and reload.

The package, by format:

``arena.py``        the arena file: superblock and slot-table layout, slot states, the
                    mapping, and the copies in and out of slots
``log_format.py``   the index log's byte layout: header, records, BULK columns, and
                    their encoding and decoding
``index_log.py``    the index log: reading, appending and compacting it, and the
                    in-memory index built from it
``slots.py``        the slot table's bookkeeping: reserving slots (size classes, slabs
                    cut into a class, orphans of dead writers), LRU eviction within and
                    across classes, retirement, commits, repairs at open, slot locks
``options.py``      :class:`MmapOptions`
``backend.py``      :class:`MmapBackend`: lifecycle, the writer lock, the write pipeline,
                    reads and the protocol methods

Options and guarantees: ``docs/backends/mmap.md``.
"""

from __future__ import annotations

from hicache_storage.backends._mmap.backend import MmapBackend
from hicache_storage.backends._mmap.options import MmapOptions

__all__ = ["MmapBackend", "MmapOptions"]
