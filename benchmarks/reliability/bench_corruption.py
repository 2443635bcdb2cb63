"""Corruption injection: bit flips and truncations in the ssd tier's LMDB file and in Redis values.

    .venv/bin/python benchmarks/reliability/bench_corruption.py --injections 1000 --seed 0

(``tests/reliability/test_corruption.py`` runs the same harness with a few dozen injections.) A store (host +
ssd, zstd level 1, tiny-16 chunks of 32 tokens, 6 sessions, two sharing a prefix) is built once; each
LMDB injection damages a fresh copy of its directory while the store is down, then a forked child
opens it and loads every session, so a crash is counted, not suffered. Where the damage lands:

- value: a byte of a chunk record (LMDB overflow pages: most of the file);
- leaf / branch: a used byte of a B-tree page (page header, node offsets, keys, node headers);
- meta: a byte of the MDB_meta structure of meta page 0 or 1 (the rest of those pages is unused);
- truncate: the file cut at a random length below its used size;
- redis-flip / redis-truncate: a chunk's value in Redis (the only copy: the session was evicted
  there), one bit flipped or the value cut short.

Outcomes, per injection: ``detected`` (open refused naming the file, or the file was repaired at
open, or a copy failed verification, a tier reported an error, a manifest did not decode, or a
referenced chunk was found missing at open: counted, and what was served is exact),
``no effect`` (every session loads exactly and nothing was reported: the byte was unused),
``served corrupt`` (a byte that differs from what was saved reached a caller: must be 0),
``undetected loss`` (something is missing and nothing said so: must be 0), ``crash`` (the child
died: must be 0). Writes ``benchmarks/results/corruption.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT_DIR))

from benchmarks.common import results_dir  # noqa: E402
from kvstore.errors import KvstoreError  # noqa: E402
from kvstore.format.layout import get_layout  # noqa: E402
from kvstore.store import SessionStore, StoreConfig, open_store  # noqa: E402
from kvstore.tiers import TierError  # noqa: E402
from tests.helpers.store import Session, build_session, save, store_config, token_stream  # noqa: E402

RESULT = results_dir(sys.argv, os.environ) / "corruption.json"  # benchmarks/results/ only with --write
LMDB_KINDS = ("value", "leaf", "branch", "meta", "truncate")
REDIS_KINDS = ("redis-flip", "redis-truncate")
OUTCOMES = ("detected", "no effect", "served corrupt", "undetected loss", "crash")
REFUSED = "of detected: open refused"  # counted beside the outcomes: the daemon would not start
LAYOUT = get_layout("tiny-16")
CT = 32
_META_BYTES = 16 + 136  # page header + MDB_meta (64-bit LMDB 0.9)
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08


def sessions_to_save() -> list[Session]:
    """Six sessions of 25 chunks, two sharing a 5-chunk prefix: 145 unique chunks of ~7 KB (each
    in its own LMDB overflow pages), enough keys for the B-tree to have branch pages."""
    shared = token_stream(1, 5 * CT)
    out = []
    for i in range(6):
        ids = token_stream(10 + i, 25 * CT + 17)
        if i < 2:
            ids[: 5 * CT] = shared
        out.append(build_session("ns", f"s{i}", ids, layout=LAYOUT, chunk_tokens=CT))
    return out


def config(root: Path, redis_url: str | None = None) -> StoreConfig:
    # Without promotion, a read leaves Redis the only holder: each injection hits the only copy.
    return store_config(root, zstd_level=1, chunk_tokens=CT, redis_url=redis_url, redis_namespace="corrupt",
                        promote_on_read=redis_url is None)


# -- checking a store against what was saved --------------------------------------------------------
def check(ss: SessionStore, saved: list[Session]) -> dict[str, int]:
    """Load every session; count what was served wrong, what is missing, and what was reported."""
    served_corrupt = missing = 0
    for s in saved:
        try:
            m = ss.get(s.namespace, s.session_id)
        except KvstoreError:
            missing += 1
            continue
        if m.chunk_keys != s.keys or m.tail != s.tail:
            served_corrupt += 1
        want = dict(zip(s.keys, s.blobs))
        with ss.read(s.namespace, m.chunk_keys) as got:
            for key, blob in zip(m.chunk_keys, got):
                if blob is None:
                    missing += 1
                elif bytes(blob) != want.get(key):
                    served_corrupt += 1
    reported = sum(c.verify_failures + c.errors for c in ss.store.counters.values())
    reported += ss.damage.manifests + ss.damage.missing_chunks  # (a repair at open counts as a tier error)
    return {"served_corrupt": served_corrupt, "missing": missing, "reported": reported, "refused": 0}


def check_dir(root: Path, saved: list[Session]) -> dict[str, int]:
    try:
        ss = open_store(config(root))
    except (TierError, KvstoreError) as e:
        return {"served_corrupt": 0, "missing": 0, "reported": 0, "refused": 1, "error": str(e)}  # type: ignore[dict-item]
    try:
        return check(ss, saved)
    finally:
        ss.store.close()


def classify(result: dict[str, int] | None) -> str:
    if result is None:
        return "crash"
    if result["served_corrupt"]:
        return "served corrupt"
    if result["refused"] or result["reported"]:
        return "detected"
    return "undetected loss" if result["missing"] else "no effect"


def in_child(fn: Callable[[], dict[str, int]]) -> dict[str, int] | None:
    """Run ``fn`` in a forked child; None if the child died (a signal, or no answer)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            out = json.dumps(fn()).encode()
        except BaseException as e:  # an exception is an answer too: the parent reports it as a crash
            out = json.dumps({"exception": repr(e)}).encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or not data:
        return None
    out = json.loads(data)
    return None if "exception" in out else out


