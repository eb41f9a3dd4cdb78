"""The wheel: only ``hicache_storage`` at top level, entry points registered, typed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_files() -> list[str]:
    """The repository's files as a fresh clone plus this change would have them: tracked,
    or new and not ignored (never build/, .venv/, caches)."""
    if not (ROOT / ".git").exists():  # an unpacked sdist or tarball: no git to ask
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".ruff_cache", ".mypy_cache"}
        return [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file()
            and not skip & set(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).exists()]


def build_wheel(dest: Path) -> Path:
    """A wheel built from a clean copy of the sources: a build in the tree itself reuses a
    stale build/lib and ships modules that no longer exist."""
    src = dest / "src"
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(src), "-w", str(dest / "dist")],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (dest / "dist").glob("hicache_storage-*.whl")
    return wheel


def test_wheel_layout_and_entry_points(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"hicache_storage"}
    assert "hicache_storage/backends/_file.py" in names
    assert "hicache_storage/conformance/__init__.py" in names
    assert "hicache_storage/py.typed" in names
    # Every package directory in the source tree is shipped: a subpackage missing from
    # pyproject's `packages` list would otherwise be silently left out of the wheel.
    shipped = set(names)
    missing = []
    walked = 0
    for src, dest in (
        ("hicache_storage", "hicache_storage"),
        ("backends", "hicache_storage/backends"),
        ("conformance", "hicache_storage/conformance"),
    ):
        for init in (ROOT / src).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            walked += 1
            rel = init.relative_to(ROOT / src).as_posix()
            if f"{dest}/{rel}" not in shipped:
                missing.append(f"{src}/{rel}")
    assert walked >= 5  # hicache_storage, cli, storekit, backends, conformance at least
    assert missing == [], f"not in the wheel (add to pyproject's packages list): {missing}"
    # ...and nothing else: the wheel's modules are exactly the source modules.
    expected = set()
    for f in source_files():
        for src, dest in (
            ("backends/", "hicache_storage/backends/"),
            ("conformance/", "hicache_storage/conformance/"),
            ("hicache_storage/", "hicache_storage/"),
        ):
            if f.startswith(src) and f.endswith(".py"):
                expected.add(dest + f[len(src) :])
    assert {n for n in names if n.endswith(".py")} == expected
    info = next(n for n in names if n.endswith("entry_points.txt"))
    eps = zipfile.ZipFile(wheel).read(info).decode()
    assert "[hicache_storage.backends]" in eps
    assert "file = hicache_storage.backends._file:FileBackend" in eps
    assert "hicache-storage = hicache_storage.cli.main:main" in eps


def test_no_top_level_backends_or_conformance_outside_the_repo(tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys;"
        "assert importlib.util.find_spec('backends') is None;"
        "assert importlib.util.find_spec('conformance') is None;"
        "import hicache_storage.backends._file as m; print(m.__name__)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hicache_storage.backends._file"


def test_import_is_light() -> None:
    code = "import sys, hicache_storage, hicache_storage.backends; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"
