"""FORMAT.md's worked examples, and an independent reader of a stored session.

The examples (between the ``example`` and ``turns-example`` markers of docs/FORMAT.md) are built by the
real writer: one small chunk dumped byte by byte with its fields decoded, and a session kept as a base
manifest plus turn records, written into an LMDB data directory and read back by the reader below, so
the doc's examples are what the code writes and reads. tests/format/test_format_reader.py fails when
the doc and this output differ.

The reader (``read_manifest``, ``read_turn_record``, ``apply_turns``, ``read_session``, ``read_chunk``,
``read_shared_session``) is written from FORMAT.md alone and imports nothing of kvstore: ``--check``
compares what it reads of a session with turn records with what kvstore's own reader
(``kvstore.format.turn_record.apply``) makes; tests/store/test_shared_turns.py reads shared sessions
from Redis with it.

    python docs/format_example.py            # rewrite the examples in docs/FORMAT.md
    python docs/format_example.py --check    # exit 1 if they are stale or the reader disagrees
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DOC = Path(__file__).resolve().parent / "FORMAT.md"
BEGIN, END = "<!-- example:begin (docs/format_example.py) -->", "<!-- example:end -->"
TURNS_BEGIN, TURNS_END = "<!-- turns-example:begin (docs/format_example.py) -->", "<!-- turns-example:end -->"
IDS = [9906, 1917]  # two tokens: one entry of each m=2 cache, two of each m=1 cache
NS = "demo"

# ---- an independent reader of a stored session (FORMAT.md sections 3 and 5 alone) --------------
# Nothing below imports kvstore: struct, json, xxhash, zstandard, lmdb and numpy only. tests/format checks
# that reading a session loads no kvstore module.

META_DB, CHUNKS_DB = b"meta", b"chunks"
MANIFEST_HEAD = struct.Struct("<4sHI")  # magic, version, meta_len
TURN_HEAD = struct.Struct("<4sHQQQIQdII")  # magic ... tail_len: 58 bytes


class FormatError(ValueError):
    """A manifest, turn record or record that is not what FORMAT.md describes (damage)."""


def read_manifest(blob: bytes) -> dict[str, Any]:
    """A manifest (section 3): its meta object, with ``tail`` (the trailing span's chunk, bytes) added."""
    if len(blob) < 22:
        raise FormatError(f"manifest truncated ({len(blob)} bytes)")
    magic, version, meta_len = MANIFEST_HEAD.unpack_from(blob, 0)
    if magic != b"KVMF" or version != 1:
        raise FormatError("not a version-1 manifest")
    if xxhash.xxh3_64_intdigest(blob[:-8]) != struct.unpack_from("<Q", blob, len(blob) - 8)[0]:
        raise FormatError("manifest checksum mismatch")
    if 10 + meta_len + 4 > len(blob) - 8:
        raise FormatError("meta_len runs past the checksum")
    (tail_len,) = struct.unpack_from("<I", blob, 10 + meta_len)
    if 10 + meta_len + 4 + tail_len + 8 != len(blob):
        raise FormatError("tail_len does not end at the checksum")
    meta = json.loads(blob[10 : 10 + meta_len].decode("utf-8"))
    if not isinstance(meta, dict):
        raise FormatError("meta is not a JSON object")
    meta.setdefault("generation", 0)
    meta["tail"] = bytes(blob[14 + meta_len : 14 + meta_len + tail_len])
    return meta


def read_turn_record(blob: bytes) -> dict[str, Any]:
    """A turn record (section 3, "Turns"), checked as the section says: length, magic and version,
    checksum (XXH3-64 of every byte before the last 8), then the lengths the header claims."""
    if len(blob) < TURN_HEAD.size + 8:
        raise FormatError(f"turn record truncated ({len(blob)} bytes)")
    magic, version, base, gen, first, n_keys, tokens, updated, n_ids, tail_len = TURN_HEAD.unpack_from(blob, 0)
    if magic != b"KVMT" or version != 1:
        raise FormatError("not a version-1 turn record")
    if xxhash.xxh3_64_intdigest(blob[:-8]) != struct.unpack_from("<Q", blob, len(blob) - 8)[0]:
        raise FormatError("turn record checksum mismatch")
    at = TURN_HEAD.size
    if at + 16 * n_keys + 4 * n_ids + tail_len + 8 != len(blob):
        raise FormatError("turn record lengths do not add up")
    keys = [blob[at + 16 * i : at + 16 * (i + 1)].hex() for i in range(n_keys)]
    at += 16 * n_keys
    ids = list(struct.unpack_from(f"<{n_ids}I", blob, at))
    at += 4 * n_ids
    return {"base": base, "generation": gen, "first_chunk": first, "chunk_keys": keys, "token_count": tokens,
            "updated_at": updated, "last_token_ids": ids, "tail": bytes(blob[at : at + tail_len])}


def _well_formed(s: dict[str, Any]) -> bool:
    """The counts a version must satisfy (section 3): a token chain's token_count is len(chunk_keys) x C + t
    with 0 <= t < C; engine pages have C = 0, no tail and no last ids."""
    c, n = s["chunk_tokens"], len(s["chunk_keys"])
    if s.get("kind") == "engine-pages" or (c == 0 and "kind" not in s):
        return c == 0 and not s["tail"] and not s["last_token_ids"]
    return c > 0 and 0 <= s["token_count"] - n * c < c


def apply_turns(base: dict[str, Any], records: Iterable[bytes]) -> tuple[dict[str, Any], int]:
    """The version a manifest (``read_manifest``) and its turn records (raw, in key order) make, and how
    many records it applied: each while it decodes and extends the version so far; the first that does
    not ends it. If the version they make breaks the manifest's counts, the base alone (none applied)."""
    s = dict(base, chunk_keys=list(base["chunk_keys"]))
    n = 0
    for blob in records:
        try:
            r = read_turn_record(blob)
        except FormatError:
            break
        if r["base"] != s["generation"] or r["first_chunk"] != len(s["chunk_keys"]) or \
                r["generation"] <= s["generation"]:
            break
        s["chunk_keys"] += r["chunk_keys"]
        for name in ("token_count", "tail", "last_token_ids", "generation", "updated_at"):
            s[name] = r[name]
        n += 1
    if n and not _well_formed(s):
        return dict(base), 0
    return s, n


def chunk_token_ids(blob: bytes) -> list[int]:
    """A chunk's token ids (section 2: token_count at offset 12, tokens_offset at 56)."""
    count, at = struct.unpack_from("<I", blob, 12)[0], struct.unpack_from("<I", blob, 56)[0]
    return list(struct.unpack_from(f"<{count}I", blob, at))


def turn_prefix(namespace: str, session_id: str) -> bytes:
    return f"t:{namespace}/{session_id}".encode("ascii") + b"\0"


def read_session(data_dir: str | Path, namespace: str, session_id: str) -> dict[str, Any] | None:
    """A session as a daemon's data directory holds it (section 5): ``m:<ns>/<sid>`` in the ``meta``
    database, then its turn records in key order. None if it has no manifest (turn records without a
    manifest are no session). The result's ``turn_records`` says how many records were applied."""
    with _env(data_dir) as env, env.begin() as txn:
        meta = env.open_db(META_DB, txn=txn, create=False)
        blob = txn.get(f"m:{namespace}/{session_id}".encode("ascii"), db=meta)
        if blob is None:
            return None
        prefix = turn_prefix(namespace, session_id)
        cur = txn.cursor(db=meta)
        records = []
        if cur.set_range(prefix):
            for key, value in cur:
                if not key.startswith(prefix):
                    break
                records.append(value)
        s, n = apply_turns(read_manifest(blob), records)
    s["turn_records"] = n
    return s


def read_shared_session(client: Any, prefix: str, namespace: str, session_id: str) -> dict[str, Any] | None:
    """A session as daemons sharing it through Redis keep it (section 3, "Shared sessions in Redis"): the
    base ``P#s{P/T}:m:S`` and the turns of the list ``P#s{P/T}:t:S``, read with ``client`` (any Redis
    client with ``get`` and ``lrange``; not atomic: read it while nobody writes). None if never published
    or deleted. The result's ``shared_generation`` is the latest version's; ``turn_records`` says how many
    turns were applied (all of them, unless the shared record is damaged)."""
    tag = f"{prefix}#s{{{prefix}/{namespace}}}".encode("ascii")
    base = client.get(tag + b":m:" + session_id.encode("ascii"))
    if base is None:
        return None
    gen, writer, manifest = bytes(base).split(b"\n", 2)
    if not manifest:
        return None
    turns, heads = [], []
    for entry in client.lrange(tag + b":t:" + session_id.encode("ascii"), 0, -1):
        g, _, _, record = bytes(entry).split(b"\n", 3)
        heads.append(int(g))
        turns.append(record)
    if heads != list(range(int(gen) + 1, int(gen) + 1 + len(heads))):
        raise FormatError("shared turns are not the generations after the base's")
    s, n = apply_turns(read_manifest(manifest), turns)
    s["turn_records"], s["shared_generation"] = n, int(gen) + len(heads)
    return s


def read_chunk(data_dir: str | Path, key: bytes) -> bytes | None:
    """The chunk stored under ``key`` in the ``chunks`` database (section 5, "Records"): flag 0, 1, 2 and
    3 records. Check it as section 2 says."""
    with _env(data_dir) as env, env.begin() as txn:
        rec = txn.get(key, db=env.open_db(CHUNKS_DB, txn=txn, create=False))
    if rec is None:
        return None
    flag, raw_len, prefix = struct.unpack_from("<BII", rec, 0)
    if flag == 0 and prefix == raw_len == len(rec) - 9:
        return bytes(rec[9:])
    if flag == 1 and prefix < raw_len and prefix <= len(rec) - 9:
        rest = _frame(rec[9 + prefix :], raw_len - prefix)
        if rest is not None:
            return bytes(rec[9 : 9 + prefix]) + rest
    if flag == 2:
        value = _chunk_record(rec, raw_len, prefix)
        if value is not None:
            return value
    if flag == 3 and prefix <= raw_len:
        value = _runs_record(rec, raw_len, prefix)
        if value is not None:
            return value
    raise FormatError(f"corrupt record (flag {flag})")


def _frame(data: bytes, size: int) -> bytes | None:
    """One zstd frame that must declare and decompress to exactly ``size`` bytes (None: it does not)."""
    try:
        if zstandard.frame_content_size(data) != size:  # checked before decompressing (section 5)
            return None
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(size, 1))
    except zstandard.ZstdError:
        return None
    return out if len(out) == size else None