# -- where to damage the LMDB file ---------------------------------------------------------------------
def page_regions(data: bytes, psize: int = 4096) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of the used file by kind: value (overflow data), leaf, branch, meta."""
    regions: dict[str, list[tuple[int, int]]] = {k: [] for k in ("value", "leaf", "branch", "meta")}
    (last_pg,) = max((struct.unpack_from("<QQ", data, p * psize + 16 + 24 + 96) for p in (0, 1)),
                     key=lambda t: t[1])[:1]
    p = 0
    while p <= last_pg:
        base = p * psize
        flags = struct.unpack_from("<H", data, base + 10)[0]
        if flags & _P_META:
            regions["meta"].append((base, base + _META_BYTES))
        elif flags & _P_OVERFLOW:
            n = max(1, struct.unpack_from("<I", data, base + 12)[0])
            regions["value"].append((base + 16, min(base + n * psize, len(data))))
            p += n
            continue
        elif flags & (_P_LEAF | _P_BRANCH):  # the used parts: header + node offsets, and the nodes
            lower, upper = struct.unpack_from("<HH", data, base + 12)
            kind = "leaf" if flags & _P_LEAF else "branch"
            regions[kind] += [(base, base + min(lower, psize)), (base + min(upper, psize), base + psize)]
        p += 1
    return regions


def pick(ranges: list[tuple[int, int]], rng: random.Random) -> int:
    weights = [b - a for a, b in ranges]
    a, b = rng.choices(ranges, weights=weights)[0]
    return rng.randrange(a, b)


def damage_lmdb(path: Path, kind: str, rng: random.Random) -> str:
    data_file = path / "ssd" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    if kind == "truncate":
        used = max(r[1] for rs in page_regions(bytes(data)).values() for r in rs)
        cut = rng.randrange(0, used)
        data_file.write_bytes(bytes(data[:cut]))
        return f"cut at {cut} of {used}"
    regions = page_regions(bytes(data))[kind]
    if not regions:
        return "none"
    off, bit = pick(regions, rng), rng.randrange(8)
    data[off] ^= 1 << bit
    data_file.write_bytes(bytes(data))
    return f"bit {bit} of byte {off}"


# -- runs -----------------------------------------------------------------------------------------------
@dataclass
class Tally:
    counts: dict[str, Counter[str]]

    def add(self, kind: str, outcome: str) -> None:
        self.counts.setdefault(kind, Counter())[outcome] += 1

    def rows(self) -> list[list[object]]:
        out = []
        for kind, c in sorted(self.counts.items()):
            out.append([kind, sum(c[o] for o in OUTCOMES), *[c[o] for o in (*OUTCOMES, REFUSED)]])
        total = Counter[str]()
        for c in self.counts.values():
            total.update(c)
        out.append(["all", sum(total[o] for o in OUTCOMES), *[total[o] for o in (*OUTCOMES, REFUSED)]])
        return out


def run_lmdb(n: int, seed: int, work: Path, tally: Tally) -> None:
    saved = sessions_to_save()
    pristine = work / "pristine"
    ss = open_store(config(pristine))
    for s in saved:
        save(ss, s)
    ss.store.close()
    rng = random.Random(seed)
    for i in range(n):
        kind = LMDB_KINDS[i % len(LMDB_KINDS)]
        case = work / f"case{i}"
        shutil.copytree(pristine, case)
        damage_lmdb(case, kind, rng)
        result = in_child(lambda case=case: check_dir(case, saved))  # type: ignore[misc]
        tally.add(kind, classify(result))
        if result is not None and result["refused"]:
            tally.add(kind, REFUSED)
        shutil.rmtree(case)


def run_redis(n: int, seed: int, work: Path, redis_url: str, tally: Tally) -> None:
    import redis

    saved = sessions_to_save()
    ss = open_store(config(work / "redis-store", redis_url))
    client = redis.Redis.from_url(redis_url)
    try:
        for s in saved:
            save(ss, s)
            ss.evict(s.namespace, s.session_id, "redis")
            # an eviction keeps the durable copy; drop it so Redis holds the only one (as for chunks a
            # daemon sharing this Redis saved): every injection then hits the copy that is served
            ss.store.tiers[ss.store.durable].delete_many(s.keys)
        blobs = {k: b for s in saved for k, b in zip(s.keys, s.blobs)}
        rng = random.Random(seed)
        for i in range(n):
            kind = REDIS_KINDS[i % len(REDIS_KINDS)]
            key = rng.choice(sorted(blobs))
            rkey = b"corrupt:" + key
            value = bytearray(blobs[key])
            if kind == "redis-flip":
                value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)
            else:
                value = value[: rng.randrange(len(value))]
            client.set(rkey, bytes(value))
            before = [c.verify_failures for c in ss.store.counters.values()]
            result = check(ss, saved)
            result["reported"] = sum(c.verify_failures for c in ss.store.counters.values()) - sum(before)
            tally.add(kind, classify(result))
            client.set(rkey, blobs[key])  # restore the damaged (and dropped) copy
    finally:
        ss.store.close()
        client.close()


def run(n: int, seed: int, redis_url: str | None) -> Tally:
    tally = Tally({})
    with tempfile.TemporaryDirectory(prefix="kvstore-corruption-") as tmp:
        n_redis = n // 4 if redis_url else 0
        run_lmdb(n - n_redis, seed, Path(tmp), tally)
        if redis_url:
            run_redis(n_redis, seed, Path(tmp), redis_url, tally)
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--injections", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis injections")
    args = ap.parse_args()
    server = None
    redis_url = None
    if not args.no_redis and shutil.which("redis-server"):
        from conftest import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="kvstore-corruption-redis-")))
        server.start()
        redis_url = server.url
    try:
        tally = run(args.injections, args.seed, redis_url)
    finally:
        if server is not None:
            server.stop()
    header = ["where", "injected", *OUTCOMES, REFUSED]
    rows = tally.rows()
    print(" | ".join(f"{h:>15}" for h in header))
    for r in rows:
        print(" | ".join(f"{c!s:>15}" for c in r))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"command": "python benchmarks/reliability/bench_corruption.py "
                                             f"--injections {args.injections} --seed {args.seed}"
                                             + (" --no-redis" if args.no_redis else ""),
                                  "header": header, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
