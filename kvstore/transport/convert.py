"""Proto <-> domain translation of sessions, and nothing else (both clients and the daemon use it;
the daemon-only stats translation is kvstore/server/stats_pb.py)."""

from __future__ import annotations

from kvstore.format import chunk
from kvstore.format.layout import Layout, layout_by_id
from kvstore.format.manifest import Manifest, Retention, unnamed_kind
from kvstore.format.turn_record import Append
from kvstore.v1 import kvstore_pb2 as pb


def retention_to_pb(r: Retention) -> pb.Retention:
    return pb.Retention(pinned=r.pinned, ttl_s=r.ttl_s or 0.0)


def retention_from_pb(r: pb.Retention) -> Retention:
    """0 is "never expires" (None); any other value is kept as sent, so that a save or touch refuses
    a negative or NaN one (``manifest.check_retention``) rather than store it as "never"."""
    return Retention(pinned=r.pinned, ttl_s=None if r.ttl_s == 0 else r.ttl_s)


def session_to_pb(m: Manifest) -> pb.Session:
    lay = layout_by_id(m.layout_id)
    return pb.Session(
        session_id=m.session_id, namespace=m.namespace, layout_id=m.layout_id,
        layout_name=lay.name if lay else "", token_count=m.token_count, chunk_tokens=m.chunk_tokens,
        chunk_keys=list(m.chunk_keys), tail=m.tail, last_token_ids=list(m.last_token_ids),
        created_at=m.created_at, updated_at=m.updated_at, retention=retention_to_pb(m.retention),
        metadata=dict(m.metadata), generation=m.generation,
    )


def session_from_pb(s: pb.Session, now: float | None = None) -> Manifest:
    """A manifest from the wire. With ``now`` (a commit), the daemon stamps the times and the store
    keeps the first created_at; without it (a client reading), the stored times are kept. Its
    ``generation``: the stored version's (an answer), or the version a commit replaces. Its kind: the
    wire has no field for it, engine pages travel as ``chunk_tokens`` 0 (a daemon checks it is its
    layout's kind)."""
    created, updated = (now, now) if now is not None else (s.created_at, s.updated_at)
    return Manifest(
        session_id=s.session_id, namespace=s.namespace, layout_id=bytes(s.layout_id),
        token_count=s.token_count, chunk_tokens=s.chunk_tokens, chunk_keys=tuple(bytes(k) for k in s.chunk_keys),
        tail=bytes(s.tail), last_token_ids=tuple(s.last_token_ids), created_at=created, updated_at=updated,
        retention=retention_from_pb(s.retention), metadata=dict(s.metadata), generation=s.generation,
        kind=unnamed_kind(s.chunk_tokens),
    )


def summary_to_pb(m: Manifest) -> pb.SessionSummary:
    lay = layout_by_id(m.layout_id)
    return pb.SessionSummary(namespace=m.namespace, session_id=m.session_id, layout_name=lay.name if lay else "",
                             token_count=m.token_count, chunks=len(m.chunk_keys), updated_at=m.updated_at,
                             retention=retention_to_pb(m.retention))


def layout_to_pb(lay: Layout, chunk_tokens: int) -> pb.LayoutInfo:
    """A layout with what requests need: its 16-byte id, and its geometry for building chunks."""
    return pb.LayoutInfo(
        name=lay.name, layout_id=lay.layout_id, bytes_per_token=float(lay.bytes_per_token), n_layers=lay.n_layers,
        window=lay.window, chunk_bytes=chunk.encoded_size(lay, chunk_tokens),
        caches=[pb.CacheInfo(name=c.name, layer=c.layer, m=c.m, channels=c.channels, format=str(c.fmt),
                             code_bytes=c.code_bytes, scale_bytes=c.scale_bytes) for c in lay.caches])


def append_to_pb(a: Append) -> pb.SessionAppend:
    return pb.SessionAppend(session_id=a.session_id, base=a.base, chunk_keys=list(a.chunk_keys),
                            token_count=a.token_count, tail=a.tail, last_token_ids=list(a.last_token_ids))


def append_from_pb(a: pb.SessionAppend, namespace: str, layout_id: bytes) -> Append:
    """An append from the wire, of the save header's namespace and layout."""
    return Append(namespace, a.session_id, layout_id, a.base, tuple(bytes(k) for k in a.chunk_keys), a.token_count,
                  bytes(a.tail), tuple(a.last_token_ids))
