"""The identity of a model's weights: a resolved location and a cheap fingerprint.

Two engines that compute different KV for the same tokens must never share a namespace.
The model's *name* does not say that: a relative path (``model="model"``) names other
weights in every working directory, a path or hub id without a pinned revision names
whatever was put there last, and a fine-tune keeps its base model's ``config.json``.
:func:`model_identity` returns what does: the resolved absolute path (or the hub id with
its revision) and :func:`weights_fingerprint`, a digest of the weights computed once at
start, without reading all of their bytes.

**What the fingerprint covers.** For every weight file of the model directory
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, and their index files;
only the safetensors files and their index where there are any, as an engine loads
them; or the one file a ``.gguf`` model path names):
its name relative to the directory, its size, and samples of its bytes. A safetensors
file gives its whole header (every tensor's name, dtype, shape and offsets) and the
first and last :data:`SAMPLE_BYTES` of every tensor's data; any other file gives
:data:`FILE_SAMPLES` evenly spaced samples of :data:`SAMPLE_BYTES`. About 1 MiB of reads
per 1,000 tensors; nothing else is read.

**What it catches**: other weights under the same name or path (another checkpoint, a
retrained or fine-tuned model, merged LoRA weights: any change that touches a tensor's
first or last bytes, which a training step does to every tensor it updates), other
tensor names, shapes or dtypes, a quantized copy, an added or removed shard.

**What it cannot catch**: a change confined to the middle of tensors, leaving every
sampled byte as it was (no training produces one; a hand edit can), and weights changed
on disk after the engine started (the fingerprint is taken once). The same bytes give the
same fingerprint on every machine, whatever their path or modification time: engines
that load identical weights share their pages, on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

__all__ = [
    "FILE_SAMPLES",
    "SAMPLE_BYTES",
    "WEIGHT_SUFFIXES",
    "model_identity",
    "weights_fingerprint",
]

#: File name endings that hold weights (and the index files that list them).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
#: Bytes read from each end of a safetensors tensor, and per sample of another file.
SAMPLE_BYTES = 512
#: Evenly spaced samples read from a weight file that is not safetensors.
FILE_SAMPLES = 64
#: A safetensors header larger than this is not read whole (the format's own limit).
_MAX_HEADER = 100 << 20


def _weight_files(directory: Path) -> list[Path]:
    """The model's weight files under ``directory`` (one level of subfolders), sorted.

    Where there are safetensors files, only they and their index (what an engine loads
    when they are there: ``training_args.bin`` or an ``original/*.pth`` beside them is
    not the model).
    """
    found = [
        p
        for pattern in ("*", "*/*")
        for p in directory.glob(pattern)
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith(".")
    ]
    safetensors = [p for p in found if p.name.endswith((".safetensors", ".safetensors.index.json"))]
    if any(p.name.endswith(".safetensors") for p in safetensors):
        found = safetensors
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def _read_at(f: int, offset: int, n: int) -> bytes:
    return os.pread(f, max(0, n), max(0, offset))


def _safetensors(f: int, size: int, h: hashlib._Hash) -> bool:
    """Hash a safetensors file's header and its tensors' ends; False if it is not one."""
    if size < 8:
        return False
    (n,) = struct.unpack("<Q", _read_at(f, 0, 8))
    if n <= 0 or n > _MAX_HEADER or 8 + n > size:
        return False
    raw = _read_at(f, 8, n)
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(header, dict):
        return False
    h.update(raw)
    data = 8 + n
    for name in sorted(k for k in header if k != "__metadata__"):
        spec = header[name]
        offsets = spec.get("data_offsets") if isinstance(spec, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(x) is int for x in offsets)
            and 0 <= offsets[0] <= offsets[1] <= size
        ):
            return False  # (not a header a loader would take: sampled as any file)
        start, end = data + offsets[0], min(data + offsets[1], size)
        head = min(SAMPLE_BYTES, max(0, end - start))
        h.update(_read_at(f, start, head))
        h.update(_read_at(f, max(start + head, end - SAMPLE_BYTES), SAMPLE_BYTES))
    return True


def _samples(f: int, size: int, h: hashlib._Hash) -> None:
    """Hash :data:`FILE_SAMPLES` evenly spaced samples of a file (all of a small one)."""
    if size <= FILE_SAMPLES * SAMPLE_BYTES:
        h.update(_read_at(f, 0, size))
        return
    step = (size - SAMPLE_BYTES) / (FILE_SAMPLES - 1)
    for i in range(FILE_SAMPLES):
        h.update(_read_at(f, int(i * step), SAMPLE_BYTES))


def weights_fingerprint(location: str | os.PathLike[str]) -> str | None:
    """A digest of the weights at ``location`` (see the module docs); None: none found.

    ``location`` is a model directory, or one weight file (a ``.gguf`` model). A weight
    file that cannot be read is folded in by its name and size (the engine will say
    whether it needed it).
    """
    where = Path(location)
    if where.is_file():
        root, files = where.parent, [where]
    else:
        root, files = where, _weight_files(where)
    if not files:
        return None
    h = hashlib.sha256(b"hicache-weights-v1\0")
    for path in files:
        name = path.relative_to(root).as_posix()
        try:
            f = os.open(path, os.O_RDONLY)
        except OSError:
            try:
                size = path.stat().st_size
            except OSError:
                size = -1
            h.update(f"{name}\0{size}\0unreadable\0".encode())
            continue
        try:
            size = os.fstat(f).st_size
            h.update(f"{name}\0{size}\0".encode())
            if not (path.name.endswith(".safetensors") and _safetensors(f, size, h)):
                _samples(f, size, h)
        finally:
            os.close(f)
    return h.hexdigest()[:32]


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot folder of a hub model, if its files are in the local cache."""
    try:
        from huggingface_hub import (  # type: ignore[import-not-found,unused-ignore]
            snapshot_download,
        )

        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub id, not cached, no huggingface_hub
        return None


def model_identity(model: str, revision: str | None = None) -> tuple[str, str]:
    """``(model_id, fingerprint)`` of the model an engine loads from ``model``.

    A local directory or file (a ``.gguf`` model) is named by its resolved absolute
    path; anything else is a hub id, named with its ``revision``. The fingerprint is that
    of the directory or file, or of the hub model's snapshot in the local cache. A hub id whose files are not in the local
    cache gets ``"unread:<revision>"``: only its name and revision tell it apart.
    """
    path = Path(model).expanduser()
    if path.is_dir() or path.is_file():
        resolved = str(path.resolve())
        return resolved, weights_fingerprint(resolved) or "no-weight-files"
    model_id = f"{model}@{revision}" if revision else model
    snapshot = _hub_snapshot(model, revision)
    fingerprint = weights_fingerprint(snapshot) if snapshot is not None else None
    return model_id, fingerprint or f"unread:{revision or 'unpinned'}"
