"""Bad arguments to ``hicache-storage``: one line on stderr, exit 2, no traceback, no figure.

Issue 8 item 16: ``bench --batch 0``, ``--dtype floot`` and ``max_size: Infinity`` ended in
tracebacks, ``bench --batch -3`` did no I/O and reported about 2000 GB/s, and a misspelt
backend name or invalid JSON in ``conformance`` printed 50 failed checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_storage.cli.bench import PhaseResult
from hicache_storage.cli.main import main

EXE = Path(sys.executable).parent / "hicache-storage"

SMALL = ["--pages", "8", "--batch", "3", "--page-size", "4", "--layer-num", "2",
         "--kv-heads", "2", "--head-dim", "16", "--no-progress"]  # fmt: skip


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(argv)`` as the console script runs it: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits on usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, out, err)
    assert out == "", f"nothing may be printed on stdout (no figure): {out!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"one line expected on stderr, got {len(lines)}: {err!r}"
    assert "Traceback" not in err
    assert lines[0].startswith("hicache-storage")
    assert "error:" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _bench(root: Path, *extra: str, options: dict[str, object] | None = None) -> list[str]:
    opts = {"root": str(root), **(options or {})}
    return ["bench", "--hicache-storage-backend-extra-config", json.dumps(opts), *SMALL, *extra]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batch", "0"], "--batch"),
        (["--batch", "-3"], "--batch"),
        (["--batch", "many"], "--batch"),
        (["--pages", "0"], "--pages"),
        (["--pages", "-1"], "--pages"),
        (["--page-size", "0"], "--page-size"),
        (["--layer-num", "0"], "--layer-num"),
        (["--kv-heads", "-2"], "--kv-heads"),
        (["--head-dim", "1.5"], "--head-dim"),
        (["--dtype", "floot"], "did you mean 'float'"),
        (["--dtype", "tensor"], "unknown dtype 'tensor'"),
        (["--dtype", "qint8"], "qint8"),
        (["--layout", "diagonal"], "--layout"),
        (["--pages", str(2**40)], "the benchmark needs"),  # more memory than the machine has
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_bench_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    root = tmp_path / "store"
    code, out, err = run_main(_bench(root, *args), capsys)
    assert_one_line_error(code, out, err, needle)
    assert not root.exists(), "validation must come before any I/O"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('{"max_size": Infinity}', "max_size"),
        ('{"max_size": -Infinity}', "max_size"),
        ('{"max_size": NaN}', "max_size"),
        ('{"max_size": "Infinity"}', "max_size"),
        ('{"max_size": ' + "9" * 401 + "}", "max_size"),
        ('{"max_size": "' + "9" * 401 + '"}', "too large"),
        ('{"min_free_space": 1e400}', "min_free_space"),
        ('{"max_concurrency": Infinity}', "max_concurrency"),
        ('{"eviction_ratio": NaN}', "eviction_ratio"),
        ('{"rooot": "/x"}', "unknown option"),
        ("{bad", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ("[" * 100_000, "nested too deeply"),
        ('[{"root": 1' + "0" * 5000 + "}]", "digits"),
    ],
)
def test_bad_bench_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, needle: str
) -> None:
    root = tmp_path / "store"
    if extra.startswith("{") and extra != "{bad" and "rooot" not in extra:
        extra = extra[:-1] + f", {json.dumps('root')}: {json.dumps(str(root))}}}"
    argv = ["bench", "--hicache-storage-backend-extra-config", extra, *SMALL]
    code, out, err = run_main(argv, capsys)
    assert_one_line_error(code, out, err, needle)
    assert not root.exists()


def test_bad_backend_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, needle in [
        ("fiel", "unknown storage backend 'fiel'"),
        ("no_such_module_xyz:Thing", "cannot import"),
        ("json:JSONDecoder", "not a HiCacheStorage subclass"),
        ("file@nobody", "unknown storage backend"),
    ]:
        code, out, err = run_main(
            [*_bench(tmp_path / "s"), "--hicache-storage-backend", name], capsys
        )
        assert_one_line_error(code, out, err, needle)


CTOR_RAISES = """
from hicache_storage.backends import FileBackend

class CtorRaises(FileBackend):
    def __init__(self, config=None, **options):
        raise ValueError("endpoint refused:\\nline two of the message")
