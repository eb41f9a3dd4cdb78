"""Page hashes (golden vectors), namespace digests, key validation, object names."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import (
    KVCacheNamespace,
    StorageConfig,
    object_name,
    page_hashes,
    storage_namespace_seed,
)
from hicache_storage.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidTypeError,
    NamespaceMismatchError,
)
from hicache_storage.keys import KEY_MAX_LEN, validate_key
from hicache_storage.layouts import POOL_KIND_IDS, POOL_KINDS

H1 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
H2 = "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
SEED_A = "1788ab758c62a241d83bbc10f0cb8b745cec48d7a3d2a78a2e84123d48ff4c99"
H1_SEEDED = "bb2ad6f18395e2ab50661c6191fa163a2e566ae086e9d5d08e426f5333bf9645"


def test_golden_vectors_match_the_reference_chain() -> None:
    assert page_hashes([1, 2, 3, 4], 4) == [H1]
    assert page_hashes([5, 6, 7, 8], 4, prior_hash=H1) == [H2]
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [H1, H2]
    assert storage_namespace_seed(None, "tenantA") == SEED_A
    assert page_hashes([1, 2, 3, 4], 4, namespace_seed=SEED_A) == [H1_SEEDED]


def test_prior_hash_takes_precedence_over_seed() -> None:
    # The prior already carries the seed of the sequence it continues.
    assert page_hashes([5, 6, 7, 8], 4, prior_hash=H1, namespace_seed=SEED_A) == [H2]


def test_partial_last_page_is_never_hashed() -> None:
    assert page_hashes([1, 2, 3, 4, 5, 6], 4) == [H1]
    assert page_hashes([1, 2, 3], 4) == []
    assert page_hashes([], 4) == []


def test_chain_matches_an_independent_computation() -> None:
    tokens = list(range(100, 132))
    prev = b""
    expected = []
    for i in range(0, 32, 8):
        prev = hashlib.sha256(prev + struct.pack("<8I", *tokens[i : i + 8])).digest()
        expected.append(prev.hex())
    assert page_hashes(tokens, 8) == expected


def test_wide_token_ids_use_the_tagged_u64_encoding() -> None:
    wide = [1, 2, 3, 2**32]
    expected = hashlib.sha256(b"\xff" + struct.pack("<4Q", *wide)).hexdigest()
    assert page_hashes(wide, 4) == [expected]
    assert page_hashes([1, 2, 3, 2**32 - 1], 4) != [expected]


def test_tuple_tokens_hash_every_element() -> None:
    expected = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).hexdigest()
    assert page_hashes([(1, 2), (3, 4)], 2) == [expected]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((None, "a"), ("a", None)),
        (("", ""), (None, None)),
        (("a", "bc"), ("ab", "c")),
        (("", ""), ("", None)),
    ],
)
def test_namespace_seeds_are_distinct(
    a: tuple[str | None, str | None], b: tuple[str | None, str | None]
) -> None:
    assert storage_namespace_seed(*a) != storage_namespace_seed(*b)


def test_no_seed_without_extra_key_or_salt() -> None:
    assert storage_namespace_seed(None, None) is None


def test_bad_token_ids_raise() -> None:
    with pytest.raises(InvalidArgumentError):
        page_hashes([1, -1], 2)
    with pytest.raises(InvalidTypeError):
        page_hashes([1, "x"], 2)
    with pytest.raises(InvalidArgumentError):
        page_hashes([1, 2], 0)
    with pytest.raises(InvalidArgumentError):
        page_hashes([1, 2], 2, prior_hash="not-hex")


BASE: dict[str, Any] = {"model_id": "m", "dtype": "bfloat16", "page_size": 16}


def test_namespace_digest_is_stable_and_pinned() -> None:
    ns = KVCacheNamespace(**BASE)
    # Pinned: a digest change would orphan every stored page; change it only on purpose.
    assert ns.digest == KVCacheNamespace(**BASE).digest
    assert ns.digest.startswith("ns1-")
    assert len(ns.digest) == 36
    assert (
        ns.digest
        == "ns1-"
        + hashlib.sha256(
            b'{"dtype":"bfloat16","model_id":"m","page_size":16,"schema_version":1}'
        ).hexdigest()[:32]
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"dtype": "float8_e4m3fn"},
        {"dtype": "float8_e5m2"},
        {"page_size": 32},
        {"object_layout": "page_first"},
        {"rank_replicated": True},
        {"total_kv_heads": 8, "kv_heads_per_shard": 2},
        {"layer_range": (0, 16)},
        {"tenant": "acme"},
        {"weights_fingerprint": "sha256:abc"},
    ],
)
def test_every_identity_field_changes_the_digest(change: dict[str, Any]) -> None:
    assert KVCacheNamespace(**{**BASE, **change}).digest != KVCacheNamespace(**BASE).digest


def test_dtype_is_normalized() -> None:
    import torch

    assert (
        KVCacheNamespace(**{**BASE, "dtype": torch.bfloat16}).digest
        == KVCacheNamespace(**BASE).digest
    )
    assert KVCacheNamespace(**{**BASE, "dtype": "torch.bfloat16"}).dtype == "bfloat16"


@pytest.mark.parametrize(
    "bad",
    [
        {"model_id": ""},
        {"page_size": 0},
        {"dtype": ""},
        {"rank_replicated": True, "total_kv_heads": 8},
        {"total_kv_heads": 8, "kv_heads_per_shard": 3},
        {"layer_range": (4, 4)},
        {"layer_range": (-1, 4)},
    ],
)
def test_invalid_namespaces_raise(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KVCacheNamespace(**{**BASE, **bad})


def test_namespace_dict_round_trip() -> None:
    ns = KVCacheNamespace(**BASE, layer_range=(0, 8), tenant="t")
    assert KVCacheNamespace.from_dict(ns.to_dict()) == ns
    with pytest.raises(ConfigError, match="unknown namespace fields"):
        KVCacheNamespace.from_dict({**BASE, "colour": "red"})


@pytest.mark.parametrize("key", ["a", "A-b_c.d", "0" * 64, "x" * KEY_MAX_LEN, H1 + ".mamba"])
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/abs",
        "a\x00b",
        "x" * (KEY_MAX_LEN + 1),
        "é",
        "a b",
        ".hidden",
        "a..b",
        "a\\b",
        5,
        None,
        b"k",
    ],
)
def test_invalid_keys_raise(key: object) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(key)


def test_object_names() -> None:
    n = object_name("ns1-x", H1)
    assert n.path == f"ns1-x/{n.fanout}/{H1}"
    assert len(n.fanout) == 2
    s = object_name("ns1-x", H1, "h0-3")
    assert s.leaf == f"{H1}~h0-3"
    assert s.path != n.path
    with pytest.raises(InvalidKeyError):
        object_name("ns1-x", "../etc")
    with pytest.raises(InvalidArgumentError):
        object_name("ns1-x", H1, "bad/shard")
    # Fan-out spreads keys over many directories.
    fans = {object_name("d", f"k{i}").fanout for i in range(5000)}
    assert len(fans) == 256


# --------------------------------------------------------------------------- for_pool


@pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
def test_for_pool_builds_the_namespace_register_mem_pool_host_accepts(
    tmp_path: Path, layout: str, mla: bool
) -> None:
    import torch

    from hicache_storage.backends import FileBackend
    from hicache_storage.host_pool import HostKVPool

    pool = HostKVPool(num_pages=4, page_size=8, layer_num=2, kv_heads=2, head_dim=16,
                      dtype=torch.float16, layout=layout, mla=mla)  # fmt: skip
    ns = KVCacheNamespace.for_pool(pool, model_id="acme/model-7b", tenant="t1")
    assert (ns.page_size, ns.dtype, ns.object_layout, ns.rank_replicated) == (
        8, "float16", layout, mla,
    )  # fmt: skip
    assert ns.tenant == "t1"
    b = FileBackend(StorageConfig(namespace=ns), root=str(tmp_path))
    try:
        b.register_mem_pool_host(pool)  # no NamespaceMismatchError
        idx = pool.alloc(8)
        assert idx is not None
        key = page_hashes(list(range(8)), 8)[0]
        assert b.batch_set_v1([key], idx) == [True]
        assert b.batch_get_v1([key], idx) == [True]
    finally:
        b.close()


def test_the_namespace_mismatch_advice_works(tmp_path: Path) -> None:
    """The error names KVCacheNamespace.for_pool; following it fixes the mismatch."""
    import torch

    from hicache_storage.backends import FileBackend
    from hicache_storage.host_pool import HostKVPool

    pool = HostKVPool(num_pages=2, page_size=16, layer_num=1, kv_heads=1, head_dim=8,
                      dtype=torch.bfloat16, layout="page_first")  # fmt: skip
    wrong = KVCacheNamespace(model_id="m", dtype="float16", page_size=4)
    b = FileBackend(StorageConfig(namespace=wrong), root=str(tmp_path))
    with pytest.raises(NamespaceMismatchError, match=r"KVCacheNamespace\.for_pool\(pool"):
        b.register_mem_pool_host(pool)
    b.close()
    b = FileBackend(
        StorageConfig(namespace=KVCacheNamespace.for_pool(pool, model_id="m")), root=str(tmp_path)
    )
    b.register_mem_pool_host(pool)
    b.close()


class _SGLangStylePool:
    """The attributes an SGLang HostKVCache exposes (no HostKVPool methods)."""

    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


@pytest.mark.parametrize("mla_attr", ["is_mla", "mla"])
def test_for_pool_reads_sglang_style_pools(tmp_path: Path, mla_attr: str) -> None:
    import torch

    from hicache_storage.backends import FileBackend

    pool = _SGLangStylePool(page_size=64, dtype=torch.float8_e4m3fn, layout="page_first_direct",
                            **{mla_attr: True})  # fmt: skip
    ns = KVCacheNamespace.for_pool(pool, model_id="deepseek-ai/DeepSeek-V3")
    assert (ns.page_size, ns.dtype, ns.object_layout, ns.rank_replicated) == (
        64, "float8_e4m3fn", "page_first_direct", True,
    )  # fmt: skip
    b = FileBackend(StorageConfig(namespace=ns), root=str(tmp_path))
    b.register_mem_pool_host(pool)  # type: ignore[arg-type]  # attributes only: no page access
    b.close()
    plain = KVCacheNamespace.for_pool(
        _SGLangStylePool(page_size=1, dtype="torch.bfloat16"), model_id="m", total_kv_heads=8
    )
    assert (plain.object_layout, plain.rank_replicated, plain.dtype) == (
        "opaque", False, "bfloat16",
    )  # fmt: skip
    assert plain.total_kv_heads == 8


def test_for_pool_refuses_contradictions_and_missing_facts() -> None:
    pool = _SGLangStylePool(page_size=16, dtype="bfloat16", layout="page_first")
    with pytest.raises(ConfigError, match="page_size=32 contradicts"):
        KVCacheNamespace.for_pool(pool, model_id="m", page_size=32)
    with pytest.raises(ConfigError, match="rank_replicated"):
        KVCacheNamespace.for_pool(pool, model_id="m", rank_replicated=True)
    # Restating a fact the pool has is fine (torch spelling included).
    ns = KVCacheNamespace.for_pool(pool, model_id="m", dtype="torch.bfloat16", page_size=16)
    assert ns == KVCacheNamespace.for_pool(pool, model_id="m")
    with pytest.raises(ConfigError, match="unknown namespace fields"):
        KVCacheNamespace.for_pool(pool, model_id="m", tennant="x")
    with pytest.raises(ConfigError, match="has no 'dtype'"):
        KVCacheNamespace.for_pool(_SGLangStylePool(page_size=4), model_id="m")
    ns = KVCacheNamespace.for_pool(_SGLangStylePool(page_size=4), model_id="m", dtype="int8")
    assert ns.dtype == "int8"
    import numpy as np

    ns = KVCacheNamespace.for_pool(
        _SGLangStylePool(page_size=np.int64(4), dtype="int8"), model_id="m"
    )
    assert ns.page_size == 4
    assert type(ns.page_size) is int
    with pytest.raises(ConfigError, match="model_id"):
        KVCacheNamespace.for_pool(pool, model_id="")


# --------------------------------------------------------------------------- hot paths


def test_batch_validation_agrees_with_the_per_key_rule_on_random_batches() -> None:
    """validate_keys checks a batch in one pass; it must accept exactly what
    validate_key accepts, and name the same first bad key."""
    import random

    from hicache_storage.keys import validate_keys

    rng = random.Random(7)
    alphabet = "abcdef0123456789_-.\n\r\t /\x00\u2028\x85éK~" + "A" * 5
    for _ in range(3000):
        batch = []
        for _ in range(rng.randint(2, 6)):
            n = rng.choice([0, 1, 5, 64, KEY_MAX_LEN - 1, KEY_MAX_LEN, KEY_MAX_LEN + 1])
            if rng.random() < 0.7:
                batch.append("".join(rng.choice("0123456789abcdef") for _ in range(n)))
            else:
                batch.append("".join(rng.choice(alphabet) for _ in range(n)))
        expected: Any
        try:
            expected = [validate_key(k) for k in batch]
        except InvalidKeyError as exc:
            expected = str(exc)
        try:
            got: Any = validate_keys(batch)
        except InvalidKeyError as exc:
            got = str(exc)
        assert got == expected, batch


def test_str_subclasses_are_judged_by_their_characters() -> None:
    from hicache_storage.keys import object_name, validate_keys

    class Lying(str):
        def __len__(self) -> int:
            return 1

        def __contains__(self, item: object) -> bool:
            return False

        def __format__(self, spec: str) -> str:
            return "../../etc"

    with pytest.raises(InvalidKeyError):
        validate_key(Lying("a" * (KEY_MAX_LEN + 1)))
    with pytest.raises(InvalidKeyError):
        validate_key(Lying("a..b"))
    for checked in (validate_key(Lying("abc")), validate_keys([Lying("abc"), "def"])[0]):
        assert type(checked) is str and checked == "abc"
    assert object_name("ns", Lying("abc")).path.endswith("/abc")


def test_the_object_namer_names_as_object_name_does_and_never_remembers_a_bad_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hicache_storage.keys import ObjectNamer, object_name

    monkeypatch.setattr(ObjectNamer, "CACHE_LIMIT", 8)  # the clear-when-full path too
    for shard in (None, "h0-7"):
        namer = ObjectNamer("d" * 32, shard)
        keys = [*page_hashes(list(range(4 * 30)), 4), "a.b", "x_y-z"]
        for key in keys * 2:
            want = object_name("d" * 32, key, shard)
            assert namer.name(key) == want
            assert namer.path(key) == want.path
        assert namer.paths(keys, "/root/") == [f"/root/{object_name('d' * 32, k, shard).path}" for k in keys]  # fmt: skip
        for bad in ("../x", "", "a/b", "a" * (KEY_MAX_LEN + 1)):
            for _ in range(2):  # every time, not only the first
                with pytest.raises(InvalidKeyError):
                    namer.path(bad)
    with pytest.raises(InvalidArgumentError):
        ObjectNamer("d" * 32, "bad shard")


def test_a_backend_renames_after_its_namespace_is_replaced(tmp_path: Path) -> None:
    from hicache_storage.backends import FileBackend

    b = FileBackend(
        StorageConfig(namespace=KVCacheNamespace(model_id="m1", dtype="uint8", page_size=4)),
        root=str(tmp_path),
    )
    key = page_hashes(list(range(4)), 4)[0]
    first = b.object_path(key)
    b.namespace = KVCacheNamespace(model_id="m2", dtype="uint8", page_size=4)
    assert b.object_path(key) != first
    assert b.object_path(key).startswith(b.namespace.digest + "/")
    b.close()


class _Folded(str):
    """A key whose equality ignores case: it must never share a remembered name."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and self.lower() == other.lower()

    def __hash__(self) -> int:
        return hash(self.lower())


