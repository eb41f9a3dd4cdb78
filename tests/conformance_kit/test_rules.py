"""The kit's rule registry: every rule id the kit uses is listed, and only those.

``assert cond, rule("id", ...)`` evaluates its message only when the check fails, so an
unknown id would go unnoticed until a vendor's backend broke that very check. The ids are
therefore collected statically here, from the source of every module of conformance/.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_storage.conformance.rules import (
    BASE_ENFORCED,
    RULES,
    RULES_BY_AREA,
    UnknownRuleError,
    find_rule,
    markdown_table,
    replace_table,
    statement,
)

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "conformance"
VENDOR_GUIDE = ROOT / "docs" / "vendors.md"

#: The function every failure message goes through.
RULE_HELPER = "rule"


def _called_name(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def rule_ids_in_source(sources: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """The literal rule ids of ``sources`` (name -> code), and the calls that are wrong.

    A call of ``rule`` names its rule by a string literal. A helper that takes a rule id
    and hands it on unchanged as the first argument of ``rule`` (or of another such
    helper), like ``shape_rule``, is a *forwarder*: its own calls must name their rule by
    a literal in turn. Any other first argument is reported as wrong.
    """
    trees = {name: ast.parse(code, name) for name, code in sources.items()}
    forwarders = {RULE_HELPER}
    changed = True
    while changed:  # a forwarder may call another forwarder
        changed = False
        for tree in trees.values():
            for fn in _functions(tree):
                if fn.name in forwarders:
                    continue
                params = _parameters(fn)
                for call in ast.walk(fn):
                    if (
                        isinstance(call, ast.Call)
                        and _called_name(call) in forwarders
                        and call.args
                        and isinstance(call.args[0], ast.Name)
                        and call.args[0].id in params
                    ):
                        forwarders.add(fn.name)
                        changed = True
                        break
    found: dict[str, set[str]] = {}
    wrong: list[str] = []
    for name, tree in trees.items():
        handed_on: set[int] = set()  # calls inside a forwarder passing its parameter on
        for fn in _functions(tree):
            if fn.name in forwarders:
                params = _parameters(fn)
                handed_on |= {
                    id(call)
                    for call in ast.walk(fn)
                    if isinstance(call, ast.Call)
                    and _called_name(call) in forwarders
                    and call.args
                    and isinstance(call.args[0], ast.Name)
                    and call.args[0].id in params
                }
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or _called_name(call) not in forwarders:
                continue
            if id(call) in handed_on:
                continue
            first = call.args[0] if call.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.setdefault(first.value, set()).add(f"{name}:{call.lineno}")
            else:
                wrong.append(f"{name}:{call.lineno}: {ast.unparse(call)[:80]}")
    return found, wrong


def kit_sources() -> dict[str, str]:
    return {p.relative_to(KIT).as_posix(): p.read_text() for p in sorted(KIT.rglob("*.py"))}


def test_every_rule_the_kit_uses_is_registered_and_every_registered_rule_is_used() -> None:
    used, wrong = rule_ids_in_source(kit_sources())
    assert wrong == [], "rule ids must be string literals (or handed on by a forwarder)"
    unregistered = {r: sorted(where) for r, where in used.items() if r not in RULES}
    assert unregistered == {}, "add these to conformance/rules.py"
    unused = sorted(set(RULES) - set(used))
    assert unused == [], "no check of the kit enforces these rules"


def test_the_static_scan_sees_forwarders_and_refuses_computed_ids() -> None:
    code = (
        "def rule(rule_id, text):\n    return text\n"
        "def outer(rid, what):\n    return rule(rid, what)\n"
        "def outermost(x):\n    return outer(x, 'y')\n"
        "def check(name):\n"
        "    rule('lit-a', 'x')\n    outer('lit-b', 'x')\n    outermost('lit-c')\n"
        "    rule('lit-' + name, 'x')\n    outer(name.upper(), 'x')\n    rule(text='x', rule_id='k')\n"
    )
    found, wrong = rule_ids_in_source({"m.py": code})
    assert set(found) == {"lit-a", "lit-b", "lit-c"}
    assert [w.split(":")[1] for w in wrong] == ["11", "12", "13"]


def test_the_catalogue_is_well_formed() -> None:
    assert len(RULES) == sum(len(rules) for rules in RULES_BY_AREA.values()), "duplicate ids"
    for rule_id, text in RULES.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule_id), rule_id
        assert text[:1].isupper() or text[:1] == "`", (rule_id, text)
        assert text.endswith(".") and ". " not in text.rstrip("."), ("one sentence", rule_id)
    assert set(BASE_ENFORCED) <= set(RULES)
    assert all(reason.strip() for reason in BASE_ENFORCED.values())


def test_rule_refuses_an_unknown_id() -> None:
    from hicache_storage.conformance.suite import raises_rule, rule, shape_rule

    with pytest.raises(UnknownRuleError, match=r"'no-such-rule'.*RULES"):
        rule("no-such-rule", "detail")
    with pytest.raises(UnknownRuleError), shape_rule("no-such-rule"):
        pass
    with pytest.raises(UnknownRuleError), raises_rule("no-such-rule", ValueError, "x"):
        raise ValueError
    with pytest.raises(UnknownRuleError):
        statement("no-such-rule")
    message = rule("set-existing", "set replaced a value")
    assert message.splitlines()[0] == "[set-existing] set replaced a value"
    assert RULES["set-existing"] in message


def test_raises_rule_names_its_rule() -> None:
    from hicache_storage.conformance.suite import raises_rule

    def missing_key() -> None:
        raise KeyError("x")

    # A call, not a raise statement: raises_rule's __exit__ is typed bool | None, so after a
    # raise in its block mypy would take the rest of this test for unreachable.
    with raises_rule("hostile-keys", KeyError, "key 'x'"):
        missing_key()
    for body in (lambda: None, lambda: int("x")):
        with (
            pytest.raises(pytest.fail.Exception) as failed,
            raises_rule("hostile-keys", KeyError, "key 'x'"),
        ):
            body()
        assert str(failed.value).startswith("[hostile-keys] key 'x' ")
        assert RULES["hostile-keys"] in str(failed.value)


def test_find_rule_takes_the_first_known_id() -> None:
    assert find_rule("AssertionError: [0] [get-miss] a hit\n  rule get-miss: ...") == "get-miss"
    assert find_rule("assert [True, False] == [True]") is None


def test_the_vendor_guide_shows_the_generated_rule_table() -> None:
    text = VENDOR_GUIDE.read_text()
    assert replace_table(text) == text, (
        "docs/vendors.md's rule table is out of date: run "
        "python -m hicache_storage.conformance.rules --update docs/vendors.md"
    )
    for rule_id in RULES:
        assert f"| `{rule_id}` |" in markdown_table()


def test_rules_command_prints_and_updates_the_table(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hicache_storage.conformance.rules"]
    r = subprocess.run([*cmd, "--markdown"], capture_output=True, text=True, check=True)
    assert r.stdout == markdown_table()
    doc = tmp_path / "guide.md"
    stale = markdown_table().replace(RULES["set"], "an old statement")
    doc.write_text(f"# Guide\n\nBefore.\n\n{stale}\nAfter.\n")
    subprocess.run([*cmd, "--update", str(doc)], check=True)
    assert doc.read_text() == f"# Guide\n\nBefore.\n\n{markdown_table()}\nAfter.\n"
    (tmp_path / "plain.md").write_text("no table here\n")
    r = subprocess.run(
        [*cmd, "--update", str(tmp_path / "plain.md")], capture_output=True, text=True, check=False
    )
    assert r.returncode == 1 and "no rule table markers" in r.stderr


def test_every_check_is_marked_with_the_rule_it_enforces() -> None:
    """The plugin reports a failure that names no rule under the check's marked rule, so
    every check carries exactly one such mark, naming a listed rule."""
    from hicache_storage.conformance.suite import BackendConformance

    checks = {n: f for n, f in vars(BackendConformance).items() if n.startswith("test_")}
    assert len(checks) > 30
    marks = {
        name: [m.args for m in getattr(fn, "pytestmark", []) if m.name == "hicache_rule"]
        for name, fn in checks.items()
    }
    wrong = {n: m for n, m in marks.items() if len(m) != 1 or m[0][0] not in RULES}
    assert wrong == {}, "mark each check with @enforces(<one rule id of RULES>)"
