"""Session manifests: what a session is, stored durably and committed after its chunks.

A manifest names the session's complete chunks in order (their keys), carries the trailing
tokens that do not fill a chunk yet together with their packed entries (as a chunk-format blob,
key all zeros), and the ids of the last tokens (what bounded replay needs). Binary form:

    b"KVMF" | u16 version | u32 meta_len | meta (JSON, UTF-8) | u32 tail_len | tail blob | xxh3-64

A manifest is one value written in one transaction, so a commit is atomic: a crashed save leaves
the previous version intact.

A manifest says its session's kind (``Kind``): a token chain, or engine pages (no trailing span, no
token ids, its keys an engine's blocks). The store's behaviour for each is ``store/sessions/kind.py``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import xxhash

from kvstore.errors import InvalidArgument

MAGIC = b"KVMF"
VERSION = 1
_HEAD = struct.Struct("<4sHI")
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")
NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
KEY_PREFIX = b"m:"
#: A manifest keeps the ids of its last min(token_count, LAST_TOKEN_IDS) tokens: what bounded replay
#: needs (the SWA window of every preset, docs/FORMAT.md section 3).
LAST_TOKEN_IDS = 128


class Kind(StrEnum):
    """What a session is made of, chosen from its layout when it is saved and said by its manifest.
    (A StrEnum: a load groups its blobs by kind, and a plain Enum hashes in Python, 5x slower.)"""

    #: Chunks of ``chunk_tokens`` tokens keyed by their token ids, in a chain; a trailing span; the last ids.
    TOKEN_CHAIN = "token-chain"
    #: An engine's KV blocks (``format/page.py``) keyed by the engine's block hashes, in no chain.
    ENGINE_PAGES = "engine-pages"


def unnamed_kind(chunk_tokens: int) -> Kind:
    """The kind of a session whose record does not name one: a manifest stored before manifests said
    their kind, and a ``Session`` on the wire (its proto has no kind). In both, engine pages are the
    sessions of ``chunk_tokens`` 0, and only they are (docs/FORMAT.md sections 3 and 6)."""
    return Kind.ENGINE_PAGES if chunk_tokens == 0 else Kind.TOKEN_CHAIN


class ManifestError(ValueError):
    """Stored manifest bytes are damaged or of an unknown version."""


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(f"malformed session id {session_id!r}: 1-128 chars of [A-Za-z0-9_.:-], "
                              f"starting with a letter or digit")
    return session_id


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
        raise InvalidArgument(f"malformed namespace {namespace!r}: 1-64 chars of [A-Za-z0-9_.-]")
    return namespace


def manifest_key(namespace: str, session_id: str) -> bytes:
    """The key of a session's manifest in the durable tier's meta keyspace (never among chunks)."""
    return KEY_PREFIX + f"{namespace}/{session_id}".encode()


def is_legacy_manifest(key: bytes, value: bytes | memoryview) -> bool:
    """Whether a value found among the chunks is a manifest the old format kept there (under a
    manifest key). Decided by its magic, not its key's length: a manifest key can be 16 bytes."""
    return key.startswith(KEY_PREFIX) and bytes(memoryview(value)[: len(MAGIC)]) == MAGIC


@dataclass(frozen=True)
class Retention:
    """How long a session is kept: pinned sessions are never evicted; ttl_s=None means no expiry
    (a save or touch accepts only what ``check_retention`` does)."""

    pinned: bool = False
    ttl_s: float | None = None


def check_retention(r: Retention) -> Retention:
    """A retention a save or touch may set: ttl_s None (never expires; 0 on the wire) or a positive,
    finite number of seconds. A negative, NaN or infinite one is InvalidArgument (the wire's -5 was
    once stored as "never expires")."""
    ttl = r.ttl_s
    if not isinstance(r.pinned, bool):
        raise InvalidArgument(f"retention.pinned must be true or false, got {r.pinned!r}")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl)
                            or ttl <= 0):
        raise InvalidArgument(f"retention.ttl_s must be a positive, finite number of seconds (0 on the wire, or "
                              f"none: never expires), got {ttl!r}")
    return r


