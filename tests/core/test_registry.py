"""Backend discovery through entry points, with fake installed distributions."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hicache_storage import StorageConfig, available_backends, create_backend, load_backend_class
from hicache_storage.backends import FileBackend
from hicache_storage.errors import (
    AmbiguousBackendError,
    BackendLoadError,
    ConfigError,
    UnknownBackendError,
)

BACKEND_SRC = """
from hicache_storage import HiCacheStorage

class {cls}(HiCacheStorage):
    name = "{name}"

    def __init__(self, config=None, **options):
        super().__init__(config)
        self.options = options
        self.data = {{}}

    def get(self, key, target=None):
        return None

    def set(self, key, value):
        return True

    def exists(self, key):
        return False
"""


def fake_dist(site: Path, dist: str, module: str, body: str, entry_points: dict[str, str]) -> None:
    """Write an installed-looking distribution (dist-info + module) under ``site``."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hicache_storage.backends]\n{lines}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "site"
    d.mkdir()
    fake_dist(d, "acme-storage", "acme_mod", BACKEND_SRC.format(cls="Acme", name="acme"),
              {"acme": "acme_mod:Acme", "dup": "acme_mod:Acme"})  # fmt: skip
    fake_dist(d, "other-storage", "other_mod", BACKEND_SRC.format(cls="Other", name="dup"),
              {"dup": "other_mod:Other"})  # fmt: skip
    fake_dist(
        d,
        "broken-storage",
        "broken_mod",
        "import not_a_real_module_xyz\n",
        {"broken": "broken_mod:X"},
    )
    fake_dist(
        d,
        "odd-storage",
        "odd_mod",
        "class NotABackend:\n    pass\n",
        {"odd": "odd_mod:NotABackend"},
    )
    monkeypatch.syspath_prepend(str(d))
    return d


def test_builtin_file_is_found_by_entry_point() -> None:
    infos = available_backends()
    (file_info,) = infos["file"]
    assert file_info.distribution == "hicache-storage"
    assert file_info.capabilities is not None
    assert file_info.capabilities.zero_copy
    assert load_backend_class("file") is FileBackend


def test_vendor_backend_by_name(site: Path, tmp_path: Path) -> None:
    b = create_backend(
        "acme", StorageConfig(extra_config={"region": "x", "prefetch_threshold": 9}), zone="z"
    )
    assert type(b).__name__ == "Acme"
    # The engine controller's keys never reach the backend; explicit options win.
    assert b.options == {"region": "x", "zone": "z"}  # type: ignore[attr-defined]
    infos = available_backends()
    assert infos["acme"][0].distribution == "acme-storage"
    assert infos["acme"][0].version == "1.2.3"


def test_duplicate_names_are_refused_unless_pinned(site: Path) -> None:
    with pytest.raises(AmbiguousBackendError) as err:
        create_backend("dup")
    assert "acme-storage" in str(err.value)
    assert "other-storage" in str(err.value)
    assert type(create_backend("dup@other-storage")).__name__ == "Other"
    assert type(create_backend("dup@acme-storage")).__name__ == "Acme"
    assert len(available_backends()["dup"]) == 2


def test_load_errors_are_reported_not_raised_by_listing(site: Path) -> None:
    infos = available_backends()
    assert "not_a_real_module_xyz" in (infos["broken"][0].load_error or "")
    assert "not a HiCacheStorage subclass" in (infos["odd"][0].load_error or "")
    with pytest.raises(BackendLoadError, match="failed to load"):
        create_backend("broken")
    with pytest.raises(BackendLoadError, match="not a HiCacheStorage"):
        create_backend("odd")


def test_unknown_names_list_what_is_installed(site: Path) -> None:
    with pytest.raises(UnknownBackendError) as err:
        create_backend("nope")
    msg = str(err.value)
    assert "installed:" in msg
    assert "acme" in msg
    assert "file" in msg
    with pytest.raises(UnknownBackendError, match=r"dup@nobody"):
        create_backend("dup@nobody")


def test_known_but_missing_builtin_has_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_storage import registry

    real = registry._entry_points
    # As if the nixl extra were not installed: its entry point is not there.
    monkeypatch.setattr(
        registry, "_entry_points", lambda: {k: v for k, v in real().items() if k != "nixl"}
    )
    with pytest.raises(UnknownBackendError, match=r"hicache-storage\[nixl\]") as err:
        create_backend("nixl")
    assert "Known but not installed: nixl" in str(err.value)


def test_module_class_path(site: Path) -> None:
    assert type(create_backend("acme_mod:Acme")).__name__ == "Acme"
    with pytest.raises(BackendLoadError, match="no attribute"):
        create_backend("acme_mod:Missing")
    with pytest.raises(BackendLoadError, match="cannot import"):
        create_backend("no_such_mod_abc:Thing")


