"""Page hashes, namespaces and object names: the one key scheme every backend shares.

Three layers, each defined once here:

1. **Page hash** (the logical key the engine passes around): the SGLang chain,
   ``H_i = SHA256(raw32(H_{i-1}) || LE_u32(t) for t in page_i)``, 64 lowercase hex chars.
   :func:`page_hashes` reproduces it byte for byte (golden vectors in the tests).
2. **Namespace** (:class:`KVCacheNamespace`): everything that makes two KV pages with the
   same page hash *different bytes*: model, logical dtype, page size, host byte layout,
   rank replication and head grouping, layer range, tenant salt, weights fingerprint. Its
   :attr:`~KVCacheNamespace.digest` is stable across releases and processes.
3. **Object name** (:func:`object_name`): ``<digest>/<fanout>/<key>[~<shard>]``. Every
   backend stores a page under this name (a relative path for file stores, a key suffix
   for key-value stores), so identities that differ land in disjoint keyspaces and miss,
   never collide.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, cast

from typing_extensions import override

from hicache_storage.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidTypeError,
    NamespaceMismatchError,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "KEY_MAX_LEN",
    "KVCacheNamespace",
    "ObjectName",
    "ObjectNamer",
    "is_object_leaf",
    "normalize_dtype",
    "object_name",
    "page_hashes",
    "partial_page_hash",
    "partial_page_hashes",
    "storage_namespace_seed",
    "validate_key",
]

#: Longest key accepted (characters). Object names stay under common filesystem (255)
#: and S3 (1024) limits with the namespace digest, fan-out and shard suffix added.
KEY_MAX_LEN = 200

_KEY_RE = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")
# A whole batch at once: keys joined by newlines (a character no key may hold), each
# within the length limit. ".." and the newline count are checked beside it.
_KEYS_RE = re.compile(
    rf"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{{0,{KEY_MAX_LEN - 1}}}(?:\n[A-Za-z0-9_\-][A-Za-z0-9_.\-]{{0,{KEY_MAX_LEN - 1}}})*"
)
_HEX_BYTE = [f"{i:02x}" for i in range(256)]
#: The fan-out hash of object names (see :func:`object_name`), copied for each name.
_FANOUT_HASH = hashlib.blake2b(digest_size=1)
_SHARD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-]{0,47}")
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF
_NAMESPACE_SEED_TAG = b"sglang-cache-namespace-v1"


# --------------------------------------------------------------------------- page hashes


def _encode_page(tokens: Sequence[Any]) -> bytes:
    """Encode one page of token ids the way the reference chain does."""
    flat: list[int] = []
    for tok in tokens:
        if isinstance(tok, (tuple, list)):
            flat.extend(tok)
        else:
            flat.append(tok)
    for t in flat:
        if not isinstance(t, int) or isinstance(t, bool):
            raise InvalidTypeError(f"token ids must be ints, got {type(t).__name__}")
        if t < 0 or t > _U64_MAX:
            raise InvalidArgumentError(f"token id {t} is outside [0, 2**64)")
    if flat and max(flat) > _U32_MAX:
        # Wide page: one 0xff tag byte, then every id as u64 little-endian. The odd byte
        # count keeps it apart from any u32 encoding.
        return b"\xff" + struct.pack(f"<{len(flat)}Q", *flat)
    return struct.pack(f"<{len(flat)}I", *flat)


def _prior_bytes(prior: str | None) -> bytes:
    if prior is None:
        return b""
    try:
        raw = bytes.fromhex(prior)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"prior hash must be hex, got {prior!r}") from exc
    return raw


def page_hashes(
    token_ids: Sequence[Any],
    page_size: int,
    prior_hash: str | None = None,
    namespace_seed: str | None = None,
) -> list[str]:
    """Return the chained page hashes of ``token_ids``, one per *full* page.

    Args:
        token_ids: token ids (ints; tuples such as EAGLE bigrams hash every element).
        page_size: tokens per page; a partial last page is never hashed.
        prior_hash: hash of the page before ``token_ids[0]`` (continues a chain).
        namespace_seed: seed for the first page of a sequence (see
            :func:`storage_namespace_seed`); ignored when ``prior_hash`` is given, because
            the prior already carries the seed.

    Returns:
        64-character lowercase hex digests, chained: page *i* depends on every page before.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
    prior = prior_hash if prior_hash is not None else namespace_seed
    prev = _prior_bytes(prior)
    out: list[str] = []
    full = len(token_ids) - len(token_ids) % page_size
    for start in range(0, full, page_size):
        h = hashlib.sha256(prev)
        h.update(_encode_page(token_ids[start : start + page_size]))
        prev = h.digest()
        out.append(prev.hex())
    return out


