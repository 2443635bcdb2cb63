"""A one-time step of an ssd tier's open: data dirs of the first format kept meta records (session
manifests) among the values, framed like them; the tier moves them to the meta sub-database in one
LMDB transaction (all of them or none, so an interrupted open just moves them again). Once moved
there is nothing left to find: every later open costs one cursor seek.

The tier does not know what a manifest is: the caller says what an old meta record looks like
(``LegacyMeta``: the key prefix they were kept under, and a test of a key and its decoded value).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import lmdb

from kvstore.tiers.base import Stored, TierError

log = logging.getLogger(__name__)


class LegacyMeta(NamedTuple):
    """How to recognise a meta record the first format kept among the values."""

    prefix: bytes  # every such record's key starts with it
    recognise: Callable[[bytes, Stored], bool]  # (key, decoded value) -> whether it is one


def find_legacy_meta(env: lmdb.Environment, values: lmdb._Database, decode: Callable[[bytes, memoryview], Stored],
                     legacy: LegacyMeta, path: str) -> list[tuple[bytes, bytes]]:
    """The records among ``values`` that ``legacy`` recognises, decoded: (key, value), for the tier
    to move in one transaction of its own writer. A record that cannot be decoded (damaged) is
    logged and left where it is."""
    found: list[tuple[bytes, bytes]] = []
    with env.begin(db=values, buffers=True) as txn:
        cursor = txn.cursor()
        if not cursor.set_range(legacy.prefix):  # keys are sorted: the candidates are one run
            return found
        for raw_key, record in cursor:
            key = bytes(raw_key)
            if not key.startswith(legacy.prefix):
                break
            try:
                value = decode(key, record)
            except TierError as e:  # CorruptValue: a damaged old record stays where it is
                log.error("ssd tier %s: cannot read old-format record %r: %s", path, key, e)
                continue
            if legacy.recognise(key, value):
                found.append((key, bytes(value)))
    return found
