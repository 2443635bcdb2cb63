"""Writes the worked example of docs/FORMAT.md (between its ``example`` markers): one small chunk
built by the real writer, dumped byte by byte with its fields decoded, so the doc's example is
what the code writes. tests/format/test_format_reader.py fails when the doc and this output differ.

    python docs/format_example.py            # rewrite the example in docs/FORMAT.md
    python docs/format_example.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstore.format import chunk, quant
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.layout import EntryFormat, get_layout

DOC = Path(__file__).resolve().parent / "FORMAT.md"
BEGIN, END = "<!-- example:begin (docs/format_example.py) -->", "<!-- example:end -->"
LAYOUT = get_layout("tiny-8")
IDS = [9906, 1917]  # two tokens: one entry of each m=2 cache, two of each m=1 cache
NS = "demo"


def example_chunk() -> bytes:
    ents = {}
    for i, c in enumerate(LAYOUT.caches):
        n = c.entries_for(len(IDS))
        j = torch.arange(c.channels, dtype=torch.float32)
        x = torch.stack([((j % 13) - 6) * 0.25 * (e + 1) * (i + 1) for e in range(n)])  # a ramp per entry
        q = quant.quantize_main(x) if c.fmt is EntryFormat.FP4_E4M3_16 else quant.quantize_indexer(x)
        ents[c.name] = chunk.Entries.of(*q)
    key = chunk_key(LAYOUT.layout_id, NS, ROOT, IDS)
    return chunk.encode(LAYOUT, key=key, start=0, token_ids=IDS, entries=ents)


def render() -> str:
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


def main() -> None:
    doc = DOC.read_text()
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    new = doc[:start] + render() + doc[end:]
    if "--check" in sys.argv:
        sys.exit(0 if new == doc else 1)
    DOC.write_text(new)


if __name__ == "__main__":
    main()
