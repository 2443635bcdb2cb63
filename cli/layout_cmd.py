"""`kvstore layout list|show NAME`: the persisted caches of a model and their bytes per token."""

from __future__ import annotations

import argparse

from rich.table import Table

from cli.ui import console
from kvstore.layout import PRESETS, get_layout


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("layout", help="list model layouts or show one")
    lsub = p.add_subparsers(dest="layout_cmd", required=True)
    lsub.add_parser("list", help="known layouts and their bytes per token").set_defaults(func=cmd_list)
    show = lsub.add_parser("show", help="per-cache table of one layout")
    show.add_argument("name", choices=sorted(PRESETS))
    show.set_defaults(func=cmd_show)


def cmd_list(args: argparse.Namespace) -> int:
    t = Table("layout", "caches", "bytes/token", "SWA state (B/seq)", "persists SWA", "layout id")
    for lay in PRESETS.values():
        t.add_row(lay.name, str(len(lay.caches)), f"{float(lay.bytes_per_token):,.2f}",
                  f"{lay.swa_state_bytes:,}", "yes" if lay.persists_swa else "no", lay.layout_hex)
    console().print(t)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    lay = get_layout(args.name)
    t = Table("cache", "layer", "m", "channels", "format", "B/entry", "entries/token", "bytes/token",
              title=f"{lay.name}  (layout id {lay.layout_hex})")
    for c in lay.caches:
        t.add_row(c.name, str(c.layer), str(c.m), str(c.channels), c.fmt.value,
                  f"{c.code_bytes}+{c.scale_bytes}={c.entry_bytes}", f"{float(c.entries_per_token):g}",
                  f"{float(c.bytes_per_token):,.2f}")
    t.add_section()
    t.add_row("total", "", "", "", "", "", f"{float(lay.entries_per_token):g}",
              f"{float(lay.bytes_per_token):,.1f}")
    con = console()
    con.print(t)
    fate = "persisted at each turn boundary" if lay.persists_swa else "never persisted: rebuilt by replay"
    con.print(f"{float(lay.bytes_per_token):,.1f} bytes/token persisted global KV; SWA state "
              f"{lay.n_layers} layers x {lay.window} x {lay.swa_entry_bytes} B = {lay.swa_state_bytes:,} B "
              f"per sequence ({fate})")
    return 0
