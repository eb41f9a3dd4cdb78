"""Issue 8 item 9: the conformance kit never shows a backend's secrets.

A conformance run of a backend with secret options (``password``, a ``redis://u:pw@``
URL, ``auth``, marked secret only by the backend's options class, and secrets nested in a
list and a dict option: issue 27 item 13), given in a private ``@file``, must keep every secret out of the worker processes' command lines
(which every local user can read), the JSON and Markdown reports, the terminal output,
the log records and the failure messages, while the workers still receive the options.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hicache_storage.config import REDACTED

TEETH = Path(__file__).parent / "teeth"


def digest(value: str) -> str:
    """What the canary backend's traces record of a secret (secret_backends.digest)."""
    return hashlib.sha256(value.encode()).hexdigest()


CHECKS = "processes_writing_the_same_keys or killed_writers or read_your_writes or vendor_assert"


def _scan_proc(stop: threading.Event, seen: dict[int, str]) -> None:
    """Record the command line of every conformance worker process while they run."""
    while not stop.is_set():
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in seen:
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "conformance._worker" in cmdline:
                seen[int(entry.name)] = cmdline
        stop.wait(0.01)


@pytest.fixture(scope="module")
def canary_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("secrets")
    canaries = {
        "password": f"CANARY-pw-{secrets.token_hex(8)}",
        "upstream": f"CANARY-url-{secrets.token_hex(8)}",
        "auth": f"CANARY-auth-{secrets.token_hex(8)}",
        "endpoint_url": f"CANARY-eurl-{secrets.token_hex(8)}",
        "endpoint_pw": f"CANARY-epw-{secrets.token_hex(8)}",
        "token": f"CANARY-tok-{secrets.token_hex(8)}",
    }
    traces = tmp / "traces"
    traces.mkdir()
    options = {
        "root": str(tmp / "store"),
        "password": canaries["password"],
        "upstream": f"redis://u:{canaries['upstream']}@127.0.0.1:1/0",
        "auth": canaries["auth"],
        "endpoints": [
            {"url": f"redis://u:{canaries['endpoint_url']}@127.0.0.1:2/0"},
            {"url": "redis://127.0.0.1:3/0", "password": canaries["endpoint_pw"]},
        ],
        "extra": {"auth": {"token": canaries["token"]}},
        "trace_dir": str(traces),
    }
    extra = tmp / "extra-config.json"  # the private @file
    extra.write_text(json.dumps(options))
    extra.chmod(0o600)
    (tmp / "test_canary.py").write_text(
        textwrap.dedent("""
        import pytest
        from hicache_storage.conformance import BackendConformance, BackendSpec
        from hicache_storage.conformance.plugin import spec_from_config


        class TestCanary(BackendConformance):
            # the backend and its options come from the command line (@file)

            def test_vendor_assert_showing_the_password(self, backend_spec):
                # a vendor's own check, careless with the secret: print, log, assert
                import logging

                password = backend_spec.options["password"]
                print("connecting with", password)
                logging.getLogger("vendor").warning("auth failed for %s", password)
                assert password == "what the server expected"


        class TestCanaryUnreachable(BackendConformance):
            @pytest.fixture
            def backend_spec(self, request):
                spec = spec_from_config(request.config)
                return BackendSpec(spec.name, {**spec.options, "workers_unreachable": True})
        """)
    )
    (tmp / "pytest.ini").write_text("[pytest]\n")
    report, markdown, log = tmp / "report.json", tmp / "report.md", tmp / "log.txt"
    seen: dict[int, str] = {}
    stop = threading.Event()
    scanner = threading.Thread(target=_scan_proc, args=(stop, seen), daemon=True)
    scanner.start()
    try:
        proc = subprocess.run(
            [
                sys.executable, "-m", "pytest", str(tmp / "test_canary.py"), "-c", str(tmp / "pytest.ini"),
                "--rootdir", str(tmp), "-p", "no:cacheprovider", "-rA", "-l", "-k", CHECKS,
                "--hicache-storage-backend", "secret_backends:CanaryFile",
                "--hicache-storage-backend-extra-config", f"@{extra}",
                "--hicache-conformance-report", str(report), "--hicache-conformance-markdown", str(markdown),
                "-o", "log_cli=true", "--log-cli-level=DEBUG", "--log-level=DEBUG",
                "--log-file", str(log), "--log-file-level=DEBUG",
            ],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TEETH), os.environ.get("PYTHONPATH")]))},
            capture_output=True, text=True, timeout=600, check=False, cwd=tmp,
        )  # fmt: skip
    finally:
        stop.set()
        scanner.join()
    return {
        "canaries": canaries,
        "proc": proc,
        "report_text": report.read_text() if report.exists() else "",
        "markdown": markdown.read_text() if markdown.exists() else "",
        "log": log.read_text() if log.exists() else "",
        "traces": [json.loads(p.read_text()) for p in sorted(traces.glob("*.json"))],
        "scanned": seen,
    }


