"""The progress of ``hicache-storage conformance``: one bar per rule area, then a summary.

A pytest plugin object the command passes to ``pytest.main``. It groups the kit's checks
by the area of the rule each enforces (the vendor guide's grouping), shows a bar per area
(on a terminal; elsewhere a line per area as it completes) in place of pytest's dots, and
at the end prints a table of the areas and where the reports went. Failures are still
printed by pytest (``-rfE``), each naming its rule.
"""

from __future__ import annotations

import io
import os
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import pytest

__all__ = ["KitProgress"]

#: Checks that enforce no listed rule (none should) are counted under this area.
OTHER = "other"


def _area_of(item: Any) -> str:
    from hicache_storage.conformance.rules import RULES_BY_AREA

    marker = item.get_closest_marker("hicache_rule")
    rule_id = marker.args[0] if marker is not None and marker.args else None
    for area, rules in RULES_BY_AREA.items():
        if rule_id in rules:
            return area
    return OTHER


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class KitProgress:
    """Bars per rule area while the kit runs; a table and the report paths at the end."""

    def __init__(self, stream: TextIO | None = None, bars: bool | None = None) -> None:
        self._own: TextIO | None = None
        if stream is None:
            stream = sys.stderr
            try:  # a copy of the terminal's descriptor: pytest captures fd 2 while checks run
                stream = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
                self._own = stream
            except (AttributeError, OSError, io.UnsupportedOperation):
                bars = False  # (a stderr with no descriptor: an IDE, a notebook, a test)
        self.stream = stream
        self.bars = _isatty(stream) if bars is None else bars
        self.area: dict[str, str] = {}  # nodeid -> area
        self.total: Counter[str] = Counter()
        self.outcome: dict[str, str] = {}  # nodeid -> passed, failed, error or not claimed
        self._bars: dict[str, Any] = {}

    # pytest hooks ----------------------------------------------------------------

    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        """No dot or letter per check: the bars say it.

        The categories stay pytest's (an error at setup or teardown is an error), so its
        summary of failures and errors and its counts are unchanged.
        """
        category: str
        if report.when == "call":
            category = "skipped" if report.skipped else report.outcome
        elif report.skipped:
            category = "skipped"
        elif report.failed:
            category = "error"
        else:
            return None  # (a passed setup or teardown: pytest reports nothing for it)
        return category, "", category.upper()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Count the checks of each area; start the bars."""
        for item in session.items:
            area = _area_of(item)
            self.area[item.nodeid] = area
            self.total[area] += 1
        if self.bars and self.total:
            import shutil

            from tqdm import tqdm

            width = max(len(a) for a in self.total)
            columns = shutil.get_terminal_size((100, 24)).columns  # (0 from some ptys)
            for pos, area in enumerate(self.total):
                self._bars[area] = tqdm(
                    total=self.total[area], desc=area.ljust(width), position=pos,
                    file=self.stream, leave=True, unit="check", ncols=columns or 100,
                )  # fmt: skip

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Note a check's outcome under its area: one per check, the worst one."""
        area = self.area.get(report.nodeid)
        if area is None:
            return
        if report.when == "call" or not report.passed:
            if report.skipped:
                outcome = "not claimed"
            elif report.failed:
                outcome = "failed" if report.when == "call" else "error"
            else:
                outcome = "passed"
            first = report.nodeid not in self.outcome
            if first or outcome in ("failed", "error"):
                self.outcome[report.nodeid] = outcome
            if first:
                self._advance(area)

    def _advance(self, area: str) -> None:
        counts = self._tally(area)
        bar = self._bars.get(area)
        if bar is not None:
            bar.update(1)
            bad = counts["failed"] + counts["error"]
            if bad:
                bar.set_postfix_str(f"{bad} failed")
        elif sum(counts.values()) == self.total[area]:
            print(f"  {area}: {self._counts(area)}", file=self.stream, flush=True)

    def pytest_sessionfinish(self) -> None:
        """Close the bars."""
        self.close()

    def close(self) -> None:
        """Close the bars and the terminal descriptor this object opened (idempotent)."""
        for bar in self._bars.values():
            bar.close()
        self._bars = {}
        if self._own is not None:
            self._own.close()
            self._own = None

    # the end ---------------------------------------------------------------------

    def _tally(self, area: str) -> Counter[str]:
        return Counter(o for n, o in self.outcome.items() if self.area[n] == area)

    def _counts(self, area: str) -> str:
        c = self._tally(area)
        parts = [f"{c['passed']} passed"]
        parts += [f"{c[k]} {k}" for k in ("failed", "error", "not claimed") if c[k]]
        missing = self.total[area] - sum(c.values())
        if missing:
            parts.append(f"{missing} not run")
        n = self.total[area]
        return f"{n} check{'' if n == 1 else 's'}, " + ", ".join(parts)

    def summary(self, backend: str, report: str | None, markdown: str | None) -> str:
        """The closing lines: a row per area, then where the reports are (or how to get them)."""
        width = max((len(a) for a in self.total), default=10)
        if not self.total:
            return f"conformance of {backend!r}: no checks selected"
        lines = [f"conformance of {backend!r}, by rule area:"]
        lines += [f"  {area.ljust(width)}  {self._counts(area)}" for area in self.total]
        if report:
            lines.append(f"JSON report: {report}")
        if markdown:
            lines.append(f"Markdown report: {markdown}")
        if not report and not markdown:
            lines.append(
                "reports: none kept; --report FILE.json writes the JSON report and "
                "--markdown FILE.md a Markdown summary (docs/vendors.md, section 3)"
            )
        return "\n".join(lines)
