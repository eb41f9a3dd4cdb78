"""Secrets at library level (an engine calls the SDK directly, no CLI in between):
option reprs, errors raised by an options class or by option coercion, and the protocol
layer's failure logs never show a secret option's value or a URL password, however deep
in a list or dict option it sits; and the one redaction rule of
:mod:`hicache_storage.secrets` itself."""

from __future__ import annotations

import json
import logging
import traceback
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
# Secrets nested in list and dict options (issue 27 item 13).
PW2 = "CANARY-PW2-3c9e"
T0K3N = "CANARY-T0K3N-8d1e"
ENDPOINTS = [{"url": f"redis://u:{URL_PW}@h", "password": PW2}]
EXTRA = {"auth": {"token": T0K3N}}


@dataclass(frozen=True)
class CanaryOptions(FileOptions):
    password: str | None = None
    auth_blob: str | None = secret()  # a secret whose name does not say so
    apiKey: str | None = None
    upstream: str | None = None
    endpoints: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None
    min_len: int = 0
    fail: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.password is not None and len(self.password) < self.min_len:
            raise ConfigError(f"password {self.password!r} is shorter than {self.min_len}")
        if any("host" in e for e in self.endpoints or ()):
            raise ConfigError(f"endpoints take a url, not a host: {self.endpoints}")


class Canary(FileBackend):
    name = "canary"
    options_class = CanaryOptions
    options: CanaryOptions  # what options_class parses into

    def set(self, key: str, value: Any) -> bool:
        if self.options.fail:  # a client error that quotes what it was given
            raise ConnectionError(
                f"AUTH {self.options.password} {self.options.auth_blob} refused by "
                f"{self.options.upstream} ({self.options.endpoints}, "
                f"{json.dumps(self.options.extra)})"
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
        **{"endpoints": ENDPOINTS, "extra": EXTRA, **options},
    )


def assert_clean(text: str) -> None:
    for canary_ in (PW, AUTH, URL_PW, PW2, T0K3N):
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


@pytest.mark.parametrize("name", ["root", "max_size", "max_concurrency", "directory", "group"])
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


@pytest.mark.parametrize("bad", [EXTRA, ENDPOINTS, [[[EXTRA]]]])
def test_option_coercion_errors_never_show_nested_secrets(tmp_path: Path, bad: Any) -> None:
    """Issue 27 item 13: a list or dict given where a number was due was quoted as is."""
    with pytest.raises(ConfigError, match="min_len") as info:
        canary(tmp_path, min_len=bad)
    assert_clean(str(info.value))
    assert_clean("".join(traceback.format_exception(info.value)))


