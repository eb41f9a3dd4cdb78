"""``hicache-storage vllm-args``: the vLLM ``kv_transfer_config`` that runs a backend.

(The engine tests in tests/integrations/vllm/ build every engine from this command's function, so
the configuration it prints is the one proven inside vLLM.)
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

EXE = Path(sys.executable).parent / "hicache-storage"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, check=False)


def test_the_config_loads_our_connector_with_the_backend_and_its_options() -> None:
    r = run("vllm-args", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", '{"root": "/var/cache/kv", "fsync": true}')  # fmt: skip
    assert r.returncode == 0, r.stderr
    flag, value = shlex.split(r.stdout)
    assert flag == "--kv-transfer-config"
    assert json.loads(value) == {
        "kv_connector": "HiCacheKVConnector",
        "kv_connector_module_path": "hicache_storage.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "backend_name": "file",
            "root": "/var/cache/kv",
            "fsync": True,
        },
    }


def test_json_role_and_policy() -> None:
    r = run("vllm-args", "--hicache-storage-backend", "memory", "--json",
            "--role", "kv_producer", "--policy", "fail")  # fmt: skip
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout)
    assert config["kv_role"] == "kv_producer" and config["kv_load_failure_policy"] == "fail"
    assert config["kv_connector_extra_config"] == {"backend_name": "memory"}


def test_connector_keys_pass_and_typos_fail_here_not_in_vllms_worker() -> None:
    r = run("vllm-args", "--hicache-storage-backend", "file", "--json",
            "--hicache-storage-backend-extra-config",
            '{"root": "/x", "tenant": "team-a", "staging_blocks": 8}')  # fmt: skip
    assert r.returncode == 0, r.stderr
    extra = json.loads(r.stdout)["kv_connector_extra_config"]
    assert extra["tenant"] == "team-a" and extra["staging_blocks"] == 8
    r = run("vllm-args", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", '{"rot": "/x"}')  # fmt: skip
    assert r.returncode == 2
    assert "unknown option(s) ['rot']" in r.stderr and r.stdout == ""
    r = run("vllm-args", "--hicache-storage-backend", "no-such-store")
    assert r.returncode == 2 and "no-such-store" in r.stderr
    r = run("vllm-args", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", '{"backend_name": "shm"}')  # fmt: skip
    assert r.returncode == 2 and "set by vllm-args itself" in r.stderr


def test_secrets_stay_out_of_the_config_and_go_to_the_environment() -> None:
    """vLLM logs its kv_transfer_config: a password in a URL is named as an env variable."""
    secret = "hunter2-CANARY-77"
    r = run("vllm-args", "--hicache-storage-backend", "redis",
            "--hicache-storage-backend-extra-config",
            json.dumps({"url": f"redis://user:{secret}@127.0.0.1:6379/0"}))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert secret not in r.stdout and secret not in r.stderr
    extra = json.loads(shlex.split(r.stdout)[1])["kv_connector_extra_config"]
    assert "url" not in extra
    assert "HICACHE_STORAGE_REDIS_URL" in r.stderr