def partial_page_hashes(
    token_ids: Sequence[Any], prior_hash: str | None = None, namespace_seed: str | None = None
) -> list[str]:
    """The keys of the partial pages holding ``token_ids[:1]``, ``[:2]``... and all of it.

    A partial page has fewer tokens than a page, and only those have KV.

    Chained like :func:`page_hashes` (``prior_hash``: the full page before it), with a
    domain tag, each token length-prefixed and the token count last: never the key of
    a full page, nor of another length of the same partial page. One pass (the hash of
    each length continues the last).
    """
    prior = prior_hash if prior_hash is not None else namespace_seed
    h = hashlib.sha256(b"hicache-partial-page\0")
    h.update(_prior_bytes(prior))
    out: list[str] = []
    for count, token in enumerate(token_ids, 1):
        encoded = _encode_page([token])
        h.update(len(encoded).to_bytes(2, "little") + encoded)
        key = h.copy()
        key.update(count.to_bytes(8, "little"))
        out.append(key.hexdigest())
    return out


def partial_page_hash(
    token_ids: Sequence[Any], prior_hash: str | None = None, namespace_seed: str | None = None
) -> str:
    """The key of the partial page holding ``token_ids`` (see :func:`partial_page_hashes`)."""
    if not token_ids:
        raise InvalidArgumentError("a partial page holds at least one token")
    return partial_page_hashes(token_ids, prior_hash, namespace_seed)[-1]


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """Return the reference engine's namespace seed for (extra_key, cache_salt).

    ``None`` when both are ``None`` (keys stay unchanged and backward compatible);
    otherwise a hex digest that is used as the prior hash of a sequence's first page.
    """
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(_NAMESPACE_SEED_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode("utf-8")
            h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()


# --------------------------------------------------------------------------- namespaces


def normalize_dtype(dtype: Any) -> str:
    """Return the logical dtype name: ``torch.bfloat16`` and ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype)
    name = name.removeprefix("torch.")
    name = name.strip()
    if not name:
        raise ConfigError("dtype must not be empty")
    return name


@dataclass(frozen=True)
class KVCacheNamespace:
    """The identity of a KV page's bytes; two namespaces never read each other's pages.

    Attributes:
        model_id: served model identity (e.g. ``"meta-llama/Llama-3.1-8B"``); required.
        dtype: logical KV dtype (``"bfloat16"``, ``"float8_e4m3fn"``...); fp8 variants differ.
        page_size: tokens per page.
        object_layout: byte order of a stored page (the host-pool layout, e.g.
            ``"page_first"``, or ``"opaque"`` for arbitrary values).
        rank_replicated: True when every rank holds the same bytes (MLA): no shard suffix.
        total_kv_heads: KV heads of the model (0 when rank-replicated or unknown).
        kv_heads_per_shard: heads per stored object (head grouping), 0 when unknown.
        layer_range: ``(start, end)`` layers held by this stage, ``None`` for all layers.
        tenant: tenant salt; different tenants never share pages.
        pool: which of a hybrid model's pools the pages belong to, with its page geometry
            (``"mamba/page_first/48+20"``); empty for the KV pool. A page of one pool is
            never read as another's.
        head_groups: pages stored as this many head-group objects with a write tag, which
            every TP size can assemble (:mod:`hicache_storage.headgroups`); 0: one object
            per rank's page.
        weights_fingerprint: optional digest of the weights/numerics (fine-tunes, kernels).
        schema_version: version of this identity scheme.
    """

    model_id: str
    dtype: str
    page_size: int
    object_layout: str = "opaque"
    rank_replicated: bool = False
    total_kv_heads: int = 0
    kv_heads_per_shard: int = 0
    layer_range: tuple[int, int] | None = None
    tenant: str = ""
    pool: str = ""
    head_groups: int = 0
    weights_fingerprint: str = ""
    schema_version: int = 1
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Normalize ``dtype``, check every field and compute the namespace digest."""
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise ConfigError("model_id must be a non-empty string (it would merge models)")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool):
            raise ConfigError(f"page_size must be an int, got {self.page_size!r}")
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {self.page_size}")
        if not self.object_layout:
            raise ConfigError("object_layout must not be empty")
        if self.total_kv_heads < 0 or self.kv_heads_per_shard < 0:
            raise ConfigError("total_kv_heads and kv_heads_per_shard must be >= 0")
        if self.rank_replicated and (self.total_kv_heads or self.kv_heads_per_shard):
            raise ConfigError(
                "a rank-replicated (MLA) namespace has no head axis: leave heads at 0"
            )
        if self.kv_heads_per_shard and self.total_kv_heads % self.kv_heads_per_shard:
            raise ConfigError(
                f"kv_heads_per_shard={self.kv_heads_per_shard} must divide "
                f"total_kv_heads={self.total_kv_heads}"
            )
        if self.head_groups and (
            not isinstance(self.head_groups, int)
            or self.head_groups < 0
            or not self.total_kv_heads
            or self.total_kv_heads % self.head_groups
            or self.kv_heads_per_shard != self.total_kv_heads // self.head_groups
        ):
            raise ConfigError(
                f"head_groups={self.head_groups} must divide total_kv_heads="
                f"{self.total_kv_heads}, with kv_heads_per_shard the heads of one group"
            )
        if self.layer_range is not None:
            start, end = self.layer_range
            if not 0 <= start < end:
                raise ConfigError(
                    f"layer_range must satisfy 0 <= start < end, got {self.layer_range}"
                )
            object.__setattr__(self, "layer_range", (int(start), int(end)))
        if self.schema_version != 1:
            raise ConfigError(f"unsupported namespace schema_version {self.schema_version}")
        object.__setattr__(self, "_digest", self._compute_digest())

    def _canonical(self) -> dict[str, Any]:
        # Optional fields equal to their default are left out, so adding a new optional
        # field in a later release does not change the digest of existing namespaces.
        out: dict[str, Any] = {}
        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if f.name in ("model_id", "dtype", "page_size", "schema_version") or value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def _compute_digest(self) -> str:
        blob = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        return "ns1-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]

    @property
    def digest(self) -> str:
        """Stable identifier of this namespace, safe as a path component and a key prefix."""
        return self._digest

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict (inverse of :meth:`from_dict`)."""
        data = asdict(self)
        data.pop("_digest", None)
        return data

    @classmethod
    def for_pool(cls, pool: Any, *, model_id: str, **extra: Any) -> KVCacheNamespace:
        """The namespace of the pages of host pool ``pool``, for model ``model_id``.

        Reads what :meth:`HiCacheStorage.register_mem_pool_host
        <hicache_storage.protocol.HiCacheStorage.register_mem_pool_host>` checks from the
        pool: ``page_size``, ``dtype``, ``layout`` (the stored object layout) and MLA
        (``mla`` or ``is_mla``: an MLA pool's pages are rank-replicated). Works with
        :class:`~hicache_storage.host_pool.HostKVPool` and SGLang-style host pools.

        ``extra`` sets the other fields (``tenant``, ``total_kv_heads``,
        ``layer_range``, ``weights_fingerprint``...) and may supply a fact the pool does
        not have; a field that contradicts the pool raises :class:`ConfigError`, since a
        backend would refuse that pool anyway.
        """
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(extra) - known
        if unknown:
            raise ConfigError(f"unknown namespace fields {sorted(unknown)}; known: {sorted(known)}")
        facts: dict[str, Any] = {}
        page_size = getattr(pool, "page_size", None)
        if page_size is not None:
            if hasattr(page_size, "__index__") and not isinstance(page_size, bool):
                page_size = operator.index(page_size)  # numpy and torch integers
            facts["page_size"] = page_size
        dtype = getattr(pool, "dtype", None)
        if dtype is not None:
            facts["dtype"] = normalize_dtype(dtype)
        layout = getattr(pool, "layout", None)
        if layout is not None:
            facts["object_layout"] = str(layout)
        # The same lookup as register_mem_pool_host: ``mla``, then ``is_mla``.
        facts["rank_replicated"] = bool(getattr(pool, "mla", getattr(pool, "is_mla", False)))
        for name, value in facts.items():
            if name not in extra:
                continue
            given = normalize_dtype(extra[name]) if name == "dtype" else extra[name]
            if given != value:
                raise ConfigError(
                    f"for_pool: {name}={extra[name]!r} contradicts the pool's {value!r}; "
                    f"leave {name} out to take it from the pool"
                )
        for name in ("page_size", "dtype"):
            if name not in facts and name not in extra:
                raise ConfigError(
                    f"for_pool: the pool ({type(pool).__name__}) has no {name!r} attribute; "
                    f"pass {name}=... explicitly"
                )
        return cls(model_id=model_id, **{**extra, **facts})

    def check_pool(self, pool: Any) -> None:
        """Raise :class:`NamespaceMismatchError` if host pool ``pool`` contradicts this namespace.

        The inverse of :meth:`for_pool`: the pool's ``page_size``, ``dtype``, ``layout``
        (unless the namespace's ``object_layout`` is ``opaque``) and MLA flag (``mla`` or
        ``is_mla``) must match, or pages written through the pool would be filed under a
        namespace that describes other bytes. A fact the pool does not expose is not
        checked. ``register_mem_pool_host`` calls this, so a mismatch fails when the pool
        is attached, not as silent collisions later.
        """
        problems = []
        page_size = getattr(pool, "page_size", None)
        if page_size is not None and page_size != self.page_size:
            problems.append(f"page_size {page_size} != namespace page_size {self.page_size}")
        dtype = getattr(pool, "dtype", None)
        if dtype is not None and normalize_dtype(dtype) != self.dtype:
            problems.append(f"dtype {normalize_dtype(dtype)} != namespace dtype {self.dtype}")
        layout = getattr(pool, "layout", None)
        if layout is not None and self.object_layout != "opaque" and layout != self.object_layout:
            problems.append(f"layout {layout} != namespace object_layout {self.object_layout}")
        is_mla = bool(getattr(pool, "mla", getattr(pool, "is_mla", False)))
        if is_mla != self.rank_replicated:
            problems.append(
                f"MLA pool={is_mla} but namespace rank_replicated={self.rank_replicated}"
            )
        if problems:
            raise NamespaceMismatchError(
                "host pool does not match the backend's namespace: "
                + "; ".join(problems)
                + ". Build the namespace from the pool: KVCacheNamespace.for_pool(pool, model_id=...)"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheNamespace:
        """Build a namespace from a dict, rejecting unknown fields."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown namespace fields {sorted(unknown)}; known: {sorted(known)}")
        kwargs = dict(data)
        if kwargs.get("layer_range") is not None:
            kwargs["layer_range"] = tuple(kwargs["layer_range"])
        return cls(**kwargs)


