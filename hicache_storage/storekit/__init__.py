"""Building blocks a backend may use. None of them is part of the contract.

The contract (:mod:`hicache_storage.protocol`) says *what* a backend must do; these
modules are *how* the built-in backends do it, offered to vendors so that a new store
does not write its own framing, publication or accounting. Pick by the kind of store:

=====================  ===========================================================  ===========================
module                 what it gives                                                use it when
=====================  ===========================================================  ===========================
``blobstore``          :class:`BlobStore`: a base for stores that hold whole        the store is a key/value
                       values. You write get-many, put-many-if-absent and           service (Redis, S3, a
                       exists-many; it does the header, verification, targets,      database, Mooncake as KV)
                       leading runs, per-item failures and error mapping
``filestore``          :class:`FileTreeStore`: pages as files in a directory         the store is a file system
                       tree (atomic publish, capacity, recycling, metadata cache)   (local disk, tmpfs, NFS)
                       and its I/O hook ``move_payloads``; built from ``filetree``
                       (what reads and writes share), ``filereads``,
                       ``filewrites``, ``treescan`` and ``scansnapshot`` (the
                       tree's scans) and ``spacelock`` (the free-space lock)
``header``             the 48-byte object header (magic, version, length,           every stored object, so a
                       checksum, name digest) and its checks                        truncated or foreign one is
                                                                                    a miss
``atomic``             temporary + link/rename publication, first writer wins,      writing files
                       stale-temporary sweeps, vectored I/O
``capacity``           :class:`CapacityTracker`: reserve/commit/release with LRU    the store has a size cap
                       eviction
``metacache``          a bounded, expiring cache of positive existence answers      existence checks cost a
                                                                                    round trip
``iopool``             :class:`IOPool`: map a per-page function over worker         per-page I/O blocks and
                       threads                                                      can overlap
``pathsafety``         directories and files other local users cannot plant or     anything on a shared host
                       read (owner, mode and link checks)                           file system
=====================  ===========================================================  ===========================

Layer rule: backends import the core and ``storekit``; the core never imports
``storekit``, and nothing here imports a backend (``tests/core/test_layers.py`` checks it).
"""
