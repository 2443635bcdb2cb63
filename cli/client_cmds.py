"""Client-side commands against a running daemon: `kvstore health | stats | sessions | bytes-per-token
| evict | prefetch`. Every command takes the connection flags (address, token, TLS); every failure is one line
on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from cli import args as check
from cli.ui import console, framed, numbers_right
from kvstore.format.layout import get_layout, layout_by_id

if TYPE_CHECKING:  # kvstore.client pulls in gRPC: imported only when a command runs
    from kvstore.client import Client
    from kvstore.v1 import kvstore_pb2 as pb

BASELINE = "deepseek-v4-flash"
SERVICE = "kvstore.v1.KVStore"  # the health service names of kvstore/server/health.py
TIER_HEALTH = "kvstore.tier."
LAYOUTS_HEALTH = "kvstore.layouts"
CLI_TIMEOUT_S = 10.0  # a CLI call should fail in seconds, not retry for a minute
CLI_RETRIES = 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    conn = argparse.ArgumentParser(add_help=False)
    g = conn.add_argument_group("connection")
    g.add_argument("--address", metavar="HOST:PORT", type=check.address,
                   help="the daemon (default $KVSTORE_ADDRESS, else 127.0.0.1:50151)")
    g.add_argument("--token", help="bearer token (default $KVSTORE_TOKEN)")
    g.add_argument("--tls-ca-file", metavar="PEM", help="CA that signed the daemon's certificate (any --tls-* turns "
                                                        "TLS on)")
    g.add_argument("--tls-cert-file", metavar="PEM", help="client certificate, for mutual TLS")
    g.add_argument("--tls-key-file", metavar="PEM", help="client private key, for mutual TLS")
    g.add_argument("--tls-server-name", metavar="NAME", help="name to check the daemon's certificate against")

    p = sub.add_parser("health", parents=[conn], help="is the daemon serving, and each of its tiers? (exit 0 only "
                       "when every part is SERVING)")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("stats", parents=[conn], help="per-tier sizes, hits and counters (admin)")
    p.add_argument("--json", action="store_true", help="print the StatsResponse as JSON")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.set_defaults(func=cmd_stats)

    sp = sub.add_parser("sessions", help="list, show or delete sessions")
    ssub = sp.add_subparsers(dest="sessions_cmd", required=True, metavar="ACTION")
    p = ssub.add_parser("ls", parents=[conn], help="sessions the token covers")
    p.add_argument("--namespace", default="", help="only this namespace")
    p.set_defaults(func=cmd_sessions_ls)
    for name, help_, func in (("show", "one session's manifest, tiers, retention", cmd_sessions_show),
                              ("rm", "delete a session (chunks other sessions use are kept)", cmd_sessions_rm)):
        p = ssub.add_parser(name, parents=[conn], help=help_)
        p.add_argument("namespace")
        p.add_argument("session_id")
        p.set_defaults(func=func)

    p = sub.add_parser("bytes-per-token", parents=[conn],
                       help="persistent bytes/token measured on the daemon vs the V4-Flash baseline (admin)")
    p.set_defaults(func=cmd_bytes_per_token)

    p = sub.add_parser("evict", parents=[conn], help="move a session's chunks down to a tier (admin)")
    p.add_argument("namespace")
    p.add_argument("session_id")
    p.add_argument("--to", required=True, metavar="TIER", help="tier name, e.g. ssd")
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("prefetch", parents=[conn],
                       help="promote a session's chunks to the fastest tier in the background, ahead of a resume")
    p.add_argument("namespace")
    p.add_argument("session_id")
    p.set_defaults(func=cmd_prefetch)


# -- connection and errors, in one place ---------------------------------------------------------
def _client(args: argparse.Namespace) -> Client:
    from kvstore.client import Client, ClientConfig, ClientTls, default_address

    tls_args = {"ca_file": args.tls_ca_file, "cert_file": args.tls_cert_file, "key_file": args.tls_key_file,
                "server_name": args.tls_server_name}
    tls = ClientTls(**{k: v or "" for k, v in tls_args.items()}) if any(tls_args.values()) else None
    address = args.address
    if address is None:  # $KVSTORE_ADDRESS gets the same check as the flag
        from cli.errors import UsageError

        try:
            address = check.address(default_address())
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"$KVSTORE_ADDRESS: {e}") from None
    config = ClientConfig(address=address,
                          token=args.token if args.token is not None else os.environ.get("KVSTORE_TOKEN", ""),
                          tls=tls, timeout_s=CLI_TIMEOUT_S, retries=CLI_RETRIES, backoff_s=0.2)
    return Client(config)


def with_client(fn: Callable[[Client, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Open a client for ``fn`` and turn every failure into a one-line CliError: exit status 2 for what
    the daemon calls an invalid argument (and unreadable TLS files), 1 for the rest."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        import grpc

        from cli.errors import CliError, UsageError
        from kvstore.client import Unauthenticated
        from kvstore.errors import InvalidArgument, KvstoreError, PermissionDenied, Unavailable

        client = None
        try:
            client = _client(args)
            return fn(client, args)
        except Unavailable as e:
            why = _one_line(e).removeprefix("daemon unavailable: ")
            raise CliError(f"cannot reach kvstore daemon at {client.address if client else args.address}: "
                           f"{why}") from None
        except Unauthenticated as e:
            raise CliError(f"not authenticated: {_one_line(e)} (pass --token or set $KVSTORE_TOKEN)") from None
        except PermissionDenied as e:
            raise CliError(f"permission denied: {_one_line(e)}") from None
        except InvalidArgument as e:
            raise UsageError(_one_line(e) or type(e).__name__) from None
        except KvstoreError as e:
            raise CliError(_one_line(e) or type(e).__name__) from None
        except grpc.RpcError as e:  # a code the client does not map (e.g. DEADLINE_EXCEEDED)
            raise CliError(f"{e.code().name}: {_one_line(e.details())}") from None  # type: ignore[attr-defined]
        except OSError as e:  # unreadable TLS files
            raise UsageError(_one_line(e)) from None
        finally:
            if client is not None:
                client.close()

    return run


def _one_line(e: object) -> str:
    return " ".join(str(e).split())


# -- formatting helpers -----------------------------------------------------------------------------
def human(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:,.0f} B" if i == 0 else f"{n:,.1f} {units[i]}"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _retention(pinned: bool, ttl_s: float) -> str:
    if pinned:
        return "pinned"
    return f"ttl {ttl_s:g}s" if ttl_s > 0 else "default"


# -- commands ---------------------------------------------------------------------------------------
def health_report(client: Client) -> dict[str, str]:
    """The status of each part of the daemon (grpc.health.v1; kvstore/server/health.py): "" (the
    daemon), kvstore.v1.KVStore and kvstore.tier.NAME for each of its tiers, in that order."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.client.calls import domain_error
    from kvstore.client.config import channel_options, metadata
    from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    cfg = client.config
    opts = channel_options(cfg)
    channel = (grpc.secure_channel(client.address, cfg.tls.credentials(), opts) if cfg.tls
               else grpc.insecure_channel(client.address, opts))
    call = {"timeout": cfg.timeout_s, "metadata": metadata(cfg)}
    stub = health_pb2_grpc.HealthStub(channel)

    def check(service: str) -> str:
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), **call)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]  # a daemon without per-part statuses
                return "UNKNOWN"
            raise domain_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    try:
        report = {"": check("")}
        try:
            tiers = list(kvstore_pb2_grpc.KVStoreStub(channel).GetServerInfo(kvstore_pb2.GetServerInfoRequest(),
                                                                             **call).tiers)
        except grpc.RpcError as e:
            raise domain_error(e) from None
        for service in (SERVICE, *(TIER_HEALTH + t for t in tiers), LAYOUTS_HEALTH):
            report[service] = check(service)
        return report
    finally:
        channel.close()


