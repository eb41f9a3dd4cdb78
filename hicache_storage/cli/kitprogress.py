"""The progress of ``hicache-storage conformance``: one bar per rule area, then a summary.

A pytest plugin object the command passes to ``pytest.main``. It groups the kit's checks
by the area of the rule each enforces (the vendor guide's grouping), shows a bar per area
(on a terminal; elsewhere a line per area as it completes) in place of pytest's dots, and
at the end prints a table of the areas and where the reports went. Failures are still
printed by pytest (``-rfE``), each naming its rule.
"""

from __future__ import annotations

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


class KitProgress:
    """Bars per rule area while the kit runs; a table and the report paths at the end."""

    def __init__(self, stream: TextIO | None = None, bars: bool | None = None) -> None:
        self._own: TextIO | None = None
        if stream is None:
            # A copy of the terminal's descriptor: pytest captures fd 2 while checks run.
            stream = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
            self._own = stream
        self.stream = stream
        self.bars = self.stream.isatty() if bars is None else bars
        self.area: dict[str, str] = {}  # nodeid -> area
        self.total: Counter[str] = Counter()
        self.done: dict[str, Counter[str]] = {}  # area -> outcome counts
        self._bars: dict[str, Any] = {}

    # pytest hooks ----------------------------------------------------------------

    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        """No dot per check: the bars say it.

        The categories stay pytest's, so its summary of failures and its counts are
        unchanged.
        """
        if report.when == "call" or (report.when == "setup" and not report.passed):
            category = "skipped" if report.skipped else report.outcome
            return category, "", category.upper()
        return None

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Count the checks of each area; start the bars."""
        for item in session.items:
            area = _area_of(item)
            self.area[item.nodeid] = area
            self.total[area] += 1
        self.done = {area: Counter() for area in self.total}
        if self.bars:
            import shutil

            from tqdm import tqdm

            width = max(len(a) for a in self.total) if self.total else 10
            columns = shutil.get_terminal_size((100, 24)).columns  # (0 from some ptys)
            for pos, area in enumerate(self.total):
                self._bars[area] = tqdm(
                    total=self.total[area], desc=area.ljust(width), position=pos,
                    file=self.stream, leave=True, unit="check", ncols=columns or 100,
                )  # fmt: skip

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Count a finished check under its area."""
        area = self.area.get(report.nodeid)
        if area is None:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "not claimed" if report.skipped else report.outcome
            self.done[area][outcome] += 1
            self._advance(area)
        elif report.when == "teardown" and report.failed:
            self.done[area]["failed"] += 1  # (an error at teardown: counted, no step)

    def _advance(self, area: str) -> None:
        counts = self.done[area]
        finished = sum(counts[k] for k in ("passed", "failed", "not claimed"))
        bar = self._bars.get(area)
        if bar is not None:
            bar.update(1)
            if counts["failed"]:
                bar.set_postfix_str(f"{counts['failed']} failed")
        elif finished == self.total[area]:
            print(f"  {area}: {self._counts(area)}", file=self.stream, flush=True)

    def pytest_sessionfinish(self) -> None:
        """Close the bars."""
        for bar in self._bars.values():
            bar.close()
        self._bars = {}
        if self._own is not None:
            self._own.close()
            self._own = None

    # the end ---------------------------------------------------------------------

    def _counts(self, area: str) -> str:
        c = self.done.get(area, Counter())
        parts = [f"{c['passed']} passed"]
        parts += [f"{c[k]} {k}" for k in ("failed", "not claimed") if c[k]]
        n = self.total[area]
        return f"{n} check{'' if n == 1 else 's'}, " + ", ".join(parts)

    def summary(self, backend: str, report: str | None, markdown: str | None) -> str:
        """The closing lines: a row per area, then where the reports are (or how to get them)."""
        width = max((len(a) for a in self.total), default=10)
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
