"""Two tenants on one daemon: the quiet tenant's resume time and the tier it hits, alone, beside a
noisy tenant saving and prefetching in a loop, with and without per-namespace quotas.

A real daemon (real port, real LMDB) with a small host tier. The quiet tenant saves one session
and resumes it (LoadSession) every round; between rounds the noisy tenant saves a fresh session
and prefetches its last few. Reported per scenario: the quiet resume's median time, the share of
its chunks the host tier held at each resume, and whether (and when) the noisy tenant was refused.

    python -m benchmarks.store.bench_quotas [--write]     # writes benchmarks/results/quotas.{md,json}
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import git_state, machine, markdown_table, write_result
from kvstore.client import Client
from kvstore.errors import ResourceExhausted
from tests.helpers.daemon import make_session, running_daemon, save_session

HOST_BYTES = 16 << 20
QUIET_TOKENS, NOISY_TOKENS = 16_000, 8_000  # tiny-16: ~3.8 MB and ~1.9 MB per session
ROUNDS = 40
QUOTAS = f"""
[quotas.quiet]
host_bytes = {6 << 20}

[quotas.noisy]
host_bytes = {8 << 20}
ssd_bytes = {48 << 20}
"""
TOKENS = '[tokens]\n"tok-admin" = ["*"]\n"tok-quiet" = ["quiet"]\n"tok-noisy" = ["noisy"]\n'


def scenario(root: Path, noisy: bool, quotas: bool) -> dict[str, Any]:
    tokens = root / "tokens.toml"
    tokens.write_text(TOKENS + (QUOTAS if quotas else ""))
    out: dict[str, Any] = {"noisy": noisy, "quotas": quotas}
    with running_daemon(root / "data", "--tokens-file", str(tokens), "--host-capacity-bytes", str(HOST_BYTES)) as d, \
            Client(address=d.address, token="tok-quiet", shared_memory=False, timeout_s=120) as q, \
            Client(address=d.address, token="tok-noisy", shared_memory=False, timeout_s=120) as n, \
            Client(address=d.address, token="tok-admin", shared_memory=False, timeout_s=120) as admin:
        s = make_session(namespace="quiet", session_id="q", tokens=QUIET_TOKENS, seed=1)
        save_session(q, s)
        chunks = len(s.blobs)
        times, host, refused_at, saved = [], [], None, 0
        for r in range(ROUNDS):
            if noisy and refused_at is None:
                for k in range(2):
                    try:
                        save_session(n, make_session(namespace="noisy", session_id=f"n{r}-{k}", tokens=NOISY_TOKENS,
                                                     seed=1000 + 2 * r + k))
                        saved += 1
                    except ResourceExhausted:
                        refused_at = saved
                        break
                for j in range(max(0, saved - 3), saved):
                    n.prefetch_session("noisy", f"n{j // 2}-{j % 2}")
            while admin.stats().prefetch.pending:
                time.sleep(0.01)
            host.append(admin.get_session("quiet", "q")[1].get("host", 0) / chunks)
            t0 = time.perf_counter()
            q.load_session("quiet", "q")
            times.append(time.perf_counter() - t0)
        usage = {u.namespace: u for u in admin.stats().namespaces}
        out.update(resume_ms=statistics.median(times) * 1e3, resume_p90_ms=sorted(times)[int(0.9 * len(times))] * 1e3,
                   host_hit=statistics.mean(host), host_hit_min=min(host), noisy_sessions_saved=saved,
                   noisy_refused_after=refused_at,
                   noisy_ssd_bytes=usage["noisy"].ssd_bytes if "noisy" in usage else 0)
    return out


def main() -> None:
    rows = []
    for noisy, quotas in ((False, False), (True, False), (True, True)):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(scenario(Path(tmp), noisy, quotas))
            print(rows[-1], flush=True)
    table = markdown_table(
        ["scenario", "quiet resume median (ms)", "p90 (ms)", "quiet chunks in host (mean / min)",
         "noisy sessions saved", "noisy refused (RESOURCE_EXHAUSTED)", "noisy ssd bytes"],
        [[("quiet alone" if not r["noisy"] else "with noisy tenant") + (", quotas" if r["quotas"] else ", no quotas"),
          f"{r['resume_ms']:.1f}", f"{r['resume_p90_ms']:.1f}", f"{r['host_hit']:.0%} / {r['host_hit_min']:.0%}",
          r["noisy_sessions_saved"], "no" if r["noisy_refused_after"] is None else f"after {r['noisy_refused_after']}",
          f"{r['noisy_ssd_bytes']:,}"] for r in rows])
    body = (f"`python -m benchmarks.store.bench_quotas --write`; {machine()}; {git_state()}.\n\n"
            f"One daemon, host tier {HOST_BYTES >> 20} MiB, tiny-16 chunks of 256 tokens. The quiet tenant resumes "
            f"one {QUIET_TOKENS:,}-token session {ROUNDS} times; before each resume the noisy tenant saves two fresh "
            f"{NOISY_TOKENS:,}-token sessions and prefetches its last three. Quotas: quiet host share 6 MiB; noisy "
            f"host share 8 MiB, ssd 48 MiB.\n\n{table}\n")
    write_result("quotas.md", "Two tenants: the quiet one's resumes beside a noisy one", body)
    write_result("quotas.json", "quotas", "").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
