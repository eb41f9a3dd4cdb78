"""Tests of the LMCache plugin inside the real LMCache engine (0.5.6, on the CPU).

They run in ``.venv-lmcache``, which ``bash scripts/lmcache_env.sh`` builds
(``scripts/test.sh`` builds it and runs them there, in a private network namespace).
Run from any other venv, this directory stops the whole run with a usage error instead of
skipping: a skipped integration test would read as a pass.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import lmcache
except ImportError as exc:
    raise pytest.UsageError(
        f"tests/integrations/lmcache needs the real LMCache package, and {sys.executable} "
        f"cannot import it ({exc}). Build its venv with `bash scripts/lmcache_env.sh`, then "
        "run `.venv-lmcache/bin/python -m pytest tests/integrations/lmcache`."
    ) from exc

del lmcache
sys.path.insert(0, str(Path(__file__).parents[2] / "workers"))


def pytest_configure(config: pytest.Config) -> None:
    """LMCache warns at import and leaves its event loops and sockets to the collector
    (ResourceWarning); the suite's "warnings are errors" rule is for this package's
    code, so those categories are let through here, for this directory only."""
    for category in ("DeprecationWarning", "FutureWarning", "UserWarning", "ResourceWarning",
                     "pytest.PytestUnraisableExceptionWarning"):  # fmt: skip
        config.addinivalue_line("filterwarnings", f"ignore::{category}")


@pytest.fixture(autouse=True)
def collect_lmcaches_leftovers() -> Iterator[None]:
    """After each test, collect what LMCache's engine leaves to the collector (its event
    loop, sockets), with warnings off: pytest would report it later, outside the
    warning filters above."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real redis-server on 127.0.0.1."""
    import engine_servers
    from redis_server import running

    with running(tmp_path_factory.mktemp("redis")) as server:
        engine_servers.REDIS_URL[:] = [server.url]
        yield server.url
        engine_servers.REDIS_URL.clear()


@pytest.fixture(scope="session", autouse=True)
def s3_server() -> Iterator[str]:
    """One real S3 server (moto's) on 127.0.0.1."""
    import engine_servers
    from moto_server import running_moto

    with running_moto() as server:
        server.make_bucket("hicache-sglang")
        engine_servers.S3_OPTIONS.update(
            endpoint_url=server.endpoint, bucket="hicache-sglang", key=server.key,
            secret=server.secret, region="us-east-1",
        )  # fmt: skip
        yield server.endpoint
        engine_servers.S3_OPTIONS.clear()


@pytest.fixture(scope="session", autouse=True)
def mooncake_store() -> Iterator[str]:
    """A Mooncake master and one storage node (inside a private network namespace)."""
    import engine_servers
    from mooncake_master import require_private_network, running_store

    require_private_network()
    with running_store(256 << 20) as (master, _holder):
        engine_servers.MOONCAKE_MASTER[:] = [master.address]
        yield master.address
        engine_servers.MOONCAKE_MASTER.clear()
