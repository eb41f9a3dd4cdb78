"""The option vocabulary: one name per idea across the built-in backends.

docs/concepts.md ("Option names") is the glossary; these tests hold every built-in
backend's options class to it, and hold ``usage()`` to the protocol's one schema.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

import pytest

from hicache_storage import StorageConfig
from hicache_storage.config import RENAMED_OPTIONS
from hicache_storage.errors import ConfigError
from hicache_storage.protocol import USAGE_KEYS, HiCacheStorage
from hicache_storage.registry import create_backend, load_backend_class

BUILT_IN = ["file", "shm", "mmap", "memory", "redis", "s3", "mooncake", "nixl"]
CONCEPTS = Path(__file__).parents[2] / "docs" / "concepts.md"


def glossary() -> dict[str, set[str]]:
    """Option name -> the backends the glossary table says have it."""
    text = CONCEPTS.read_text()
    section = text[text.index("### Option names") :]
    rows = re.findall(r"^\| `([a-z_]+)` \| .* \| ([^|]+) \|$", section, re.MULTILINE)
    assert rows, "no glossary table in docs/concepts.md"
    out: dict[str, set[str]] = {}
    for name, backends in rows:
        out[name] = (
            set(BUILT_IN) if "every backend" in backends else set(re.findall(r"`(\w+)`", backends))
        )
    return out


def option_fields() -> dict[str, set[str]]:
    """Option name -> the built-in backends whose options class has it."""
    out: dict[str, set[str]] = defaultdict(set)
    for name in BUILT_IN:
        cls = getattr(load_backend_class(name), "options_class")  # noqa: B009 - not in the protocol
        for f in dataclasses.fields(cls):
            out[f.name].add(name)
    return out


def test_every_name_shared_by_two_backends_is_in_the_glossary_as_they_have_it() -> None:
    fields, names = option_fields(), glossary()
    shared = {n: b for n, b in fields.items() if len(b) > 1}
    missing = sorted(set(shared) - set(names))
    assert not missing, f"options of several backends missing from the glossary: {missing}"
    for name, backends in names.items():
        assert fields.get(name, set()) == backends, (name, fields.get(name), backends)


def test_no_backend_uses_a_renamed_option() -> None:
    fields = option_fields()
    for old, new in RENAMED_OPTIONS.items():
        assert old not in fields, (old, fields[old])
        assert new in fields, new


@pytest.mark.parametrize(("backend", "old", "new"), [
    ("file", "io_threads", "max_concurrency"),
    ("shm", "directory", "root"),
    ("mmap", "capacity", "max_size"),
    ("redis", "max_connections", "max_concurrency"),
])  # fmt: skip
def test_an_old_name_is_an_error_that_names_the_new_one(backend: str, old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=f"'{old}' is now '{new}'"):
        create_backend(backend, StorageConfig(), **{old: 1})


def test_usage_has_one_schema(tmp_path: Path, shm_dir: str) -> None:
    """Every local backend answers usage() with the three figures (ints), and counts."""
    made = {
        "file": create_backend("file", StorageConfig(), root=str(tmp_path / "f"), max_size="1GiB"),
        "shm": create_backend("shm", StorageConfig(), root=shm_dir),
        "mmap": create_backend(
            "mmap", StorageConfig(), path=str(tmp_path / "m" / "arena"), max_size="8MiB",
            slot_size="64KiB", prefault=False,
        ),
        "memory": create_backend("memory", StorageConfig(), store=f"usage-{tmp_path.name}"),
        "nixl": create_backend("nixl", StorageConfig(), root=str(tmp_path / "n"), max_size="1GiB"),
        "uncapped file": create_backend("file", StorageConfig(), root=str(tmp_path / "u")),
    }  # fmt: skip
    try:
        for what, b in made.items():
            before = b.usage()
            assert all(isinstance(before[k], int) for k in USAGE_KEYS), (what, before)
            assert b.batch_set(["a", "b", "c"], [b"x" * 1000] * 3) == [True] * 3
            after = b.usage()
            if what == "uncapped file":  # no limit: nothing counted, and it says so
                assert (after["objects"], after["used_bytes"], after["limit_bytes"]) == (-1, -1, 0)
                continue
            assert after["objects"] == before["objects"] + 3, (what, before, after)
            assert after["used_bytes"] >= before["used_bytes"] + 3000, (what, before, after)
            assert after["limit_bytes"] >= 0, (what, after)
        assert made["file"].usage()["limit_bytes"] == 1 << 30
        assert made["memory"].usage()["limit_bytes"] == 0
        assert 0 < made["mmap"].usage()["limit_bytes"] <= 8 << 20
    finally:
        for b in made.values():
            b.close()


def test_an_old_name_in_the_environment_is_an_error_too(
    monkeypatch: pytest.MonkeyPatch, shm_dir: str
) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_SHM_DIRECTORY", shm_dir)
    with pytest.raises(ConfigError, match="HICACHE_STORAGE_SHM_ROOT"):
        create_backend("shm", StorageConfig())


def test_a_wrapper_forwards_usage(shm_dir: str) -> None:
    from hicache_storage.wrapper import WrapperBackend

    inner = create_backend("shm", StorageConfig(), root=shm_dir)
    wrapped = WrapperBackend(inner)
    try:
        assert wrapped.set("k", b"x" * 100)
        assert wrapped.usage() == inner.usage() and wrapped.usage()["objects"] == 1
    finally:
        wrapped.close()


def test_the_protocol_default_says_it_cannot_tell() -> None:
    assert HiCacheStorage.usage.__qualname__ == "HiCacheStorage.usage"
    cls = load_backend_class("s3")
    assert "usage" not in cls.__dict__  # a remote store: the default
    assert dict.fromkeys(USAGE_KEYS, -1) == HiCacheStorage.usage(object.__new__(cls))