@dataclass(frozen=True)
class Manifest:
    session_id: str
    namespace: str
    layout_id: bytes
    token_count: int
    chunk_tokens: int
    chunk_keys: tuple[bytes, ...] = field(repr=False)
    tail: bytes = field(repr=False)  # chunk-format blob of the trailing tokens (fewer than chunk_tokens)
    last_token_ids: tuple[int, ...] = field(repr=False)  # ids of the last min(token_count, 128) tokens
    created_at: float = 0.0
    updated_at: float = 0.0
    retention: Retention = field(default_factory=Retention)
    metadata: dict[str, str] = field(default_factory=dict)
    #: The version: as stored and read, a stamp the store gives each version of the session (larger
    #: for every later one, never reused; 0 in manifests written before stamps); in a save, the
    #: version it replaces (0: none given, the save replaces whatever is there).
    generation: int = 0
    #: The session's kind (written in the stored form unless it is a token chain, the first kind).
    kind: Kind = Kind.TOKEN_CHAIN

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        check_session_id(self.session_id)
        if len(self.layout_id) != 16:
            raise InvalidArgument("layout id must be 16 bytes")
        if any(len(k) != 16 for k in self.chunk_keys):
            raise InvalidArgument("chunk keys must be 16 bytes each")
        self._check_shape()

    def extended(self, keys: Sequence[bytes], token_count: int, tail: bytes, last_token_ids: tuple[int, ...],
                 generation: int, updated_at: float) -> Manifest:
        """This version with ``keys`` appended to its chunks and the trailing span, last ids, stamp and
        time given (a turn: ``kvstore.format.turn_record``), checked as a new manifest is, except its own
        chunk keys, checked when it was made: O(what is added), not O(the session)."""
        if any(len(k) != 16 for k in keys):
            raise InvalidArgument("chunk keys must be 16 bytes each")
        m = object.__new__(Manifest)
        for name, value in self.__dict__.items():
            object.__setattr__(m, name, value)
        for name, value in (("chunk_keys", self.chunk_keys + tuple(keys)), ("token_count", token_count),
                            ("tail", tail), ("last_token_ids", last_token_ids), ("generation", generation),
                            ("updated_at", updated_at)):
            object.__setattr__(m, name, value)
        m._check_shape()
        return m

    def stamped(self, generation: int, created_at: float, updated_at: float) -> Manifest:
        """This version with another stamp and times (as the store committed it): O(1), nothing to check again."""
        m = object.__new__(Manifest)
        for name, value in self.__dict__.items():
            object.__setattr__(m, name, value)
        for name, value in (("generation", generation), ("created_at", created_at), ("updated_at", updated_at)):
            object.__setattr__(m, name, value)
        return m

    def _check_shape(self) -> None:
        """The checks of a manifest's kind, counts and trailing span (its ids and keys checked before)."""
        if not isinstance(self.kind, Kind):
            raise InvalidArgument(f"a session's kind is one of {', '.join(k.value for k in Kind)}, not {self.kind!r}")
        if self.kind is Kind.ENGINE_PAGES:  # no token chunks, no tail
            if self.chunk_tokens or self.token_count < 0 or self.tail or self.last_token_ids:
                raise InvalidArgument("a session of engine pages has chunk_tokens 0, no trailing span and no token "
                                      "ids (the engine replays its own tokens)")
            return
        if self.chunk_tokens <= 0:
            raise InvalidArgument(f"a token chain's chunks hold chunk_tokens > 0 tokens, not {self.chunk_tokens} (a "
                                  f"session of engine pages says kind=Kind.ENGINE_PAGES)")
        if self.token_count < len(self.chunk_keys) * self.chunk_tokens:
            raise InvalidArgument(f"token_count {self.token_count} is less than {len(self.chunk_keys)} chunks of "
                                  f"{self.chunk_tokens} tokens")
        if self.token_count - len(self.chunk_keys) * self.chunk_tokens >= self.chunk_tokens:
            raise InvalidArgument("the trailing span must be shorter than one chunk")

    @property
    def tail_tokens(self) -> int:
        if self.kind is Kind.ENGINE_PAGES:
            return 0
        return self.token_count - len(self.chunk_keys) * self.chunk_tokens

    @property
    def key(self) -> bytes:
        return manifest_key(self.namespace, self.session_id)

    def expired(self, now: float) -> bool:
        r = self.retention
        return not r.pinned and r.ttl_s is not None and now > self.updated_at + r.ttl_s

    def with_retention(self, retention: Retention, now: float) -> Manifest:
        return replace(self, retention=retention, updated_at=now)

    def encode(self) -> bytes:
        meta = {
            "session_id": self.session_id, "namespace": self.namespace, "layout_id": self.layout_id.hex(),
            "token_count": self.token_count, "chunk_tokens": self.chunk_tokens,
            "chunk_keys": [k.hex() for k in self.chunk_keys], "last_token_ids": list(self.last_token_ids),
            "created_at": self.created_at, "updated_at": self.updated_at,
            "retention": {"pinned": self.retention.pinned, "ttl_s": self.retention.ttl_s},
            "metadata": self.metadata, "generation": self.generation,
        }
        if self.kind is not Kind.TOKEN_CHAIN:  # a token chain's manifest is byte for byte what it was before kinds
            meta["kind"] = self.kind.value
        mj = json.dumps(meta, separators=(",", ":")).encode()
        body = _HEAD.pack(MAGIC, VERSION, len(mj)) + mj + struct.pack("<I", len(self.tail)) + self.tail
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, blob: bytes | memoryview) -> Manifest:
        """Parse stored manifest bytes; ManifestError for anything that is not a whole version-1
        manifest (docs/FORMAT.md section 3 lists what is damage)."""
        mv = memoryview(blob)
        if len(mv) < _HEAD.size + 12:
            raise ManifestError(f"manifest truncated ({len(mv)} bytes)")
        magic, version, mlen = _HEAD.unpack_from(mv, 0)
        if magic != MAGIC or version != VERSION:
            raise ManifestError(f"not a version-{VERSION} manifest (magic {bytes(magic)!r}, version {version})")
        (stored,) = struct.unpack_from("<Q", mv, len(mv) - 8)
        if xxhash.xxh3_64_intdigest(mv[:-8]) != stored:
            raise ManifestError("manifest checksum mismatch")
        if _HEAD.size + mlen + 4 + 8 > len(mv):
            raise ManifestError(f"meta_len {mlen} runs past the {len(mv)}-byte manifest")
        (tlen,) = struct.unpack_from("<I", mv, _HEAD.size + mlen)
        at = _HEAD.size + mlen + 4
        if at + tlen + 8 != len(mv):
            raise ManifestError(f"tail_len {tlen} does not end at the checksum ({len(mv) - 8 - at} bytes are there)")
        try:
            meta = json.loads(bytes(mv[_HEAD.size : _HEAD.size + mlen]).decode("utf-8"))
            return cls._of_meta(meta, bytes(mv[at : at + tlen]))
        except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ManifestError(f"manifest meta does not parse: {type(e).__name__}: {e}") from None

    @classmethod
    def _of_meta(cls, meta: Any, tail: bytes) -> Manifest:
        """The manifest ``meta`` (parsed JSON) describes; ManifestError if a key is missing or of
        another JSON type than docs/FORMAT.md gives it (keys it does not list are ignored)."""
        if not isinstance(meta, dict):
            raise ManifestError(f"manifest meta is a JSON {type(meta).__name__}, not an object")

        def get(key: str, *types: type, default: Any = ...) -> Any:
            if key not in meta and default is not ...:
                return default
            v = meta[key]
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise ManifestError(f"manifest meta {key!r} is {v!r}, not {' or '.join(t.__name__ for t in types)}")
            return v

        def ints(key: str, v: Any) -> int:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ManifestError(f"manifest meta {key!r} holds {v!r}, not an int >= 0")
            return v

        r = get("retention", dict)
        pinned, ttl = r.get("pinned"), r.get("ttl_s")
        if not isinstance(pinned, bool):
            raise ManifestError(f"manifest meta retention.pinned is {pinned!r}, not true or false")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
            raise ManifestError(f"manifest meta retention.ttl_s is {ttl!r}, not a number or null")
        metadata = get("metadata", dict)
        if not all(isinstance(v, str) for v in metadata.values()):
            raise ManifestError("manifest meta 'metadata' maps strings to something other than strings")
        chunk_tokens = ints("chunk_tokens", get("chunk_tokens", int))
        named = get("kind", str, default=None)
        if named is not None and named not in {k.value for k in Kind}:
            raise ManifestError(f"manifest meta 'kind' is {named!r}, not one of {', '.join(k.value for k in Kind)}")
        kind = Kind(named) if named is not None else unnamed_kind(chunk_tokens)  # stored before kinds: by C
        return cls(get("session_id", str), get("namespace", str), bytes.fromhex(get("layout_id", str)),
                   ints("token_count", get("token_count", int)), chunk_tokens,
                   tuple(bytes.fromhex(k) for k in get("chunk_keys", list)), tail,
                   tuple(ints("last_token_ids", t) for t in get("last_token_ids", list)),
                   get("created_at", int, float), get("updated_at", int, float),
                   Retention(pinned, ttl), dict(metadata),
                   ints("generation", get("generation", int, default=0)), kind)
