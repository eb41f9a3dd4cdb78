"""The admission rule's counter (:mod:`hicache_storage.admission`): a key is admitted once
seen ``min_seen`` times, never before it was seen at all, in fixed memory."""

from __future__ import annotations

import threading

import pytest

from hicache_storage.admission import MAX_MIN_SEEN, SeenCounter
from hicache_storage.errors import ConfigError


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i:08x}" for i in range(n)]


def test_a_key_is_admitted_on_its_nth_sighting_and_not_before() -> None:
    c = SeenCounter(3, width=1 << 16)
    ks = keys(200)
    assert c.see(ks) == [False] * 200
    assert c.admitted(ks) == [False] * 200  # (asking counts nothing)
    assert c.see(ks) == [False] * 200
    assert c.see(ks) == [True] * 200
    assert c.admitted(ks) == [True] * 200
    assert c.seen(ks[:3]) == [3, 3, 3]
    assert c.refused == 400 and c.admitted_count == 200


def test_a_key_twice_in_one_call_counts_once() -> None:
    c = SeenCounter(2, width=1 << 10)
    assert c.see(["a", "a", "b"]) == [False, False, False]
    assert c.see(["a"]) == [True]


def test_keys_never_seen_are_not_admitted_among_many_seen() -> None:
    """Collisions may admit early, never late: every key seen N times is admitted, and of
    keys never seen, (nearly) none are, with far more keys than counters per row."""
    c = SeenCounter(2, width=1 << 12)
    many = keys(3000)
    c.see(many)
    c.see(many)
    assert all(c.admitted(many))
    fresh = keys(3000, "fresh")
    early = sum(c.admitted(fresh))
    assert early < 0.2 * len(fresh), early  # a sketch of 4 rows: rare, not impossible


def test_counts_fade_so_old_popularity_does_not_admit_forever() -> None:
    c = SeenCounter(2, width=64)
    old = ["old"]
    c.see(old)
    assert c.seen(old) == [1]
    for _ in range(10 * 64):  # 10 * width sightings (of another key): every counter halves
        c.see(["hot"])
    assert c.halvings >= 1
    assert c.see(old) == [False]  # its one sighting faded: this is the first again


def test_min_seen_one_admits_everything_and_keeps_nothing() -> None:
    c = SeenCounter(1)
    assert not c.on and c._counts is None
    assert c.see(["x", "y"]) == [True, True] and c.admitted(["z"]) == [True]


@pytest.mark.parametrize("bad", [0, -1, MAX_MIN_SEEN + 1, True, 2.5])
def test_bad_min_seen_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="admit_after"):
        SeenCounter(bad)  # type: ignore[arg-type]


def test_threads_lose_no_sightings() -> None:
    c = SeenCounter(8, width=1 << 14)
    ks = keys(500)

    def see() -> None:
        for _ in range(2):
            c.see(ks)

    threads = [threading.Thread(target=see) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c.admitted(ks))  # 8 sightings each, from 4 threads


def test_two_keys_sharing_a_counter_in_one_call_lose_no_sighting() -> None:
    """Two keys of one call that share a counter in one row (not in the other): the one
    seen for the Nth time is admitted, whatever the other's count (the larger count
    wins the shared counter, never the last written)."""
    import itertools

    c = SeenCounter(6, width=64, depth=2)
    cand = keys(500)
    cols = c._slots(cand)
    a = b = None
    for i, j in itertools.combinations(range(len(cand)), 2):
        if cols[0, i] == cols[0, j] and cols[1, i] != cols[1, j]:
            a, b = cand[i], cand[j]
            break
    assert a is not None and b is not None
    for _ in range(5):
        c.see([b])
    assert c.see([b, a]) == [True, False]  # b's sixth sighting, a's first
    assert c.admitted([b]) == [True] and c.seen([b]) == [6]


def test_every_process_counts_the_same_collisions() -> None:
    """The counters' places come from a fixed hash of the key, not Python's per-process
    one: ranks of one deployment agree on which keys share counters."""
    import subprocess
    import sys

    code = "from hicache_storage.admission import SeenCounter; print(SeenCounter(2)._slots(['a', 'b']).tolist())"
    got = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout for _ in range(2)}  # fmt: skip
    assert len(got) == 1 and str(SeenCounter(2)._slots(["a", "b"]).tolist()) in got.pop()
