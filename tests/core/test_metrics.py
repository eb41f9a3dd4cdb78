"""Prometheus metrics of the backends (``hicache_storage.metrics``), scraped as an
operator would: the default registry in this process, the summed files of several
processes, and ``hicache-storage run --metrics-port``."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from hicache_storage import metrics
from hicache_storage.config import StorageConfig
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.registry import create_backend

PAGE = b"kv" * 2048  # 4 KiB


def _backend(root: Path, **options: Any) -> Any:
    ns = KVCacheNamespace(model_id="m", dtype="bfloat16", page_size=16,
                          object_layout="test", tenant=secrets.token_hex(4))  # fmt: skip
    return create_backend("file", StorageConfig(namespace=ns), root=str(root), **options)


def _value(name: str, backend: Any, **labels: str) -> float:
    got = REGISTRY.get_sample_value(
        name, {"backend": "file", "namespace": backend.namespace.digest[:12], **labels}
    )
    return 0.0 if got is None else float(got)


def test_metrics_stay_off_and_prometheus_client_unimported_unless_asked(tmp_path: Path) -> None:
    code = f"""
import sys
from hicache_storage.registry import create_backend
b = create_backend("file", root={str(tmp_path)!r})
assert b.batch_set(["a"], [b"x" * 64]) == [True] and b.batch_get(["a"])[0] is not None
from hicache_storage import metrics
assert not metrics.enabled() and "prometheus_client" not in sys.modules
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_STORAGE_METRICS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_backends_calls_are_series_with_what_they_did(tmp_path: Path) -> None:
    metrics.enable()
    b = _backend(tmp_path, max_size=1 << 20, namespace_max_size=1 << 19)
    keys = [f"k{i}" for i in range(3)]
    assert b.batch_set(keys, [PAGE] * 3) == [True] * 3
    got = b.batch_get([*keys[:2], "absent"])
    assert got[0] is not None and got[1] is not None and got[2] is None
    assert b.batch_exists(keys) == 3
    assert _value("hicache_operations_total", b, operation="batch_set") == 1
    assert _value("hicache_pages_total", b, operation="batch_set", result="ok") == 3
    assert _value("hicache_pages_total", b, operation="batch_get", result="ok") == 2
    assert _value("hicache_pages_total", b, operation="batch_get", result="miss") == 1
    assert _value("hicache_pages_total", b, operation="batch_exists", result="ok") == 3
    assert _value("hicache_operation_seconds_count", b, operation="batch_get") == 1
    assert _value("hicache_bytes_written_total", b) >= 3 * len(PAGE)
    assert _value("hicache_bytes_read_total", b) == 2 * len(PAGE)
    # Capacity, as usage() tells it (refreshed once a second on the metrics' thread).
    end = time.monotonic() + 20
    while _value("hicache_objects", b) != 3:
        assert time.monotonic() < end, "no capacity refresh"
        time.sleep(0.05)
    assert _value("hicache_capacity_limit_bytes", b) == 1 << 20
    assert _value("hicache_capacity_used_bytes", b) >= 3 * len(PAGE)
    assert _value("hicache_objects", b) == 3
    # The namespace's own figures and its quota (namespace_max_size).
    assert _value("hicache_namespace_objects", b) == 3
    assert _value("hicache_namespace_used_bytes", b) == _value("hicache_capacity_used_bytes", b)
    assert _value("hicache_namespace_limit_bytes", b) == 1 << 19
    # A damaged object: a failed read, counted as corrupt.
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.name.startswith(".") and path.stat().st_size > len(PAGE):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))
    assert b.batch_get(keys) == [None] * 3
    assert _value("hicache_corrupt_objects_total", b) == 3
    b.close()


WRITER = """
import sys
from hicache_storage.config import StorageConfig
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.registry import create_backend
ns = KVCacheNamespace(model_id="m", dtype="bfloat16", page_size=16, object_layout="mp",
                      tenant="procs")
b = create_backend("file", StorageConfig(namespace=ns), root=sys.argv[1])
keys = [f"{sys.argv[2]}-{i}" for i in range(4)]
assert b.batch_set(keys, [b"p" * 4096] * 4) == [True] * 4
assert b.batch_exists(keys) == 4
b.close()
"""