@with_client
def cmd_health(client: Client, args: argparse.Namespace) -> int:
    report = health_report(client)
    failing = {name: status for name, status in report.items() if name and status not in ("SERVING", "UNKNOWN")}
    overall = report[""]
    if not failing and overall == "SERVING":
        print("SERVING")
        return 0
    tiers = [n for n in report if n.startswith(TIER_HEALTH)]
    bad_tiers = [n for n in tiers if n in failing]
    if overall == "SERVING" and bad_tiers:
        print(f"SERVING, degraded: {len(bad_tiers)} of {len(tiers)} tiers not serving (saves still succeed)")
    elif overall == "SERVING":
        print("SERVING, degraded")
    else:
        print(f"{overall}: saves cannot succeed" if failing else overall)
    errors = _tier_errors(client) if bad_tiers else {}
    for name, status in failing.items():
        why = errors.get(name.removeprefix(TIER_HEALTH), "") if name != LAYOUTS_HEALTH else (
            "a stored page layout did not reopen: its data is kept; register it again (`kvstore stats` names it)")
        print(f"  {name} {status}{f': {why}' if why else ''}")
    if bad_tiers and not errors:
        print("  (`kvstore stats` with an admin token shows each tier's last error)")
    return 1


def _tier_errors(client: Client) -> dict[str, str]:
    """Each tier's last error, from Stats: {} when the token is not an admin's."""
    from kvstore.errors import KvstoreError

    try:
        return {t.name: t.last_error for t in client.stats().tiers if t.last_error}
    except KvstoreError:
        return {}


