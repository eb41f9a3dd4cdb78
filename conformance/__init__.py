"""Conformance kit for hicache-storage backends (installed as ``hicache_storage.conformance``)."""
