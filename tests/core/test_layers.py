"""The layer rules (CONTRIBUTING.md, "Layers"), checked by walking every import of the package.

Every ``.py`` file under ``hicache_storage/``, ``backends/`` and ``conformance/`` is parsed
with :mod:`ast` (nothing is imported or executed). Each file gets the module name it has
once installed (``backends/_file.py`` is ``hicache_storage.backends._file``), and every
import in it counts, wherever it stands: module level, inside a function (lazy), under
``if TYPE_CHECKING:``, ``import a.b`` and ``from a import b`` forms, relative forms,
``importlib.import_module("literal")`` and the string values of a module-level ``_LAZY``
map (the lazy re-export convention of ``backends/__init__`` and ``conformance/__init__``).
A name built at run time (``import_module(spec)``) cannot be seen; the registry loads
backends that way on purpose, from entry points, which is not a layer dependency.

The layers, lowest first: core, storekit, backends, conformance, tier, integrations, cli.
Nothing points up; some rules also forbid sideways and skipping imports (below).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Source directory -> the package it is installed as (pyproject's package-dir).
SOURCES: dict[str, str] = {
    "hicache_storage": "hicache_storage",
    "backends": "hicache_storage.backends",
    "conformance": "hicache_storage.conformance",
}

# Subpackage -> its layer. Every other module directly in hicache_storage/ (and the
# package itself) is the core. A new subpackage must be added here (a test says so).
SUBPACKAGE_LAYERS: dict[str, str] = {
    "hicache_storage.storekit": "storekit",
    "hicache_storage.backends": "backends",
    "hicache_storage.conformance": "conformance",
    "hicache_storage.tier": "tier",
    "hicache_storage.integrations": "integrations",
    "hicache_storage.cli": "cli",
}

BACKENDS = "hicache_storage.backends"
PRIVATE_BACKEND = "hicache_storage.backends._*"  # a backend's own module or package
STOREKIT = "hicache_storage.storekit"
CONFORMANCE = "hicache_storage.conformance"
TIER = "hicache_storage.tier"
INTEGRATIONS = "hicache_storage.integrations"
CLI = "hicache_storage.cli"


@dataclass(frozen=True)
class Rule:
    """Modules of ``layer`` never import a module matching ``forbidden``.

    ``forbidden`` is a glob over dotted names and also covers everything below the match
    (``a.b`` forbids ``a.b`` and ``a.b.c``). With ``own_subtree_ok``, an import inside
    the importer's own top three name components (``hicache_storage.backends._x``) is
    allowed: a backend package may import its own modules.
    """

    layer: str
    forbidden: str
    reason: str
    own_subtree_ok: bool = False


RULES: tuple[Rule, ...] = (
    # core: the contract and its plumbing, the bottom of the stack.
    Rule("core", STOREKIT, "building blocks are how backends work, not part of the contract"),
    Rule("core", BACKENDS, "the core finds backends through entry points, never by import"),
    Rule("core", CONFORMANCE, "the kit tests the core; the core must not need pytest or it"),
    Rule("core", TIER, "tiering is built on the protocol, above it"),
    Rule("core", INTEGRATIONS, "engine adapters sit above everything they wrap"),
    Rule("core", CLI, "the CLI is the top layer"),
    # storekit: shared mechanisms for backends.
    Rule("storekit", BACKENDS, "a building block serves every backend, so it knows none"),
    Rule("storekit", CONFORMANCE, "building blocks are runtime code, the kit is a test tool"),
    Rule("storekit", TIER, "tiering is above storage"),
    Rule("storekit", INTEGRATIONS, "engine adapters are above storage"),
    Rule("storekit", CLI, "the CLI is the top layer"),
    # backends: one store each, side by side.
    Rule(
        "backends",
        BACKENDS,
        "a backend never depends on another, directly or through the package's lazy "
        "re-exports (which would load the sibling)",
        own_subtree_ok=True,
    ),
    Rule("backends", CONFORMANCE, "a backend must work without the test kit installed"),
    Rule("backends", TIER, "tiering uses backends through the protocol, not the reverse"),
    Rule("backends", INTEGRATIONS, "engine adapters wrap backends, not the reverse"),
    Rule("backends", CLI, "the CLI is the top layer"),
    # conformance: black-box, the public API only (what a vendor's backend also has).
    Rule("conformance", PRIVATE_BACKEND, "the kit is black-box: no backend's internals"),
    Rule("conformance", STOREKIT, "the kit must not share code with what it checks"),
    Rule("conformance", TIER, "tiering is above the kit"),
    Rule("conformance", INTEGRATIONS, "engine adapters are above the kit"),
    Rule("conformance", CLI, "the CLI is the top layer (it runs the kit, not the reverse)"),
    # tier: talks to storage only through the protocol.
    Rule("tier", BACKENDS, "tiering must work with any backend, built-in or vendor"),
    Rule("tier", STOREKIT, "tiering talks to storage only through the protocol"),
    Rule("tier", INTEGRATIONS, "engine adapters are above tiering"),
    Rule("tier", CLI, "the CLI is the top layer"),
    # integrations: wrap any SDK backend for an engine.
    Rule("integrations", PRIVATE_BACKEND, "adapters wrap any backend through the registry"),
    Rule("integrations", CLI, "the CLI is the top layer"),
)


@dataclass(frozen=True)
class Allowance:
    """One import that breaks a rule by design: ``importer`` may import ``imported``."""

    importer: str
    imported: str
    reason: str


# Imports allowed against the rules. Empty today: nothing in the core imports storekit,
# backends or the kit, not even lazily (the registry loads backends from entry points and
# from "module:attr" strings with importlib, which is not an import of a named module).
EXCEPTIONS: tuple[Allowance, ...] = ()


# ---------------------------------------------------------------------------------------
# The walker


def module_name(path: Path, source_dir: Path, package: str) -> tuple[str, bool]:
    """The installed name of ``path`` (under ``source_dir``, installed as ``package``)."""
    parts = list(path.relative_to(source_dir).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join([package, *parts]), is_package


def _resolve(module: str | None, level: int, name: str, is_package: bool) -> str:
    """The absolute module named by ``from <level dots><module> import ...`` in ``name``."""
    if level == 0:
        assert module is not None
        return module
    base = name.split(".") if is_package else name.split(".")[:-1]
    if level - 1 > len(base):
        raise ValueError(f"relative import beyond the top package in {name}")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def imports_of(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Every module name that ``tree`` (the module ``name``) may import.

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule), so a rule on
    ``a.b`` catches it whichever ``b`` is.
    """
    found: set[str] = set()
    importers = {"import_module", "__import__"}  # and any alias they are imported under
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "importlib":
            importers.update(a.asname for a in node.names if a.name == "import_module" and a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, name, is_package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            func = node.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = (
                node.args[0]
                if node.args
                else next((k.value for k in node.keywords if k.arg == "name"), None)
            )
            target = _literal(first) if first is not None else None
            if callee in importers and target is not None:
                found.add(target)
    for stmt in tree.body:  # the lazy re-export map: _LAZY = {"Name": "module.path", ...}
        if (
            isinstance(stmt, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in stmt.targets)
            and isinstance(stmt.value, ast.Dict)
        ):
            found.update(m for v in stmt.value.values if v and (m := _literal(v)) is not None)
    return found


def collect(root: Path, sources: Mapping[str, str] = SOURCES) -> dict[str, set[str]]:
    """Module name -> the module names it imports, for every .py file of ``sources``."""
    modules: dict[str, set[str]] = {}
    for src, package in sources.items():
        source_dir = root / src
        for path in sorted(source_dir.rglob("*.py")):
            rel = path.relative_to(source_dir).parts
            if any(p.startswith(".") or p == "__pycache__" for p in rel):
                continue
            name, is_package = module_name(path, source_dir, package)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            modules[name] = imports_of(tree, name, is_package)
    return modules


# ---------------------------------------------------------------------------------------
# The checker


def _under(name: str, pattern: str) -> bool:
    return fnmatchcase(name, pattern) or fnmatchcase(name, pattern + ".*")


def layer_of(name: str) -> str | None:
    """The layer of a module of this package, or None for one in no known layer."""
    for package, layer in SUBPACKAGE_LAYERS.items():
        if _under(name, package):
            return layer
    parts = name.split(".")
    if parts[0] == "hicache_storage" and len(parts) <= 2:
        return "core"
    return None


def check_layers(
    modules: Iterable[tuple[str, Iterable[str]]],
    rules: Iterable[Rule] = RULES,
    exceptions: Iterable[Allowance] = EXCEPTIONS,
) -> list[str]:
    """One line per violation: a forbidden import, a module in no layer, or an exception
    that no longer excuses anything (so a stale one gets removed)."""
    rules = tuple(rules)
    exceptions = tuple(exceptions)
    used: set[Allowance] = set()
    problems: list[str] = []
    for importer, imported in sorted((m, sorted(set(i))) for m, i in modules):
        layer = layer_of(importer)
        if layer is None:
            problems.append(f"{importer} is in no layer (add its package to SUBPACKAGE_LAYERS)")
            continue
        own = ".".join(importer.split(".")[:3])
        for target in imported:
            for rule in rules:
                if rule.layer != layer or not _under(target, rule.forbidden):
                    continue
                if rule.own_subtree_ok and _under(target, own):
                    continue
                excuse = next(
                    (e for e in exceptions if e.importer == importer and e.imported == target),
                    None,
                )
                if excuse is not None:
                    used.add(excuse)
                    continue
                problems.append(f"{importer} ({layer}) imports {target}: {rule.reason}")
    problems += [
        f"exception {e.importer} -> {e.imported} excuses nothing now: remove it"
        for e in exceptions
        if e not in used
    ]
    return problems


# ---------------------------------------------------------------------------------------
# The tests


def test_the_package_keeps_its_layer_rules() -> None:
    modules = collect(ROOT)
    # The walk saw the package (a walk that finds nothing passes every rule).
    assert "hicache_storage.protocol" in modules
    assert "hicache_storage.storekit.filestore" in modules
    assert "hicache_storage.backends._file" in modules
    assert "hicache_storage.conformance.suite" in modules
    assert "hicache_storage.storekit.filestore" in modules["hicache_storage.backends._file"]
    assert "hicache_storage.backends._file" in modules["hicache_storage.backends"]  # _LAZY
    assert check_layers(modules.items()) == []


def test_every_subpackage_has_a_layer() -> None:
    for src, package in SOURCES.items():
        for init in (ROOT / src).rglob("__init__.py"):
            name, _ = module_name(init, ROOT / src, package)
            if name.count(".") == 1:  # a direct subpackage of hicache_storage
                assert name in SUBPACKAGE_LAYERS, f"{name}: give it a layer in SUBPACKAGE_LAYERS"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walker_sees_every_import_form(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "hicache_storage/__init__.py": "",
            "hicache_storage/registry.py": (
                "def load():\n    from hicache_storage.backends import _file\n    return _file\n"
            ),
            "hicache_storage/keys.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    import hicache_storage.storekit.header\n"
            ),
            "hicache_storage/storekit/__init__.py": "",
            "hicache_storage/storekit/atomic.py": "from ..backends import _shm\nfrom . import header\n",
            "backends/__init__.py": '_LAZY = {"A": "hicache_storage.backends._a"}\n',
            "backends/_a/__init__.py": "from .arena import X\n",
            "backends/_a/arena.py": (
                "import importlib\n"
                "def f():\n    return importlib.import_module('hicache_storage.backends._b')\n"
            ),
            "backends/_b.py": "from hicache_storage.backends import AThing\n",
            "conformance/__init__.py": "",
            "conformance/suite.py": "import hicache_storage.backends._a.arena as arena\n",
            "conformance/report.py": (
                "from importlib import import_module as im\n"
                "def f():\n    return im('hicache_storage.storekit.header')\n"
            ),
            "conformance/plugin.py": (
                "import importlib\n"
                "def f():\n    return importlib.import_module(name='hicache_storage.storekit.capacity')\n"
            ),
        },
    )
    modules = collect(tmp_path)
    assert "hicache_storage.storekit.header" in modules["hicache_storage.conformance.report"]
    assert "hicache_storage.storekit.capacity" in modules["hicache_storage.conformance.plugin"]
    assert modules["hicache_storage.registry"] >= {
        "hicache_storage.backends",
        "hicache_storage.backends._file",
    }
    assert "hicache_storage.storekit.header" in modules["hicache_storage.keys"]
    assert modules["hicache_storage.storekit.atomic"] >= {
        "hicache_storage.backends._shm",
        "hicache_storage.storekit.header",
    }
    assert "hicache_storage.backends._a" in modules["hicache_storage.backends"]
    assert "hicache_storage.backends._a.arena" in modules["hicache_storage.backends._a"]
    assert "hicache_storage.backends._b" in modules["hicache_storage.backends._a.arena"]
    problems = check_layers(modules.items())
    text = "\n".join(problems)
    assert "hicache_storage.registry (core) imports hicache_storage.backends._file" in text
    assert "hicache_storage.keys (core) imports hicache_storage.storekit.header" in text
    assert "hicache_storage.storekit.atomic (storekit) imports hicache_storage.backends._shm" in (
        text
    )
    assert "hicache_storage.backends._a.arena (backends) imports hicache_storage.backends._b" in (
        text
    )
    assert "hicache_storage.backends._b (backends) imports hicache_storage.backends:" in text
    assert (
        "hicache_storage.conformance.suite (conformance) imports hicache_storage.backends._a"
        in (text)
    )
    # A package's own modules and the backends package's own re-exports are fine.
    assert "hicache_storage.backends._a (backends)" not in text
    assert "hicache_storage.backends (backends)" not in text
    assert "storekit.atomic (storekit) imports hicache_storage.storekit.header" not in text


