"""The rules of the conformance kit: one id and one sentence per rule.

Every failure of the kit names the rule it enforces as ``[rule-id]``
(:func:`failure_message`); this module is the one list of those ids. A check names the
rule of each of its assertions, and is marked with the rule it enforces as a whole
(``@enforces``): a failure that names no rule (a bare assertion, or the kit's own code
tripping over what the backend returned or raised) is reported under that one.
:data:`RULES` maps each id to what a backend must do, :data:`RULES_BY_AREA` groups them
as the vendor guide shows them, and :data:`BASE_ENFORCED` names the rules the SDK keeps
by itself for every backend (with the reason), so that no backend class can break them.

The suite's ``rule()`` helper refuses an id that is not listed here, the test suite checks
that every id the kit uses is listed (and that every listed id is used), and the rule
table of ``docs/vendors.md`` is generated from this module::

    python -m hicache_storage.conformance.rules --markdown        # print the table
    python -m hicache_storage.conformance.rules --update FILE.md  # rewrite it in FILE.md

Importing this module is cheap (no torch): the report uses it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

__all__ = [
    "BASE_ENFORCED",
    "RULES",
    "RULES_BY_AREA",
    "UnknownRuleError",
    "failure_message",
    "find_rule",
    "markdown_table",
    "replace_table",
    "statement",
]

#: The rules, by area of the guide (the order of the areas is the order of the table).
RULES_BY_AREA: dict[str, dict[str, str]] = {
    "result shapes": {
        "exact-length": (
            "Batch calls return the protocol's shapes: `batch_get` and `batch_set` one "
            "entry per key, in key order, and `batch_exists` an int, for batches of 0, 1, "
            "2, 7 and 128 keys."
        ),
        "v1-exact-length": (
            "`batch_set_v1` and `batch_get_v1` return a list of exactly one bool per key, "
            "in key order (never None, never one entry per K or V half)."
        ),
        "batch-set": "`batch_set` of keys that are not stored yet returns True for every key.",
        "batch-exists": "`batch_exists` of keys that are all stored returns the number of keys.",
        "get-new-tensor": (
            "`get` without a target returns a new uint8 tensor holding the value's bytes."
        ),
        "get-returns-target": (
            "`get` with a target fills that target and returns the very same object."
        ),
    },
    "semantics": {
        "set": "`set` of a new key stores it and returns True.",
        "read-your-writes": (
            "Once `set` or `batch_set` has returned, `exists`, `get` and `batch_get` see the "
            "value, byte for byte."
        ),
        "get-miss": (
            "`get` of a missing key returns None for every kind of target (not an empty "
            "value, not a zero-filled target reported as a hit)."
        ),
        "get-miss-untouched": (
            "A miss leaves the target untouched, whatever its kind: `bytearray`, "
            "`memoryview`, a NumPy array, CPU tensors of uint8, int8, bfloat16, float16 or "
            "float32, the engine's 5-D bfloat16 staging page, a multi-segment `PageBuffer`."
        ),
        "get-size-mismatch": (
            "`get` into a target whose size differs from the stored value's returns None."
        ),
        "no-partial-fill": "`get` into a target of the wrong size writes nothing into it.",
        "set-existing": (
            "`set` of a key that is already stored returns True and keeps the first writer's bytes."
        ),
        "batch-exists-leading-run": (
            "`batch_exists` counts the keys present from the start of the list up to the "
            "first miss (keys after a gap do not count), in batches of up to 128 keys."
        ),
        "miss-not-error": (
            "A miss is not a failure: `get`, `exists` and the batch reads of missing keys "
            "return None or False and count no error in the stats."
        ),
        "delete": (
            "With `delete` claimed, `delete` of a stored key returns True and removes it, "
            "`delete` of a missing key returns False, and a deleted key can be stored again."
        ),
        "clear-scope": (
            "`clear()` removes every page of its own namespace, as every instance on it "
            "sees, and nothing of any other namespace."
        ),
        "clear-usable": "The backend stores and reads again right after `clear()`.",
        "closed": (
            "`close()` may be called twice, and every call after it returns its failure shape."
        ),
        "stats": (
            "`get_stats()` returns a `StorageStats` counting each operation's items and, "
            "by default, resets the counters."
        ),
    },
    "zero-copy v1": {
        "v1-round-trip": (
            "Pages stored with `batch_set_v1` come back byte for byte from `batch_get_v1`, "
            "in every claimed host-pool layout, MHA and MLA."
        ),
        "v1-bounds": (
            "`batch_get_v1` writes the bytes of its destination pages and not one byte "
            "outside them."
        ),
        "v1-miss": (
            "`batch_get_v1` reports False for a missing page and for a stored value whose "
            "size is not the page's."
        ),
        "v1-miss-untouched": (
            "A page `batch_get_v1` reports False for is left untouched, and so is the rest "
            "of the host pool, in every claimed layout, MHA and MLA."
        ),
        "v1-legacy": (
            "The v1 path and `get`/`set` agree on a page's bytes: `get` of a page stored "
            "by `batch_set_v1` returns its segments in order, and `batch_get_v1` reads "
            "what `set` stored."
        ),
        "v1-bad-indices": (
            "`batch_set_v1` with host indices that are misaligned, of the wrong count or "
            "outside the pool fails every page and stores none."
        ),
        "v1-no-pool": "Calls of the v1 path made before `register_mem_pool_host` fail every page.",
        "zero-copy-native": (
            "A backend claiming `zero_copy` overrides `batch_get_pages` and "
            "`batch_set_pages` with a native path instead of the default per-key loop."
        ),
    },
    "hybrid-model pools": {
        "pool-round-trip": (
            "A hybrid model's side pool (one page: a slot spread over several buffers), "
            "filed by the SGLang adapter in a namespace of its own, round-trips byte for "
            "byte through `batch_set_v1`/`batch_get_v1`, and its pages are misses in the KV "
            "namespace and in another pool's."
        ),
        "pool-trailing-states": (
            "`exists` and `batch_exists_each` answer each key of a pool's namespace on its "
            "own (stored states at pages 3 and 6 only): the adapter's `batch_exists_v2` "
            "then restores a 5-page prefix at 3 pages and a 6-page one at 3 or 6, as "
            "SGLang's own backends do."
        ),
    },
    "pages across TP sizes": {
        "head-groups": (
            "Pages two TP ranks store as head groups over the backend (4 KV heads, 4 groups: "
            "objects `<key>.h<a>-<b>` of several segments, a 16-byte writer tag last) are "
            "read by a TP 1 rank byte for byte, in `page_head` and `page_first`; a page "
            "whose groups come from two writers is a miss."
        ),
    },
    "the engine's shapes": {
        "engine-batch": (
            "Batches of the engine's size (128 pages, 127 written) round-trip on the legacy "
            "path (strided and flat bfloat16 host-pool views read into bfloat16 staging "
            "pages) and on the v1 path (61-layer pages scattered over the pool, every "
            "claimed layout, MHA and MLA), and the one missing page reads as a miss."
        ),
        "key-forms": (
            "The keys engines derive from one page hash (`<hash>_k`/`_v`, `-k`/`-v`, "
            "`.mamba`/`.swa` side pools, rank and model suffixes, `_L<a>-<b>_H<g>`) are "
            "accepted and stored as distinct objects."
        ),
    },
    "isolation": {
        "namespace-isolation": (
            "Pages of one namespace are neither visible to nor overwritten by a namespace "
            "that differs in dtype, model, layout, page size or tenant."
        ),
    },
    "atomic publication": {
        "atomic-visibility": (
            "A concurrent reader never sees part of a value: `exists` is True only for a "
            "complete object, and `get` returns all of it or None."
        ),
        "crash-safety": (
            "Writers killed with SIGKILL mid-write leave no object that exists but cannot "
            "be read or reads back wrong, and what they committed stays readable."
        ),
        "persistence": (
            "With `persistent` claimed, a new instance on the same namespace reads what a "
            "closed one committed."
        ),
        "worker": (
            "Worker processes can build the backend from its `BackendSpec` and write to it "
            "while other processes do the same (the crash check's writers run that way)."
        ),
    },
    "concurrency": {
        "threads": (
            "One instance serves a prefetch thread and a backup thread at the same time "
            "without mixing up their pages."
        ),
        "multi-process": (
            "With `shared` claimed, three processes writing the same keys all succeed, and "
            "every key then reads back right."
        ),
    },
    "robustness": {
        "hostile-keys": (
            "Keys that are not safe object names (empty, `.`, `..`, with `/`, NUL or a tab, "
            "non-ASCII, 1000 characters) raise `InvalidKeyError`, and keys that are not "
            "strings raise `InvalidArgumentError`, before backend code runs."
        ),
        "zero-length": (
            "An empty value either reads back empty or is refused (`set` returns False and "
            "the key does not exist)."
        ),
        "large-value": (
            "A 32 MiB value (or `max_object_bytes`, when smaller) is stored and reads back "
            "exactly, and a value over `max_object_bytes` is refused and not stored."
        ),
        "bad-value": (
            "`set` of something that is not a tensor, a bytes-like object or a "
            "`PageBuffer` returns False (or raises `InvalidArgumentError`) and stores nothing."
        ),
    },
    "faults": {
        "failure-shapes": (
            "When the store fails, every call returns its failure shape (None, False, 0 or "
            "a list of them), the failure is counted, and targets are left untouched."
        ),
        "no-false-success": (
            "In a batch where some pages fail, every page reported True was stored with "
            "the right bytes."
        ),
        "store-failure": (
            "With a `break_store` hook, calls on the broken store return their failure "
            "shapes and write into no target nor host-pool page, and the backend recovers "
            "with its store."
        ),
        "failed-write-absent": (
            "A write that failed while the store was broken leaves no trace: once the "
            "store is back, each of its keys either reads back right or is absent from "
            "`exists` and `batch_exists`, and can be stored again."
        ),
    },
    "performance": {
        "performance": (
            "The throughput run (v1 set, `batch_exists` and v1 get of 32 pages of 512 KiB) "
            "loses no page and reads back the same bytes; its rates go into the report."
        ),
    },
    "harness": {
        "factory": (
            "The backend is built, as a `HiCacheStorage` instance, for every namespace the "
            "kit asks for (other dtypes, models, layouts, page sizes and tenants)."
        ),
        "fault-hook": (
            "A `break_store` fixture, when given, returns a callable that takes the backend "
            "under test and returns a context manager, inside which the store fails."
        ),
    },
}

#: Every rule id, with what a backend must do to keep it.
RULES: dict[str, str] = {
    rule_id: text for rules in RULES_BY_AREA.values() for rule_id, text in rules.items()
}

#: Rules the SDK keeps by itself for every backend, so no backend class can break them
#: (the kit's teeth test has no broken backend for these), with the reason.
BASE_ENFORCED: dict[str, str] = {
    "hostile-keys": (
        "the base class's guard validates every key before the backend's own method runs"
    ),
    "closed": (
        "the guard makes `close()` idempotent, marks the instance closed and answers every "
        "later call with its failure shape without running backend code"
    ),
    "failure-shapes": (
        "the check injects the failures with the kit's `FaultyBackend` before the backend "
        "is called, and the guard turns them into failure shapes and counts them"
    ),
}


class UnknownRuleError(LookupError):
    """A rule id that :data:`RULES` does not list."""


def statement(rule_id: str) -> str:
    """What a backend must do to keep ``rule_id``; :class:`UnknownRuleError` if unknown."""
    try:
        return RULES[rule_id]
    except KeyError:
        raise UnknownRuleError(
            f"unknown conformance rule id {rule_id!r}: every rule the kit enforces must be "
            "listed in hicache_storage.conformance.rules.RULES_BY_AREA"
        ) from None


def failure_message(rule_id: str, text: str) -> str:
    """A failure message naming ``rule_id`` as ``[rule-id]``, with the rule's statement.

    :class:`UnknownRuleError` if the id is not listed.
    """
    return f"[{rule_id}] {text}\n  rule {rule_id}: {statement(rule_id)}"


_RULE_REF = re.compile(r"\[([a-z0-9][a-z0-9-]*)\]")


def find_rule(message: str) -> str | None:
    """The first known rule id named as ``[rule-id]`` in a failure message, if any."""
    for match in _RULE_REF.finditer(message):
        if match.group(1) in RULES:
            return match.group(1)
    return None


# ---------------------------------------------------------------------- the guide's table

_BEGIN = (
    "<!-- rule table: generated by `python -m hicache_storage.conformance.rules "
    "--markdown`; edit conformance/rules.py, then run it with --update -->"
)
_END = "<!-- end of rule table -->"


def markdown_table() -> str:
    """The rule table of ``docs/vendors.md``, between its two marker comments."""
    lines = [_BEGIN, "", "| area | rule | what the backend must do |", "|---|---|---|"]
    for area, rules in RULES_BY_AREA.items():
        shown = area
        for rule_id, text in rules.items():
            if rule_id in BASE_ENFORCED:
                text += f" *Kept by the SDK: {BASE_ENFORCED[rule_id]}.*"
            cell = text.replace("|", "\\|")
            lines.append(f"| {shown} | `{rule_id}` | {cell} |")
            shown = ""
    lines += ["", _END]
    return "\n".join(lines) + "\n"


def replace_table(text: str) -> str:
    """``text`` (a Markdown document) with its rule table replaced by the current one."""
    start, end = text.find(_BEGIN), text.find(_END)
    if start < 0 or end < start:
        raise ValueError("no rule table markers found in the document")
    end += len(_END)
    if text[end : end + 1] == "\n":
        end += 1
    return text[:start] + markdown_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    """``--markdown``: print the rule table; ``--update FILE``: rewrite it in FILE."""
    parser = argparse.ArgumentParser(
        prog="python -m hicache_storage.conformance.rules",
        description="The conformance kit's rule catalogue.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the Markdown rule table")
    what.add_argument("--update", metavar="FILE", help="replace the rule table in a Markdown file")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
        return 0
    path = Path(args.update)
    try:
        path.write_text(replace_table(path.read_text()))
    except (OSError, ValueError) as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
