"""The SGLang adapter never shows a secret nested in a list or dict option (issue 27 item
13), inside the real SGLang package.

The backend is ``secret_backends:CanaryFile`` (the kit's canary backend: the ``file``
backend with a password, a URL with a password, and secrets nested in a list option and
a dict option), built by SGLang's own ``dynamic`` factory. A bad option and a backend
error quoting every secret it holds reach SGLang only scrubbed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

from hicache_storage import HostKVPool
from hicache_storage.errors import ConfigError
from hicache_storage.integrations.sglang import SGLangStorage

sys.path.insert(0, str(Path(__file__).parents[2] / "conformance_kit" / "teeth"))

PW = "CANARY-sgl-pw-4e1d"
URL_PW = "CANARY-sgl-url-9b07"
PW2 = "CANARY-sgl-pw2-c3a8"
T0K3N = "CANARY-sgl-tok-61f2"


def build(tmp_path: Path, **options: Any) -> SGLangStorage:
    extra = {
        "backend_name": "secret_backends:CanaryFile",
        "module_path": "hicache_storage.integrations.sglang",
        "class_name": "SGLangStorage",
        "interface_v1": True,
        "root": str(tmp_path / "kv"),
        "password": PW,
        "endpoints": [{"url": f"redis://u:{URL_PW}@127.0.0.1:1/0"},
                      {"url": "redis://127.0.0.1:2/0", "password": PW2}],
        "extra": {"auth": {"token": T0K3N}},
        **options,
    }  # fmt: skip
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="acme/llama-test", extra_config=extra,
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(backend, SGLangStorage)
    return backend


def pool() -> HostKVPool:
    return HostKVPool(num_pages=4, page_size=4, layer_num=2, kv_heads=2, head_dim=16,
                      dtype=torch.bfloat16, layout="page_first")  # fmt: skip


def assert_clean(text: str) -> None:
    for canary in (PW, URL_PW, PW2, T0K3N):
        assert canary not in text, f"{canary} in: {text}"


@pytest.mark.parametrize(
    "bad", [{"auth": {"token": T0K3N}}, [{"url": f"redis://u:{URL_PW}@h", "password": PW2}]]
)
def test_a_bad_option_holding_a_nested_secret_is_refused_without_it(
    tmp_path: Path, bad: Any
) -> None:
    b = build(tmp_path, workers_unreachable=bad)  # a bool option given a dict or list
    with pytest.raises(ConfigError, match="workers_unreachable") as info:
        b.register_mem_pool_host(pool())
    assert_clean(str(info.value))
    b.close()


def test_a_backend_error_quoting_its_options_is_logged_scrubbed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    b = build(tmp_path, fail="refuse")  # its batch_exists raises, quoting every secret
    try:
        b.register_mem_pool_host(pool())
        assert b.exists("k") is False  # a failed call, never an exception
    finally:
        b.close()
    assert "SGLangStorage.batch_exists failed (InvalidArgumentError" in caplog.text
    assert "127.0.0.1:2" in caplog.text  # the nested options were quoted...
    assert_clean(caplog.text)  # ...without their secrets
