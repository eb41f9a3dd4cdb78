"""Engine adapters: any hicache-storage backend inside an inference engine.

* :mod:`hicache_storage.integrations.sglang` -- ``SGLangStorage``, a subclass of SGLang's
  own ``HiCacheStorage``, loaded by SGLang's ``dynamic`` storage backend.

Each adapter imports its engine when it is imported, never before: ``import
hicache_storage`` imports no engine.
"""
