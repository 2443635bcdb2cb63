"""Where the redis tier keeps each record: the key layout, for one server and for a Redis Cluster.

A Redis Cluster runs a script or a transaction only on keys of one hash slot, and a key's slot is
that of its hash tag (the text between its first ``{`` and the next ``}``) when it has one. The
layout is chosen so that nothing ever needs two slots at once:

- a value and the usage counters that account for it share a slot: values fall into 256 buckets
  by their key's first byte (chunk keys are hashes, so buckets are even), each bucket with its own
  usage hash: ``P:{b7}<key>`` is counted in ``P#usage{b7}``, and the put script touches both;
- a tenant's session records share a slot: ``P#s{P/<tenant>}:...`` (its generations, its
  base manifests, their turn lists, its change counter), so a compare-and-set of one session's
  version (a base written whole or a turn appended) is one script on one slot;
- everything else is one key per command.

A single server uses the same session records; its values keep the layout of earlier versions
(``P:<key>``, one ``P#usage`` hash), so data written before stays readable. ``P`` is the tier's
namespace. No value key can collide with a usage, meta or session key: those contain ``#``
right after ``P``, values ``:``.
"""

from __future__ import annotations

BUCKETS = 256


class RedisKeys:
    """The key of every record of one tier namespace (``tagged``: the Redis Cluster layout)."""

    def __init__(self, namespace: str, tagged: bool) -> None:
        self.namespace = namespace
        self.tagged = tagged
        self._values = f"{namespace}:".encode()
        self._meta = f"{namespace}#meta:".encode()

    # -- values and their accounting ------------------------------------------------------------
    def _bucket(self, key: bytes) -> bytes:
        return b"{%02x}" % key[0]

    def value(self, key: bytes) -> bytes:
        return self._values + (self._bucket(key) + key if self.tagged else key)

    def usage(self, key: bytes) -> bytes:
        """The usage hash that counts ``key``'s value (same slot as the value)."""
        base = f"{self.namespace}#usage".encode()
        return base + self._bucket(key) if self.tagged else base

    def usage_hashes(self) -> list[bytes]:
        """Every usage hash: their sum is the tier's usage."""
        return [self.usage(bytes([b])) for b in range(BUCKETS)] if self.tagged else [self.usage(b"\0")]

    def value_pattern(self) -> bytes:
        """SCAN match for every value key (the namespace has no glob characters)."""
        return self._values + b"*"

    def key_of_value(self, rkey: bytes) -> bytes:
        """The tier key a value key stores (inverse of ``value``)."""
        return bytes(rkey)[len(self._values) + (4 if self.tagged else 0):]

    # -- meta records ---------------------------------------------------------------------------
    def meta(self, key: bytes) -> bytes:
        return self._meta + key

    def meta_pattern(self) -> bytes:
        return self._meta + b"*"

    def key_of_meta(self, rkey: bytes) -> bytes:
        return bytes(rkey)[len(self._meta):]

    # -- shared session records: one slot per tenant --------------------------------------------
    def _tenant(self, tenant: str) -> bytes:
        return f"{self.namespace}#s{{{self.namespace}/{tenant}}}".encode()

    def generations(self, tenant: str) -> bytes:
        """Hash: session id -> generation of its latest version (kept after a delete: never reused)."""
        return self._tenant(tenant) + b":gen"

    def record(self, tenant: str, session_id: str) -> bytes:
        """String: the base version's generation and writer, each followed by a newline, then its
        manifest (nothing after the writer: deleted)."""
        return self._tenant(tenant) + b":m:" + session_id.encode()

    def turns(self, tenant: str, session_id: str) -> bytes:
        """List: the turns appended to the base since it was written, oldest first (docs/FORMAT.md,
        "Shared sessions in Redis")."""
        return self._tenant(tenant) + b":t:" + session_id.encode()

    def changes(self, tenant: str) -> bytes:
        """Counter bumped by every change of the tenant's sessions: a reader with the same value
        has nothing to catch up on."""
        return self._tenant(tenant) + b":changes"

    def tenants(self) -> bytes:
        """Set of the tenants that ever published a session."""
        return f"{self.namespace}#tenants".encode()