"""

ALWAYS_FAILS = '''
from hicache_storage.backends import FileBackend

class AlwaysFails(FileBackend):
    """Accepts the pool, stores nothing, finds nothing, reads nothing."""

    def batch_set_pages(self, keys, pages):
        return [False] * len(keys)

    def batch_get_pages(self, keys, pages):
        return [False] * len(keys)

    def batch_exists(self, keys, extra_info=None):
        return 0
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "cli_ctor_raises.py").write_text(textwrap.dedent(CTOR_RAISES))
    (d / "cli_always_fails.py").write_text(textwrap.dedent(ALWAYS_FAILS))
    monkeypatch.syspath_prepend(str(d))
    return d


def test_a_constructor_that_raises_is_one_line(
    tmp_path: Path, plugin_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_bench(tmp_path / "s"), "--hicache-storage-backend", "cli_ctor_raises:CtorRaises"]
    code, out, err = run_main(argv, capsys)
    assert_one_line_error(code, out, err, "ValueError: endpoint refused: line two")


def test_no_figure_for_work_that_did_not_happen(
    tmp_path: Path, plugin_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backend that stores nothing: exit 1, no GB/s, pages/s or us/page anywhere."""
    base = [*_bench(tmp_path / "s"), "--hicache-storage-backend", "cli_always_fails:AlwaysFails"]
    code, out, _ = run_main([*base, "--json"], capsys)
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    for phase in ("set", "exists", "get"):
        p = report[phase]
        assert p["ok"] == 0
        assert p["bytes"] == 0
        assert p["GBps"] is None
        assert p["pages_per_s"] is None
        assert p["page_us_mean"] is None
    code, out, _ = run_main(base, capsys)
    assert code == 1
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for phase in ("set", "exists", "get"):
        # phase, ok, GB/s, pages/s, p50, p99, us/page: no rate where nothing succeeded
        _name, ok, gbps, pps, _p50, _p99, us = rows[phase]
        assert (ok, gbps, pps, us) == ("0", "-", "-", "-"), rows[phase]
    assert "FAILED" in out


def test_phase_rates_count_only_pages_that_succeeded() -> None:
    none = PhaseResult("set", pages=8, page_bytes=2**20, seconds=0.5, ok=0, batch_seconds=[0.1])
    d = none.to_dict()
    assert (d["bytes"], d["GBps"], d["pages_per_s"], d["page_us_mean"]) == (0, None, None, None)
    half = PhaseResult("get", pages=8, page_bytes=10**6, seconds=2.0, ok=4, batch_seconds=[1, 1])
    d = half.to_dict()
    assert d["bytes"] == 4 * 10**6
    assert d["GBps"] == pytest.approx(4 * 10**6 / 2.0 / 1e9)
    assert d["pages_per_s"] == 2.0
    untimed = PhaseResult("get", pages=0, page_bytes=10, seconds=0.0, ok=0).to_dict()
    assert untimed["batch_ms_p50"] is None
    assert untimed["batch_ms_p99"] is None


def test_bench_shape_refuses_what_argparse_would(tmp_path: Path) -> None:
    from hicache_storage.benchkit import BenchShape
    from hicache_storage.errors import ConfigError

    for bad in ({"batch": 0}, {"batch": -3}, {"pages": 0}, {"page_size": 0}, {"dtype": "floot"},
                {"layout": "x"}, {"pages": True}):  # fmt: skip
        with pytest.raises(ConfigError):
            BenchShape(**bad)
    assert BenchShape(dtype="torch.half").dtype == "float16"


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hicache-storage-backend", "fiel"], "unknown storage backend 'fiel'"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", "{bad"],
         "not valid JSON"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
          '{"rooot": 1}'], "unknown option"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
          '{"max_size": Infinity}'], "max_size"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
          "@/nonexistent/cfg.json"], "cannot read"),
    ],
)  # fmt: skip
def test_conformance_builds_the_backend_once_and_stops_on_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    report = tmp_path / "report.json"
    code, out, err = run_main(["conformance", *args, "--report", str(report)], capsys)
    assert_one_line_error(code, out, err, needle)
    assert not report.exists()  # no check ran


def test_conformance_misspelt_backend_in_a_real_process(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(EXE), "conformance", "--hicache-storage-backend", "fiel"],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=120,
    )  # fmt: skip
    assert_one_line_error(r.returncode, r.stdout, r.stderr, "unknown storage backend 'fiel'")
    assert "failed" not in r.stdout


def test_usage_errors_in_a_real_process(tmp_path: Path) -> None:
    """The console script itself: argparse errors and option errors, no traceback."""
    env = {**os.environ}
    for argv, needle in [
        (["bench", "--batch", "0"], "--batch"),
        (["bench", "--dtype", "floot"], "floot"),
        (["bench", "--hicache-storage-backend-extra-config",
          json.dumps({"root": str(tmp_path / "s")}).replace("}", ', "max_size": Infinity}')],
         "max_size"),
        (["nosuchcommand"], "invalid choice"),
        ([], "required"),
    ]:  # fmt: skip
        r = subprocess.run(
            [str(EXE), *argv], capture_output=True, text=True, cwd=tmp_path, env=env,
            check=False, timeout=120,
        )  # fmt: skip
        assert_one_line_error(r.returncode, r.stdout, r.stderr, needle)
    assert not (tmp_path / "s").exists()


def test_conformance_preflight_uses_the_kits_environment_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_BACKEND_EXTRA_CONFIG", '{"rooot": 1}')
    code, out, err = run_main(["conformance", "--hicache-storage-backend", "file"], capsys)
    assert_one_line_error(code, out, err, "unknown option")


@pytest.mark.parametrize(
    "extra",
    [
        ["--report", "/nonexistent/dir/r.json"],
        ["--markdown", "/nonexistent/dir/r.md"],
        ["-k", "and or ("],
    ],
)
def test_conformance_refuses_bad_outputs_and_filters_before_running(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Second attack: these ran the whole kit, then failed (exit 1 or 4, several lines)."""
    from hicache_storage.cli.main import main

    config = json.dumps({"root": str(tmp_path / "r")})
    code = main(
        ["conformance", "--hicache-storage-backend", "file",
         "--hicache-storage-backend-extra-config", config, *extra]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "passed" not in out
