"""What every request must satisfy before its body runs, let alone asks a tier: the shape of its fields.

One entry point, ``check_request(request)``, which ``handlers.methods`` runs on every request both
front ends (gRPC, the local socket) hand to a body, before a quick-path test, an auth check or a
store call: a key of the wrong length, too many keys, a malformed namespace, session id or
retention, a caller-memory range that wraps, is INVALID_ARGUMENT naming the field (and the index
of the key) instead of reaching a tier (whose own guard, "tier keys must be 1 to 256 bytes long",
is an internal invariant, an INTERNAL error if a request ever reaches it). A message a method
receives that has no entry in ``CHECKS`` has no field whose shape alone can be wrong (GetServerInfo,
Stats) or whose checks need what the call carries (an arena's fd, a device handle: arena_attach.py,
device_arenas.py); a layout definition is checked whole where it is parsed (format/page_layout.py).
The checks are pure: they depend on the request alone, never on what is stored, so an answer here
tells nobody anything about another namespace.

A new request message (a new RPC, or a new field of an old one) gets its checks here: a function
in ``CHECKS``, built from the field checks below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.format.manifest import check_namespace, check_session_id
from kvstore.v1 import kvstore_pb2 as pb

KEY_BYTES = 16  # a chunk key, an engine page key, a layout id
#: The most keys a LoadChunks or LookupKeys names (a 1M-token prompt of 16-token engine blocks in
#: 4 groups is 2^18 keys: a client asks in batches); a session names as many as its message holds.
MAX_KEYS = 1 << 16
MAX_ID_CHARS = 128  # an arena or device buffer id (the daemon makes 32 hex digits)
U64 = 1 << 64


# -- field checks --------------------------------------------------------------------------------------
def check_key(field: str, key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"{field} is {len(key)} bytes long; a key is {KEY_BYTES} bytes")


def check_keys(field: str, keys: Sequence[bytes], limit: int | None = MAX_KEYS) -> None:
    """Each of ``keys`` 16 bytes long (the first that is not is named by its index), at most ``limit``."""
    if limit is not None and len(keys) > limit:
        raise InvalidArgument(f"{field} names {len(keys)} keys; at most {limit} a call")
    bad = next((i for i, k in enumerate(keys) if len(k) != KEY_BYTES), None)
    if bad is not None:
        check_key(f"{field}[{bad}]", keys[bad])


def check_ns(field: str, namespace: str) -> None:
    try:
        check_namespace(namespace)
    except InvalidArgument as e:
        raise InvalidArgument(f"{field}: {e}") from None


def check_session(field: str, session_id: str) -> None:
    try:
        check_session_id(session_id)
    except InvalidArgument as e:
        raise InvalidArgument(f"{field}: {e}") from None


def check_id(field: str, value: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{field} is {len(value)} characters long; an id is at most {MAX_ID_CHARS}")


def check_caller_memory(field: str, into: pb.CallerMemory) -> None:
    """A range of the caller's memory: an address and a size, together within the 64-bit address space."""
    if not into.address or not into.size:
        raise InvalidArgument(f"{field} needs an address and a size")
    if into.address + into.size > U64:
        raise InvalidArgument(f"{field} runs past the end of the address space ({into.address:#x} + {into.size})")


def check_ttl(field: str, ttl_s: float) -> None:
    if not math.isfinite(ttl_s) or ttl_s < 0:
        raise InvalidArgument(f"{field} must be a positive, finite number of seconds (0 on the wire: never "
                              f"expires), got {ttl_s!r}")


def check_session_pb(field: str, s: pb.Session) -> None:
    """A session version a client commits: its names and its keys' shape (the store checks the rest)."""
    check_ns(f"{field}.namespace", s.namespace)
    check_session(f"{field}.session_id", s.session_id)
    check_key(f"{field}.layout_id", s.layout_id)
    check_keys(f"{field}.chunk_keys", s.chunk_keys, limit=None)
    check_ttl(f"{field}.retention.ttl_s", s.retention.ttl_s)


# -- per message -----------------------------------------------------------------------------------------
def _named(r: Any) -> None:
    """namespace and session_id of a request that names one session."""
    check_ns("namespace", r.namespace)
    check_session("session_id", r.session_id)