@pytest.mark.parametrize("shard", [None, "h0-7"])
def test_namer_batches_name_every_key_as_object_name_does(
    shard: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch naming (names, paths, each_path, known_paths) agrees with object_name for
    plain keys, repeats and str subclasses, across memory clears, and never lets a
    subclass key answer for a plain one (or the reverse)."""
    from hicache_storage.keys import ObjectNamer, object_name

    monkeypatch.setattr(ObjectNamer, "CACHE_LIMIT", 5)
    digest = "abcd1234"
    namer = ObjectNamer(digest, shard)
    keys = [f"k{i}" for i in range(12)] + ["k3", "k0"]
    want = [object_name(digest, k, shard) for k in keys]
    assert namer.names(keys) == want
    assert namer.paths(keys, "/r/") == ["/r/" + n.path for n in want]
    assert list(namer.each_path(keys)) == [n.path for n in want]
    assert namer.names(list(reversed(keys))) == list(reversed(want))
    namer = ObjectNamer(digest, shard)
    assert namer.names(["abc"])[0] == object_name(digest, "abc", shard)
    folded = namer.names([_Folded("ABC")])[0]
    assert folded == object_name(digest, "ABC", shard)
    assert namer.names([_Folded("ABC"), "abc"])[1] == object_name(digest, "abc", shard)
    other = ObjectNamer(digest, shard)
    other.names([_Folded("ABC")])
    assert other.names(["abc"]) == [object_name(digest, "abc", shard)]
    assert other.name("abc") == object_name(digest, "abc", shard)
    assert other.known_paths([_Folded("ABC")]) == [None]  # subclasses are never looked up
    with pytest.raises(InvalidKeyError):
        namer.names(["ok", "../x"])
    assert namer.known_paths(["ok", "../x"]) == [None, None]  # nothing remembered
    ok = namer.path("ok")
    assert namer.known_paths(["ok", "../x"]) == [ok, None]