def test_several_processes_are_summed_by_the_serving_one(tmp_path: Path) -> None:
    """Each process (SGLang's TP workers, say) writes its values to the multiprocess
    directory; the process that serves sums them."""
    folder = tmp_path / "prom"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder), "HICACHE_STORAGE_METRICS": "1"}
    args = [sys.executable, "-c", WRITER, str(tmp_path / "kv")]
    procs = [subprocess.Popen([*args, name], env=env) for name in ("rank0", "rank1")]
    for p in procs:
        assert p.wait(timeout=120) == 0
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(folder))
    labels = {"backend": "file", "operation": "batch_set"}
    samples = [
        s for fam in reg.collect() for s in fam.samples
        if all(s.labels.get(k) == v for k, v in labels.items())
    ]  # fmt: skip
    pages = sum(s.value for s in samples if s.name == "hicache_pages_total")
    calls = sum(s.value for s in samples if s.name == "hicache_operations_total")
    timed = sum(s.value for s in samples if s.name == "hicache_operation_seconds_count")
    assert (pages, calls, timed) == (8, 2, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_main_job_serves_its_metrics_while_it_runs(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "report.json"
    exe = Path(sys.executable).with_name("hicache-storage")
    args = [str(exe), "run", "--hicache-storage-backend-extra-config",
            json.dumps({"root": str(tmp_path / "kv")}), "--sessions", "4", "--turns", "2",
            "--system-tokens", "256", "--user-tokens", "64", "--answer-tokens", "64",
            "--layer-num", "2", "--head-dim", "32", "--no-progress", "--json",
            "--metrics-port", str(port), "--metrics-hold", "60"]  # fmt: skip
    err = tmp_path / "stderr.txt"
    with out.open("w") as sink, err.open("w") as errors:
        proc = subprocess.Popen(args, stdout=sink, stderr=errors, text=True)
        try:
            deadline = time.monotonic() + 240
            report = None
            while report is None:
                assert proc.poll() is None, err.read_text()[-2000:]
                assert time.monotonic() < deadline
                time.sleep(0.5)
                try:
                    report = json.loads(out.read_text())
                except ValueError:
                    continue
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
        finally:
            proc.terminate()
            proc.wait(30)
    series: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("backend") == "file":
                key = (
                    s.name + "|" + s.labels.get("operation", "") + "|" + s.labels.get("result", "")
                )
                series[key] = series.get(key, 0.0) + s.value
    page = report["page_bytes"]
    stored = series["hicache_pages_total|batch_set_v1|ok"]
    assert stored > 0 and stored * page == report["bytes_written_to_storage"]
    assert series["hicache_bytes_written_total||"] == report["bytes_written_to_storage"]
    assert series["hicache_operations_total|batch_set_v1|"] >= 1


DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "hicache-storage.json"


def dashboard_series(prefix: str) -> set[str]:
    """The series the Grafana dashboard's queries name, of ``prefix``."""
    import re

    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return {
        m for e in exprs for m in re.findall(r"[a-z:_]*hicache_[a-z_]+", e) if m.startswith(prefix)
    }


def exported(families: Any) -> set[str]:
    """Every series name of ``families`` (a family's samples, with their suffixes)."""
    out = set()
    for fam in families:
        out.add(fam.name)
        out.update(fam.name + s for s in ("_total", "_bucket", "_count", "_sum"))
        out.update(s.name for s in fam.samples)
    return out


def test_the_dashboard_names_only_series_the_backends_export(tmp_path: Path) -> None:
    metrics.enable()
    _backend(tmp_path).close()
    wanted = dashboard_series("hicache_")
    assert {"hicache_pages_total", "hicache_operation_seconds_bucket"} <= wanted
    assert wanted <= exported(REGISTRY.collect())
