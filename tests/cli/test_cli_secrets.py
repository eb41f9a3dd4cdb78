"""The CLI never shows a secret (issue 8 item 9, the bench part; issue 27 item 13).

A test backend with secret options (``password`` by name, ``auth`` marked with
``secret()``, a ``redis://user:PASSWORD@host`` URL, and secrets nested in a list option
and a dict option) is selected with a ``module:Class`` spec; canary secrets planted in its
options must not appear in stdout or stderr of ``bench --json``, the human report, ``-vv``
logs, any error message, or the engine flags of ``sglang-args`` and ``vllm-args``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXE = Path(sys.executable).parent / "hicache-storage"

CANARY_PW = "CANARY-pw-5f2a9c"
CANARY_URL_PW = "CANARY-url-77be01"
CANARY_AUTH = "CANARY-auth-d41d8c"
CANARY_NESTED_URL_PW = "CANARY-nurl-0b7e41"
CANARY_NESTED_PW = "CANARY-npw-9a3f20"
CANARY_TOKEN = "CANARY-tok-61c5d2"

SECRET_BACKEND = '''
import json
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
    endpoints: list[dict] | None = None
    extra: dict | None = None
    fail: str = ""


class SecretBackend(FileBackend):
    """A file backend with the options a networked store has."""

    options_class = SecretOptions

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        o = self.options
        if not isinstance(o.endpoints, (list, type(None))):  # (from the environment: JSON)
            raise TypeError(f"endpoints came as {type(o.endpoints).__name__}")
        # A careless backend: logs and raises with its secrets in the message.
        log.warning("connecting to %s with password %s (auth %s), endpoints %s, %s",
                    o.url, o.password, o.auth, o.endpoints, json.dumps(o.extra))
        if o.fail == "value":
            raise ValueError(f"login to {o.url} failed for password {o.password} / {o.auth} "
                             f"on {o.endpoints} with {json.dumps(o.extra)}")
        if o.fail == "config":
            from hicache_storage.errors import ConfigError

            raise ConfigError(f"bad credentials {o.password} {o.auth} for {o.url} {o.endpoints}")
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
        "endpoints": [
            {"url": f"redis://u:{CANARY_NESTED_URL_PW}@h:1/0"},
            {"url": "redis://h:2/0", "password": CANARY_NESTED_PW},
        ],
        "extra": {"auth": {"token": CANARY_TOKEN}},
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
    for canary in (
        CANARY_PW,
        CANARY_URL_PW,
        CANARY_AUTH,
        CANARY_NESTED_URL_PW,
        CANARY_NESTED_PW,
        CANARY_TOKEN,
    ):
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
    assert shown["endpoints"] == [
        {"url": "redis://u:<redacted>@h:1/0"},
        {"url": "redis://h:2/0", "password": "<redacted>"},
    ]
    assert shown["extra"] == {"auth": "<redacted>"}
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


@pytest.mark.parametrize("command", ["sglang-args", "vllm-args"])
def test_engine_flags_leave_out_options_holding_nested_secrets(
    tmp_path: Path, env: dict[str, str], command: str
) -> None:
    """An engine logs the configuration these commands print: an option with a secret
    anywhere inside goes to its environment variable instead, as JSON the backend reads."""
    opts = options(tmp_path)
    r = subprocess.run(
        [str(EXE), command, "--hicache-storage-backend", "secret_backend:SecretBackend",
         "--hicache-storage-backend-extra-config", json.dumps(opts)],
        env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_canary(r)
    assert str(tmp_path / "store") in r.stdout  # the options without secrets are there
    named = set(re.findall(r"# set (HICACHE_STORAGE_\w+) in", r.stderr))
    assert named == {
        f"HICACHE_STORAGE_FILE_{k.upper()}"
        for k in ("password", "url", "auth", "endpoints", "extra")
    }, r.stderr
    # Given as the command says, the backend gets them back as they were (JSON).
    secret_env = {f"HICACHE_STORAGE_FILE_{k.upper()}": v if isinstance(v, str) else json.dumps(v)
                  for k, v in opts.items() if k in ("endpoints", "extra")}  # fmt: skip
    cfg = json.dumps({k: v for k, v in opts.items() if k not in ("endpoints", "extra")})
    r = bench({**env, **secret_env}, cfg, "-v", "--json", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_canary(r)
