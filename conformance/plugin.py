"""pytest plugin of the conformance kit (entry point ``pytest11``: ``hicache_storage``).

Loaded by every pytest session in an environment where hicache-storage is installed, so
it stays inert and cheap: it registers options, markers and the report collector, and
imports neither torch nor the suite. Nothing runs unless a :class:`BackendConformance`
subclass is collected.

Options (each also read from an environment variable):

``--hicache-storage-backend NAME``            ``HICACHE_STORAGE_BACKEND``
``--hicache-storage-backend-extra-config JSON|@file``
                                              ``HICACHE_STORAGE_BACKEND_EXTRA_CONFIG``
``--hicache-conformance-report PATH``         JSON report of the conformance checks
``--hicache-conformance-markdown PATH``       Markdown summary of the same

Secrets of the backend under test (see :mod:`hicache_storage.conformance._secrets`) are
scrubbed from every test report of the session: tracebacks, assertion messages, captured
output and captured logs, as shown on the terminal and in the reports.

A check marked with the rule it enforces (``@enforces(rule_id)``, the marker
``hicache_rule``) that fails without naming a rule fails naming that one, with what went
wrong and where: a bare assertion, or the kit's own code tripping over what the backend
returned (``None`` where bytes were due, text instead of a tensor) or raised.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
from typing_extensions import override

# Before the suite is imported anywhere: full assertion messages for vendors, with an
# editable install as well as a wheel. (The package itself is already imported, being
# this module's parent; it holds no assertions.)
pytest.register_assert_rewrite(
    "hicache_storage.conformance.suite",
    "hicache_storage.conformance.data",
    "hicache_storage.conformance.wrappers",
)

from hicache_storage.conformance import _secrets
from hicache_storage.conformance.report import ReportCollector
from hicache_storage.conformance.rules import failure_message, find_rule

if TYPE_CHECKING:
    from collections.abc import Generator

    from hicache_storage.conformance.data import BackendSpec

__all__ = ["spec_from_config"]

_ENV_BACKEND = "HICACHE_STORAGE_BACKEND"
_ENV_EXTRA = "HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache-storage", "hicache-storage conformance kit")
    group.addoption(
        "--hicache-storage-backend",
        dest="hicache_storage_backend",
        default=None,
        help=f"backend to run the conformance kit on (env {_ENV_BACKEND})",
    )
    group.addoption(
        "--hicache-storage-backend-extra-config",
        dest="hicache_storage_backend_extra_config",
        default=None,
        help=f"backend options as JSON or @file (env {_ENV_EXTRA})",
    )
    group.addoption(
        "--hicache-conformance-report", default=None, help="write a JSON report of the checks"
    )
    group.addoption(
        "--hicache-conformance-markdown",
        default=None,
        help="write a Markdown summary of the checks",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "hicache_requires(*capabilities): run only if the backend claims these capabilities",
    )
    config.addinivalue_line(
        "markers",
        "hicache_rule(rule_id): the conformance rule a check enforces, named by any failure "
        "of the check that names no rule",
    )
    config.pluginmanager.register(
        ReportCollector(
            config.getoption("hicache_conformance_report"),
            config.getoption("hicache_conformance_markdown"),
        ),
        "hicache-conformance-report",
    )


class _ScrubbedRepr:
    """A failure representation with the run's secrets taken out (terminal and reports)."""

    def __init__(self, text: str, crash: Any) -> None:
        self._text = text
        self.reprcrash = None
        if crash is not None:
            self.reprcrash = SimpleNamespace(
                path=getattr(crash, "path", ""),
                lineno=getattr(crash, "lineno", 0),
                message=_secrets.scrub(str(getattr(crash, "message", ""))),
            )

    def toterminal(self, tw: Any) -> None:
        for line in self._text.splitlines():
            tw.line(line)

    @override
    def __str__(self) -> str:
        return self._text


def _scrub_report(report: pytest.TestReport) -> None:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        report.longrepr = (longrepr[0], longrepr[1], _secrets.scrub(str(longrepr[2])))
    elif longrepr is not None:
        text = str(longrepr)
        clean = _secrets.scrub(text)
        if clean != text:
            report.longrepr = _ScrubbedRepr(clean, getattr(longrepr, "reprcrash", None))  # type: ignore[assignment]
    report.sections = [(title, _secrets.scrub(body)) for title, body in report.sections]


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """A conformance check's failure names a rule, whatever stopped the check."""
    try:
        return (yield)
    except (Exception, pytest.fail.Exception) as exc:
        marker = pyfuncitem.get_closest_marker("hicache_rule")
        if marker is None or find_rule(str(exc)) is not None:
            raise
        if isinstance(exc, AssertionError | pytest.fail.Exception):
            text = str(exc)
        else:
            text = f"the check stopped on {type(exc).__name__}: {exc}"
        failed = pytest.fail.Exception(failure_message(marker.args[0], text[:2000]))
        raise failed.with_traceback(exc.__traceback__) from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    if _secrets.registered():
        _scrub_report(outcome.get_result())


def spec_from_config(config: pytest.Config) -> BackendSpec | None:
    """The backend selected on the command line or in the environment, if any."""
    from hicache_storage.config import load_extra_config
    from hicache_storage.conformance.data import BackendSpec

    name = config.getoption("hicache_storage_backend") or os.environ.get(_ENV_BACKEND)
    if not name:
        return None
    extra = config.getoption("hicache_storage_backend_extra_config") or os.environ.get(_ENV_EXTRA)
    return BackendSpec(name, load_extra_config(extra))
