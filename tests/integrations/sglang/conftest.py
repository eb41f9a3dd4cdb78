"""Tests of the engine adapters inside the real engines (SGLang for now).

They run in ``.venv-sglang``, the second venv that ``bash scripts/sglang_env.sh`` builds
(``scripts/test.sh`` builds it and runs them there). Run from any other venv, this
directory stops the whole run with a usage error instead of skipping: a skipped
integration test would read as a pass.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

try:
    import sglang
except ImportError as exc:
    raise pytest.UsageError(
        f"tests/integrations/sglang needs the real SGLang package, and {sys.executable} cannot "
        f"import it ({exc}). Build its venv with `bash scripts/sglang_env.sh`, then run "
        "`.venv-sglang/bin/python -m pytest tests/integrations/sglang`."
    ) from exc

del sglang

# SGLang's host-pool classes import torchvision, which cannot be installed here; the
# stand-in's docstring says why and what it is.
sys.path.insert(0, str(Path(__file__).parents[2] / "workers"))
import torchvision_stand_in

torchvision_stand_in.install()

# SGLang's quantization modules warn at import that they need a GPU (AWQ, GGUF...); the
# host pools import them. Those warnings, and only those, are expected here.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"Only .* support", category=UserWarning)
    import sglang.srt.managers.cache_controller  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def redis_server(tmp_path_factory: pytest.TempPathFactory):  # -> Iterator[str]
    """One real redis-server on 127.0.0.1 for the tests that run SGLang on ``redis``."""
    import engine_servers
    from redis_server import running

    with running(tmp_path_factory.mktemp("redis")) as server:
        engine_servers.REDIS_URL[:] = [server.url]
        yield server.url
        engine_servers.REDIS_URL.clear()


@pytest.fixture(scope="session", autouse=True)
def s3_server():  # -> Iterator[str]
    """One real S3 server (moto's) on 127.0.0.1 for the tests that run SGLang on ``s3``."""
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
def mooncake_store():  # -> Iterator[str]
    """A Mooncake master and one storage node, for the tests that run SGLang on
    ``mooncake`` (this run is inside a private network namespace: scripts/test.sh)."""
    import engine_servers
    from mooncake_master import require_private_network, running_store

    require_private_network()
    with running_store(256 << 20) as (master, _holder):
        engine_servers.MOONCAKE_MASTER[:] = [master.address]
        yield master.address
        engine_servers.MOONCAKE_MASTER.clear()
