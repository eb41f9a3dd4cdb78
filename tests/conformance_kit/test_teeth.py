"""The kit has teeth: it fails every deliberately broken backend, naming the broken rule.

One inner pytest session runs the relevant checks of the kit on each broken backend of
tests/conformance_kit/teeth/broken_backends.py, plus two controls (a correct in-memory store and the
file backend) that must pass the very same checks. The inner run's JSON report is then
read back, which also tests the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_storage.conformance.rules import BASE_ENFORCED, RULES

TEETH = Path(__file__).parent / "teeth"

# (backend class, check id prefix, rule the failure message must name). Every rule of
# RULES has a broken backend here, except the rules the SDK keeps by itself for every
# backend (BASE_ENFORCED, each with its reason: hostile keys raise before backend code
# runs, calls after close() return failure shapes, the kit injects faults itself...).
EXPECTED = [
    ("WrongLengthBatchGet", "result_shapes", "exact-length"),
    ("AllHitsBatchExists", "batch_exists_counts_the_leading_run", "batch-exists-leading-run"),
    ("ClearsEverything", "clear_removes_only_its_namespace", "clear-scope"),
    ("NotUsableAfterClear", "clear_removes_only_its_namespace", "clear-usable"),
    ("PartialFill", "get_size_mismatch_never_fills", "no-partial-fill"),
    ("ReplacesExisting", "set_existing_is_a_no_op", "set-existing"),
    ("IgnoresNamespace", "namespaces_do_not_share_pages", "namespace-isolation"),
    ("NoneFromV1", "v1_result_length", "v1-exact-length"),
    ("MissIsError", "a_miss_is_not_an_error", "miss-not-error"),
    ("ClaimsZeroCopy", "zero_copy_path_is_native", "zero-copy-native"),
    ("SharedStaging", "prefetch_and_backup_threads_on_one_instance", "threads"),
    ("ForgetfulPersistent", "reopened_backend_sees_committed_pages", "persistence"),
    ("ClaimsShared", "processes_writing_the_same_keys", "multi-process"),
    ("OverflowingV1", "v1_reads_stay_inside_the_pages", "v1-bounds"),
    ("DropsValueHalf", "v1_round_trip", "v1-round-trip"),
    ("ReversedSegments", "v1_and_legacy_paths_agree", "v1-legacy"),
    ("DropsLargeValues", "large_value", "large-value"),
    ("AcceptsAnything", "wrong_value_types", "bad-value"),
    ("IgnoresTarget", "read_your_writes", "get-returns-target"),
    ("WriteBehind", "read_your_writes", "read-your-writes"),
    ("ZeroesTargetOnMiss", "get_missing_leaves_target_untouched", "get-miss-untouched"),
    ("HitOnSizeMismatch", "get_size_mismatch_never_fills", "get-size-mismatch"),
    ("DeleteNoop", "delete", "delete"),
    ("UncheckedV1Indices", "v1_bad_host_indices_fail_every_page", "v1-bad-indices"),
    ("V1WithoutPool", "v1_before_register_fails_every_page", "v1-no-pool"),
    ("EmptyValuesLost", "zero_length_value", "zero-length"),
    ("StatsNone", "stats_are_well_formed", "stats"),
    ("BytesNotTensor", "result_shapes", "get-new-tensor"),
    ("EmptyOnMiss", "get_missing_leaves_target_untouched", "get-miss"),
    ("SwallowsStoreErrors", "store_failure_gives_failure_shapes", "store-failure"),
    ("InPlaceFile", "concurrent_reader_never_sees_a_partial_value", "atomic-visibility"),
    ("InPlaceFile", "killed_writers_leave_no_wrong_object", "crash-safety"),
    # right on toy inputs, wrong on the engine's targets, batch sizes and key forms
    ("ZeroFillsTensorOnMiss", "get_missing_leaves_target_untouched", "get-miss"),
    ("WrapsAt64", "engine_batches_v1", "engine-batch"),
    ("ExistsCapped64", "engine_batches", "batch-exists-leading-run"),
    ("Int64Ids", "engine_key_forms", "key-forms"),
    # the zero-copy path's defaults hand these bugs of get() on to batch_get_v1
    ("HitOnSizeMismatch", "v1_misses_leave_pages_untouched", "v1-miss"),
    ("ZeroesTargetOnMiss", "v1_misses_leave_pages_untouched", "v1-miss-untouched"),
    ("DropsValueHalf", "injected_failures_give_failure_shapes", "no-false-success"),
    ("SetReportsExisted", "read_your_writes", "set"),
    ("BatchSetReportsFalse", "result_shapes", "batch-set"),
    ("ExistsStopsShort", "result_shapes", "batch-exists"),
    ("DropsPastBatchBudget", "performance_qualification", "performance"),
    ("DropsFirstWrite", "killed_writers_leave_no_wrong_object", "worker"),
    # a result the kit's own code cannot take, or a backend that cannot be built: the
    # failure still names a rule
    ("OneSlotPerKey", "namespaces_do_not_share_pages", "namespace-isolation"),
    ("DecodedResponses", "read_your_writes", "read-your-writes"),
    ("SkipsWideTensorTargets", "read_your_writes", "read-your-writes"),
    ("RefusesFloat8", "namespaces_do_not_share_pages", "factory"),
    # the store's fault hook: a write that failed in the outage, a hook of the wrong shape
    ("RemembersFailedWrites", "writes_failed_in_an_outage_stay_absent", "failed-write-absent"),
    ("FaultHookWithoutBackend", "store_failure_gives_failure_shapes", "fault-hook"),
    ("FaultHookWithoutBackend", "writes_failed_in_an_outage_stay_absent", "fault-hook"),
    # a hybrid model's side pools (what SGLang's v2 transfers move)
    ("IgnoresPool", "side_pool_pages_round_trip", "pool-round-trip"),
    ("WarmNamespaceExists", "states_are_restorable_only_where_stored", "pool-trailing-states"),
    # pages split by head group (shared across TP sizes)
    ("DropsSmallSegments", "head_group_pages_are_read_at_another_tp_size", "head-groups"),
]
FILE_BASED = {
    "InPlaceFile",
    "SwallowsStoreErrors",
    "DropsFirstWrite",
    "RemembersFailedWrites",
    "FaultHookWithoutBackend",
}
#: The break_store hook of a file-based class (default: broken_directory).
BREAK_STORE = {"FaultHookWithoutBackend": "paused_directory"}
CONTROLS = {"ControlMem": "memory", "ControlFile": "file"}


def suite_module() -> str:
    classes = sorted({cls for cls, _, _ in EXPECTED})
    specs = {cls: f"broken_backends:{cls}" for cls in classes} | CONTROLS
    out = [
        "import pytest",
        "from hicache_storage.conformance import BackendConformance, BackendSpec",
    ]
    for cls, name in specs.items():
        root = cls in FILE_BASED or name == "file"
        options = '{"root": str(tmp_path / "store")}' if root else "{}"
        out.append(
            textwrap.dedent(f"""

            class Test{cls}(BackendConformance):
                @pytest.fixture
                def backend_spec(self, tmp_path):
                    return BackendSpec({name!r}, {options})
            """)
        )
        if root:  # file stores can be broken for real: the store-failure checks run
            out.append(
                "    @pytest.fixture\n"
                "    def break_store(self):\n"
                "        import broken_backends\n"
                f"        return broken_backends.{BREAK_STORE.get(cls, 'broken_directory')}\n"
            )
    return "\n".join(out)


def selection() -> str:
    by_class: dict[str, set[str]] = {}
    for cls, check, _ in EXPECTED:
        by_class.setdefault(cls, set()).add(check)
    every_check = {check for _, check, _ in EXPECTED}
    for control in CONTROLS:
        by_class[control] = every_check
    return " or ".join(
        f"(Test{cls} and ({' or '.join(sorted(checks))}))" for cls, checks in by_class.items()
    )


@pytest.fixture(scope="module")
def teeth_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("teeth")
    (tmp / "test_broken.py").write_text(suite_module())
    (tmp / "pytest.ini").write_text("[pytest]\n")
    report, markdown = tmp / "report.json", tmp / "report.md"
    proc = subprocess.run(
        [
            sys.executable, "-m", "pytest", str(tmp / "test_broken.py"), "-c", str(tmp / "pytest.ini"),
            "--rootdir", str(tmp), "-p", "no:cacheprovider", "-q", "-k", selection(),
            "--hicache-conformance-report", str(report), "--hicache-conformance-markdown", str(markdown),
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TEETH), os.environ.get("PYTHONPATH")]))},
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, (
        f"the inner run should fail (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    data = json.loads(report.read_text())
    data["_markdown"] = markdown.read_text()
    return data


@pytest.mark.parametrize(
    ("cls", "check", "rule"), EXPECTED, ids=[f"{c}-{r}" for c, _, r in EXPECTED]
)
def test_the_kit_fails_each_broken_backend_naming_the_rule(
    teeth_report: dict, cls: str, check: str, rule: str
) -> None:
    records = [
        r
        for r in teeth_report["checks"]
        if r["suite"] == f"Test{cls}" and r["id"].startswith(check)
    ]
    assert records, f"no {check} check ran for {cls}"
    failed = [r for r in records if r["status"] == "failed"]
    assert failed, f"the kit passed {cls} on {check}: {records}"
    assert any(f"[{rule}]" in r["message"] for r in failed), [r["message"] for r in failed]


def test_every_rule_is_broken_here_or_kept_by_the_sdk() -> None:
    """The broken backends and BASE_ENFORCED partition RULES: a rule the SDK does not
    keep by itself has a backend above that breaks it, and the kit is seen to fail it."""
    broken = {rule for _, _, rule in EXPECTED}
    kept = set(BASE_ENFORCED)
    assert broken & kept == set(), f"broken here, yet listed as kept by the SDK: {broken & kept}"
    assert broken | kept <= set(RULES), f"not in RULES: {(broken | kept) - set(RULES)}"
    assert set(RULES) <= broken | kept, (
        f"rules with no broken backend here and not kept by the SDK: {set(RULES) - broken - kept}"
    )


def test_the_same_checks_pass_on_correct_backends(teeth_report: dict) -> None:
    for control in CONTROLS:
        records = [r for r in teeth_report["checks"] if r["suite"] == f"Test{control}"]
        assert len(records) >= 20, control
        bad = [
            (r["id"], r["message"]) for r in records if r["status"] not in ("passed", "not-claimed")
        ]
        assert bad == [], f"{control}: {bad}"
    mem = {r["id"]: r["status"] for r in teeth_report["checks"] if r["suite"] == "TestControlMem"}
    # The in-memory control claims neither persistence nor sharing nor zero-copy.
    assert mem["reopened_backend_sees_committed_pages"] == "not-claimed"
    assert mem["processes_writing_the_same_keys"] == "not-claimed"
    assert mem["zero_copy_path_is_native"] == "not-claimed"


def test_report_shape_and_markdown(teeth_report: dict) -> None:
    s = teeth_report["summary"]
    assert s["failed"] >= len(EXPECTED)
    assert s["passed"] > 0
    assert s["not-claimed"] > 0
    for r in teeth_report["checks"]:
        assert set(r) >= {"id", "suite", "status", "message", "duration"}
        assert r["status"] in ("passed", "failed", "not-claimed", "skipped")
    caps = teeth_report["backends"]["TestClaimsZeroCopy"]["capabilities"]
    assert caps["zero_copy"] is True
    assert caps["persistent"] is False
    md = teeth_report["_markdown"]
    assert "## Failed checks" in md
    for r in teeth_report["checks"]:  # a failure names its rule and states it, everywhere
        if r["status"] != "failed":
            assert (r["rule"], r["statement"]) == ("", ""), r
            continue
        assert r["rule"] in RULES, f"the failure names no rule: {r}"
        assert r["statement"] == RULES[r["rule"]]
        assert f"rule {r['rule']}: {r['statement']}" in r["message"]  # pytest's message
        assert f"  - rule `{r['rule']}`: {r['statement']}" in md
    assert "| TestControlFile | `file` |" in md
