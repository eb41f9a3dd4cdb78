"""The CLI's text commands answer without torch or a backend's client libraries.

``--help``, ``backends`` and the ``*-args`` commands print text; importing torch
alone takes 1-3 s (docs/performance.md, "CLI start-up"). Each is run in a fresh
interpreter and must leave torch unimported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import contextlib, io, json, sys
from hicache_storage.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
heavy = ("torch", "numpy", "redis", "s3fs", "botocore", "mooncake", "nixl")
print(json.dumps({"code": code, "out": out.getvalue(),
                  "loaded": sorted(m for m in heavy if m in sys.modules)}))
"""


def probe(*argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["run", "--help"],
        ["bench", "--help"],
        ["sglang-args", "--hicache-storage-backend", "file"],
        ["vllm-args", "--hicache-storage-backend", "file"],
        ["lmcache-args", "--hicache-storage-backend", "file"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_text_commands_do_not_import_torch(argv: list[str]) -> None:
    got = probe(*argv)
    assert got["code"] in (0, None)
    assert got["out"]  # (it did print its text)
    assert "torch" not in got["loaded"] and "numpy" not in got["loaded"]


def test_backends_lists_every_backend_without_torch() -> None:
    got = probe("backends", "--json")
    listed = json.loads(got["out"])
    assert {"file", "shm", "mmap", "memory", "redis", "s3", "mooncake", "nixl"} <= set(listed)
    assert "torch" not in got["loaded"]


def test_run_and_bench_help_show_every_default() -> None:
    for command, defaults in (
        ("run", ["(default: file)", "(default: 48)", "(default: write_through)", "/tmp/"]),
        ("bench", ["(default: file)", "(default: 128)", "(default: bfloat16)"]),
    ):
        text = " ".join(probe(command, "--help")["out"].split())
        for want in defaults:
            assert want in text, (command, want)
    top = probe("--help")["out"]
    assert "``" not in top  # (no reStructuredText markup in what users read)


def test_a_misspelt_backend_name_suggests_the_close_one() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli.main", "sglang-args",
         "--hicache-storage-backend", "fiel"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Did you mean 'file'?" in done.stderr
