"""Tests of the vLLM KV connector inside a real vLLM engine.

They run in ``.venv-vllm``, the venv that ``bash scripts/vllm_env.sh`` builds
(``scripts/test.sh`` builds it and runs them there, in a private network namespace, for
the mooncake backend's sake). Run from any other venv, this directory stops the whole
run with a usage error instead of skipping: a skipped engine test would read as a pass.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "workers"))
import vllm_engine  # (sets vLLM's environment before vLLM is imported)

try:
    import vllm
except ImportError as exc:
    raise pytest.UsageError(
        f"tests/integrations/vllm needs the real vLLM package, and {sys.executable} cannot import it "
        f"({exc}). Build its venv with `bash scripts/vllm_env.sh`, then run "
        "`unshare -n bash -c 'ip link set lo up && .venv-vllm/bin/python -m pytest tests/integrations/vllm'`."
    ) from exc

del vllm


def pytest_configure(config: pytest.Config) -> None:
    """vLLM and the libraries it imports warn at import and engine start (deprecations,
    "experimental API"); the suite's "warnings are errors" rule is for this package's
    code, so those categories are let through here, for this directory only."""
    for category in ("DeprecationWarning", "FutureWarning", "UserWarning", "ResourceWarning"):
        config.addinivalue_line("filterwarnings", f"ignore::{category}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, built once per session."""
    return vllm_engine.build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real redis-server on 127.0.0.1."""
    from redis_server import running

    with running(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(scope="session")
def s3_options() -> Iterator[dict[str, Any]]:
    """One real S3 server (moto's) on 127.0.0.1, with a bucket; the s3 backend's options."""
    from moto_server import running_moto

    with running_moto() as server:
        server.make_bucket("hicache-vllm")
        yield {
            "endpoint_url": server.endpoint, "bucket": "hicache-vllm", "key": server.key,
            "secret": server.secret, "region": "us-east-1",
        }  # fmt: skip


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[str]:
    """A Mooncake master and one storage node (this run is in a private network namespace)."""
    from mooncake_master import require_private_network, running_store

    require_private_network()
    with running_store(256 << 20) as (master, _holder):
        yield master.address
