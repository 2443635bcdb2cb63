"""`kvstore layout list|show NAME`: the persisted caches of a model and their bytes per token."""

from __future__ import annotations

import argparse

from rich import box
from rich.table import Table

from cli.ui import console, numbers_right
from kvstore.format.layout import PRESETS, get_layout


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("layout", help="list model layouts or show one")
    lsub = p.add_subparsers(dest="layout_cmd", required=True)
    lsub.add_parser("list", help="known layouts and their bytes per token").set_defaults(func=cmd_list)
    show = lsub.add_parser("show", help="per-cache table of one layout")
    show.add_argument("name", choices=sorted(PRESETS))
    show.set_defaults(func=cmd_show)


def cmd_list(args: argparse.Namespace) -> int:
    t = Table("layout", "caches", "B/token", "SWA B/seq", "SWA persisted", box=box.SIMPLE_HEAD,
              caption="B/token: persisted global KV per token; SWA B/seq: the sliding-window state of one sequence",
              caption_justify="left")
    for lay in PRESETS.values():
        t.add_row(lay.name, str(len(lay.caches)), f"{float(lay.bytes_per_token):,.2f}",
                  f"{lay.swa_state_bytes:,}", "yes" if lay.persists_swa else "no")
    con = console()
    con.print(numbers_right(t))
    ids = Table("layout", "layout id", box=box.SIMPLE_HEAD)
    for lay in PRESETS.values():
        ids.add_row(lay.name, lay.layout_hex)
    con.print(ids)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    lay = get_layout(args.name)
    t = Table("cache", "m", "ch", "format", "B/entry", "ent/tok", "B/token", box=box.SIMPLE_HEAD,
              title=f"{lay.name}  (layout id {lay.layout_hex})", title_justify="left",
              caption="cache: name.L<layer>; m: tokens per entry; ch: channels; B/entry: codes + scales; ent/tok: "
                      "entries per token",
              caption_justify="left")
    for c in lay.caches:
        t.add_row(c.name, str(c.m), str(c.channels), c.fmt.value,
                  f"{c.code_bytes}+{c.scale_bytes}={c.entry_bytes}", f"{float(c.entries_per_token):g}",
                  f"{float(c.bytes_per_token):,.2f}")
    t.add_section()
    t.add_row("total", "", "", "", "", f"{float(lay.entries_per_token):g}",
              f"{float(lay.bytes_per_token):,.1f}")
    for i in (1, 2, 5, 6):
        t.columns[i].justify = "right"
    con = console()
    con.print(t)
    fate = "persisted at each turn boundary" if lay.persists_swa else "never persisted: rebuilt by replay"
    con.print(f"{float(lay.bytes_per_token):,.1f} bytes/token persisted global KV; SWA state "
              f"{lay.n_layers} layers x {lay.window} x {lay.swa_entry_bytes} B = {lay.swa_state_bytes:,} B "
              f"per sequence ({fate})")
    return 0