def test_file_options_through_the_registry(tmp_path: Path) -> None:
    b = create_backend(
        "file", StorageConfig(extra_config={"root": str(tmp_path), "tp_lcm_size": 2})
    )
    assert isinstance(b, FileBackend)
    assert b.root == str(tmp_path)
    b.close()
    with pytest.raises(ConfigError, match="unknown option"):
        create_backend("file", root=str(tmp_path), rooot="typo")


# --------------------------------------------------------------------------- broken plugins

BAD_IMPORTS = {
    "exits": "import sys\nsys.exit(3)\n",
    "raises": "raise RuntimeError('no licence server')\n",
    "syntax": "def broken(:\n    pass\n",
    "genexit": "raise GeneratorExit('odd')\n",
    "custom": "class Weird(BaseException):\n    pass\n\nraise Weird('very odd')\n",
    "prints": "print('hello from a plugin at import')\nimport sys\nsys.exit('bye')\n",
}


@pytest.fixture
def bad_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "bad-site"
    d.mkdir()
    for name, body in BAD_IMPORTS.items():
        fake_dist(d, f"bad-{name}", f"bad_{name}_mod", body, {f"bad-{name}": f"bad_{name}_mod:X"})
    monkeypatch.syspath_prepend(str(d))
    return d


def test_a_plugin_that_fails_to_import_in_any_way_costs_only_its_row(bad_site: Path) -> None:
    infos = available_backends()
    for builtin in ("file", "shm", "mmap"):
        (info,) = infos[builtin]
        assert info.load_error is None, info.load_error
        assert info.capabilities is not None
    errors = {name: infos[f"bad-{name}"][0].load_error or "" for name in BAD_IMPORTS}
    assert "SystemExit" in errors["exits"]
    assert "sys.exit(3)" in errors["exits"]
    assert "RuntimeError: no licence server" in errors["raises"]
    assert "SyntaxError" in errors["syntax"]
    assert "GeneratorExit: odd" in errors["genexit"]
    assert "Weird: very odd" in errors["custom"]
    assert "sys.exit('bye')" in errors["prints"]
    for e in errors.values():
        assert "\n" not in e
        assert "failed to load" in e
    # Selecting one is a BackendLoadError, never an exit of the caller.
    with pytest.raises(BackendLoadError, match="SystemExit"):
        create_backend("bad-exits")
    with pytest.raises(BackendLoadError, match="SystemExit"):
        create_backend("bad_exits_mod:X")


def test_keyboard_interrupt_at_import_is_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "ki-site"
    d.mkdir()
    fake_dist(d, "bad-ki", "bad_ki_mod", "raise KeyboardInterrupt\n", {"bad-ki": "bad_ki_mod:X"})
    monkeypatch.syspath_prepend(str(d))
    with pytest.raises(KeyboardInterrupt):
        available_backends()


def test_cli_lists_every_backend_when_a_plugin_calls_sys_exit(tmp_path: Path) -> None:
    """A real installed plugin (dist-info with entry_points.txt) calls sys.exit(3) at import."""
    import json
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    fake_dist(site, "exiting-storage", "exiting_mod",
              "print('noise on stdout')\nimport sys\nsys.exit(3)\n", {"exiting": "exiting_mod:X"})  # fmt: skip
    exe = Path(sys.executable).parent / "hicache-storage"
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([str(exe), "backends"], env=env, capture_output=True, text=True,
                       check=False, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    for builtin in ("file", "shm", "mmap"):
        assert builtin in rows, r.stdout
        assert "LOAD ERROR" not in rows[builtin]
    assert "exiting-storage" in rows["exiting"]
    assert "LOAD ERROR" in rows["exiting"]
    assert "sys.exit(3)" in rows["exiting"]
    assert "Traceback" not in r.stderr
    r = subprocess.run([str(exe), "backends", "--json"], env=env, capture_output=True, text=True,
                       check=False, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # the plugin's print did not corrupt the JSON
    assert {"file", "shm", "mmap", "exiting"} <= set(data)
    assert "sys.exit(3)" in data["exiting"][0]["load_error"]
    assert data["file"][0]["load_error"] is None


def test_an_unprintable_import_error_still_gets_its_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "unprintable-site"
    d.mkdir()
    body = "class E(Exception):\n    def __str__(self):\n        raise RuntimeError\n\nraise E()\n"
    fake_dist(
        d, "bad-unprintable", "bad_unprintable_mod", body, {"bad-up": "bad_unprintable_mod:X"}
    )
    monkeypatch.syspath_prepend(str(d))
    infos = available_backends()
    assert "unprintable" in (infos["bad-up"][0].load_error or "")
    assert infos["file"][0].load_error is None