def test_an_options_class_error_never_quotes_a_nested_secret(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a host") as info:
        canary(tmp_path, endpoints=[{"host": "127.0.0.1", "password": PW2}])
    assert_clean(str(info.value))
    assert "127.0.0.1" in str(info.value)  # what is not secret is kept


def test_a_dict_or_list_option_from_the_environment_is_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hicache-storage sglang-args`` moves an option holding a nested secret to its
    environment variable: the backend must get the list back, not its text."""
    monkeypatch.setenv("HICACHE_STORAGE_CANARY_ENDPOINTS", json.dumps(ENDPOINTS))
    b = Canary(root=str(tmp_path / "root"))
    try:
        assert b.options.endpoints == ENDPOINTS
    finally:
        b.close()
    monkeypatch.setenv("HICACHE_STORAGE_CANARY_ENDPOINTS", "not json")
    with pytest.raises(ConfigError, match="endpoints='not json' must be a JSON array"):
        Canary(root=str(tmp_path / "root"))


def test_the_secrets_of_options_at_any_depth() -> None:
    from hicache_storage.secrets import secret_values

    options = {
        "endpoints": ENDPOINTS,  # a URL password, and a secret by name, in a list
        "extra": {"nested": ({"auth": {"token": T0K3N, "n": 1234567}},)},  # all of auth
        "storage": {"SSECustomerKey": b"raw-key-bytes"},  # camelCase, bytes
        "url": f"s3://h/b?X-Amz-Security-Token={AUTH}&page=2",  # a secret query parameter
        "root": "/data",
        "on": True,
    }
    assert secret_values(options) == {URL_PW, PW2, T0K3N, "1234567", "raw-key-bytes", AUTH}
    cycle: list[Any] = [{"password": PW}]
    cycle.append(cycle)
    deep: Any = {"password": PW2}
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        deep = [deep]
    assert secret_values({"a": cycle, "b": deep}) == {PW, PW2}
    nested = CanaryOptions(root="/data", auth_blob=AUTH)  # marked secret() by its class
    assert secret_values({"inner": [nested]}) == {AUTH}
    assert secret_values(None) == set()


def test_every_form_a_client_prints_a_secret_in_is_cut() -> None:
    """Issue 27 item 11: botocore sends an SSE-C key base64-encoded, with its MD5."""
    import base64
    import hashlib
    from urllib.parse import quote

    from hicache_storage.secrets import REDACTED, scrub

    key = 'CANARY-"key"/é+%'
    raw = key.encode()
    forms = [
        key,
        json.dumps(key)[1:-1],
        repr(key)[1:-1],
        quote(key, safe=""),
        base64.b64encode(raw).decode(),
        base64.b64encode(hashlib.md5(raw).digest()).decode(),
    ]
    for form in forms:
        assert scrub(f"header: {form}.", [key]) == f"header: {REDACTED}.", form
    assert scrub("abc and abc", ["abc"]) == "abc and abc"  # too short to search for
    assert scrub(f"redis://u:{URL_PW}@h") == f"redis://u:{REDACTED}@h"  # always


def test_the_log_scrubber_counts_holders_and_scrubs_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hicache_storage.secrets import LogScrubber

    scrubber = LogScrubber()
    log = logging.getLogger("test.library_secrets.scrubber")
    scrubber.attach(log.name)
    try:
        scrubber.add([PW])
        scrubber.add([PW])  # a second holder of the same secret
        scrubber.forget([PW])
        with caplog.at_level(logging.INFO, logger=log.name):
            try:
                raise ConnectionError(f"AUTH {PW} refused")
            except ConnectionError:
                log.exception("login with %s failed", PW)
            scrubber.forget([PW])  # the last holder is gone
            log.info("now %s", "CANARY-shown")
        assert "AUTH <redacted> refused" in caplog.text  # the traceback, scrubbed
        assert "login with <redacted> failed" in caplog.text
        assert "now CANARY-shown" in caplog.text
        assert_clean(caplog.text)
    finally:
        log.removeFilter(scrubber)


def test_a_traceback_formatted_by_an_earlier_filter_is_scrubbed_all_the_same(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record factory or filter that runs first (the kit's, holding other secrets)
    leaves the traceback formatted in ``exc_text``: the scrubber holding this secret cuts
    it there (it skipped a formatted traceback and showed the password)."""
    from hicache_storage.secrets import LogScrubber

    first, second = LogScrubber(), LogScrubber()
    first.add(["OTHER-SECRET-1234"])
    second.add([PW])
    log = logging.getLogger("test.library_secrets.two_scrubbers")
    first.attach(log.name)
    second.attach(log.name)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            try:
                raise ConnectionError(f"AUTH {PW} refused")
            except ConnectionError:
                log.exception("login failed")
        assert "AUTH <redacted> refused" in caplog.text
        assert_clean(caplog.text)
    finally:
        log.removeFilter(first)
        log.removeFilter(second)


def test_options_built_directly_show_no_url_password() -> None:
    """In a fresh interpreter (no options parsed yet), the network backends' options
    built by hand hide their URL passwords in repr."""
    import subprocess
    import sys

    code = (
        "from hicache_storage.backends._redis import RedisOptions\n"
        "from hicache_storage.backends._mooncake import MooncakeOptions\n"
        "from hicache_storage.backends._s3 import S3Options\n"
        f"print(RedisOptions(url='redis://:{PW}@h:1/0'))\n"
        f"print(MooncakeOptions(master_server_address='etcd://u:{PW}@h:2379',\n"
        f"                      metadata_server='http://u:{PW}@h:1/metadata'))\n"
        f"print(S3Options(bucket='b', secret='{PW}'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.count("<redacted>") >= 4, out
    assert_clean(out)
