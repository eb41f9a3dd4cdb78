"""The ``s3`` backend keeps its secrets out of the S3 client's DEBUG logs (issue 27 item 11).

botocore logs every request's headers at DEBUG (``botocore.endpoint``) and the canonical
request it signs (``botocore.auth``). With SSE-C, those headers carry the customer key
(base64) and the base64 of its MD5 digest. The key sits nested in ``storage_options``
(``s3_additional_kwargs``, as s3fs takes it); neither it nor a form of it may reach a log
record, against the moto server these tests start.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import KVCacheNamespace, StorageConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

from moto_server import MotoServer, running_moto

BUCKET = "hicache-secrets"


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with running_moto() as srv:
        srv.make_bucket(BUCKET)
        yield srv


def sse_c(key: str, as_json: bool) -> dict[str, Any] | str:
    options = {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": key}}
    return json.dumps(options) if as_json else options


@pytest.mark.parametrize("as_json", [False, True], ids=["dict", "json"])
def test_the_sse_c_key_never_reaches_a_log_record(
    moto: MotoServer, caplog: pytest.LogCaptureFixture, as_json: bool
) -> None:
    from hicache_storage.backends import S3Backend

    key = f"CANARY-{secrets.token_hex(16)}"[:32]  # AES-256: 32 bytes
    raw = key.encode()
    forms = {
        "raw": key,
        "base64": base64.b64encode(raw).decode(),
        "md5": base64.b64encode(hashlib.md5(raw).digest()).decode(),  # what botocore sends
    }
    page = torch.full((4096,), 7, dtype=torch.uint8)
    ns = KVCacheNamespace(model_id="m", dtype="uint8", page_size=4)
    with caplog.at_level(logging.DEBUG):  # botocore's request headers
        b = S3Backend(
            StorageConfig(namespace=ns), bucket=BUCKET, prefix=f"t-{uuid.uuid4().hex[:8]}",
            endpoint_url=moto.endpoint, region="us-east-1", key=moto.key, secret=moto.secret,
            storage_options=sse_c(key, as_json),
        )  # fmt: skip
        try:
            assert b.set("k", page) is True
            got = b.get("k")
            assert got is not None and torch.equal(got, page)
            assert b.exists("k") is True
        finally:
            b.close()
    text = "\n".join([caplog.text, *(r.getMessage() for r in caplog.records)])
    assert "x-amz-server-side-encryption-customer-key-md5" in text.lower()  # sent and logged
    leaks = sorted({f"{form} in {r.name}" for r in caplog.records for form, value in forms.items()
                    if value in r.getMessage()})  # fmt: skip
    assert not leaks, leaks
    for form, value in forms.items():
        assert value not in text, form
