"""Object header, atomic publication, stale-temporary removal."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_storage.errors import CorruptObjectError
from hicache_storage.storekit import atomic
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)


def test_header_round_trip_and_checks() -> None:
    payload = [memoryview(b"hello "), memoryview(b"world")]
    csum = checksum(payload, 1)
    assert csum == checksum([memoryview(b"hello world")], 1)  # segments hash like one buffer
    raw = encode_header(11, csum, 1, "ns/ab/key")
    assert len(raw) == HEADER_SIZE
    h = decode_header(raw, "ns/ab/key")
    assert (h.algorithm, h.payload_len, h.checksum) == (1, 11, csum)
    verify_payload(h, payload)
    with pytest.raises(CorruptObjectError, match="checksum"):
        verify_payload(h, [memoryview(b"hello World")])
    with pytest.raises(CorruptObjectError, match="bytes"):
        verify_payload(h, [memoryview(b"hello")])


@pytest.mark.parametrize("offset", range(HEADER_SIZE - 4))
def test_any_flipped_header_byte_is_detected(offset: int) -> None:
    raw = bytearray(encode_header(11, 1234, 1, "ns/ab/key"))
    raw[offset] ^= 0x01
    with pytest.raises(CorruptObjectError):
        decode_header(raw)


def test_short_header_is_corrupt() -> None:
    with pytest.raises(CorruptObjectError):
        decode_header(encode_header(1, 0, 0, "k")[:10])


def test_a_header_is_bound_to_its_name() -> None:
    raw = encode_header(5, 0, 0, "ns/ab/key-x")
    decode_header(raw)  # no name given: not checked
    decode_header(raw, "ns/ab/key-x")
    for other in ("ns/ab/key-y", "other/ab/key-x", "ns/ab/key-x~tp1of2", ""):
        with pytest.raises(CorruptObjectError, match="another name"):
            decode_header(raw, other)


def test_write_atomic_first_writer_wins(tmp_path: Path) -> None:
    final = str(tmp_path / "obj")
    assert atomic.write_atomic(final, [b"first"]) is True
    assert atomic.write_atomic(final, [b"second"]) is False
    assert Path(final).read_bytes() == b"first"
    assert os.stat(final).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["obj"]  # no temporary left behind


def test_write_atomic_failure_leaves_nothing(tmp_path: Path) -> None:
    final = str(tmp_path / "obj")

    class Boom:  # not a buffer: writev raises TypeError mid-write
        pass

    with pytest.raises(TypeError):
        atomic.write_atomic(final, [b"partial", Boom()])  # type: ignore[list-item]
    assert os.listdir(tmp_path) == []


def test_writev_and_preadv_handle_many_segments(tmp_path: Path) -> None:
    chunks = [bytes([i % 256]) * (i + 1) for i in range(3000)]  # more than IOV_MAX views
    final = str(tmp_path / "many")
    assert atomic.write_atomic(final, chunks, fsync=True)
    data = b"".join(chunks)
    assert Path(final).read_bytes() == data
    targets = [memoryview(bytearray(len(c))) for c in chunks]
    fd = os.open(final, os.O_RDONLY)
    try:
        assert atomic.preadv_all(fd, targets) == len(data)
    finally:
        os.close(fd)
    assert b"".join(bytes(t) for t in targets) == data


def _dead_pid_tag() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{proc.pid}-{atomic._start_time(os.getpid())}"


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    host = atomic._HOST_TAG
    dead = tmp_path / f"{atomic.TEMP_PREFIX}{host}.{_dead_pid_tag()}.aaaa"
    dead.write_bytes(b"x")
    mine = Path(atomic.temp_path(str(tmp_path)))
    mine.write_bytes(b"x")
    # A live process (our parent shell) that started at the recorded time: kept.
    ppid = os.getppid()
    live = tmp_path / f"{atomic.TEMP_PREFIX}{host}.{ppid}-{atomic._start_time(ppid)}.bbbb"
    live.write_bytes(b"x")
    # Same pid as a live process but another start time: a previous incarnation, removed.
    reused = tmp_path / f"{atomic.TEMP_PREFIX}{host}.{ppid}-1.cccc"
    reused.write_bytes(b"x")
    # Another host's temporary: kept until it is old.
    foreign = tmp_path / f"{atomic.TEMP_PREFIX}ffffffff.1-1.dddd"
    foreign.write_bytes(b"x")
    old_foreign = tmp_path / f"{atomic.TEMP_PREFIX}ffffffff.1-1.eeee"
    old_foreign.write_bytes(b"x")
    past = time.time() - 7200
    os.utime(old_foreign, (past, past))
    keep = tmp_path / "real-object"
    keep.write_bytes(b"x")
    assert atomic.remove_stale_temporaries(str(tmp_path), max_age=3600) == 3
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([mine.name, live.name, foreign.name, keep.name])
