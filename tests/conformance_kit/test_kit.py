"""The kit's three entry points, its plugin's inertness, and a vendor's own distribution."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_storage.conformance.rules import RULES

ROOT = Path(__file__).resolve().parents[2]
VENDOR = ROOT / "examples" / "vendor-backend"
EXE = Path(sys.executable).parent / "hicache-storage"


def pythonpath(*dirs: Path | str) -> str:
    """``dirs`` ahead of the caller's own PYTHONPATH (kept, so a run can pin the SDK)."""
    return os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


def test_plugin_is_registered_and_inert() -> None:
    code = (
        "import sys, pytest\n"
        "from importlib.metadata import entry_points\n"
        "eps = [e for e in entry_points(group='pytest11') if e.name == 'hicache_storage']\n"
        "assert eps and eps[0].value == 'hicache_storage.conformance.plugin', eps\n"
        "import hicache_storage.conformance.plugin as p\n"
        "assert 'torch' not in sys.modules, 'the plugin imported torch'\n"
        "assert 'hicache_storage.conformance.suite' not in sys.modules\n"
        "import inspect\n"
        "fixtures = [n for n, o in vars(p).items() if 'Fixture' in type(o).__name__]\n"
        "assert fixtures == [], fixtures\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_assertion_messages_are_rewritten_for_vendors(tmp_path: Path) -> None:
    """A failing check shows the compared values, not a bare AssertionError."""
    (tmp_path / "test_v.py").write_text(
        "import pytest\n"
        "from hicache_storage.conformance import BackendConformance, BackendSpec\n"
        "class TestSame(BackendConformance):\n"
        "    @pytest.fixture\n"
        "    def backend_spec(self, tmp_path):\n"
        "        return BackendSpec('broken_backends:ReplacesExisting', {})\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path / "test_v.py"), "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-k", "set_existing"],
        env={**os.environ, "PYTHONPATH": pythonpath(ROOT / "tests" / "conformance_kit" / "teeth")},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 1
    assert "[set-existing]" in r.stdout
    assert f"rule set-existing: {RULES['set-existing']}" in r.stdout  # the rule, stated
    assert "assert b'" in r.stdout or "assert tensor" in r.stdout or "==" in r.stdout


@pytest.fixture(scope="module")
def vendor_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vendor distribution, built and installed (as a wheel) into a private site dir."""
    site = tmp_path_factory.mktemp("vendor-site")
    # Built from a copy: a build in the source tree leaves build/ and *.egg-info there.
    src = tmp_path_factory.mktemp("vendor-src") / "vendor-backend"
    shutil.copytree(VENDOR, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(site), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    return site


def vendor_env(site: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(site), **extra}


def test_vendor_backend_is_found_by_name(vendor_site: Path) -> None:
    r = subprocess.run(
        [str(EXE), "backends", "--json"],
        env=vendor_env(vendor_site),
        capture_output=True,
        text=True,
        check=True,
    )
    (entry,) = json.loads(r.stdout)["sqlite-kv"]
    assert entry["distribution"] == "hicache-vendor-example"
    assert entry["load_error"] is None
    assert entry["capabilities"]["persistent"] is True


def test_cli_runs_the_kit_on_the_vendor_backend(vendor_site: Path, tmp_path: Path) -> None:
    extra = json.dumps({"path": str(tmp_path / "kv.sqlite")})
    report, markdown = tmp_path / "report.json", tmp_path / "report.md"
    r = subprocess.run(
        [str(EXE), "conformance", "--hicache-storage-backend", "sqlite-kv",
         "--hicache-storage-backend-extra-config", extra, "--report", str(report), "--markdown", str(markdown)],
        env=vendor_env(vendor_site), capture_output=True, text=True, cwd=tmp_path, check=False, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    data = json.loads(report.read_text())
    statuses = {c["id"]: c["status"] for c in data["checks"]}
    assert data["summary"]["failed"] == 0
    assert data["summary"]["passed"] >= 40
    assert statuses["zero_copy_path_is_native"] == "not-claimed"
    assert statuses["killed_writers_leave_no_wrong_object"] == "passed"
    assert statuses["processes_writing_the_same_keys"] == "passed"
    (info,) = data["backends"].values()
    assert info["backend"] == "sqlite-kv"
    assert info["class"] == "hicache_vendor_example.SQLiteBackend"
    perf = next(c for c in data["checks"] if c["id"] == "performance_qualification")
    assert perf["metrics"]["performance"]["get_GBps"] > 0
    assert "| TestConformance | `sqlite-kv` |" in markdown.read_text()
    assert "conformance of 'sqlite-kv'" in r.stdout


def test_zero_code_pytest_with_environment_variables(vendor_site: Path, tmp_path: Path) -> None:
    env = vendor_env(
        vendor_site,
        HICACHE_STORAGE_BACKEND="sqlite-kv",
        HICACHE_STORAGE_BACKEND_EXTRA_CONFIG=json.dumps({"path": str(tmp_path / "kv.sqlite")}),
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "hicache_storage.conformance", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q", "-k", "read_your_writes or namespaces"],
        env=env, capture_output=True, text=True, cwd=tmp_path, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "6 passed" in r.stdout


def test_cli_exit_code_on_failures_and_usage_errors(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT / "tests" / "conformance_kit" / "teeth")}
    report, markdown = tmp_path / "report.json", tmp_path / "report.md"
    r = subprocess.run(
        [str(EXE), "conformance", "--hicache-storage-backend", "broken_backends:AllHitsBatchExists", "-k", "leading_run",
         "--report", str(report), "--markdown", str(markdown)],
        env=env, capture_output=True, text=True, cwd=tmp_path, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1
    assert "[batch-exists-leading-run]" in r.stdout
    assert "1 failed" in r.stdout
    stated = RULES["batch-exists-leading-run"]
    assert f"rule batch-exists-leading-run: {stated}" in r.stdout
    (failed,) = [c for c in json.loads(report.read_text())["checks"] if c["status"] == "failed"]
    assert (failed["rule"], failed["statement"]) == ("batch-exists-leading-run", stated)
    assert f"  - rule `batch-exists-leading-run`: {stated}" in markdown.read_text()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "hicache_storage.conformance", "-p", "no:cacheprovider", "-q",
         "-k", "read_your_writes"],
        env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_STORAGE_BACKEND")},
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1
    assert "no backend selected" in r.stdout


def test_a_break_store_of_the_wrong_shape_fails_saying_what_the_kit_expects() -> None:
    from hicache_storage.backends import MemoryBackend
    from hicache_storage.conformance.suite import broken

    @contextlib.contextmanager
    def without_backend() -> Iterator[None]:  # the shape docs/vendors.md once showed
        yield

    @contextlib.contextmanager
    def right(backend: object) -> Iterator[None]:
        yield

    backend = MemoryBackend()
    try:
        for hook, what in [
            (without_backend, "break_store(backend) cannot be called"),
            (without_backend(), "got _GeneratorContextManager"),
            (lambda backend: None, "break_store(backend) returned NoneType"),
        ]:
            with pytest.raises(pytest.fail.Exception) as failed:
                broken(hook, backend)
            message = str(failed.value)
            assert message.startswith("[fault-hook] ") and what in message, message
            assert "takes the backend under test and returns a context manager" in message
            assert RULES["fault-hook"] in message
        with broken(right, backend):
            pass
    finally:
        backend.close()
