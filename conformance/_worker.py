"""Worker process of the conformance suite (multi-process and crash checks).

``python -m hicache_storage.conformance._worker`` reads one JSON object from its stdin
(an inherited pipe: backend options, secrets included, are never on a command line or
in a file) with ``name``, ``options``, ``namespace`` and ``task``. Tasks:

* ``{"op": "write", "keys": [...], "nbytes": N, "loop": bool, "via": "set" | "v1"}``:
  store each key's derived content (see ``data.content``); print ``ready`` after the
  first round; with ``loop``, repeat in random order until killed. Exit status 3 if a
  write reports failure.
* ``{"op": "stream", "salt": S, "nbytes": N}``: write new keys forever (until killed),
  ``sha256(f"{S}:{i}")`` for i = 0, 1, ...; print ``key <key>`` before each write and
  ``ready`` after the first, so the parent knows every key that may exist.

Whatever the worker prints (an error, a traceback, a log record) has the spec's secrets
scrubbed out first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import traceback
from typing import Any

from hicache_storage import HiCacheStorage, KVCacheNamespace, StorageConfig
from hicache_storage.conformance import _secrets
from hicache_storage.conformance.data import BackendSpec, content, fill_page, make_pool


def main(argv: list[str]) -> int:
    """Run the task read from stdin; print a scrubbed traceback if it raises."""
    if len(argv) > 1:
        print("usage: python -m hicache_storage.conformance._worker < spec.json", file=sys.stderr)
        return 2
    spec_json: dict[str, Any] = json.loads(sys.stdin.read())
    _secrets.register(spec_json.get("options"))  # before anything can log or raise
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(spec_json)
    except Exception as exc:  # noqa: BLE001 - reported (scrubbed) to the parent
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(_secrets.scrub(text), file=sys.stderr, flush=True)
        return 1


def _run(spec_json: dict[str, Any]) -> int:
    spec = BackendSpec(spec_json["name"], spec_json["options"])
    ns = KVCacheNamespace.from_dict(spec_json["namespace"])
    task: dict[str, Any] = spec_json["task"]
    backend = spec.create(StorageConfig(namespace=ns))
    if task["op"] == "stream":
        return _stream(backend, task["salt"], task["nbytes"])
    keys: list[str] = task["keys"]
    nbytes: int = task["nbytes"]
    rng = random.Random()
    pool = None
    if task.get("via") == "v1":
        pool = make_pool(num_pages=len(keys))
        backend.register_mem_pool_host(pool)
    first = True
    try:
        while True:
            order = list(keys)
            rng.shuffle(order)
            if pool is not None:
                for page, key in zip(
                    pool.page_buffers(range(len(order) * pool.page_size)), order, strict=True
                ):
                    fill_page(page, key)
                ok = backend.batch_set_v1(order, list(range(len(order) * pool.page_size)))
            else:
                ok = [backend.set(k, content(k, nbytes)) for k in order]
            if not all(ok):
                print(
                    json.dumps({"failed": [k for k, r in zip(order, ok, strict=True) if not r]}),
                    flush=True,
                )
                return 3
            if first:
                print("ready", flush=True)
                first = False
            if not task.get("loop"):
                return 0
    finally:
        backend.close()


def _stream(backend: HiCacheStorage, salt: str, nbytes: int) -> int:
    i = 0
    while True:
        key = hashlib.sha256(f"{salt}:{i}".encode()).hexdigest()
        print(f"key {key}", flush=True)
        if not backend.set(key, content(key, nbytes)):
            print(f"failed {key}", flush=True)
            return 3
        if i == 0:
            print("ready", flush=True)
        i += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