def _chunk_record(rec: bytes, raw_len: int, h: int) -> bytes | None:
    """A flag 2 record's chunk (section 5, "Flag 2": the header and table raw, the codes' sign plane
    and magnitude stream, the transformed tail); None if invalid. The table says everything."""
    if len(rec) < 11:
        return None
    (f,) = struct.unpack_from("<H", rec, 9)
    at = 11 + 4 * f
    if len(rec) < at + h or h < 72:
        return None
    lens = struct.unpack_from(f"<{f}I", rec, 11)
    head = rec[at : at + h]
    at += h
    (header_bytes,) = struct.unpack_from("<H", head, 6)
    (t_ids,) = struct.unpack_from("<I", head, 12)
    ids_off, n_sec, s_off = struct.unpack_from("<I", head, 56)[0], struct.unpack_from("<H", head, 60)[0], \
        struct.unpack_from("<I", head, 64)[0]
    if head[:4] != b"KVCK" or header_bytes != h or not h <= s_off <= raw_len or len(head) < 72 + 16 * n_sec:
        return None
    secs = [dict(zip(("cache", "kind", "entries", "offset", "length"),
                     (*struct.unpack_from("<HB", head, 72 + 16 * i), *struct.unpack_from("<III", head, 76 + 16 * i))))
            for i in range(n_sec)]
    scale_len = {c["cache"]: c["length"] for c in secs if c["kind"] == 1}
    groups: dict[int, list[dict[str, int]]] = {}
    for c in secs:  # codes sections with entries, grouped by codes length / their cache's scales length
        if c["kind"] == 0 and c["entries"]:
            sl = scale_len.get(c["cache"], 0)
            groups.setdefault(c["length"] // sl if sl else 0, []).append(c)
    n_codes = s_off - h
    if f != (len(groups) or (1 if n_codes else 0)) or len(rec) < at + (n_codes + 3) // 4 + sum(lens):
        return None
    signs = np.frombuffer(rec, np.uint8, (n_codes + 3) // 4, at)
    at += len(signs)
    frames = []
    for n in lens:
        frames.append(rec[at : at + n])
        at += n
    # the magnitude stream: each group's codes sections in table order, then every byte in none
    order_parts = [np.arange(c["offset"] - h, c["offset"] - h + c["length"]) for g in groups.values() for c in g]
    covered = np.zeros(n_codes, bool)
    for part in order_parts:
        covered[part] = True
    order = np.concatenate([*order_parts, np.flatnonzero(~covered)]) if n_codes else np.zeros(0, np.int64)
    sizes = [sum(c["length"] for c in g) for g in groups.values()] or [0] * f
    if sizes:
        sizes[-1] += int((~covered).sum())
    stream = []
    for frame, size in zip(frames, sizes):
        got = _frame(frame, size)
        if got is None:
            return None
        stream.append(got)
    mags = np.empty(n_codes, np.uint8)
    mags[order] = np.frombuffer(b"".join(stream), np.uint8)
    bits = np.unpackbits(signs, bitorder="little")[: 2 * n_codes].reshape(-1, 2) if n_codes else np.zeros((0, 2))
    codes = (mags & 7) | ((mags & 0x38) << 1) | (bits[:, 0].astype(np.uint8) << 3) | (bits[:, 1].astype(np.uint8) << 7)
    # the tail: copied, then each scales section's residuals and bases undone, the ids' byte planes joined
    scales = [c for c in secs if c["kind"] == 1 and c["entries"]]
    widths = [c["length"] // c["entries"] for c in scales]
    tail_len = raw_len - s_off
    tail = _frame(rec[at:], tail_len + sum(widths))
    if tail is None:
        return None
    t = np.frombuffer(tail, np.uint8)
    out = np.frombuffer(bytes(head) + codes.tobytes() + tail[:tail_len], np.uint8).copy()
    base = tail_len
    for c, w in zip(scales, widths):
        n, o = c["entries"], c["offset"] - s_off
        res = t[o : o + w * n].reshape(w, n).T
        out[c["offset"] : c["offset"] + w * n] = ((res.astype(np.uint16) + t[base : base + w]) & 0xFF).ravel()
        base += w
    o = ids_off - s_off
    out[ids_off : ids_off + 4 * t_ids] = t[o : o + 4 * t_ids].reshape(4, t_ids).T.ravel()
    return out.tobytes()


def _runs_record(rec: bytes, raw_len: int, prefix: int) -> bytes | None:
    """A flag 3 record's value (section 5: the runs gathered into the frame, the rest raw); None if invalid."""
    if len(rec) < 11:
        return None
    (g,) = struct.unpack_from("<H", rec, 9)
    at = 11 + 16 * g
    if g == 0 or len(rec) < at:
        return None
    runs = [struct.unpack_from("<IIII", rec, 11 + 16 * i) for i in range(g)]
    end = gathered = 0
    for off, length, stride, count in runs:
        if length < 1 or count < 1 or stride < length or off < end:
            return None
        end = off + (count - 1) * stride + length
        gathered += length * count
    if end > prefix or len(rec) < at + prefix - gathered:
        return None
    raw = rec[at : at + prefix - gathered]
    want = gathered + raw_len - prefix
    packed = _frame(rec[at + prefix - gathered :], want)
    if packed is None:
        return None
    value = bytearray(raw_len)
    pos = src = cut = 0  # cut: bytes of the raw part used; src: of the frame's runs
    for off, length, stride, count in runs:
        for i in range(count):
            start = off + i * stride
            value[pos:start] = raw[cut : cut + start - pos]
            cut += start - pos
            value[start : start + length] = packed[src : src + length]
            src += length
            pos = start + length
    value[pos:prefix] = raw[cut:]
    value[prefix:] = packed[gathered:]
    return bytes(value)


def _env(data_dir: str | Path) -> lmdb.Environment:
    # lock=True: a running daemon's directory is read consistently, beside its writers
    return lmdb.open(str(Path(data_dir) / "ssd"), readonly=True, max_dbs=8, lock=True)


# ---- the examples, built by kvstore's writer ---------------------------------------------------

def _layout() -> Any:
    from kvstore.format.layout import get_layout
    return get_layout("tiny-8")


def _chunk(ids: list[int], key: bytes, start: int) -> bytes:
    """A tiny-8 chunk of ``ids`` (a ramp of values per entry), by kvstore's writer."""
    import torch

    from kvstore.format import chunk, quant
    from kvstore.format.layout import EntryFormat
    lay = _layout()
    ents = {}
    for i, c in enumerate(lay.caches):
        n = c.entries_for(len(ids))
        j = torch.arange(c.channels, dtype=torch.float32)
        x = torch.stack([((j % 13) - 6) * 0.25 * (e + 1) * (i + 1) for e in range(n)]) if n else \
            torch.zeros(0, c.channels)  # a ramp per entry
        q = quant.quantize_main(x) if c.fmt is EntryFormat.FP4_E4M3_16 else quant.quantize_indexer(x)
        ents[c.name] = chunk.Entries.of(*q)
    return chunk.encode(lay, key=key, start=start, token_ids=ids, entries=ents)


def example_chunk() -> bytes:
    from kvstore.format.keys import ROOT, chunk_key
    return _chunk(IDS, chunk_key(_layout().layout_id, NS, ROOT, IDS), 0)


def render() -> str:
    import torch

    from kvstore.format import chunk, quant
    LAYOUT = _layout()
    blob = example_chunk()
    h = chunk.read_header(blob)
    regions: list[tuple[int, int, str]] = [(0, 72, "header"), (72, 72 + 16 * h.n_sections, "section table")]
    rows = []
    for i, (ci, kind, n, off, length) in enumerate(chunk._sections(blob, h)):
        c = LAYOUT.caches[ci]
        what = f"{c.name} {'codes' if kind == 0 else 'scales'}"
        rows.append(f"| {i} | {ci} ({c.name}) | {kind} | {n} | {off} | {length} |")
        if length:
            regions.append((off, off + length, what))
    regions += [(h.tokens_offset, h.tokens_offset + 4 * h.token_count, "token ids"),
                (h.total_bytes - 8, h.total_bytes, "checksum")]
    dump = []
    for at in range(0, len(blob), 16):
        line = blob[at : at + 16]
        names = sorted({name for a, b, name in regions if a < at + 16 and b > at})
        dump.append(f"{at:04x}  {line[:8].hex(' '):<23}  {line[8:].hex(' '):<23}  {', '.join(names) or '(padding)'}")
    main = chunk.decode(blob, LAYOUT).entries["main.L2"]
    b0, s0 = int(main.codes[0, 0]), int(main.scales[0, 0])
    vals = quant.dequantize_main(torch.from_numpy(main.codes[:1].copy()), torch.from_numpy(main.scales[:1].copy()),
                                 torch.float32)[0, :2].tolist()
    return "\n".join([
        BEGIN,
        f"Layout `tiny-8` (`{LAYOUT.layout_hex}`), namespace `{NS}`, the first chunk of a sequence "
        f"(parent = 16 zero bytes), {len(IDS)} tokens `{IDS}` (a store would use C = 256; two keep the dump "
        f"short). {h.total_bytes} bytes: header_bytes = pad16(72 + 16 x {h.n_sections}) = {h.header_bytes}, "
        f"compressible_offset {h.compressible_offset}, tokens_offset {h.tokens_offset}, key `{h.key.hex()}`, "
        f"checksum `{blob[-8:].hex()}` (u64 {int.from_bytes(blob[-8:], 'little'):#018x}).",
        "",
        "| entry | cache_index | kind | entries | offset | length |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Dequantizing by hand: `main.L2` entry 0, codes byte 0 = 0x{b0:02x}: channel 0 is code "
        f"{b0 & 15} (low nibble), channel 1 code {b0 >> 4}; scale byte 0 = 0x{s0:02x} (E4M3: exponent "
        f"{(s0 >> 3) & 15}, mantissa {s0 & 7}: 2^({(s0 >> 3) & 15} - 7) x (1 + {s0 & 7}/8) = "
        f"{2.0 ** (((s0 >> 3) & 15) - 7) * (1 + (s0 & 7) / 8)!r}); values e2m1(code) x scale = {vals[0]!r} and "
        f"{vals[1]!r}.",
        "",
        "```",
        *dump,
        "```",
        END,
    ])


TURN_IDS = [9906, 1917, 1115, 374, 264, 1296, 13]  # a base of 3 tokens, then two turns of 2 tokens
TURN_C = 2  # chunk_tokens (a store would use 256: 2 keep the example short)
TURN_SID = "chat"
GEN = 1_764_000_000_000_000  # the base's stamp; each turn's is larger
TIME = 1_764_000_000.0


def turn_example(data_dir: Path) -> tuple[Any, list[Any]]:
    """A session written as a base manifest (3 tokens) plus turn records into ``data_dir``, as the store
    lays it out (section 5): records 0 and 1 extend it (5, then 7 tokens); record 2 extends the base
    again, so it is not an extension of the version read so far and is ignored. Returns the base and
    the records."""
    from kvstore.format.keys import ROOT, chunk_key
    from kvstore.format.manifest import Manifest
    from kvstore.format.turn_record import TurnRecord, turn_key
    lay = _layout()
    keys: list[bytes] = []
    for j in range(len(TURN_IDS) // TURN_C):
        keys.append(chunk_key(lay.layout_id, NS, keys[-1] if keys else ROOT, TURN_IDS[j * TURN_C : (j + 1) * TURN_C]))

    def tail(n: int) -> bytes:
        start = n // TURN_C * TURN_C
        return _chunk(TURN_IDS[start:n], bytes(16), start)

    base = Manifest(TURN_SID, NS, lay.layout_id, 3, TURN_C, tuple(keys[:1]), tail(3), tuple(TURN_IDS[:3]), TIME,
                    TIME, generation=GEN)
    recs = [TurnRecord(GEN, GEN + 1, 1, tuple(keys[1:2]), 5, tail(5), tuple(TURN_IDS[:5]), TIME + 1.5),
            TurnRecord(GEN + 1, GEN + 2, 2, tuple(keys[2:3]), 7, tail(7), tuple(TURN_IDS[:7]), TIME + 3.0),
            TurnRecord(GEN, GEN + 3, 1, tuple(keys[1:2]), 5, tail(5), tuple(TURN_IDS[:5]), TIME + 4.5)]
    env = lmdb.open(str(data_dir / "ssd"), max_dbs=8)
    with env.begin(write=True) as txn:
        env.open_db(CHUNKS_DB, txn=txn)
        meta = env.open_db(META_DB, txn=txn)
        txn.put(base.key, base.encode(), db=meta)
        for seq, r in enumerate(recs):
            txn.put(turn_key(NS, TURN_SID, seq), r.encode(), db=meta)
    env.close()
    return base, recs


def check_turns(got: dict[str, Any] | None, base: Any, recs: list[Any]) -> None:
    """What the independent reader read is what kvstore's reader makes of the same records."""
    from kvstore.format.turn_record import apply
    want, n = apply(base, recs)
    assert n == 2, n
    assert got is not None and got["turn_records"] == n, got
    mine = {k: got[k] for k in ("chunk_keys", "token_count", "tail", "last_token_ids", "generation", "updated_at",
                                "created_at", "chunk_tokens", "layout_id")}
    theirs = {"chunk_keys": [k.hex() for k in want.chunk_keys], "token_count": want.token_count, "tail": want.tail,
              "last_token_ids": list(want.last_token_ids), "generation": want.generation,
              "updated_at": want.updated_at, "created_at": want.created_at, "chunk_tokens": want.chunk_tokens,
              "layout_id": want.layout_id.hex()}
    if mine != theirs:
        raise AssertionError(f"the independent reader read {mine}, kvstore's reader {theirs}")


def render_turns() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        base, recs = turn_example(Path(tmp))
        got = read_session(tmp, NS, TURN_SID)
        check_turns(got, base, recs)
    assert got is not None
    blob = recs[0].encode()
    r = read_turn_record(blob)
    n_keys, n_ids, tail_len = len(r["chunk_keys"]), len(r["last_token_ids"]), len(r["tail"])
    fields = [("magic", 4, "bytes", "`KVMT`"), ("version", 2, "u16", "1"), ("base", 8, "u64", str(r["base"])),
              ("generation", 8, "u64", str(r["generation"])), ("first_chunk", 8, "u64", str(r["first_chunk"])),
              ("n_keys", 4, "u32", str(n_keys)), ("token_count", 8, "u64", str(r["token_count"])),
              ("updated_at", 8, "f64", repr(r["updated_at"])), ("n_ids", 4, "u32", str(n_ids)),
              ("tail_len", 4, "u32", str(tail_len)),
              ("chunk_keys", 16 * n_keys, "16 bytes each", ", ".join(f"`{k}`" for k in r["chunk_keys"])),
              ("last_token_ids", 4 * n_ids, "u32 each", f"`{r['last_token_ids']}`"),
              ("tail", tail_len, "a chunk", f"{tail_len} bytes: {r['token_count'] % TURN_C} token, start "
                                            f"{r['token_count'] // TURN_C * TURN_C}, key all zeros"),
              ("checksum", 8, "u64", f"`{blob[-8:].hex()}` = XXH3_64bits(bytes [0, {len(blob) - 8}))")]
    rows, at = [], 0
    for name, size, typ, value in fields:
        rows.append(f"| {at} | {size} | {typ} | {name} | {value} |")
        at += size
    assert at == len(blob)
    head = 58 + 16 * n_keys + 4 * n_ids
    lines = [blob[a : min(a + 16, head)] for a in range(0, head, 16)]
    dump = [f"{16 * i:04x}  {line[:8].hex(' '):<23}  {line[8:].hex(' ')}".rstrip() for i, line in enumerate(lines)]
    key0 = turn_prefix(NS, TURN_SID) + (0).to_bytes(4, "big")
    return "\n".join([
        TURNS_BEGIN,
        f"Session `{NS}/{TURN_SID}` of layout `tiny-8`, C = {TURN_C} (a store would use 256), tokens "
        f"`{TURN_IDS}`. The base `m:{NS}/{TURN_SID}` holds the first 3 (1 chunk, a 1-token tail, generation "
        f"{GEN}); turn record 0 (key `{key0.hex(' ')}`: `t:{NS}/{TURN_SID}`, 0x00, seq 0 big-endian) adds "
        f"chunk 1 (5 tokens), record 1 adds chunk 2 (7 tokens), and record 2 names base {GEN} again, so it "
        f"does not extend the version read so far (generation {GEN + 2}, 3 chunks) and is ignored. Record 0, "
        f"{len(blob)} bytes:",
        "",
        "| offset | size | type | field | value |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Its first {head} bytes (head, key, ids; the tail and checksum follow):",
        "",
        "```",
        *dump,
        "```",
        "",
        f"What `read_session` reads (records applied: {got['turn_records']}): token_count "
        f"{got['token_count']}, chunk_keys `{got['chunk_keys']}`, last_token_ids `{got['last_token_ids']}`, "
        f"generation {got['generation']}, updated_at {got['updated_at']!r}, created_at {got['created_at']!r} "
        f"(the base's), a tail of {len(got['tail'])} bytes holding token ids `{chunk_token_ids(got['tail'])}`.",
        TURNS_END,
    ])


def main() -> None:
    doc = DOC.read_text()
    new = doc
    for begin, end, text in ((BEGIN, END, render()), (TURNS_BEGIN, TURNS_END, render_turns())):
        start, stop = new.index(begin), new.index(end) + len(end)
        new = new[:start] + text + new[stop:]
    if "--check" in sys.argv:
        sys.exit(0 if new == doc else 1)
    DOC.write_text(new)


if __name__ == "__main__":
    main()
