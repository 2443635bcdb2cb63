"""A value as a tier stores it: a chunk (``chunk.py``) or an engine page blob (``page.py``), each
named by its own magic. What a read without an index entry can check of it (a write-back flush, a
copy published to a shared tier), and where its compressible bytes start (the ssd tier's codec)."""

from __future__ import annotations

from kvstore.format import chunk, page


def is_valid_blob(key: bytes, blob: bytes | memoryview) -> bool:
    """A stored value (chunk or page blob) is served only if its checksum holds and it claims ``key``."""
    try:
        if page.is_page(blob):
            h = page.read_header(blob)
            page.verify_checksum(blob)
            return h.key == key
        header = chunk.read_header(blob)
        chunk.verify_checksum(blob)
    except (chunk.ChunkError, page.PageError):
        return False
    return header.key == key


def compressible_offset(blob: bytes | memoryview) -> int:
    """Where a stored value's compressible tail starts (chunk or page blob); 0 for anything else."""
    return page.compressible_offset(blob) if page.is_page(blob) else chunk.compressible_offset(blob)