def _leaks(text: str, canaries: dict[str, str]) -> list[str]:
    return [name for name, value in canaries.items() if value in text or "CANARY" in text]


def test_the_run_happened_as_planned(canary_run: dict) -> None:
    proc = canary_run["proc"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]  # Unreachable fails
    data = json.loads(canary_run["report_text"])
    status = {(c["suite"], c["id"]): c["status"] for c in data["checks"]}
    for check in ("read_your_writes", "processes_writing_the_same_keys"):
        assert status[("TestCanary", check)] == "passed", data["checks"]
    assert status[("TestCanary", "killed_writers_leave_no_wrong_object")] == "passed"
    assert status[("TestCanaryUnreachable", "processes_writing_the_same_keys")] == "failed"
    assert status[("TestCanaryUnreachable", "killed_writers_leave_no_wrong_object")] == "failed"


def test_workers_get_the_options_but_not_on_their_command_line(canary_run: dict) -> None:
    canaries = canary_run["canaries"]
    workers = [t for t in canary_run["traces"] if t["worker"]]
    assert len(workers) >= 3 + 6, canary_run["traces"]  # 3 same-keys writers, 2 x 3 crash rounds
    for t in workers:
        assert t["password"] == digest(canaries["password"]), "a worker did not get the password"
        assert t["auth"] == digest(canaries["auth"])
        assert t["upstream"] == digest(f"redis://u:{canaries['upstream']}@127.0.0.1:1/0")
        cmdline = " ".join(t["cmdline"])
        assert not _leaks(cmdline, canaries), f"secret on a worker's command line: {cmdline}"
        assert "options" not in cmdline and "{" not in cmdline, cmdline
        assert t["stdin"].startswith("pipe:"), t["stdin"]  # an inherited pipe, not a file
    assert canary_run["scanned"], "the /proc scan saw no worker"
    for pid, cmdline in canary_run["scanned"].items():
        assert not _leaks(cmdline, canaries), f"secret in /proc/{pid}/cmdline: {cmdline}"


def test_no_output_shows_a_secret(canary_run: dict) -> None:
    canaries = canary_run["canaries"]
    proc = canary_run["proc"]
    outputs = {
        "JSON report": canary_run["report_text"],
        "Markdown report": canary_run["markdown"],
        "stdout (live logs, failures, showlocals)": proc.stdout,
        "stderr": proc.stderr,
        "log file": canary_run["log"],
    }
    assert canary_run["report_text"] and canary_run["markdown"] and canary_run["log"]
    for name, text in outputs.items():
        leaked = _leaks(text, canaries)
        assert not leaked, f"{name} shows {leaked}: ...{text[text.find('CANARY') - 300 :][:600]}"
    assert "DEBUG" in canary_run["log"]  # log records were captured at every level


def test_reports_show_the_options_redacted(canary_run: dict) -> None:
    data = json.loads(canary_run["report_text"])
    options = data["backends"]["TestCanary"]["options"]
    assert options["password"] == REDACTED
    assert options["auth"] == REDACTED  # marked secret by the backend's options class only
    assert options["upstream"] == f"redis://u:{REDACTED}@127.0.0.1:1/0"
    assert options["endpoints"] == [
        {"url": f"redis://u:{REDACTED}@127.0.0.1:2/0"},
        {"url": "redis://127.0.0.1:3/0", "password": REDACTED},
    ]
    assert options["extra"] == {"auth": REDACTED}
    assert options["root"].endswith("store")  # what is not secret is still shown
    assert f'"password": "{REDACTED}"' in canary_run["markdown"]


def test_failure_messages_keep_their_cause_without_the_secret(canary_run: dict) -> None:
    data = json.loads(canary_run["report_text"])
    by_id = {(c["suite"], c["id"]): c for c in data["checks"]}
    same = by_id[("TestCanaryUnreachable", "processes_writing_the_same_keys")]["message"]
    crash = by_id[("TestCanaryUnreachable", "killed_writers_leave_no_wrong_object")]["message"]
    for message, rule in ((same, "[multi-process]"), (crash, "[worker]")):
        assert rule in message, message
        assert "ConnectionError" in message and "127.0.0.1:1" in message, message
        assert "127.0.0.1:3" in message, message  # the nested options, quoted and scrubbed
        assert REDACTED in message, message
    assert "ConnectionError" in canary_run["proc"].stdout
    vendor = by_id[("TestCanary", "vendor_assert_showing_the_password")]
    assert vendor["status"] == "failed" and REDACTED in vendor["message"], vendor
    assert "what the server expected" in vendor["message"], vendor  # the rest is kept
    assert f"auth failed for {REDACTED}" in canary_run["proc"].stdout  # the log record
    assert f"connecting with {REDACTED}" in canary_run["proc"].stdout  # captured stdout
