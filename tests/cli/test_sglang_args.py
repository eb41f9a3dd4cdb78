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


def test_a_password_in_a_url_value_stays_out_of_the_flags(tmp_path: Path) -> None:
    mod = tmp_path / "url_store.py"
    mod.write_text(
        "from dataclasses import dataclass\n"
        "from hicache_storage.backends import MemoryBackend, MemoryOptions\n"
        "@dataclass(frozen=True)\n"
        "class Opts(MemoryOptions):\n"
        "    endpoint: str = ''\n"
        "class UrlStore(MemoryBackend):\n"
        "    name = 'url-store'\n"
        "    options_class = Opts\n"
    )
    canary = "S3cr3t-CANARY-91"
    r = subprocess.run(
        [str(EXE), "sglang-args", "--hicache-storage-backend", "url_store:UrlStore",
         "--hicache-storage-backend-extra-config",
         json.dumps({"endpoint": f"redis://admin:{canary}@127.0.0.1:6379/0"})],
        capture_output=True, text=True, check=False, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert canary not in r.stdout + r.stderr
    assert "HICACHE_STORAGE_URL_STORE_ENDPOINT" in r.stderr


def test_the_adapters_own_keys_cannot_be_overridden_but_its_options_pass() -> None:
    r = run("sglang-args", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", '{"module_path": "evil.mod"}')  # fmt: skip
    assert r.returncode == 2 and "module_path" in r.stderr
    r = run("sglang-args", "--hicache-storage-backend", "memory",
            "--hicache-storage-backend-extra-config",
            '{"model_id": "acme/m", "kv_cache_dtype": "fp8_e4m3", "allocator": "shm"}')  # fmt: skip
    assert r.returncode == 0, r.stderr
    extra = json.loads(shlex.split(r.stdout)[4])
    assert (extra["model_id"], extra["kv_cache_dtype"], extra["allocator"]) == (
        "acme/m", "fp8_e4m3", "shm",
    )  # fmt: skip
