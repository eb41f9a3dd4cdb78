"""``hicache-storage sglang-args``: the SGLang flags that run a backend as its L3."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

EXE = Path(sys.executable).parent / "hicache-storage"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, check=False)


def test_the_flags_load_our_adapter_with_the_backend_and_its_options() -> None:
    r = run("sglang-args", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", '{"root": "/var/cache/kv", "fsync": true}')  # fmt: skip
    assert r.returncode == 0, r.stderr
    flags = shlex.split(r.stdout)
    assert flags[:4] == [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
    ]
    extra = json.loads(flags[4])
    assert extra == {
        "backend_name": "file",
        "module_path": "hicache_storage.integrations.sglang",
        "class_name": "SGLangStorage",
        "interface_v1": True,
        "root": "/var/cache/kv",
        "fsync": True,
    }


def test_a_misspelt_option_fails_here_not_in_sglangs_worker() -> None:
    r = run("sglang-args", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", '{"rot": "/x"}')  # fmt: skip
    assert r.returncode == 2
    assert "unknown option(s) ['rot']" in r.stderr and "root" in r.stderr
    assert r.stdout == ""


def test_an_unknown_backend_is_a_clear_error() -> None:
    r = run("sglang-args", "--hicache-storage-backend", "no-such-store")
    assert r.returncode == 2
    assert "no-such-store" in r.stderr


def test_secrets_stay_out_of_the_flags_and_go_to_the_environment(tmp_path: Path) -> None:
    """SGLang logs its extra config; a secret option is named as an environment variable."""
    secret = "hunter2-CANARY-77"
    mod = tmp_path / "secret_store.py"
    mod.write_text(
        "from dataclasses import dataclass\n"
        "from hicache_storage.backends import MemoryBackend, MemoryOptions\n"
        "@dataclass(frozen=True)\n"
        "class Opts(MemoryOptions):\n"
        "    password: str = ''\n"
        "class SecretStore(MemoryBackend):\n"
        "    name = 'secret-store'\n"
        "    options_class = Opts\n"
    )
    r = subprocess.run(
        [str(EXE), "sglang-args", "--hicache-storage-backend", "secret_store:SecretStore",
         "--hicache-storage-backend-extra-config", json.dumps({"password": secret, "store": "s"})],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert secret not in r.stdout and secret not in r.stderr
    extra = json.loads(shlex.split(r.stdout)[4])
    assert "password" not in extra and extra["store"] == "s"
    assert "HICACHE_STORAGE_SECRET_STORE_PASSWORD" in r.stderr