def tiers_table(tiers: Sequence[pb.TierStats], reads: int, title: str | None = "kvstore tiers (fast to slow)"
                ) -> Table:
    """One column per tier, one row per counter: as readable at 80 columns as at 200."""
    t = Table("", *(r.name for r in tiers), title=title, caption="hit rate: the share of all chunk reads this "
              "tier served", box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left")
    rows: list[tuple[str, Callable[[pb.TierStats], str]]] = [
        ("persistent", lambda r: "yes" if r.persistent else "no"),
        ("used", lambda r: human(r.used_bytes)),
        ("capacity", lambda r: human(r.capacity_bytes) if r.capacity_bytes else "unlimited"),
        ("items", lambda r: f"{r.items:,}"),
        ("hits", lambda r: f"{r.hits:,}"),
        ("hit rate", lambda r: _pct(r.hits, reads)),
        ("evictions", lambda r: f"{r.evictions:,}"),
        ("demotions", lambda r: f"{r.demotions:,}"),
        ("promotions", lambda r: f"{r.promotions:,}"),
        ("verify failures", lambda r: f"{r.verify_failures:,}"),
        ("errors", lambda r: f"{r.errors:,}" + (" [red]degraded[/]" if r.degraded else "")),
    ]
    for label, cell in rows:
        t.add_row(label, *(cell(r) for r in tiers))
    return numbers_right(t)


def stats_view(s: pb.StatsResponse) -> Group:
    reads = s.loaded_chunks + s.missed_chunks
    lines: list[object] = [
        framed(tiers_table(s.tiers, reads)),
        f"lookups {s.lookups:,}: {s.hit_tokens:,} / {s.requested_tokens:,} tokens hit "
        f"({_pct(s.hit_tokens, s.requested_tokens)}); chunk reads {s.loaded_chunks:,} served, "
        f"{s.missed_chunks:,} missed"]
    b = s.bytes_per_token
    if b.tokens:
        lines.append(f"sessions {s.sessions:,}: {b.tokens:,} distinct tokens stored (a shared prefix counts once), "
                     f"{b.measured:,.2f} persistent B/token measured (layout formula {b.formula:,.2f})")
    else:
        lines.append(f"sessions {s.sessions:,}")
    x = s.transport
    lines.append(f"transport: {x.arenas:,} same-host arenas attached; chunk calls {x.arena_calls:,} through an arena "
                 f"({x.overflow_calls:,} overflowed to the stream), {x.stream_calls:,} on the gRPC stream; "
                 f"{x.local_calls:,} calls over the local socket")
    p = s.prefetch
    lines.append(f"prefetch: {p.requested:,} requested ({p.coalesced:,} coalesced, {p.dropped:,} dropped), "
                 f"{p.completed:,} completed, {p.chunks_promoted:,} chunks promoted, {p.chunks_skipped:,} skipped, "
                 f"{p.pending:,} pending")
    if s.namespaces:
        lines.append(framed(namespaces_table(s.namespaces)))
    lines += [Text(f"tier {r.name}: last error: {r.last_error}", style="red") for r in s.tiers if r.last_error]
    return Group(*lines)  # type: ignore[arg-type]


def namespaces_table(usage: Sequence[pb.NamespaceUsage]) -> Table:
    """Each namespace's usage against its quota (``-``: unlimited)."""
    t = Table("namespace", "host", "ssd", "sessions", box=None)

    def of(n: int, q: int, has: bool, bytes_: bool = True) -> str:
        shown = human(n) if bytes_ else f"{n:,}"
        return f"{shown} / {human(q) if bytes_ else f'{q:,}'}" if has else f"{shown} / -"

    for u in usage:
        t.add_row(u.namespace or "(unowned)", of(u.host_bytes, u.host_quota, u.has_host_quota),
                  of(u.ssd_bytes, u.ssd_quota, u.has_ssd_quota),
                  of(u.sessions, u.sessions_quota, u.has_sessions_quota, bytes_=False))
    return numbers_right(t)


@with_client
def cmd_stats(client: Client, args: argparse.Namespace) -> int:
    from kvstore.errors import PermissionDenied

    try:
        first = client.stats()
    except PermissionDenied:  # a tenant's token: its own namespaces' usage and quotas, nothing else
        usage = client.namespace_stats()
        if args.json:
            from google.protobuf.json_format import MessageToDict

            print(json.dumps([MessageToDict(u, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=True) for u in usage], indent=2))
        else:
            console().print(framed(namespaces_table(usage)))
        return 0
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(first, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True, unquote_int64_if_possible=True),
                         indent=2))
        return 0
    if args.watch is None:
        console().print(stats_view(first))
        return 0
    if args.watch <= 0:
        from cli.errors import UsageError

        raise UsageError(f"--watch needs a positive number of seconds, got {args.watch:g}")
    from rich.live import Live

    con = console()
    try:
        if con.is_terminal:  # redraw in place
            with Live(stats_view(client.stats()), console=con, auto_refresh=False) as live:
                while True:
                    time.sleep(args.watch)
                    live.update(stats_view(client.stats()), refresh=True)
        else:  # a pipe or a file: append one snapshot per interval
            while True:
                con.print(f"-- {datetime.now():%H:%M:%S}")
                con.print(stats_view(client.stats()))
                con.file.flush()
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