def test_the_checker_catches_each_kind_of_violation() -> None:
    violating = {
        ("hicache_storage.protocol", ("hicache_storage.storekit.header",)),
        ("hicache_storage", ("hicache_storage.conformance",)),
        ("hicache_storage.storekit.blobstore", ("hicache_storage.cli.main",)),
        ("hicache_storage.backends._redis", ("hicache_storage.backends._file",)),
        ("hicache_storage.backends._mmap.arena", ("hicache_storage.conformance.suite",)),
        ("hicache_storage.conformance.suite", ("hicache_storage.storekit.atomic",)),
        ("hicache_storage.tier.controller", ("hicache_storage.backends",)),
        ("hicache_storage.integrations.sglang", ("hicache_storage.backends._shm",)),
        ("hicache_storage.newpkg.mod", ("os",)),
    }
    problems = check_layers(violating)
    assert len(problems) == len(violating), problems
    for importer, _ in violating:
        assert any(p.startswith(f"{importer} ") for p in problems), importer


def test_the_checker_passes_what_the_rules_allow() -> None:
    allowed = {
        ("hicache_storage", ("hicache_storage.protocol", "hicache_storage.registry")),
        ("hicache_storage.storekit.filestore", ("hicache_storage.protocol",)),
        ("hicache_storage.backends", ("hicache_storage.backends._file",)),
        ("hicache_storage.backends._mmap", ("hicache_storage.backends._mmap.arena",)),
        ("hicache_storage.backends._file", ("hicache_storage.storekit.filestore", "os")),
        ("hicache_storage.conformance.suite", ("hicache_storage", "hicache_storage.errors")),
        ("hicache_storage.integrations.sglang", ("hicache_storage.registry",)),
        ("hicache_storage.cli.main", ("hicache_storage.conformance", "hicache_storage.backends")),
    }
    assert check_layers(allowed) == []


def test_exceptions_excuse_one_import_and_go_stale() -> None:
    modules = {("hicache_storage.registry", ("hicache_storage.backends._file",))}
    excuse = Allowance("hicache_storage.registry", "hicache_storage.backends._file", "test")
    assert check_layers(modules, exceptions=[excuse]) == []
    stale = Allowance("hicache_storage.keys", "hicache_storage.storekit", "test")
    (problem,) = check_layers(set(), exceptions=[stale])
    assert "excuses nothing now" in problem
