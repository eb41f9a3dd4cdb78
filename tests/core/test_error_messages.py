"""Every API an error (or log, or hint) message names exists.

A message that tells a user to call ``KVCacheNamespace.for_pool(...)`` must not send them
to a method that does not exist. This test reads every string literal of the package
(``hicache_storage/``, ``backends/``, ``conformance/``; docstrings aside) and resolves each
API it names:

* ``Name.attr(`` / ``module.attr(`` (a dotted call): ``Name`` is a class or function of
  the package, or an importable module, and every attribute along the path exists;
* ``name(`` (a bare call): a public function, class or method of the package, a builtin
  or an ``os`` function;
* ``call X`` / ``use X`` with a dotted ``X``: resolved the same way.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import os
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("hicache_storage", "backends", "conformance")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
#: ``Name.attr(`` or ``a.b.c(``, not preceded by another name character or a dot.
_DOTTED_CALL = re.compile(rf"(?<![\w.])({_IDENT}(?:\.{_IDENT})+)\(")
#: ``name(``; ``option(s)`` (English plural) is not a call.
_BARE_CALL = re.compile(rf"(?<![\w.])({_IDENT})\((?!s\))")
#: ``call X.y`` / ``use X.y``, with or without backticks or quotes.
_VERB_DOTTED = re.compile(
    rf"\b(?:call|calls|calling|use|using|see)\s+[`'\"]*({_IDENT}(?:\.{_IDENT})+)", re.IGNORECASE
)

#: Bare names that look like calls but are not APIs, each with the reason.
NOT_APIS = {
    "hicache_requires": "a pytest marker, registered in conformance/plugin.py",
    "hicache_rule": "a pytest marker, registered in conformance/plugin.py",
}


def _strings(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each string literal of ``path`` that is not a docstring."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):  # f-string parts are Constant nodes too
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.lineno, node.value


def _package_modules() -> list[object]:
    mods: list[object] = []
    # backends/ and conformance/ are mapped into the package by the install, so they are
    # walked from their own paths.
    for pkg_name in ("hicache_storage", "hicache_storage.backends", "hicache_storage.conformance"):
        pkg = importlib.import_module(pkg_name)
        mods.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            try:
                mods.append(importlib.import_module(info.name))
            except ImportError:
                # An engine adapter imports its engine (SGLang...), which this venv lacks;
                # its own venv's tests cover it. Anything else must import.
                if not info.name.startswith("hicache_storage.integrations."):
                    raise
    return mods


def _known_names() -> dict[str, list[object]]:
    """Every class and function defined in the package, by name, and its methods' names."""
    names: dict[str, list[object]] = {}
    for mod in _package_modules():
        for attr, obj in vars(mod).items():
            if inspect.isclass(obj) or inspect.isfunction(obj):
                names.setdefault(attr, []).append(obj)
                if inspect.isclass(obj):
                    for member in dir(obj):
                        names.setdefault(member, []).append(getattr(obj, member, None))
    return names


def _has_path(obj: object, attrs: list[str]) -> bool:
    for a in attrs:
        try:
            obj = getattr(obj, a)
        except AttributeError:
            return False
    return True


def _resolve_dotted(path: str, known: dict[str, list[object]]) -> bool:
    parts = path.split(".")
    # A class or function of the package (KVCacheNamespace.for_pool) ...
    if any(_has_path(root, parts[1:]) for root in known.get(parts[0], [])):
        return True
    # ... or the longest importable module prefix (os.fork, hicache_storage.keys.page_hashes).
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _has_path(module, parts[i:])
    return False


def _resolve_bare(name: str, known: dict[str, list[object]]) -> bool:
    return name in NOT_APIS or name in known or hasattr(builtins, name) or hasattr(os, name)


def missing_apis(text: str, known: dict[str, list[object]]) -> list[str]:
    """The APIs ``text`` names that do not exist."""
    dotted = [m.group(1) for m in _DOTTED_CALL.finditer(text)]
    verbs = [m.group(1) for m in _VERB_DOTTED.finditer(text)]
    bare = [m.group(1) for m in _BARE_CALL.finditer(text)]
    return (
        [f"{d}(" for d in dotted if not _resolve_dotted(d, known)]
        + [v for v in verbs if not _resolve_dotted(v, known)]
        + [f"{b}(" for b in bare if not _resolve_bare(b, known)]
    )


@pytest.fixture(scope="module")
def known() -> dict[str, list[object]]:
    return _known_names()


def test_the_checker_catches_a_missing_api(known: dict[str, list[object]]) -> None:
    assert missing_apis("call KVCacheNamespace.for_pool(pool, model_id=...)", known) == []
    assert missing_apis("Build it with KVCacheNamespace.from_pool(pool)", known) == [
        "KVCacheNamespace.from_pool("
    ]
    assert missing_apis("use hicache_storage.keys.page_hashes", known) == []
    assert missing_apis("use hicache_storage.keys.page_hash", known) == [
        "hicache_storage.keys.page_hash"
    ]
    assert missing_apis("call flush_everything() first", known) == ["flush_everything("]
    assert missing_apis("call register_mem_pool_host() first", known) == []
    assert missing_apis("HiCacheStorage.batch_get_v1(keys, idx)", known) == []
    assert missing_apis("HiCacheStorage.batch_get_v2(keys, idx)", known) == [
        "HiCacheStorage.batch_get_v2("
    ]
    assert missing_apis("os.fork() and torch.frombuffer(x)", known) == []
    assert missing_apis("unknown option(s) ['x']", known) == []


def test_for_pool_exists_as_the_mismatch_message_says() -> None:
    from hicache_storage import KVCacheNamespace

    assert inspect.ismethod(KVCacheNamespace.for_pool)  # a classmethod, bound to the class
    src = (REPO / "hicache_storage" / "keys.py").read_text()
    assert "KVCacheNamespace.for_pool(pool, model_id=...)" in src


def test_every_api_named_in_a_message_exists(known: dict[str, list[object]]) -> None:
    problems: list[str] = []
    scanned = 0
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            for line, text in _strings(path):
                scanned += 1
                problems.extend(
                    f"{path.relative_to(REPO)}:{line}: names {api!r}: {text!r}"
                    for api in missing_apis(text, known)
                )
    assert scanned > 500  # the scan saw the package
    assert not problems, "messages name APIs that do not exist:\n" + "\n".join(problems)
    for name, why in NOT_APIS.items():  # the exceptions list does not rot
        hits = [
            t
            for top in SCANNED
            for p in (REPO / top).rglob("*.py")
            for _, t in _strings(p)
            if f"{name}(" in t
        ]
        assert hits, f"NOT_APIS[{name!r}] ({why}) is no longer used; remove it"
