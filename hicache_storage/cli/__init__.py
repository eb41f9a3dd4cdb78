"""The ``hicache-storage`` command line."""