def _save(r: pb.SaveChunksRequest) -> None:
    if not r.HasField("header"):
        return
    h = r.header
    check_ns("header.namespace", h.namespace)
    check_key("header.layout_id", h.layout_id)
    if h.parent_key:
        check_key("header.parent_key (empty for chunk 0)", h.parent_key)
    check_id("header.arena_id", h.arena_id)
    if h.HasField("commit"):  # authorized by the header's namespace: the two must agree
        if h.commit.namespace != h.namespace or h.commit.layout_id != h.layout_id:
            raise InvalidArgument("header.commit must name the header's namespace and layout")
        check_session_pb("header.commit", h.commit)
    if h.HasField("append"):  # a turn named by what it adds: the header's namespace and layout are the session's
        if h.HasField("commit"):
            raise InvalidArgument("a save carries header.commit (the version whole) or header.append, not both")
        check_session("header.append.session_id", h.append.session_id)
        if not h.append.base:
            raise InvalidArgument("header.append.base must name the version the turn extends (a session is "
                                  "created by a save with header.commit)")
        check_keys("header.append.chunk_keys", h.append.chunk_keys)


def _load_chunks(r: pb.LoadChunksRequest) -> None:
    check_ns("namespace", r.namespace)
    check_keys("keys", r.keys)
    check_id("arena_id", r.arena_id)
    if r.HasField("into"):
        check_caller_memory("into", r.into)
    if r.more_into:
        if not r.HasField("into"):
            raise InvalidArgument("more_into needs into: the first region of slots is that one")
        for i, more in enumerate(r.more_into):
            check_caller_memory(f"more_into[{i}]", more)
        regions = [r.into, *r.more_into]
        unscattered = next((i for i, m in enumerate(regions) if not m.slot_bytes), None)
        if unscattered is not None:
            at = "into" if unscattered == 0 else f"more_into[{unscattered - 1}]"
            raise InvalidArgument(f"{at}.slot_bytes: with more_into every region is a region of slots "
                                  f"(slot_offsets and slot_bytes)")
        if (named := sum(len(m.slot_offsets) for m in regions)) != len(r.keys):
            raise InvalidArgument(f"more_into: into and more_into name {named} slots for {len(r.keys)} keys: one "
                                  f"per key, the keys split over the regions in order")


def _load_session(r: pb.LoadSessionRequest) -> None:
    _named(r)
    check_id("arena_id", r.arena_id)
    if r.HasField("into"):
        check_caller_memory("into", r.into)


def _lookup(r: pb.LookupRequest) -> None:
    check_ns("namespace", r.namespace)
    check_key("layout_id", r.layout_id)


def _lookup_keys(r: pb.LookupKeysRequest) -> None:
    check_ns("namespace", r.namespace)
    check_keys("keys", r.keys)


def _list(r: pb.ListSessionsRequest | pb.NamespaceStatsRequest) -> None:
    if r.namespace:  # "" = every namespace the token covers
        check_ns("namespace", r.namespace)


def _touch(r: pb.TouchSessionRequest) -> None:
    _named(r)
    check_ttl("retention.ttl_s", r.retention.ttl_s)


def _register(r: pb.RegisterLayoutRequest) -> None:
    if r.namespace:  # "" = every namespace the token covers (the definition: store/sessions/layouts.py)
        check_ns("namespace", r.namespace)


def _detach(r: pb.DetachArenaRequest) -> None:
    check_id("arena_id", r.arena_id)


def _to_device(r: pb.LoadSessionToDeviceRequest) -> None:
    _named(r)
    check_id("buffer_id", r.buffer_id)


CHECKS: dict[type, Callable[[Any], None]] = {
    pb.SaveChunksRequest: _save,
    pb.LoadChunksRequest: _load_chunks,
    pb.LoadSessionRequest: _load_session,
    pb.LookupRequest: _lookup,
    pb.LookupKeysRequest: _lookup_keys,
    pb.CommitSessionRequest: lambda r: check_session_pb("session", r.session),
    pb.GetSessionRequest: _named,
    pb.ListSessionsRequest: _list,
    pb.NamespaceStatsRequest: _list,
    pb.DeleteSessionRequest: _named,
    pb.TouchSessionRequest: _touch,
    pb.EvictSessionRequest: _named,
    pb.PrefetchSessionRequest: _named,
    pb.RegisterLayoutRequest: _register,
    pb.DetachArenaRequest: _detach,
    pb.LoadSessionToDeviceRequest: _to_device,
}


def check_request(request: Any) -> None:
    """InvalidArgument, naming the field, unless every field of ``request`` has a shape its RPC accepts."""
    check = CHECKS.get(type(request))
    if check is None:
        return
    try:
        check(request)
    except InvalidArgument as e:  # each check names a field: say whose
        raise InvalidArgument(f"{request.DESCRIPTOR.name}.{e}") from None


def is_valid(request: Any) -> bool:
    """Whether ``check_request`` passes (for a test that must not raise: a front end's quick-path test)."""
    try:
        check_request(request)
    except InvalidArgument:
        return False
    return True