#: Namespace used when a backend is created without one: opaque values, one model.
DEFAULT_NAMESPACE = KVCacheNamespace(model_id="default", dtype="bytes", page_size=1)


# --------------------------------------------------------------------------- object names


def is_object_leaf(leaf: str) -> bool:
    """True if ``leaf`` is a key, or ``<key>~<shard>``, as object names end.

    The file-tree stores count and evict only such names in their directories.
    """
    key, sep, shard = leaf.partition("~")
    if not key or len(key) > KEY_MAX_LEN or _KEY_RE.fullmatch(key) is None or ".." in key:
        return False
    return not sep or _SHARD_RE.fullmatch(shard) is not None


def validate_key(key: object) -> str:
    """Return ``key`` if it is a valid storage key, else raise :class:`InvalidKeyError`.

    A key has 1 to :data:`KEY_MAX_LEN` characters from ``[A-Za-z0-9_.-]``, does not start
    with ``.`` and does not contain ``..``. Page hashes (hex) and ``<hash>.<pool>`` keys
    pass; path separators, NUL, whitespace and non-ASCII text do not, so a key can never
    escape a backend's root or collide with its temporary files.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be str, got {type(key).__name__}")
    if type(key) is not str:
        key = str.__str__(key)  # the characters themselves: a subclass may lie about them
    if not key:
        raise InvalidKeyError("key must not be empty")
    if len(key) > KEY_MAX_LEN:
        raise InvalidKeyError(f"key is {len(key)} characters long; the limit is {KEY_MAX_LEN}")
    if _KEY_RE.fullmatch(key) is None or ".." in key:
        raise InvalidKeyError(
            f"invalid key {key!r}: use characters [A-Za-z0-9_.-], do not start with '.' "
            "and do not use '..'"
        )
    return key


def validate_keys(keys: object) -> list[str]:
    """Validate a batch of keys; return them as a (new) list.

    The rule is :func:`validate_key`'s. A batch of valid keys is checked in one pass
    (one regular expression over the keys joined by newlines); a batch with a bad key is
    checked key by key, so the error names the first bad one.
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise InvalidTypeError(f"keys must be a list of str, got {type(keys).__name__}")
    batch = list(keys)
    if len(batch) < 2 or set(map(type, batch)) != {str}:
        return [validate_key(k) for k in batch]  # (str subclasses become plain str)
    try:
        joined = "\n".join(batch)
    except TypeError:
        joined = None  # a key that is not a str: validate_key says which
    if (
        joined is not None
        and _KEYS_RE.fullmatch(joined) is not None
        and joined.count("\n") == len(batch) - 1  # no key holds the separator
        and ".." not in joined
    ):
        return batch
    return [validate_key(k) for k in batch]


