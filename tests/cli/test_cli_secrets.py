"""``hicache-storage bench`` never shows a secret (issue 8 item 9, the bench part).

A test backend with secret options (``password`` by name, ``auth`` marked with
``secret()``, and a ``redis://user:PASSWORD@host`` URL) is selected with a ``module:Class``
spec; canary secrets planted in its options must not appear in stdout or stderr of
``bench --json``, the human report, ``-vv`` logs, or any error message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXE = Path(sys.executable).parent / "hicache-storage"

CANARY_PW = "CANARY-pw-5f2a9c"
CANARY_URL_PW = "CANARY-url-77be01"
CANARY_AUTH = "CANARY-auth-d41d8c"

SECRET_BACKEND = '''
import logging
from dataclasses import dataclass

from hicache_storage.backends import FileBackend, FileOptions
from hicache_storage.config import secret

log = logging.getLogger("secret_backend")


@dataclass(frozen=True)
class SecretOptions(FileOptions):
    password: str | None = None
    url: str | None = None
    auth: str | None = secret()
    fail: str = ""


class SecretBackend(FileBackend):
    """A file backend with the options a networked store has."""

    options_class = SecretOptions

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        o = self.options
        # A careless backend: logs and raises with its secrets in the message.
        log.warning("connecting to %s with password %s (auth %s)", o.url, o.password, o.auth)
        if o.fail == "value":
            raise ValueError(f"login to {o.url} failed for password {o.password} / {o.auth}")
        if o.fail == "config":
            from hicache_storage.errors import ConfigError

            raise ConfigError(f"bad credentials {o.password} {o.auth} for {o.url}")
        if o.fail == "runtime":
            raise RuntimeError(f"{o.password}")
'''


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "secret_backend.py").write_text(textwrap.dedent(SECRET_BACKEND))
    return {**os.environ, "PYTHONPATH": str(d)}


def options(tmp_path: Path, **extra: object) -> dict[str, object]:
    return {
        "root": str(tmp_path / "store"),
        "password": CANARY_PW,
        "url": f"redis://admin:{CANARY_URL_PW}@cache.example:6379/0",
        "auth": CANARY_AUTH,
        **extra,
    }


SMALL = ["--pages", "4", "--batch", "2", "--page-size", "4", "--layer-num", "2",
         "--kv-heads", "2", "--head-dim", "16"]  # fmt: skip


def bench(env: dict[str, str], cfg: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(EXE), *extra[:1], "bench", "--hicache-storage-backend", "secret_backend:SecretBackend",
         "--hicache-storage-backend-extra-config", cfg, *SMALL, *extra[1:]],
        env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip


def assert_no_canary(r: subprocess.CompletedProcess[str]) -> None:
    for canary in (CANARY_PW, CANARY_URL_PW, CANARY_AUTH):
        assert canary not in r.stdout, f"{canary} leaked on stdout"
        assert canary not in r.stderr, f"{canary} leaked on stderr"
    assert "CANARY" not in r.stdout + r.stderr


def test_bench_json_and_report_never_show_secrets(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = json.dumps(options(tmp_path))
    r = bench(env, cfg, "-vv", "--json", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_canary(r)
    report = json.loads(r.stdout)
    assert report["ok"] is True
    shown = report["options"]
    assert shown["password"] == "<redacted>"
    assert shown["auth"] == "<redacted>"  # marked secret() by the options class
    assert shown["url"] == "redis://admin:<redacted>@cache.example:6379/0"
    assert shown["root"] == str(tmp_path / "store")  # other options are shown as given
    assert "secret_backend" in r.stderr  # the backend's warning was logged, redacted
    r = bench(env, cfg, "-v")  # the human report, with its progress bars
    assert r.returncode == 0, r.stderr[-3000:]
    assert "byte-exact: OK" in r.stdout
    assert_no_canary(r)


def test_secrets_from_a_private_file_never_show(tmp_path: Path, env: dict[str, str]) -> None:
    f = tmp_path / "secret.json"
    f.write_text(json.dumps(options(tmp_path)))
    f.chmod(0o600)
    r = bench(env, f"@{f}", "-vv", "--json", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_canary(r)


@pytest.mark.parametrize("fail", ["value", "config", "runtime"])
def test_error_messages_never_show_secrets(tmp_path: Path, env: dict[str, str], fail: str) -> None:
    cfg = json.dumps(options(tmp_path, fail=fail))
    for verbosity in ("-v", "-vv"):  # -vv adds the traceback: it is redacted too
        r = bench(env, cfg, verbosity, "--json", "--no-progress")
        assert r.returncode == 2, r.stderr[-3000:]
        assert r.stdout == ""
        assert "hicache-storage: error:" in r.stderr
        assert_no_canary(r)


def test_type_errors_of_secret_options_never_show_them(tmp_path: Path, env: dict[str, str]) -> None:
    for bad in ({"password": ["CANARY-in-a-list"]}, {"auth": {"CANARY": 1}}, {"password": 1234567}):
        cfg = json.dumps({**options(tmp_path), **bad})
        r = bench(env, cfg, "-v", "--json", "--no-progress")
        assert r.returncode == 2, r.stderr[-3000:]
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "CANARY" not in r.stdout + r.stderr


def test_conformance_errors_never_show_secrets(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = json.dumps(options(tmp_path, fail="value"))
    r = subprocess.run(
        [str(EXE), "conformance", "--hicache-storage-backend", "secret_backend:SecretBackend",
         "--hicache-storage-backend-extra-config", cfg],
        env=env, capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("hicache-storage: error:")]
    assert len(errors) == 1, r.stderr  # (the backend's own warning is on the line before)
    assert "Traceback" not in r.stderr
    assert "passed" not in r.stdout  # no check ran
    assert_no_canary(r)
