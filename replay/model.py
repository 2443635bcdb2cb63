"""The tiny-16 / tiny-8 reference model of shared/MINIATURE.md, one flat file in gpt-fast style.

Everything that shapes DeepSeek-V4.1-Flash's KV cache is kept: a causal encoder-decoder whose decoder
global KV is projected from H_{L/2}; per-layer SWA (window 128, FP8); CSA2 global entries (m=2 encoder,
m=1 decoder) held as the packed FP4 bytes the store persists; Full / Reuse / Reindex layers; a top-k
indexer and the decoder's block candidate pool. A token's arithmetic never depends on how the sequence
was chunked (see _mm and attend), so chunked prefill and replay are bit-identical to one shot on CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from kvstore.format import quant
from kvstore.format.layout import Layout, get_layout
from replay.cache import SessionState
from replay.calibration import Calibration

SWA, FULL, REUSE, REINDEX, DEC_FULL = "S", "F", "U", "X", "F*"
_NONE = 1 << 62  # sorts after every real entry id
_QB = 16  # SWA query block


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 16
    n_heads: int = 4
    head_dim: int = 128  # one KV head, K = V
    rope_dim: int = 16  # the last 16 dims of every rotated vector
    rope_base: float = 10000.0
    window: int = 128
    ffn_dim: int = 512
    norm_eps: float = 1e-6
    m: tuple[int, ...] = (0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1)
    modes: tuple[str, ...] = ("S", "S", "F", "U", "F", "U", "F", "U", "F*", "U", "X", "U", "X", "U", "X", "U")
    index_heads: int = 4
    index_dim: int = 32
    top_k: int = 32
    pool_blocks: int = 32
    block_size: int = 8
    layout_name: str = "tiny-16"
    # Global entries inside the query's own SWA window (MINIATURE.md is silent; docs/MODEL.md): False keeps them
    # selectable (the spec's literal rule, counted twice: FP8 via SWA, FP4 via the selection); True drops from
    # the indexer's candidates every entry whose tokens all lie in the window the query's SWA really sees.
    exclude_in_window: bool = False

    @classmethod
    def tiny16(cls, **kw: object) -> ModelArgs:
        return cls(**kw)  # type: ignore[arg-type]

    @classmethod
    def tiny8(cls, **kw: object) -> ModelArgs:
        tiny8 = {"n_layers": 8, "m": (0, 0, 2, 2, 1, 1, 1, 1), "modes": ("S", "S", "F", "U", "F*", "U", "X", "U"),
                 "layout_name": "tiny-8"}
        return cls(**{**tiny8, **kw})  # type: ignore[arg-type]

    @property
    def n_encoder(self) -> int:
        return self.n_layers // 2

    @property
    def layout(self) -> Layout:
        return get_layout(self.layout_name)

    def source(self, layer: int) -> int:
        """The Full layer whose global caches ``layer`` attends to (-1 for SWA-only layers)."""
        if self.modes[layer] == SWA:
            return -1
        return max(i for i in range(layer + 1) if self.modes[i] in (FULL, DEC_FULL))

    def __post_init__(self) -> None:
        enc = self.n_encoder
        want = [(SWA, FULL, REUSE)] * enc + [(DEC_FULL,)] + [(REUSE, REINDEX)] * (self.n_layers - enc - 1)
        if len(self.m) != self.n_layers or [mode in w for mode, w in zip(self.modes, want, strict=True)].count(False):
            raise ValueError(f"modes {self.modes}: need S/F/U in the encoder, then F*, then U/X (and one m per layer)")
        for i, mode in enumerate(self.modes):
            if (mode == SWA) != (self.m[i] == 0) or (mode != SWA and self.m[i] != self.m[self.source(i)]):
                raise ValueError(f"layer {i}: m={self.m[i]} does not fit mode {mode!r} and its source layer")
        caches = {(f"{kind}.L{i}", self.m[i], dim) for i, mode in enumerate(self.modes) if mode in (FULL, DEC_FULL)
                  for kind, dim in (("main", self.head_dim), ("index", self.index_dim))}
        if caches != {(c.name, c.m, c.channels) for c in self.layout.caches}:
            raise ValueError(f"layout {self.layout_name} does not describe this model's global caches")


def check_token_ids(tokens: Tensor | list[int], vocab_size: int) -> None:
    """ValueError naming the first id outside [0, vocab_size), instead of torch's IndexError from the
    embedding (or a device-side assert on CUDA). A tensor costs one min/max (a host sync on a GPU)."""
    if isinstance(tokens, Tensor):
        if not tokens.numel():
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        bad = lo if lo < 0 else hi if hi >= vocab_size else None
    else:
        bad = next((int(t) for t in tokens if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside this model's vocabulary: ids are 0 to {vocab_size - 1} "
                         f"(vocab_size {vocab_size})")


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a: [M, K], b: [N, K] -> [M, N]. BLAS switches kernels (and summation order) for small or odd M
    and N; padding both to multiples of 16 keeps every element independent of the chunk size."""
    m, n = a.shape[0], b.shape[0]
    pm, pn = -(-max(m, 1) // 16) * 16 - m, -(-max(n, 1) // 16) * 16 - n
    a, b = F.pad(a, (0, 0, 0, pm)) if pm else a, F.pad(b, (0, 0, 0, pn)) if pn else b
    return (a @ b.T)[:m, :n]


def rope_angles(pos: Tensor, args: ModelArgs) -> Tensor:
    """pos: [T] -> (cos, sin) of every rotary frequency, [T, 2, rope_dim/2]."""
    inv = args.rope_base ** -(torch.arange(0, args.rope_dim, 2, device=pos.device) / args.rope_dim)
    ang = pos.double()[:, None] * inv.double()
    return torch.stack([ang.cos(), ang.sin()], 1).float()


def rope(x: Tensor, cs: Tensor) -> Tensor:
    """Rotate the last rope_dim dims of x: [T, ..., D] by cs: [T, 2, rope_dim/2] (rotate-half pairs)."""
    half = cs.shape[-1]
    cos, sin = (cs[:, i].view(cs.shape[0], *([1] * (x.dim() - 2)), half).to(x.dtype) for i in (0, 1))
    x1, x2 = x[..., -2 * half:-half], x[..., -half:]
    return torch.cat([x[..., :-2 * half], x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Linear(nn.Linear):
    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__(fan_in, fan_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, fan_in] -> [T, fan_out]
        return _mm(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Compressor(nn.Module):
    """A Full layer's global-entry writer: m tokens -> one main entry (FP4) + one indexer key (FP4)."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.args, self.layer_id, self.m = args, layer_id, args.m[layer_id]
        self.wkv = Linear(args.dim, args.head_dim)
        self.wz = Linear(args.dim, args.head_dim) if self.m > 1 else None
        self.ape = nn.Parameter(torch.zeros(self.m, args.head_dim)) if self.m > 1 else None
        self.norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wik = Linear(args.head_dim, args.index_dim)

    def project(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h: [T, D] normed input -> (kv, gate z): [T, Dh] each (z is kv itself when m = 1)."""
        kv = self.wkv(h)
        return kv, self.wz(h) if self.wz is not None else kv

    def encode(self, kv: Tensor, z: Tensor, gpos: Tensor) -> tuple[Tensor, Tensor]:
        """Groups kv, z: [G, m, Dh] first at positions gpos: [G] -> (main entries [G, Dh], indexer keys
        [G, Di]), rotated, before quantization. Shared by the eager path and replay/fast_decode.py."""
        c = (torch.softmax(z + self.ape, dim=1) * kv).sum(1) if self.ape is not None else kv[:, 0]
        c = self.norm(c)  # softmax-gated pooling, per channel, then RMSNorm: [G, Dh]
        cs = rope_angles(gpos, self.args)
        return rope(c, cs), rope(self.wik(c), cs)

    def forward(self, h: Tensor, pos0: int, state: SessionState) -> None:  # h: [T, D] normed input
        m, dh = self.m, self.args.head_dim
        kv, z = self.project(h)  # [T, Dh]
        start = pos0
        if self.layer_id in state.pending:
            pkv, pz, start = state.pending.pop(self.layer_id)
            kv, z = torch.cat([pkv, kv]), torch.cat([pz, z])
        skip = (-start) % m  # the rest of a group begun before a replay's first token: it is loaded
        kv, z, start = kv[skip:], z[skip:], start + skip
        groups = kv.shape[0] // m
        if kv.shape[0] > groups * m:
            state.pending[self.layer_id] = (kv[groups * m:], z[groups * m:], start + groups * m)
        main, index = state.caches[f"main.L{self.layer_id}"], state.caches[f"index.L{self.layer_id}"]
        g0 = start // m
        first = max(0, main.n - g0)  # entries already in the cache (loaded on resume) are kept
        if first >= groups:
            return
        assert g0 <= main.n == index.n, "global cache has a hole before the new entries"
        gpos = torch.arange(g0 + first, g0 + groups, device=h.device) * m
        c, ik = self.encode(kv[first * m:groups * m].view(-1, m, dh), z[first * m:groups * m].view(-1, m, dh), gpos)
        main.write(g0 + first, *quant.quantize_main(c))
        index.write(g0 + first, *quant.quantize_indexer(ik))


class Indexer(nn.Module):
    """score(t, s) = sum_h w_h(t) ReLU(q_h(t) . k_s); q rotated like the keys."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.wq = Linear(args.dim, args.index_heads * args.index_dim)
        self.ww = Linear(args.dim, args.index_heads)

    def forward(self, h: Tensor, cs: Tensor, keys: Tensor) -> Tensor:
        """h: [T, D]; keys: [N, Di] shared by every query or [T, P, Di] one pool per query -> [T, N or P]."""
        t, nh, di = h.shape[0], self.args.index_heads, self.args.index_dim
        q = rope(self.wq(h).view(t, nh, di), cs)  # [T, Hi, Di]
        s = _mm(q.reshape(t * nh, di), keys).view(t, nh, -1) if keys.dim() == 2 else q @ keys.transpose(1, 2)
        w = self.ww(h) * (nh * di) ** -0.5  # [T, Hi]
        return (s.relu_() * w[..., None]).sum(1).float()


def n_selectable(pos: Tensor, win_lo: Tensor, m: int, args: ModelArgs) -> Tensor:
    """Entries [0, n) of an m-ratio cache a query at ``pos`` may select: group g is visible iff g < (p+1)//m;
    with ``exclude_in_window`` also only groups with a token before the query's SWA window, which starts at
    max(win_lo, p - window + 1) (win_lo: where the layer's SWA run began). Shapes broadcast."""
    nvis = (pos + 1) // m
    if not args.exclude_in_window:
        return nvis
    first = torch.maximum(pos - args.window + 1, win_lo)
    return torch.minimum(nvis, -(-first // m))


def _rank(scores: Tensor, ids: Tensor, ok: Tensor) -> Tensor:
    # Ties (entries whose every head is ReLU-zero) go to the newest entry, whatever the tensor shapes.
    return (scores + ids * 1e-30).masked_fill(~ok, float("-inf"))


def select_top_k(ranked: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """ranked, ids: [T, N] -> (entry ids [T, k] ascending, valid [T, k]); fewer than k if fewer exist."""
    if ranked.shape[1] < k:
        ranked = F.pad(ranked, (0, k - ranked.shape[1]), value=float("-inf"))
        ids = F.pad(ids, (0, k - ids.shape[1]))
    val, j = ranked.topk(k, dim=1)
    sel = ids.gather(1, j).masked_fill(val == float("-inf"), _NONE).sort(1).values
    return sel.masked_fill(sel == _NONE, 0), sel != _NONE


def block_pool(ranked: Tensor, nvis: Tensor, args: ModelArgs) -> tuple[Tensor, Tensor]:
    """Decoder Full layer: keep the pool_blocks blocks of block_size entries with the best max score,
    the newest block always. ranked: [T, N] -> (entry ids [T, P], valid [T, P])."""
    t, n, bs = ranked.shape[0], ranked.shape[1], args.block_size
    nb = -(-n // bs)
    best = F.pad(ranked, (0, nb * bs - n), value=float("-inf")).view(t, nb, bs).amax(-1)  # [T, nb]
    best = best.scatter(1, ((nvis - 1).clamp_min(0) // bs)[:, None], float("inf"))  # nvis = 0: nothing is valid
    blocks = best.topk(min(args.pool_blocks, nb), dim=1).indices  # [T, B]
    pool = (blocks[..., None] * bs + torch.arange(bs, device=ranked.device)).flatten(1)
    return pool.clamp(max=n - 1), pool < nvis[:, None]


def attend(q: Tensor, pos: Tensor, ext: Tensor, e0: int, glob: Tensor, glob_ok: Tensor, window: int) -> Tensor:
    """Softmax over each query's SWA window (ext: [E, D], positions [e0, pos0+T)) and its selected global
    entries (glob: [T, k, D], glob_ok: [T, k]); K = V. q: [T, H, D] -> [T, H, D]."""
    (t, _, d), pos0 = q.shape, int(pos[0])
    r0 = pos0 % _QB  # row of the first query in its block
    k0 = pos0 - r0 - window + 1  # position of kbuf[0]
    kbuf = q.new_zeros(-(-(r0 + t) // _QB) * _QB + window - 1, d)
    kbuf[e0 - k0:e0 - k0 + ext.shape[0]] = ext
    return attend_blocks(q, pos, kbuf, e0, glob, glob_ok, window)


def attend_blocks(q: Tensor, pos: Tensor, kbuf: Tensor, e0: int | Tensor, glob: Tensor, glob_ok: Tensor,
                  window: int) -> Tensor:
    """attend's arithmetic, free of host syncs (replay/fast_decode.py captures it in CUDA graphs). kbuf:
    [nb * _QB + window - 1, D] holds the keys of positions k0 + i, k0 = pos0 - pos0 % _QB - window + 1 (zero
    where there is none); block i of _QB queries sees kbuf[i*_QB : i*_QB + span]. Queries go in blocks aligned
    to absolute positions, so every query's arithmetic is the same whatever the chunking."""
    t, h, d = q.shape
    nb, span = (kbuf.shape[0] - window + 1) // _QB, _QB + window - 1
    rows = pos - (pos[:1] - pos[:1] % _QB)  # [T]: each query's row in the block grid
    kblk = kbuf.unfold(0, span, _QB)  # [nb, D, span]
    qbuf = q.new_zeros(nb * _QB, h, d).index_copy_(0, rows, q)
    s = (qbuf.view(nb, _QB * h, d) @ kblk).view(nb * _QB, h, span).index_select(0, rows)  # [T, H, span]
    p, j = pos[:, None], torch.arange(span, device=q.device)
    r = p % _QB  # column j of row p is position p - r - window + 1 + j
    ok = (j >= r) & (j < r + window) & (j >= e0 - p + r + window - 1)
    s = torch.cat([s, q @ glob.transpose(1, 2)], -1) * d**-0.5  # [T, H, span + k]
    s = torch.softmax(s.masked_fill(~torch.cat([ok, glob_ok], 1)[:, None], float("-inf")), -1)
    pw = q.new_zeros(nb * _QB, h, span).index_copy_(0, rows, s[..., :span])
    out = (pw.view(nb, _QB * h, span) @ kblk.transpose(1, 2)).view(nb * _QB, h, d).index_select(0, rows)
    return out + s[..., span:] @ glob


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.args, self.layer_id, self.mode, self.src = args, layer_id, args.modes[layer_id], args.source(layer_id)
        self.wq = Linear(args.dim, args.n_heads * args.head_dim)
        self.wkv = Linear(args.dim, args.head_dim)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim)
        self.compressor = Compressor(args, layer_id) if self.mode in (FULL, DEC_FULL) else None
        self.indexer = Indexer(args) if self.mode in (FULL, DEC_FULL, REINDEX) else None

    def qk(self, h: Tensor, cs: Tensor) -> tuple[Tensor, Tensor]:
        """h: [T, D] -> (q: [T, H, Dh], k: [T, Dh]), rotated; k is the SWA key before its FP8 round trip."""
        t, a = h.shape[0], self.args
        return rope(self.wq(h).view(t, a.n_heads, a.head_dim), cs), rope(self.kv_norm(self.wkv(h)), cs)

    def forward(self, h: Tensor, pos: Tensor, cs: Tensor, state: SessionState,
                ctx: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        q, k = self.qk(h, cs)
        ext, e0 = state.rings[self.layer_id].push(k, int(pos[0]))
        if self.indexer is not None:
            index = state.caches[f"index.L{self.src}"]
            ctx["topk"] = self.select(h, pos, cs, index.values[:index.n], pos.new_tensor(e0), ctx)
        glob, glob_ok = self.selected(state, k, ctx)
        return self.wo(attend(q, pos, ext, e0, glob, glob_ok, self.args.window).reshape(h.shape[0], -1))

    def selected(self, state: SessionState, k: Tensor, ctx: dict[str, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The global entries this layer attends to, [T, k, Dh], and which are valid, [T, k] (none for SWA
        layers; k: [T, Dh] gives the shape). Reuse layers take the latest selection as it is."""
        if self.mode == SWA:
            return k.new_zeros(k.shape[0], 0, k.shape[1]), torch.zeros(k.shape[0], 0, dtype=torch.bool, device=k.device)
        sel, ok = ctx["topk"]
        return state.caches[f"main.L{self.src}"].values[sel], ok

    def select(self, h: Tensor, pos: Tensor, cs: Tensor, keys: Tensor, win_lo: Tensor,
               ctx: dict[str, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Top-k entries of the source's indexer keys [N, Di] (entries [0, N); those not yet selectable are
        masked, so N may be a fixed capacity). win_lo: where this layer's SWA run began (0-d tensor)."""
        assert self.indexer is not None
        k = self.args.top_k
        nvis = n_selectable(pos, win_lo, self.args.m[self.src], self.args)  # [T]
        if self.mode == REINDEX:
            pool, pool_ok = ctx["pool"]
            return select_top_k(_rank(self.indexer(h, cs, keys[pool]), pool, pool_ok), pool, k)
        ids = torch.arange(keys.shape[0], device=h.device).expand(h.shape[0], -1)  # [T, N]
        ranked = _rank(self.indexer(h, cs, keys), ids, ids < nvis[:, None])
        if self.mode == FULL:
            return select_top_k(ranked, ids, k)
        pool, pool_ok = ctx["pool"] = block_pool(ranked, nvis, self.args)
        return select_top_k(ranked.gather(1, pool).masked_fill(~pool_ok, float("-inf")), pool, k)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1, self.w3 = Linear(args.dim, args.ffn_dim), Linear(args.dim, args.ffn_dim)
        self.w2 = Linear(args.ffn_dim, args.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(args.dim, args.norm_eps), RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)

    def compress(self, x: Tensor, pos: Tensor, state: SessionState) -> None:
        """Full layers: write the global entries completed by these tokens (before anyone attends)."""
        if self.attention.compressor is not None:
            self.attention.compressor(self.attention_norm(x), int(pos[0]), state)

    def forward(self, x: Tensor, pos: Tensor, cs: Tensor, state: SessionState,
                ctx: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        x = x + self.attention(self.attention_norm(x), pos, cs, state, ctx)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, seed: int = 0, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():  # norms stay 1; matrices ~ N(0, 1/fan_in)
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        self.to(device=device, dtype=dtype)
        self.calibration: Calibration | None = None  # a trained checkpoint's measured R -> error table

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    def new_state(self, max_len: int = 0) -> SessionState:
        """max_len > 0: global caches preallocated for that many tokens (see SessionState)."""
        return SessionState(self.args, self.device, self.output.weight.dtype, max_len)

    def prefill(self, tokens: Tensor | list[int], state: SessionState, chunk_size: int = 256,
                all_logits: bool = False) -> Tensor:
        """Append tokens: the encoder runs over all of them, the decoder over the last min(window, n).
        Returns the last token's logits [V] (all_logits: [n_decoder, V], one per decoder position)."""
        n = len(tokens)
        return self._run(tokens, state, state.pos + n - min(n, self.args.window), chunk_size, all_logits)

    def decode_one_token(self, token: int | Tensor, state: SessionState) -> Tensor:
        """One token through every layer -> logits [V]."""
        return self._run([int(token)], state, state.pos, 1, False)

    def decode_tokens(self, tokens: Tensor | list[int], state: SessionState, decoder_from: int | None = None,
                      chunk_size: int = 256) -> Tensor:
        """Teacher-forced decode: append tokens with the decoder over every one of them, continuing its run
        (or starting one at ``decoder_from``). Equals decode_one_token in a loop; logits [n_decoder, V]."""
        return self._run(tokens, state, state.pos if decoder_from is None else decoder_from, chunk_size, True)

    def replay(self, state: SessionState, tokens: Tensor | list[int], start_pos: int,
               decoder_from: int | None = None, chunk_size: int = 256) -> Tensor:
        """Rebuild every SWA ring (and the compressors' pending tokens) from tokens [start_pos, end) over
        the loaded global caches; SWA sees only the replayed span and loaded entries are never rewritten.
        The decoder runs over the last min(window, R) tokens, or from ``decoder_from`` (a saved
        ``state.decoder_from``) to match a session that decoded. Returns the last token's logits [V]."""
        dec = self.prepare_replay(state, len(tokens), start_pos, decoder_from)
        return self._run(tokens, state, dec, chunk_size, False)

    def prepare_replay(self, state: SessionState, n: int, start_pos: int, decoder_from: int | None) -> int:
        """Check the loaded global caches cover a replay of n tokens from start_pos, reset the SWA rings and
        pending tokens to start there, and return where the decoder starts (replay's first half)."""
        end = start_pos + n
        if start_pos < 0 or n == 0:
            raise ValueError("replay needs start_pos >= 0 and at least one token")
        for spec in self.args.layout.caches:
            need, most = min(-(-start_pos // spec.m), end // spec.m), end // spec.m
            have = state.n_entries(spec.name)
            if not need <= have <= most or have != state.n_entries("main." + spec.name.split(".")[1]):
                raise ValueError(f"{spec.name}: {have} entries loaded; replaying tokens [{start_pos}, {end}) "
                                 f"needs {need} to {most}, the same count in main and index")
        state.pos = start_pos
        state.pending.clear()
        for ring in state.rings:
            ring.reset(start_pos)
        dec = end - min(n, self.args.window) if decoder_from is None else max(start_pos, decoder_from)
        if dec >= end:
            raise ValueError(f"decoder_from {decoder_from} leaves no token for the decoder")
        return dec

    @torch.no_grad()
    def _run(self, tokens: Tensor | list[int], state: SessionState, dec_start: int, chunk_size: int,
             all_logits: bool) -> Tensor:
        check_token_ids(tokens if isinstance(tokens, Tensor) else list(tokens), self.args.vocab_size)
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).flatten()
        if tokens.numel() == 0 or chunk_size < 1:
            raise ValueError("need at least one token and chunk_size >= 1")
        enc, start, end = self.args.n_encoder, state.pos, state.pos + tokens.numel()
        if state.rings[enc].hi != dec_start:  # the decoder's SWA sees only its own contiguous run
            for ring in state.rings[enc:]:
                ring.reset(dec_start)
            state.decoder_from = dec_start
        out = []
        for a in range(start, end, chunk_size):
            b = min(a + chunk_size, end)
            pos = torch.arange(a, b, device=self.device)
            cs = rope_angles(pos, self.args)  # [T, 2, rope_dim/2]
            x = self.tok_embeddings(tokens[a - start:b - start])  # x: [T, D]
            ctx: dict[str, tuple[Tensor, Tensor]] = {}
            for layer in self.layers[:enc]:
                layer.compress(x, pos, state)
                x = layer(x, pos, cs, state, ctx)
            self.layers[enc].compress(x, pos, state)  # decoder global KV from H_{L/2}, every token
            d = max(0, dec_start - a)
            if d < b - a:
                x, pos, cs = x[d:], pos[d:], cs[d:]
                for layer in self.layers[enc:]:
                    x = layer(x, pos, cs, state, ctx)
                out.append(x if all_logits else x[-1:])
            state.pos = b
        logits = self.output(self.norm(torch.cat(out))).float()
        return logits if all_logits else logits[-1]

    def save_checkpoint(self, path: str | Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"model_args": json.dumps(asdict(self.args))})

    @classmethod
    def load_checkpoint(cls, path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype = torch.float32) -> Transformer:
        with safe_open(str(path), framework="pt") as f:
            raw = json.loads(f.metadata()["model_args"])
        args = ModelArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        model = cls(args, device=device, dtype=dtype)
        model.load_state_dict(load_file(str(path)))
        if (cal := Calibration.path_for(Path(path))).exists():
            model.calibration = Calibration.load(cal)
        return model
