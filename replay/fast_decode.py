"""Decode and replay without per-op launch overhead: static shapes, no host syncs, CUDA graphs.

The eager path (Transformer._run) reads positions back to the host (``int(pos[0])``), slices by data
(``values[:n]``, ring windows that grow) and quantizes through kvstore.format.quant's checked codecs, so on a GPU
every token costs a few thousand kernel launches and dozens of synchronizations. Here one step of T tokens
is a function of device tensors only: the session's position and each ring's start travel in a small input
vector, the global caches are preallocated for ``max_len`` tokens (entries not yet selectable are masked,
not sliced off), SWA windows are gathered by index, and a compressor writes every group a step may complete,
keeping the old bytes where the group is incomplete or already loaded. Its shapes depend only on (T, the
decoder's offset in the step), so each such step is captured once in a CUDA graph and replayed.

It runs the model's own modules and the same arithmetic as the eager path, on the same SessionState (one
live sequence per FastDecoder, as gpt-fast's setup_caches): the eager path may be used on that state between
fast steps (prefill, save, load). tests/replay/test_fast_decode.py checks logits and caches against the eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from replay.cache import SessionState
from replay.graph_codecs import GraphCodecs
from replay.model import Linear, Transformer, attend_blocks, check_token_ids, rope, rope_angles

_Step = Callable[[], Tensor]


@dataclass(frozen=True)
class FastDecodeConfig:
    max_len: int = 32768  # tokens a session may reach: the global caches are allocated for it
    chunk: int = 128  # tokens per replay step (one graph per distinct step shape)
    graphs: bool = True  # capture each step shape in a CUDA graph (CUDA only; else run the static step eagerly)
    compile: bool = False  # torch.compile each step first (fuses elementwise kernels; not bit-exact vs eager)
    # pad the rows of the layers' projections to 16 as the eager path does (bit-identical on CPU); False: one
    # token's projection as a plain GEMV (on the H200 the padded fp32 GEMMs took ~2.4 ms of a decode step)
    exact_gemm: bool = True


class FastDecoder:
    """decode_one_token / decode_tokens / replay of a Transformer on one preallocated SessionState."""

    def __init__(self, model: Transformer, config: FastDecodeConfig = FastDecodeConfig()) -> None:
        self.model, self.config, self.args = model, config, model.args
        self.state = model.new_state(config.max_len)
        dev, a = model.device, model.args
        self.codecs = GraphCodecs(dev)
        self.comp = [i for i, b in enumerate(model.layers) if b.attention.compressor is not None]
        # the m > 1 compressors' last m - 1 projections (kv, z), slot = position % m
        zeros = [torch.zeros(a.m[i], a.head_dim, device=dev, dtype=model.output.weight.dtype) for i in self.comp]
        self.pending = {i: (z, z.clone()) for i, z in zip(self.comp, zeros, strict=True) if a.m[i] > 1}
        self.meta = torch.zeros(1 + a.n_layers + len(self.comp), dtype=torch.long, device=dev)  # pos0, lo, n
        self.tokens: dict[int, Tensor] = {}
        self.steps: dict[tuple[int, int, tuple[bool, ...]], _Step] = {}
        self.binding = self._binding()
        self.graphs = config.graphs and dev.type == "cuda"

    def new_state(self) -> SessionState:
        """The decoder's one state, emptied (its tensors stay where they are)."""
        s = self.state
        s.pos = s.decoder_from = 0
        s.pending.clear()
        for c in s.caches.values():
            c.n = 0
        for r in s.rings:
            r.reset(0)
        return s

    def decode_one_token(self, token: int | Tensor, state: SessionState) -> Tensor:
        """One token (an int, or a device tensor such as the last argmax: no host sync, so not checked
        against the vocabulary) -> logits [V]."""
        if not isinstance(token, Tensor):
            check_token_ids([int(token)], self.args.vocab_size)
        tok = token.reshape(1) if isinstance(token, Tensor) else torch.tensor([int(token)])
        return self._run(tok, state, state.pos)

    def replay(self, state: SessionState, tokens: Tensor | list[int], start_pos: int,
               decoder_from: int | None = None) -> Tensor:
        """Transformer.replay on this decoder's state, in steps of ``config.chunk`` tokens -> logits [V]."""
        check_token_ids(tokens, self.args.vocab_size)
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        return self._run(tokens, state, self.model.prepare_replay(state, len(tokens), start_pos, decoder_from))

    def _run(self, tokens: Tensor, state: SessionState, dec_start: int) -> Tensor:
        if state is not self.state:
            raise ValueError("FastDecoder runs only on its own state (FastDecoder.new_state())")
        start, end, enc = state.pos, state.pos + tokens.numel(), self.args.n_encoder
        if tokens.numel() == 0 or end > self.config.max_len:
            raise ValueError(f"need 1 to {self.config.max_len - start} tokens, got {tokens.numel()}")
        if state.rings[enc].hi != dec_start:  # as Transformer._run: the decoder's SWA sees its own run only
            for ring in state.rings[enc:]:
                ring.reset(dec_start)
            state.decoder_from = dec_start
        out = tokens.new_zeros(0)
        for a in range(start, end, self.config.chunk):
            b = min(a + self.config.chunk, end)
            out = self._step(tokens[a - start:b - start], a, min(max(0, dec_start - a), b - a))
        return out

    def _step(self, tokens: Tensor, pos0: int, d: int) -> Tensor:
        """Tokens [pos0, pos0 + T), the decoder over the last T - d: set the inputs, run, do the bookkeeping."""
        s, t, a = self.state, tokens.numel(), self.args
        if self._binding() != self.binding:  # a cache grew past its capacity: the graphs point at old tensors
            self.steps.clear()
            self.binding = self._binding()
        for i in self.pending:  # the eager path's pending tokens into the static buffers
            m, p = a.m[i], s.pending.get(i)
            if pos0 % m and p is None and s.caches[f"main.L{i}"].n <= pos0 // m:
                raise ValueError(f"layer {i}: the group of position {pos0} is neither pending nor loaded")
            if p is not None and p[0].data_ptr() != self.pending[i][0].data_ptr():
                self.pending[i][0][:len(p[0])].copy_(p[0])
                self.pending[i][1][:len(p[1])].copy_(p[1])
        meta = [pos0] + [r.lo for r in s.rings] + [s.caches[f"main.L{i}"].n for i in self.comp]
        self._to_device(self.meta, torch.tensor(meta))
        self._to_device(self.tokens.setdefault(t, self.meta.new_zeros(t)), tokens)
        # which compressors may write an entry: a group completes in this step and is not loaded (else the
        # step only keeps the pending projections: even positions of a decode, a replay over loaded entries)
        writes = tuple(self.config.compile or (pos0 + t) // a.m[i] > max(s.caches[f"main.L{i}"].n, pos0 // a.m[i])
                       for i in self.comp)  # compiled: one step for all (a compile takes a minute)
        out = self._step_fn(t, d, writes)()
        s.pos = pos0 + t
        for i, ring in enumerate(s.rings):
            lo = pos0 + d if i >= a.n_encoder else pos0
            if s.pos > lo:
                ring.hi, ring.lo = s.pos, max(ring.lo, s.pos - a.window)
        for i in self.comp:
            m, r = a.m[i], s.pos % a.m[i]
            for kind in ("main", "index"):
                s.caches[f"{kind}.L{i}"].n = max(s.caches[f"{kind}.L{i}"].n, s.pos // m)
            s.pending.pop(i, None)
            if r:  # as Compressor.forward leaves it: the incomplete group's projections
                s.pending[i] = (self.pending[i][0][:r], self.pending[i][1][:r], s.pos - r)
        return out.clone()

    @staticmethod
    def _to_device(dst: Tensor, src: Tensor) -> None:
        if src.device.type == "cpu" and dst.device.type == "cuda":
            src = src.pin_memory()  # the caching host allocator keeps it until the copy is done
        dst.copy_(src, non_blocking=True)

    def _binding(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for c in self.state.caches.values() for t in (c.codes, c.scales, c.values))

    def _step_fn(self, t: int, d: int, writes: tuple[bool, ...]) -> _Step:
        """The step for (t, d, writes): as it is, torch.compile'd, and/or captured in a CUDA graph (once)."""
        key = (t, d, writes)
        if key not in self.steps:
            fn: _Step = lambda: self._static_step(t, d, writes)  # noqa: E731
            if self.config.compile:
                fn = torch.compile(fn, fullgraph=True, dynamic=False)
            self.steps[key] = self._capture(fn) if self.graphs else fn
        return self.steps[key]

    def _capture(self, fn: _Step) -> _Step:
        """Warm up on a side stream and capture; the state is restored after both (they ran the step)."""
        s = self.state
        mutable = [t for c in s.caches.values() for t in (c.codes, c.scales, c.values)]
        mutable += [t for r in s.rings for t in (r.codes, r.scales, r.keys)]
        mutable += [t for p in self.pending.values() for t in p]
        saved = [t.clone() for t in mutable]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for t, v in zip(mutable, saved, strict=True):
            t.copy_(v)

        def replay() -> Tensor:
            graph.replay()
            return out

        return replay

    @torch.no_grad()
    def _static_step(self, t: int, d: int, writes: tuple[bool, ...]) -> Tensor:
        """Tokens self.tokens[t] at positions meta[0] + [0, t) through the encoder and the m-compressors, the
        last t - d through the decoder -> the last token's logits [V]. Device tensors only, fixed shapes."""
        model, a, enc = self.model, self.args, self.args.n_encoder
        pos = self.meta[0] + torch.arange(t, device=self.meta.device)  # [T]
        cs = rope_angles(pos, a)
        x = model.tok_embeddings(self.tokens[t])  # [T, D]
        ctx: dict[str, tuple[Tensor, Tensor]] = {}
        win = self._window(pos)
        for i in range(a.n_layers):
            if i == enc:  # decoder global KV from H_{L/2}, every token; the decoder over the last t - d
                self._compress(i, model.layers[i].attention_norm(x), pos, writes[self.comp.index(i)])
                if d == t:
                    return x.new_zeros(a.vocab_size)
                x, pos, cs = x[d:], pos[d:], cs[d:]
                win = self._window(pos) if d else win
            x = self._block(i, x, pos, cs, win, ctx, writes)
        return model.output(model.norm(x[-1:])).float()[0]

    def _block(self, i: int, x: Tensor, pos: Tensor, cs: Tensor, win: tuple[Tensor, Tensor, Tensor],
               ctx: dict[str, tuple[Tensor, Tensor]], writes: tuple[bool, ...]) -> Tensor:
        block, s = self.model.layers[i], self.state
        attn, h = block.attention, block.attention_norm(x)
        if attn.compressor is not None and i < self.args.n_encoder:
            self._compress(i, h, pos, writes[self.comp.index(i)])
        t, a, lin, ff = x.shape[0], self.args, self._linear, block.feed_forward
        q = rope(lin(attn.wq, h).view(t, a.n_heads, a.head_dim), cs)  # Attention.qk
        k = rope(attn.kv_norm(lin(attn.wkv, h)), cs)
        kbuf, e0 = self._ring(i, k, pos, win)
        if attn.indexer is not None:
            ctx["topk"] = attn.select(h, pos, cs, s.caches[f"index.L{attn.src}"].values, e0, ctx)
        glob, glob_ok = attn.selected(s, k, ctx)
        x = x + lin(attn.wo, attend_blocks(q, pos, kbuf, e0, glob, glob_ok, a.window).reshape(t, -1))
        h = block.ffn_norm(x)
        return x + lin(ff.w2, F.silu(lin(ff.w1, h)) * lin(ff.w3, h))  # FeedForward

    def _linear(self, layer: Linear, x: Tensor) -> Tensor:
        return layer(x) if self.config.exact_gemm else F.linear(x, layer.weight)

    def _window(self, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """For tokens at pos: [T], the positions p of attend_blocks' kbuf (every block's window), where each
        is found in cat([ring keys, new keys]), and which are not past the last token. Shared by the layers."""
        w, t = self.args.window, pos.shape[0]
        pos0 = pos[0]
        p = pos0 - pos0 % 16 - w + 1 + torch.arange(-(-(15 + t) // 16) * 16 + w - 1, device=pos.device)
        return p, torch.where(p < pos0, p % w, w + p - pos0).clamp(0, w + t - 1), p < pos0 + t

    def _ring(self, i: int, k: Tensor, pos: Tensor, win: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """SwaRing.push without host syncs: FP8 round trip of k [T, Dh], the keys attend_blocks needs (kbuf,
        zeros before the ring's start e0 and past the last token), then the new keys into the ring."""
        ring, w, t = self.state.rings[i], self.args.window, k.shape[0]
        codes, scales = self.codecs.quantize_swa(k)
        k = self.codecs.dequantize_swa(codes, scales, k.dtype)
        p, idx, upto = win
        e0 = torch.maximum(self.meta[1 + i], pos[0] - w + 1)
        kbuf = torch.where((upto & (p >= e0))[:, None], torch.cat([ring.keys, k])[idx], 0.0)
        keep = slice(max(0, t - w), t)
        slots = pos[keep] % w
        for dst, new in ((ring.codes, codes), (ring.scales, scales), (ring.keys, k)):
            dst.index_copy_(0, slots, new[keep])
        return kbuf, e0

    def _compress(self, i: int, h: Tensor, pos: Tensor, write_any: bool) -> None:
        """Compressor.forward without host syncs: every group the step may complete is computed; a group
        is written only where it is complete and not already loaded (else its old bytes are written back)."""
        comp, a, s, t = self.model.layers[i].attention.compressor, self.args, self.state, h.shape[0]
        assert comp is not None
        m, dh, dev = comp.m, a.head_dim, h.device
        if not write_any and m == 1:
            return
        kv, z = comp.project(h)  # [T, Dh]
        pos0 = pos[0]
        if m > 1:  # rows for positions [pos0 - (m-1), pos0 + T)
            pkv, pz = self.pending[i]
            old = (pos0 - (m - 1) + torch.arange(m - 1, device=dev)) % m
            kv, z = torch.cat([pkv[old], kv]), torch.cat([pz[old], z])
        if not write_any:
            self._keep_pending(i, kv, z, pos0, t)
            return
        g = torch.arange(-(-t // m), device=dev)
        gam = pos0 // m + g  # [G]: the groups that may complete, first the one holding pos0
        idx = ((m - 1 - pos0 % m) + g[:, None] * m + torch.arange(m, device=dev)).clamp(max=m - 2 + t)
        c, ik = comp.encode(kv[idx].view(-1, m, dh), z[idx].view(-1, m, dh), gam * m)
        main, index = s.caches[f"main.L{i}"], s.caches[f"index.L{i}"]
        mc, ms = self.codecs.quantize_main(c)
        ic, isc = self.codecs.quantize_indexer(ik)
        write = ((gam < (pos0 + t) // m) & (gam >= self.meta[1 + a.n_layers + self.comp.index(i)]))[:, None]
        for dst, new in ((main.codes, mc), (main.scales, ms), (index.codes, ic), (index.scales, isc),
                         (main.values, self.codecs.dequantize_main(mc, ms, main.values.dtype)),
                         (index.values, self.codecs.dequantize_indexer(ic, isc, index.values.dtype))):
            dst.index_copy_(0, gam, torch.where(write, new, dst[gam]))
        if m > 1:
            self._keep_pending(i, kv, z, pos0, t)

    def _keep_pending(self, i: int, kv: Tensor, z: Tensor, pos0: Tensor, t: int) -> None:
        """The last m - 1 positions' projections (rows t .. t + m - 2 of kv, z), for the next step."""
        m, (pkv, pz) = self.args.m[i], self.pending[i]
        ar = torch.arange(m - 1, device=kv.device)
        slots = (pos0 + t - (m - 1) + ar) % m
        pkv.index_copy_(0, slots, kv[t + ar])
        pz.index_copy_(0, slots, z[t + ar])
