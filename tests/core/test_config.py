"""Sizes, extra-config parsing, option dataclasses, StorageConfig facts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from hicache_storage import KVCacheNamespace, StorageConfig, load_extra_config, parse_size
from hicache_storage.config import Size, parse_options
from hicache_storage.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("1Gi", 2**30),
        ("1.5G", 1_500_000_000),
        ("200GB", 200 * 10**9),
        ("10k", 10_000),
        (" 2 TiB ", 2 * 2**40),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-5", -1, True, None, "1e3"])
def test_parse_size_rejects_garbage_loudly(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_load_extra_config(tmp_path: Path) -> None:
    assert load_extra_config(None) == {}
    assert load_extra_config('{"root": "/x"}') == {"root": "/x"}
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"a": 1}))
    assert load_extra_config(f"@{f}") == {"a": 1}
    t = tmp_path / "c.toml"
    t.write_text('root = "/y"\nfsync = true\n')
    assert load_extra_config(f"@{t}") == {"root": "/y", "fsync": True}
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_extra_config("{nope")
    with pytest.raises(ConfigError, match="JSON object"):
        load_extra_config("[1]")
    with pytest.raises(ConfigError, match="cannot read"):
        load_extra_config(f"@{tmp_path / 'missing.json'}")


@dataclass(frozen=True)
class _Opts:
    root: str = "/r"
    limit: Size | None = None
    ratio: float = 0.5
    threads: int = 2
    on: bool = False
    mode: Literal["a", "b"] = "a"


def test_parse_options_types_env_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_DEMO_THREADS", "7")
    monkeypatch.setenv("HICACHE_STORAGE_DEMO_ON", "yes")
    o = parse_options(_Opts, "demo", {"limit": "1KiB", "ratio": "0.25", "mode": "b", "on": False})
    assert o == _Opts(root="/r", limit=Size(1024), ratio=0.25, threads=7, on=False, mode="b")


def test_parse_options_drops_controller_keys() -> None:
    assert parse_options(_Opts, "demo", {"prefetch_threshold": 256, "interface_v1": 1}) == _Opts()


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"rooot": "/x"}, "unknown option"),
        ({"threads": "many"}, "integer"),
        ({"threads": 1.5}, "integer"),
        ({"on": "maybe"}, "boolean"),
        ({"mode": "c"}, "one of"),
        ({"limit": "lots"}, "invalid size"),
        ({"root": 5}, "string"),
    ],
)
def test_parse_options_rejects_bad_values(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_options(_Opts, "demo", opts)


def test_storage_config_shards() -> None:
    ns = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4)
    assert StorageConfig(namespace=ns).shard is None
    assert StorageConfig(namespace=ns, tp_rank=1, tp_size=4).shard == "tp1of4"
    heads = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, total_kv_heads=8)
    assert StorageConfig(namespace=heads, tp_rank=1, tp_size=4).shard == "h2-3"
    # Fewer heads than ranks: ranks that hold the same head share its objects.
    assert StorageConfig(namespace=heads, tp_rank=15, tp_size=16).shard == "h7-7"
    mla = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, rank_replicated=True)
    assert StorageConfig(namespace=mla, tp_rank=3, tp_size=4).shard is None
    assert not StorageConfig(namespace=mla, tp_rank=3, tp_size=4).is_storage_writer
    assert StorageConfig(namespace=mla, tp_rank=0, tp_size=4).is_storage_writer
    assert StorageConfig(namespace=ns, pp_rank=1, pp_size=2).shard == "pp1of2"
    staged = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, layer_range=(16, 32))
    assert StorageConfig(namespace=staged, pp_rank=1, pp_size=2).shard is None


def test_storage_config_validation() -> None:
    with pytest.raises(ConfigError):
        StorageConfig(tp_rank=4, tp_size=4)
    with pytest.raises(ConfigError):
        StorageConfig(namespace="m")  # type: ignore[arg-type]
    cfg = StorageConfig(extra_config={"root": "/x", "prefetch_threshold": 1})
    assert cfg.backend_options() == {"root": "/x"}


@pytest.mark.parametrize(
    "bad",
    [
        float("inf"),
        float("-inf"),
        float("nan"),
        "Infinity",
        "-Infinity",
        "inf",
        "nan",
        "NaN",
        "9" * 401,  # float() of it is inf: int(inf) raised OverflowError
        "1" * 5000,  # past Python's int-string limit
        "0." + "1" * 100,
        -1,
        -0.5,
        "-5",
        2**63,  # over the 64-bit bound
        "9223372036854775808",
        "8388608TiB",  # 2**63 bytes
        1e19,
        b"4096",
        [4096],
    ],
)
def test_parse_size_rejects_non_finite_huge_and_negative_with_config_error(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(bad)
    assert len(str(err.value)) < 300  # a 5000-digit value is cut in the message


def test_parse_size_bounds_are_exact() -> None:
    assert parse_size(2**63 - 1) == 2**63 - 1
    assert parse_size("9223372036854775807") == 2**63 - 1
    assert parse_size("8388607.5TiB") == int(8388607.5 * 2**40)
    assert parse_size("0.5KiB") == 512
    assert parse_size(1.9) == 1  # fractions of a byte are dropped
    assert parse_size("123456789012345678") == 123456789012345678  # no float rounding


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"limit": float("inf")}, r"option limit: invalid size inf"),
        ({"limit": "Infinity"}, r"option limit: invalid size 'Infinity'"),
        ({"limit": "9" * 401}, r"option limit: size .* too large"),
        ({"limit": float("nan")}, r"option limit"),
        ({"limit": -1}, r"option limit"),
        ({"ratio": float("nan")}, "finite"),
        ({"ratio": float("inf")}, "finite"),
        ({"ratio": "Infinity"}, "finite"),
        ({"ratio": 10**400}, "number"),  # float(10**400) raised OverflowError
        ({"threads": float("inf")}, "integer"),  # int(inf) raised OverflowError
        ({"threads": float("nan")}, "integer"),
        ({"threads": 10**30}, "out of range"),
        ({"threads": "9" * 5000}, "integer"),
        ({"root": "/tmp/a\x00b"}, "NUL"),
        ({"root": b"/tmp"}, "string"),
        ({"on": [1]}, "boolean"),
        ({"mode": ["a"]}, "one of"),
    ],
)
def test_every_option_coercion_error_is_a_config_error(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        parse_options(_Opts, "demo", opts)
    assert len(str(err.value)) < 300


def test_env_option_coercion_errors_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_DEMO_LIMIT", "Infinity")
    with pytest.raises(ConfigError, match="option limit"):
        parse_options(_Opts, "demo", {})
    monkeypatch.setenv("HICACHE_STORAGE_DEMO_LIMIT", "1KiB")
    monkeypatch.setenv("HICACHE_STORAGE_DEMO_RATIO", "nan")
    with pytest.raises(ConfigError, match="finite"):
        parse_options(_Opts, "demo", {})


@dataclass(frozen=True)
class _Checked:
    password: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        if self.threads > 4:  # a check that raises ValueError, not ConfigError
            raise ValueError(f"too many threads ({self.threads}) for password {self.password}")


def test_options_class_errors_become_config_errors_without_secrets() -> None:
    with pytest.raises(ConfigError, match="too many threads") as err:
        parse_options(_Checked, "demo", {"threads": 9, "password": "CANARY-s3cr3t"})
    assert "CANARY" not in str(err.value)
    assert err.value.__cause__ is None


def test_real_backend_options_reject_infinity_and_huge_sizes(tmp_path: Path) -> None:
    from hicache_storage.backends import FileBackend

    for bad in (float("inf"), "Infinity", "inf", "nan", "9" * 401, -1, 2**64):
        with pytest.raises(ConfigError, match="max_size"):
            FileBackend(None, root=str(tmp_path), max_size=bad)
    with pytest.raises(ConfigError, match="NUL"):
        FileBackend(None, root=f"{tmp_path}/a\x00b")
    # The JSON spelling (json.loads accepts Infinity and NaN) fails the same way.
    opts = load_extra_config('{"max_size": Infinity, "root": ' + json.dumps(str(tmp_path)) + "}")
    with pytest.raises(ConfigError, match="max_size"):
        FileBackend(None, **opts)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[" * 100_000, "nested too deeply"),  # RecursionError from json.loads
        ('{"root": 1' + "0" * 5000 + "}", "digits"),  # a ValueError that is not a JSONDecodeError
    ],
)
def test_load_extra_config_hostile_json_is_a_config_error(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        load_extra_config(text)
    assert "set_int_max_str_digits" not in str(err.value)


def test_for_toml_hostile_input_is_a_config_error(tmp_path: Path) -> None:
    t = tmp_path / "c.toml"
    t.write_text("root = " + "[" * 100_000)
    with pytest.raises(ConfigError, match="TOML"):
        load_extra_config(f"@{t}")
