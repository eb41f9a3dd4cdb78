"""The ``hicache-storage`` command line, in process and through the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_storage.cli.main import main
from hicache_storage.layouts import LAYOUTS

SMALL = [
    "--pages",
    "8",
    "--batch",
    "3",
    "--page-size",
    "4",
    "--layer-num",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
]


def test_backends_lists_file_with_capabilities(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "file" in out
    assert "zero_copy, delete, persistent, shared" in out
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (entry,) = data["file"]
    assert entry["distribution"] == "hicache-storage"
    assert entry["load_error"] is None
    assert entry["capabilities"]["zero_copy"] is True


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bench_json_verifies_every_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    extra = json.dumps({"root": str(tmp_path)})
    args = [
        "bench",
        "--hicache-storage-backend-extra-config",
        extra,
        "--layout",
        layout,
        "--json",
        "--no-progress",
    ]
    assert main([*args, *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["verified_pages"] == 8
    assert report["mismatched_pages"] == 0
    for phase in ("set", "get"):
        assert report[phase]["ok"] == 8
        assert report[phase]["seconds"] > 0
        seconds = report[phase]["seconds"]  # rounded to the microsecond
        expected = report[phase]["bytes"] / seconds / 1e9
        # GB/s has 4 significant digits; seconds' rounding adds up to 0.5 us / seconds.
        assert report[phase]["GBps"] == pytest.approx(expected, rel=1e-3 + 0.5e-6 / seconds)
        assert report[phase]["bytes"] == 8 * report["page_bytes"]
    assert report["exists"]["ok"] == 8
    assert report["stats"]["ops"]["batch_set_v1"]["ok"] == 8
    # The run's namespace is cleared afterwards unless --keep.
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_bench_keep_and_extra_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"root": str(tmp_path / "store"), "fsync": True}))
    rc = main(["bench", "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", f"@{cfg}",
               "--keep", "--mla", "--no-progress", *SMALL])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "verified 8/8 pages byte-exact: OK" in out
    assert "MLA" in out
    assert len([p for p in (tmp_path / "store").rglob("*") if p.is_file()]) == 8


LOSSY = '''
from hicache_storage.backends import FileBackend

class Lossy(FileBackend):
    """Says every page landed but corrupts the first byte of each read."""

    def batch_get_pages(self, keys, pages):
        out = super().batch_get_pages(keys, pages)
        for p in pages:
            p.segments[0].memoryview[0] ^= 0xFF
        return out
'''


def test_bench_fails_when_bytes_do_not_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lossy_mod.py").write_text(textwrap.dedent(LOSSY))
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = json.dumps({"root": str(tmp_path / "s")})
    rc = main(["bench", "--hicache-storage-backend", "lossy_mod:Lossy",
               "--hicache-storage-backend-extra-config", extra, "--no-progress", *SMALL])  # fmt: skip
    assert rc == 1
    assert "verified 0/8 pages byte-exact: FAILED" in capsys.readouterr().out


def test_errors_are_reported_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--hicache-storage-backend", "nope", "--no-progress", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "unknown storage backend 'nope'" in err
    assert "installed: file" in err
    assert main(["bench", "--hicache-storage-backend-extra-config", "{bad", "--no-progress"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert (
        main(["bench", "--hicache-storage-backend-extra-config", '{"rooot": 1}', "--no-progress"])
        == 2
    )
    assert "unknown option" in capsys.readouterr().err


def test_an_mla_page_head_pool_is_refused_before_any_backend_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = json.dumps({"root": str(tmp_path / "kv")})
    args = ["bench", "--hicache-storage-backend-extra-config", extra, "--layout", "page_head",
            "--mla", "--no-progress", *SMALL]  # fmt: skip
    assert main(args) == 2
    assert "an MLA pool has no 'page_head' layout" in capsys.readouterr().err
    assert not (tmp_path / "kv").exists()


def test_console_script(tmp_path: Path) -> None:
    exe = shutil.which("hicache-storage", path=str(Path(sys.executable).parent))
    assert exe is not None, "the console script is not installed"
    r = subprocess.run([exe, "backends"], capture_output=True, text=True, check=True)
    assert "file" in r.stdout
    r = subprocess.run(
        [exe, "bench", "--hicache-storage-backend-extra-config", json.dumps({"root": str(tmp_path)}), *SMALL],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout
    assert "OK" in r.stdout
