"""The model identity the vLLM connector puts in its namespace (engine-free)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from hicache_storage.integrations.weights import (
    FILE_SAMPLES,
    SAMPLE_BYTES,
    model_identity,
    weights_fingerprint,
)


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file of uint8 tensors (the format: u64 header length, JSON, data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


def model_dir(path: Path, seed: int, *, size: int = 8192) -> Path:
    """A model folder: the same config.json every time, weights made from ``seed``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 128}')
    rng = __import__("random").Random(seed)
    write_safetensors(
        path / "model.safetensors",
        {f"layers.{i}.weight": rng.randbytes(size) for i in range(3)},
    )
    return path


def test_different_weights_behind_the_same_config_differ(tmp_path: Path) -> None:
    a = weights_fingerprint(model_dir(tmp_path / "a", seed=1))
    b = weights_fingerprint(model_dir(tmp_path / "b", seed=2))
    assert a and b and a != b


def test_the_same_bytes_anywhere_are_the_same_weights(tmp_path: Path) -> None:
    """Copied elsewhere, with other modification times: shared on purpose."""
    a = model_dir(tmp_path / "a", seed=1)
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    os.utime(b / "model.safetensors", (1, 1))
    assert weights_fingerprint(a) == weights_fingerprint(b)


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_change_at_either_end_of_any_tensor_is_seen(tmp_path: Path, where: str) -> None:
    """A fine-tune changes every tensor it touches; one changed tensor is enough."""
    d = model_dir(tmp_path / "m", seed=1)
    before = weights_fingerprint(d)
    f = d / "model.safetensors"
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    header = json.loads(f.read_bytes()[8 : 8 + n])
    start, end = header["layers.1.weight"]["data_offsets"]
    at = 8 + n + (start if where == "first" else end - 1)
    raw = bytearray(f.read_bytes())
    raw[at] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert weights_fingerprint(d) != before


def test_a_change_in_the_middle_of_a_tensor_is_not_seen(tmp_path: Path) -> None:
    """What the fingerprint documents it cannot catch: it reads the ends of tensors."""
    d = model_dir(tmp_path / "m", seed=1, size=8 * SAMPLE_BYTES)
    before = weights_fingerprint(d)
    f = d / "model.safetensors"
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    raw = bytearray(f.read_bytes())
    raw[8 + n + 4 * SAMPLE_BYTES] ^= 0xFF  # the middle of the first tensor
    f.write_bytes(bytes(raw))
    assert weights_fingerprint(d) == before


def test_shards_names_and_other_formats_count(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m", seed=1)
    one = weights_fingerprint(d)
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    renamed = weights_fingerprint(d)
    assert renamed != one
    # Beside safetensors, other weight files are not the model (an engine loads the
    # safetensors): not read.
    (d / "training_args.bin").write_bytes(os.urandom(1000))
    assert weights_fingerprint(d) == renamed
    # A model of .bin files only: each one sampled.
    b = tmp_path / "bin-model"
    b.mkdir()
    big = os.urandom(FILE_SAMPLES * SAMPLE_BYTES * 4)
    (b / "pytorch_model.bin").write_bytes(big)
    with_bin = weights_fingerprint(b)
    sampled = bytearray(big)
    sampled[0] ^= 1  # the first sample of a non-safetensors file
    (b / "pytorch_model.bin").write_bytes(bytes(sampled))
    assert weights_fingerprint(b) not in (None, with_bin)
    # A file that claims to be safetensors but is not is sampled, not trusted.
    (d / "broken.safetensors").write_bytes(b"\xff" * 100)
    assert weights_fingerprint(d) not in (None, renamed)


@pytest.mark.parametrize("offsets", [["x", 8], [0, 1e30], [4, 2], [-1, 4], [0, 10**30]])
def test_a_safetensors_header_with_bad_offsets_is_sampled_not_a_crash(
    tmp_path: Path, offsets: list[object]
) -> None:
    raw = json.dumps({"w": {"dtype": "U8", "shape": [8], "data_offsets": offsets}}).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    first = weights_fingerprint(tmp_path)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x01" + bytes(7))
    assert first and weights_fingerprint(tmp_path) not in (None, first)  # (sampled)


def test_a_weight_file_that_cannot_be_read_is_named_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM, not the fingerprint, says whether it needed that file. (This runs as root,
    who reads any file: the refusal is the operating system's answer, stood in for.)"""
    (tmp_path / "model.bin").write_bytes(os.urandom(100))
    (tmp_path / "optimizer.pt").write_bytes(os.urandom(100))
    readable = weights_fingerprint(tmp_path)
    real_open = os.open

    def refuse(path: object, *args: object) -> int:
        if str(path).endswith("optimizer.pt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    fp = weights_fingerprint(tmp_path)
    assert fp and fp != readable


def test_a_gguf_file_model_is_resolved_and_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM takes model="./model.gguf": a file, named by its resolved path and read."""
    for where, seed in (("one", 1), ("two", 2)):
        (tmp_path / where).mkdir()
        rng = __import__("random").Random(seed)
        (tmp_path / where / "model.gguf").write_bytes(rng.randbytes(FILE_SAMPLES * SAMPLE_BYTES))
    monkeypatch.chdir(tmp_path / "one")
    first = model_identity("model.gguf")
    monkeypatch.chdir(tmp_path / "two")
    second = model_identity("./model.gguf")
    assert first[0] == str((tmp_path / "one" / "model.gguf").resolve())
    assert second[0] == str((tmp_path / "two" / "model.gguf").resolve())
    assert first[1] != second[1] and not first[1].startswith("unread")


def test_no_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert weights_fingerprint(tmp_path) is None
    model_id, fingerprint = model_identity(str(tmp_path))
    assert (model_id, fingerprint) == (str(tmp_path.resolve()), "no-weight-files")


def test_a_relative_path_is_resolved_against_where_the_engine_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines started as model="model" from two folders load other weights: their
    identities differ in the path and in the fingerprint."""
    model_dir(tmp_path / "one" / "model", seed=1)
    model_dir(tmp_path / "two" / "model", seed=2)
    monkeypatch.chdir(tmp_path / "one")
    first = model_identity("model")
    monkeypatch.chdir(tmp_path / "two")
    second = model_identity("model")
    assert first[0] == str((tmp_path / "one" / "model").resolve())
    assert second[0] == str((tmp_path / "two" / "model").resolve())
    assert first[1] != second[1]


def test_a_hub_id_not_in_the_local_cache_is_named_with_its_revision(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    assert model_identity("acme/not-here", "abc123") == ("acme/not-here@abc123", "unread:abc123")
    assert model_identity("acme/not-here") == ("acme/not-here", "unread:unpinned")