@dataclass(frozen=True, slots=True)
class ObjectName:
    """Where a page lives: ``<namespace>/<fanout>/<leaf>``.

    ``fanout`` is two hex characters derived from the leaf, so a directory-like store
    spreads a namespace evenly over 256 directories (10 million pages: about 40,000
    entries each, well within what ext4, XFS and tmpfs index efficiently).
    """

    namespace: str
    fanout: str
    leaf: str
    #: The full relative name, ``namespace/fanout/leaf`` (computed once).
    path: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Compute :attr:`path`."""
        object.__setattr__(self, "path", f"{self.namespace}/{self.fanout}/{self.leaf}")

    @override
    def __str__(self) -> str:
        return self.path


class ObjectNamer:
    """:func:`object_name` for one namespace and shard, with recent names remembered.

    The prefetch path names the same pages again and again; a remembered name costs a
    dictionary lookup instead of a validation and a hash, and a batch of remembered
    paths is one C-speed pass (:meth:`paths`). A key is validated (and its name
    computed) the first time it is seen, so an invalid key is never remembered and always
    raises :class:`InvalidKeyError`, as with :func:`object_name`. Only plain ``str`` keys
    are looked up in the memory (a subclass is validated, and so made a plain ``str``,
    first).

    Args:
        digest: a :attr:`KVCacheNamespace.digest`.
        shard: the shard coordinate, or ``None`` (checked here, once).
    """

    __slots__ = ("_digest", "_names", "_path_of", "_prefix", "_suffix")

    #: Keys remembered (about 30 MB when full, for 64-character keys: paths, and the
    #: names asked for); cleared when full (a batch larger than this is kept whole).
    CACHE_LIMIT = 1 << 15

    def __init__(self, digest: str, shard: str | None) -> None:
        if shard is not None and _SHARD_RE.fullmatch(shard) is None:
            raise InvalidArgumentError(f"invalid shard coordinate {shard!r}")
        self._digest = digest
        self._prefix = digest + "/"
        self._suffix = "" if shard is None else "~" + shard
        self._path_of: dict[str, str] = {}  # key -> path (the hot paths need only these)
        self._names: dict[str, ObjectName] = {}  # key -> name, made when asked for

    def _new_path(self, key: str) -> str:
        """Validate ``key``, then compute and remember its path."""
        return self._remember([validate_key(key)])[0]  # a str subclass: a plain str now

    def _remember(self, keys: list[str]) -> list[str]:
        """The paths of ``keys`` (plain ``str``, validated), computed and remembered."""
        if len(self._path_of) + len(keys) > self.CACHE_LIMIT:
            self._path_of.clear()
            self._names.clear()
        hexes, prefix, suffix, fresh = _HEX_BYTE, self._prefix, self._suffix, _FANOUT_HASH.copy
        out = []
        for key in keys:
            leaf = key + suffix
            h = fresh()  # (a copy: 0.25 us less a key than building a blake2b object)
            h.update(leaf.encode())
            path = f"{prefix}{hexes[h.digest()[0]]}/{leaf}"
            self._path_of[key] = path
            out.append(path)
        return out

    def fill(self, paths: list[str | None], keys: list[str], at: int, count: int = 16) -> None:
        """Name the keys from ``at`` whose ``paths`` (from :meth:`known_paths`) are None.

        Up to ``count`` keys, validated in one pass (:class:`InvalidKeyError` names the
        first bad one), so a loop that names keys as it reaches them pays a batch's price
        per key but names at most ``count - 1`` keys it will not look at.
        """
        todo = [i for i in range(at, min(at + count, len(keys))) if paths[i] is None]
        if todo:
            for i, path in zip(
                todo, self._remember(validate_keys([keys[i] for i in todo])), strict=True
            ):
                paths[i] = path

    def name(self, key: str) -> ObjectName:
        """``object_name(digest, key, shard)``."""
        found = self._names.get(key) if type(key) is str else None
        if found is None:
            path, at = self.path(key), len(self._prefix)
            found = ObjectName(self._digest, path[at : at + 2], path[at + 3 :])
            if type(key) is str:
                self._names[key] = found
        return found

    def names(self, keys: list[str]) -> list[ObjectName]:
        """``name(key)`` for every key, the new ones named as a batch (see :meth:`fill`)."""
        paths = self.paths(keys)
        if type(keys) is not list or set(map(type, keys)) != {str}:
            return [self.name(k) for k in keys]
        get, at, digest, out = self._names.get, len(self._prefix), self._digest, []
        for key, path in zip(keys, paths, strict=True):
            found = get(key)
            if found is None:
                found = self._names[key] = ObjectName(digest, path[at : at + 2], path[at + 3 :])
            out.append(found)
        return out

    def path(self, key: str) -> str:
        """``object_name(digest, key, shard).path``."""
        found = self._path_of.get(key) if type(key) is str else None
        return found if found is not None else self._new_path(key)

    def known_paths(self, keys: list[str]) -> list[str | None]:
        """The remembered path of each key, None for a key not remembered (or not a ``str``).

        One C-speed pass: no validation, no hash. :meth:`path` names the others.
        """
        if set(map(type, keys)) <= {str}:
            return list(map(self._path_of.get, keys))
        get = self._path_of.get
        return [get(k) if type(k) is str else None for k in keys]

    def each_path(self, keys: list[str], prefix: str = "") -> Iterator[str]:
        """``prefix + path(key)`` for each key in turn, keys named only near where reached.

        For loops that may stop early (the leading run of ``batch_exists``): keys more
        than a few past the first miss are never validated or hashed.
        """
        paths = self.known_paths(keys)
        for i, path in enumerate(paths):
            if path is None:
                self.fill(paths, keys, i)
                path = paths[i]
            yield prefix + cast("str", path)

    def paths(self, keys: list[str], prefix: str = "") -> list[str]:
        """``prefix + path(key)`` for every key (one call for a batch's hot loop)."""
        if set(map(type, keys)) <= {str}:
            found = list(map(self._path_of.get, keys))  # every remembered one, at C speed
            if None in found:
                self.fill(found, keys, 0, len(keys))
            out = cast("list[str]", found)
        else:
            out = [self.path(k) for k in keys]
        return [prefix + p for p in out] if prefix else out


def object_name(digest: str, page_hash: str, shard: str | None = None) -> ObjectName:
    """Build the object name of ``page_hash`` in namespace ``digest`` for ``shard``.

    This is the only function that maps keys to stored names; every backend uses it.

    Args:
        digest: a :attr:`KVCacheNamespace.digest`.
        page_hash: the key (validated with :func:`validate_key`).
        shard: the shard coordinate (e.g. ``"h0-7"`` for KV heads 0..7), ``None`` when the
            object is rank-replicated.
    """
    page_hash = validate_key(page_hash)
    if shard is None:
        leaf = page_hash
    else:
        if _SHARD_RE.fullmatch(shard) is None:
            raise InvalidArgumentError(f"invalid shard coordinate {shard!r}")
        leaf = f"{page_hash}~{shard}"
    fan = hashlib.blake2b(leaf.encode("ascii"), digest_size=1).hexdigest()
    return ObjectName(digest, fan, leaf)