@with_client
def cmd_sessions_ls(client: Client, args: argparse.Namespace) -> int:
    sessions = client.list_sessions(args.namespace)
    if not sessions:
        print(f"no sessions in namespace {args.namespace!r}" if args.namespace else "no sessions")
        return 0
    t = Table("namespace", "session", "layout", "tokens", "chunks", "retention", "updated", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for x in sessions:
        t.add_row(x.namespace, x.session_id, x.layout_name, f"{x.token_count:,}", f"{x.chunks:,}",
                  _retention(x.retention.pinned, x.retention.ttl_s), _when(x.updated_at))
    con = console()
    for i in (3, 4):  # tokens, chunks
        t.columns[i].justify = "right"
    con.print(t)
    con.print(f"{len(sessions)} sessions, {sum(x.token_count for x in sessions):,} tokens in all (a prefix "
              f"shared by several sessions counts in each; `kvstore stats` counts it once)")
    return 0


@with_client
def cmd_sessions_show(client: Client, args: argparse.Namespace) -> int:
    m, tiers = client.get_session(args.namespace, args.session_id)
    lay = layout_by_id(m.layout_id)
    t = Table("field", "value", title=f"session {m.namespace}/{m.session_id}", show_header=False)
    t.add_row("layout", f"{lay.name if lay else 'unknown'} ({m.layout_id.hex()})")
    t.add_row("tokens", f"{m.token_count:,} ({len(m.chunk_keys)} chunks of {m.chunk_tokens} + {m.tail_tokens} "
                        f"trailing)")
    t.add_row("chunks per tier", ", ".join(f"{name} {n}" for name, n in tiers.items()) or "-")
    t.add_row("trailing span", human(len(m.tail)))
    t.add_row("retention", _retention(m.retention.pinned, m.retention.ttl_s or 0.0))
    t.add_row("created", _when(m.created_at))
    t.add_row("updated", _when(m.updated_at))
    t.add_row("last token ids", f"{len(m.last_token_ids)} kept for replay")
    if m.chunk_keys:
        t.add_row("first chunk key", m.chunk_keys[0].hex())
        t.add_row("last chunk key", m.chunk_keys[-1].hex())
    for k, v in sorted(m.metadata.items()):
        t.add_row(f"metadata {k}", v)
    console().print(t)
    return 0


@with_client
def cmd_sessions_rm(client: Client, args: argparse.Namespace) -> int:
    freed = client.delete_session(args.namespace, args.session_id)
    print(f"deleted {args.namespace}/{args.session_id}: freed {freed} chunks")
    return 0


def baseline(b: pb.BytesPerToken) -> tuple[float, int, bool]:
    """The V4-Flash-style store beside this one, by one definition (`kvstore bytes-per-token` and the
    demo both use it): it persists V4-Flash's global KV (3,514.25 B/token at the real geometry; for
    a miniature such as tiny-16, the same design scaled to it: the formula x 3514.25 / 890) plus one
    SWA snapshot per live session, the state at its latest turn boundary (what resuming it needs:
    V4-Flash's 3,214,336 B at the real geometry, the model's own SWA state for a miniature). A store
    that kept every boundary's snapshot would hold more. (global KV B/token, snapshot bytes, real
    geometry?)"""
    base, v41 = get_layout(BASELINE), get_layout("deepseek-v4.1-flash")
    real = abs(b.formula - float(v41.bytes_per_token)) < 1e-6
    global_kv = float(base.bytes_per_token) / float(v41.bytes_per_token) * b.formula
    return global_kv, base.swa_state_bytes if real else b.baseline_swa_snapshot, real


def bytes_per_token_view(b: pb.BytesPerToken, number: str = "") -> Group:
    """Where the persisted bytes go (the compressed total and its parts, then the uncompressed bytes and
    theirs: never one added to the other), and the V4-Flash-style baseline (``baseline``)."""
    tok = b.tokens
    global_kv, swa, real = baseline(b)
    factor = float(get_layout(BASELINE).bytes_per_token) / float(get_layout("deepseek-v4.1-flash").bytes_per_token)
    t = Table("", "bytes", "B/token", box=box.SIMPLE_HEAD, title_justify="left",
              title=f"{number}persistent bytes per token: {plural(b.sessions, 'session')}, {tok:,} tokens, "
                    f"{plural(b.unique_chunks, 'unique chunk')} (shared chunks once)")
    t.add_row("layout formula", "", f"{b.formula:,.2f}")
    t.add_row("[bold]on disk[/] (stored + LMDB overhead)", f"{b.stored + b.lmdb_overhead:,}",
              f"[bold]{b.measured:,.2f}[/]")
    t.add_row("  stored values, compressed", f"{b.stored:,}", f"{b.stored / tok:,.2f}")
    t.add_row("  LMDB overhead (pages)", f"{b.lmdb_overhead:,}", f"{b.lmdb_overhead / tok:,.2f}")
    unc = b.payload + b.chunk_overhead + b.manifests
    t.add_row("uncompressed (before zstd)", f"{unc:,}", f"{unc / tok:,.2f}")
    t.add_row("  payload (packed entries)", f"{b.payload:,}", f"{b.payload / tok:,.2f}")
    t.add_row("  chunk overhead (headers, ids, sums)", f"{b.chunk_overhead:,}", f"{b.chunk_overhead / tok:,.2f}")
    t.add_row("  manifests", f"{b.manifests:,}", f"{b.manifests / tok:,.2f}")
    t.add_row("compression (raw / stored)", f"{b.raw:,} / {b.stored:,}",
              f"{b.raw / b.stored:.3f}x" if b.stored else "-")

    with_swa = global_kv + swa * b.sessions / tok
    v = Table("", "B/token", box=box.SIMPLE_HEAD, title_justify="left",
              title=f"V4-Flash-style store ({BASELINE}{'' if real else ', scaled to this model'})")
    v.add_row("global KV" if real else f"global KV (formula x {factor:.2f})", f"{global_kv:,.2f} B/token")
    v.add_row(f"+ SWA snapshot, {swa:,} B per session ({b.sessions})", f"{swa * b.sessions / tok:,.2f} B/token")
    v.add_row("[bold]= total[/]", f"[bold]{with_swa:,.2f} B/token[/]")
    ratio = (f"baseline / measured: [bold]{with_swa / b.measured:,.2f}x[/] the bytes per token "
             f"({global_kv / b.measured:,.2f}x for the global KV alone). The baseline counts one SWA snapshot per "
             f"session (its latest turn boundary, which a resume needs); keeping one per turn boundary would cost "
             f"more.")
    return Group(framed(numbers_right(t)), framed(numbers_right(v)), ratio)


@with_client
def cmd_bytes_per_token(client: Client, args: argparse.Namespace) -> int:
    b = client.stats().bytes_per_token
    if not b.tokens or not b.measured:
        print("no live sessions: save a session to measure bytes per token")
        return 0
    console().print(bytes_per_token_view(b))
    return 0


@with_client
def cmd_evict(client: Client, args: argparse.Namespace) -> int:
    moved = client.evict(args.namespace, args.session_id, args.to)
    m, tiers = client.get_session(args.namespace, args.session_id)  # chunks by the fastest tier holding each
    order = client.stats().tiers  # fast to slow (evict is an admin call: so is Stats)
    rank = {t.name: i for i, t in enumerate(order)}
    volatile = {t.name for t in order if not t.persistent}
    # still in a memory tier above the target: in use by a load when the daemon tried (it skips those);
    # a persistent tier above it is the durable copy, which stays when the target is below it
    stuck = sum(n for name, n in tiers.items() if name in volatile and rank[name] < rank.get(args.to, -1))
    missing = tiers.get("missing", 0)
    already = len(m.chunk_keys) - moved - missing - stuck
    now = ", ".join(f"{name} {n}" for name, n in tiers.items()) or "no chunks"
    what = f"{args.namespace}/{args.session_id}"
    if moved:
        line = f"moved {plural(moved, 'chunk')} of {what} down to {args.to}"
        line += f", {already} already there" if already else ""
    elif already:
        line = f"nothing to move: {'the' if already > 1 else 'its'} {plural(already, 'chunk')} of {what} " \
               f"{'are' if already > 1 else 'is'} already in {args.to}"
    else:
        line = f"nothing moved of {what}"
    line += f", {stuck} not moved (in use by a load: evict again)" if stuck else ""
    print(f"{line}{f', {missing} missing' if missing else ''} (chunks now: {now})")
    return 0


def plural(n: int, noun: str) -> str:
    """3, "chunk" -> "3 chunks"; 1, "chunk" -> "1 chunk"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


@with_client
def cmd_prefetch(client: Client, args: argparse.Namespace) -> int:
    r = client.prefetch_session(args.namespace, args.session_id)
    where = f"{args.namespace}/{args.session_id}"
    if r.dropped:
        print(f"prefetch of {where} dropped: the daemon's prefetch queue is full ({r.already_fast} chunks already "
              f"in {r.tier})")
    else:
        joined = " (joined a prefetch already waiting)" if r.coalesced else ""
        print(f"prefetch of {where}: {r.queued} chunks queued for {r.tier}, {r.already_fast} already there{joined}")
    return 0
