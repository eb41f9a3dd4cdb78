"""Secrets at library level (an engine calls the SDK directly, no CLI in between):
option reprs, errors raised by an options class, and the protocol layer's failure logs
never show a secret option's value or a URL password."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.backends import FileBackend, FileOptions
from hicache_storage.config import is_secret_option, secret
from hicache_storage.errors import ConfigError

PW = "CANARY-PW-7f3a"
AUTH = "CANARY-AUTH-91b2"
URL_PW = "CANARY-URLPW-55c1"


@dataclass(frozen=True)
class CanaryOptions(FileOptions):
    password: str | None = None
    auth_blob: str | None = secret()  # a secret whose name does not say so
    apiKey: str | None = None
    upstream: str | None = None
    min_len: int = 0
    fail: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.password is not None and len(self.password) < self.min_len:
            raise ConfigError(f"password {self.password!r} is shorter than {self.min_len}")


class Canary(FileBackend):
    name = "canary"
    options_class = CanaryOptions
    options: CanaryOptions  # what options_class parses into

    def set(self, key: str, value: Any) -> bool:
        if self.options.fail:  # a client error that quotes what it was given
            raise ConnectionError(
                f"AUTH {self.options.password} {self.options.auth_blob} refused by "
                f"{self.options.upstream}"
            )
        return super().set(key, value)

    def batch_set_pages(self, keys: list[str], pages: Any) -> list[bool]:
        if self.options.fail:
            raise RuntimeError(f"bug with {self.options.apiKey} and {self.options.password}")
        return super().batch_set_pages(keys, pages)


def canary(tmp_path: Path, **options: Any) -> Canary:
    return Canary(
        root=str(tmp_path / "root"),
        password=PW,
        auth_blob=AUTH,
        apiKey=PW + "-api",
        upstream=f"redis://user:{URL_PW}@127.0.0.1:1/0",
        **options,
    )


def assert_clean(text: str) -> None:
    for canary_ in (PW, AUTH, URL_PW):
        assert canary_ not in text, text


def test_option_reprs_are_redacted(tmp_path: Path) -> None:
    b = canary(tmp_path)
    try:
        assert_clean(repr(b.options))
        assert_clean(repr(b))
        assert "password=<redacted>" in repr(b.options)
    finally:
        b.close()


def test_an_options_class_error_never_quotes_the_secret(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        canary(tmp_path, min_len=50)
    assert_clean(str(info.value))
    assert "shorter than 50" in str(info.value)


def test_failure_logs_are_scrubbed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hicache_storage.conformance.data import make_pool

    b = canary(tmp_path, fail=True)
    try:
        with caplog.at_level(logging.DEBUG):
            assert b.set("k", b"v") is False  # an expected kind of failure (ConnectionError)
            pool = make_pool(num_pages=2)
            b.register_mem_pool_host(pool)
            assert b.batch_set_v1(["a", "b"], list(range(2 * pool.page_size))) == [False] * 2
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "refused" in text and "bug with" in text  # the failures were logged...
        assert "Traceback" in text  # ...the unexpected one with its traceback
        assert_clean(text)  # ...without a secret
        assert_clean(caplog.text)
    finally:
        b.close()


@pytest.mark.parametrize(
    "name", ["apiKey", "accessKeyId", "passphrase", "db_pwd", "AUTH_TOKEN", "sessionCookie"]
)
def test_secret_names_in_any_spelling(name: str) -> None:
    assert is_secret_option(name)


@pytest.mark.parametrize("name", ["root", "max_size", "io_threads", "directory", "group"])
def test_ordinary_names_are_not_secrets(name: str) -> None:
    assert not is_secret_option(name)


def test_url_passwords_of_ordinary_options_are_scrubbed_from_failure_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Third review: a client error quoting only the password of a URL option (not the
    whole URL) leaked, as did secret query parameters and secrets nested in dicts."""
    from hicache_storage.config import redact_options, redact_text

    b = canary(tmp_path, fail=True)
    try:
        with caplog.at_level(logging.WARNING):
            b._log_failure("set", ConnectionError(f"WRONGPASS {URL_PW} for user"))
        assert "WRONGPASS" in caplog.text
        assert_clean(caplog.text)
    finally:
        b.close()
    assert URL_PW not in redact_text(f"s3://h/b?password={URL_PW}&x=1")
    assert URL_PW not in redact_text(f"redis://u:a@{URL_PW}@127.0.0.1:1/0")
    assert URL_PW not in repr(redact_options({"extra": {"token": URL_PW}}))
