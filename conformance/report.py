"""Report of a conformance run: one record per check, as JSON and as Markdown.

Statuses: ``passed``, ``failed``, ``not-claimed`` (the backend does not claim the
capability the check needs) and ``skipped`` (any other skip). A run whose claimed checks
all pass exits 0.

A failed check's record names the rule its message names (``rule``) and states it
(``statement``, from :data:`hicache_storage.conformance.rules.RULES`); the Markdown
summary shows the statement under each failed check.

Backend options are shown redacted (``redact_options`` with the backend's options class)
and every message is scrubbed of the run's secrets, so a report can be shared.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_storage.config import redact_options
from hicache_storage.conformance import _secrets
from hicache_storage.conformance.rules import RULES, find_rule

if TYPE_CHECKING:
    import pytest

    from hicache_storage.conformance.data import BackendSpec
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["CheckRecord", "ReportCollector", "render_markdown"]


@dataclass
class CheckRecord:
    """The outcome of one check.

    ``rule`` and ``statement``: for a failed check, the rule its message names and what
    that rule asks of a backend (empty when the message names none).
    """

    id: str
    suite: str
    nodeid: str
    status: str = "passed"
    message: str = ""
    duration: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    rule: str = ""
    statement: str = ""


def _check_id(item_name: str) -> str:
    return item_name.removeprefix("test_")


def _short_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return _secrets.scrub(str(crash.message))
    if isinstance(report.longrepr, tuple):  # skip: (path, line, reason)
        return _secrets.scrub(str(report.longrepr[2]).removeprefix("Skipped: "))
    return _secrets.scrub(str(report.longrepr)[-2000:])


class ReportCollector:
    """Collects conformance results during a pytest session and writes the report.

    Args:
        json_path: where :meth:`pytest_sessionfinish` writes the JSON report (None: none).
        markdown_path: where it writes the Markdown report (None: none).
    """

    def __init__(self, json_path: str | None, markdown_path: str | None) -> None:
        self.json_path = json_path
        self.markdown_path = markdown_path
        self.records: dict[str, CheckRecord] = {}
        self.backends: dict[str, dict[str, Any]] = {}
        self._suites: dict[str, str] = {}
        self.started = time.time()

    # -------------------------------------------------------------- what the suite tells us

    def note_backend(self, suite: str, backend: HiCacheStorage, spec: BackendSpec | None) -> None:
        """Remember which backend a suite class tests (first one wins)."""
        if suite in self.backends:
            return
        caps = backend.capabilities
        options = None
        if spec is not None:
            options = spec.redacted_options(_secrets.options_class_of(backend))
        self.backends[suite] = {
            "backend": spec.name if spec is not None else (backend.name or type(backend).__name__),
            "class": f"{type(backend).__module__}.{type(backend).__qualname__}",
            "options": options,
            "capabilities": {
                "zero_copy": caps.zero_copy,
                "delete": caps.delete,
                "persistent": caps.persistent,
                "shared": caps.shared,
                "max_object_bytes": caps.max_object_bytes,
                "layouts": sorted(caps.layouts),
                "mla": caps.mla,
            },
        }

    # -------------------------------------------------------------- pytest hooks

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Note the suite class of every collected conformance check."""
        for item in items:
            cls = getattr(item, "cls", None)
            if cls is not None and getattr(cls, "_hicache_conformance", False):
                self._suites[item.nodeid] = cls.__name__

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Record the outcome, duration and metrics of one conformance check.

        A failure is also matched to the rule its message names.
        """
        suite = self._suites.get(report.nodeid)
        if suite is None:
            return
        name = report.nodeid.split("::")[-1]
        rec = self.records.get(report.nodeid)
        if rec is None:
            rec = self.records[report.nodeid] = CheckRecord(_check_id(name), suite, report.nodeid)
        rec.duration += report.duration
        for key, value in report.user_properties:
            if key == "hicache_metric" and isinstance(value, dict):
                rec.metrics.update(value)
        if report.skipped:
            reason = _short_message(report)
            rec.status = "not-claimed" if reason.startswith("not claimed") else "skipped"
            rec.message = reason
        elif report.failed:
            rec.status = "failed"
            rec.message = (f"{report.when}: " if report.when != "call" else "") + _short_message(
                report
            )
            rec.rule = find_rule(rec.message) or ""
            rec.statement = RULES.get(rec.rule, "")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write the JSON and Markdown reports, scrubbed of this run's secrets."""
        if not self.records:
            return
        data = self.to_dict()
        # Last line of defence: no secret of this run in a file that may be shared.
        if self.json_path:
            Path(self.json_path).write_text(_secrets.scrub(json.dumps(data, indent=2)) + "\n")
        if self.markdown_path:
            Path(self.markdown_path).write_text(_secrets.scrub(render_markdown(data)))

    # -------------------------------------------------------------- output

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict."""
        checks = [asdict(r) for r in self.records.values()]
        summary: dict[str, int] = {"passed": 0, "failed": 0, "not-claimed": 0, "skipped": 0}
        for r in checks:
            summary[r["status"]] = summary.get(r["status"], 0) + 1
        return {
            "tool": "hicache-storage conformance",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "python": platform.python_version(),
            "machine": f"{platform.system()} {platform.machine()}",
            "backends": self.backends,
            "summary": summary,
            "checks": checks,
        }


def render_markdown(data: dict[str, Any]) -> str:
    """A human summary of a report dict."""
    lines = ["# hicache-storage conformance report", ""]
    s = data["summary"]
    lines.append(
        f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, "
        f"{s.get('not-claimed', 0)} not claimed, {s.get('skipped', 0)} skipped "
        f"(started {data['started']}, Python {data['python']}, {data['machine']})."
    )
    lines += ["", "## Backends and claimed capabilities", ""]
    lines.append(
        "| suite | backend | class | zero_copy | delete | persistent | shared | max object | layouts | MLA |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    yes = {True: "yes", False: "no"}
    options: list[str] = []
    for suite, info in data["backends"].items():
        c = info["capabilities"]
        lines.append(
            f"| {suite} | `{info['backend']}` | `{info['class']}` | {yes[c['zero_copy']]} | {yes[c['delete']]} "
            f"| {yes[c['persistent']]} | {yes[c['shared']]} | {c['max_object_bytes'] or 'unbounded'} "
            f"| {', '.join(c['layouts'])} | {yes[c['mla']]} |"
        )
        if info.get("options"):
            shown = json.dumps(redact_options(info["options"]), sort_keys=True)
            options.append(f"- {suite}: `{_secrets.scrub(shown)}`")
    if options:
        lines += ["", "Options (secrets redacted):", "", *options]
    failed = [c for c in data["checks"] if c["status"] == "failed"]
    if failed:
        lines += ["", "## Failed checks", ""]
        for c in failed:
            lines.append(
                f"- **{c['suite']} / {c['id']}**: {c['message'].splitlines()[0] if c['message'] else ''}"
            )
            if c.get("statement"):
                lines.append(f"  - rule `{c['rule']}`: {c['statement']}")
    perf = [c for c in data["checks"] if c["metrics"]]
    if perf:
        lines += ["", "## Performance qualification", ""]
        for c in perf:
            for name, m in c["metrics"].items():
                lines.append(
                    f"- {c['suite']} / {name}: " + ", ".join(f"{k} = {v}" for k, v in m.items())
                )
    lines += [
        "",
        "## All checks",
        "",
        "| suite | check | status | seconds | message |",
        "|---|---|---|---|---|",
    ]
    for c in data["checks"]:
        msg = (c["message"].splitlines()[0] if c["message"] else "").replace("|", "\\|")[:160]
        lines.append(f"| {c['suite']} | {c['id']} | {c['status']} | {c['duration']:.2f} | {msg} |")
    return "\n".join(lines) + "\n"
