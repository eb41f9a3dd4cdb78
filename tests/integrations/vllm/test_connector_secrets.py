"""The vLLM connector never shows a secret nested in a list or dict option (issue 27 item
13), with vLLM's own config classes.

The backend is ``secret_backends:CanaryFile`` (the kit's canary backend: the ``file``
backend with a password, a URL with a password, and secrets nested in a list option and
a dict option). A bad option raises without them; a store that cannot be reached, whose
error quotes every secret it holds, is logged without them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm_engine import BLOCK, kv_transfer_config

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.vllm import HiCacheKVConnector

sys.path.insert(0, str(Path(__file__).parents[2] / "conformance_kit" / "teeth"))

PW = "CANARY-vllm-pw-2f8a"
URL_PW = "CANARY-vllm-url-d51c"
PW2 = "CANARY-vllm-pw2-70be"
T0K3N = "CANARY-vllm-tok-a93e"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture
def config(tiny_model: Path, tmp_path: Path) -> Any:
    """A real VllmConfig for the tiny model, the connector on the canary backend."""
    args = EngineArgs(
        model=str(tiny_model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True,
        max_model_len=256, enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config("file", {"root": "/nonexistent"}),
    )  # fmt: skip
    vllm_config = args.create_engine_config()
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.clear()
    extra.update(
        backend_name="secret_backends:CanaryFile", root=str(tmp_path / "kv"), password=PW,
        endpoints=[{"url": f"redis://u:{URL_PW}@127.0.0.1:1/0"},
                   {"url": "redis://127.0.0.1:2/0", "password": PW2}],
        extra={"auth": {"token": T0K3N}},
    )  # fmt: skip
    return vllm_config


def kv_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    group = KVCacheGroupSpec(list(LAYERS), spec)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group],
                         kv_cache_layout="LBHNC")  # fmt: skip


def assert_clean(text: str) -> None:
    for canary in (PW, URL_PW, PW2, T0K3N):
        assert canary not in text, f"{canary} in: {text}"


@pytest.mark.parametrize(
    "bad", [{"auth": {"token": T0K3N}}, [{"url": f"redis://u:{URL_PW}@h", "password": PW2}]]
)
def test_a_bad_option_holding_a_nested_secret_is_refused_without_it(config: Any, bad: Any) -> None:
    config.kv_transfer_config.kv_connector_extra_config["workers_unreachable"] = bad
    with pytest.raises(ConfigError, match="workers_unreachable") as info:
        HiCacheKVConnector(config, KVConnectorRole.SCHEDULER, kv_config())
    assert_clean(str(info.value))


def test_an_unreachable_store_is_logged_without_its_secrets(
    config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config.kv_transfer_config.kv_connector_extra_config["fail"] = "build"
    connector = HiCacheKVConnector(config, KVConnectorRole.SCHEDULER, kv_config())
    connector.shutdown()
    assert "backend cannot be reached (BackendUnavailableError" in caplog.text
    assert "127.0.0.1:2" in caplog.text  # the nested options were quoted...
    assert_clean(caplog.text)  # ...without their secrets
    assert_clean(repr(connector.settings))  # the settings both sides share, too
