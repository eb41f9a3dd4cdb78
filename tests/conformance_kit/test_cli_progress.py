"""``hicache-storage conformance`` as a user sees it: progress by rule area, a summary
naming the reports, and the README's figures for the kit on ``memory``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_storage.cli.kitprogress import KitProgress
from hicache_storage.conformance.rules import RULES_BY_AREA

ROOT = Path(__file__).resolve().parents[2]


def conformance(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli.main", "conformance",
         "--hicache-storage-backend", "memory", *args],
        cwd=tmp_path, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip


def test_progress_by_area_then_a_summary_naming_the_reports(tmp_path: Path) -> None:
    report = tmp_path / "kit.json"
    done = conformance(tmp_path, "--report", str(report), "--markdown", str(tmp_path / "k.md"))
    assert done.returncode == 0, done.stderr[-2000:]
    # Off a terminal: one line per area as it completes (stderr), no dots.
    area_lines = [
        ln for ln in done.stderr.splitlines() if re.match(r"^  [a-z].*: \d+ checks?, ", ln)
    ]
    assert {ln.split(":")[0].strip() for ln in area_lines} == set(RULES_BY_AREA) - {"harness"}
    # The closing table and where the reports are.
    assert f"JSON report: {report}" in done.stdout
    assert f"Markdown report: {tmp_path / 'k.md'}" in done.stdout
    summary = json.loads(report.read_text())["summary"]
    table = re.findall(r"^  (\S.*?)\s{2,}(\d+) checks?, (\d+) passed", done.stdout, re.MULTILINE)
    assert sum(int(n) for _, n, _ in table) == sum(summary.values())
    assert sum(int(p) for _, _, p in table) == summary["passed"]


def test_without_report_flags_it_says_how_to_keep_them(tmp_path: Path) -> None:
    done = conformance(tmp_path, "-k", "read_your_writes")
    assert done.returncode == 0
    assert "--report FILE.json" in done.stdout and "docs/vendors.md" in done.stdout


def test_the_readme_states_the_kits_counts_on_memory(tmp_path: Path) -> None:
    """README: "N checks (P passed and C not claimed on `memory` ...)": the kit's own
    count, so the figure cannot go stale."""
    report = tmp_path / "kit.json"
    assert conformance(tmp_path, "--report", str(report)).returncode == 0
    s = json.loads(report.read_text())["summary"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"(\d+) checks \((\d+) passed and (\d+) not claimed on `memory`", readme)
    assert m is not None
    assert (int(m[1]), int(m[2]), int(m[3])) == (sum(s.values()), s["passed"], s["not-claimed"]), (
        "update the README's conformance figures"
    )


def test_the_bars_count_every_check_once() -> None:
    class Item:
        def __init__(self, nodeid: str, rule: str) -> None:
            self.nodeid, self.rule = nodeid, rule

        def get_closest_marker(self, name: str) -> object:
            return type("M", (), {"args": (self.rule,)})()

    class Report:
        def __init__(self, nodeid: str, when: str, outcome: str) -> None:
            self.nodeid, self.when, self.outcome = nodeid, when, outcome
            self.passed, self.failed, self.skipped = (
                outcome == o for o in ("passed", "failed", "skipped")
            )

    import io

    out = io.StringIO()
    p = KitProgress(out, bars=False)
    items = [Item("a", "exact-length"), Item("b", "read-your-writes"), Item("c", "delete")]
    p.pytest_collection_finish(type("S", (), {"items": items})())
    for nodeid, when, outcome in [("a", "setup", "passed"), ("a", "call", "passed"),
                                  ("a", "teardown", "passed"), ("b", "setup", "skipped"),
                                  ("c", "call", "failed")]:  # fmt: skip
        p.pytest_runtest_logreport(Report(nodeid, when, outcome))  # type: ignore[arg-type]
    text = p.summary("memory", None, None)
    assert "result shapes" in text and "1 check, 1 passed" in text
    assert "2 checks, 0 passed, 1 failed, 1 not claimed" in text


def test_one_outcome_per_check_errors_apart_and_checks_not_run_said() -> None:
    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

        def get_closest_marker(self, name: str) -> object:
            return type("M", (), {"args": ("read-your-writes",)})()

    class Report:
        def __init__(self, nodeid: str, when: str, outcome: str) -> None:
            self.nodeid, self.when, self.outcome = nodeid, when, outcome
            self.passed, self.failed, self.skipped = (
                outcome == o for o in ("passed", "failed", "skipped")
            )

    import io

    p = KitProgress(io.StringIO(), bars=False)
    p.pytest_collection_finish(type("S", (), {"items": [Item(x) for x in "abcd"]})())
    reports = [("a", "call", "passed"), ("a", "teardown", "failed"),  # passed, then broke
               ("b", "setup", "failed"), ("c", "call", "passed")]  # fmt: skip
    statuses = []
    for nodeid, when, outcome in reports:
        r = Report(nodeid, when, outcome)
        statuses.append(p.pytest_report_teststatus(r))  # type: ignore[arg-type]
        p.pytest_runtest_logreport(r)  # type: ignore[arg-type]
    # pytest's own categories: errors at setup or teardown stay errors (for -rfE).
    assert [s[0] if s else None for s in statuses] == ["passed", "error", "error", "passed"]
    text = p.summary("memory", None, None)
    assert "4 checks, 1 passed, 2 error, 1 not run" in text


def test_in_process_with_a_stderr_that_has_no_descriptor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import io

    from hicache_storage.cli.main import main

    saved = sys.stderr
    sys.stderr = io.StringIO()
    try:
        code = main(["conformance", "--hicache-storage-backend", "memory", "-k", "test_delete"])
    finally:
        sys.stderr = saved
    assert code == 0
    assert "by rule area" in capsys.readouterr().out


def test_a_k_that_selects_nothing_is_a_usage_error(tmp_path: Path) -> None:
    done = conformance(tmp_path, "-k", "no_such_check")
    assert done.returncode == 2 and "selects none of the kit's checks" in done.stderr
