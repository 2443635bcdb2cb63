"""A differentiable, teacher-forced forward of replay/model.py's Transformer, for training.

``Transformer._run`` is the inference path: no grad, packed FP4/FP8 caches written in place, chunked.
``forward`` here computes the same logits for whole sequences [B, T] from position 0 (tests/replay/test_train.py
checks it against ``_run`` on the same weights) with the caches as straight-through fake-quantized floats
(replay/fakequant.py) and attention batched over sequences with model.attend's blocked arithmetic.

Two things inference does not need and training does:
- ``decoder_from`` [B]: where each sequence's decoder run begins. Inference prefill runs the decoder over
  only the last min(128, n) tokens with its SWA starting there, so training samples that start and takes
  its loss only from positions >= decoder_from (positions before it are computed and ignored).
- the indexer's own signal: top-k is discrete, so the LM loss never reaches the indexer. ``index_kl`` is the
  DeepSeek-V3.2 recipe: KL(head-mean main-attention distribution over the visible entries || softmax of the
  indexer scores), with the indexer's inputs detached, so it trains only the indexer (wq, ww, wik).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from replay.fakequant import fq_indexer, fq_main, fq_swa
from replay.model import (
    _QB,
    FULL,
    REINDEX,
    SWA,
    Attention,
    Compressor,
    Indexer,
    ModelArgs,
    Transformer,
    _rank,
    block_pool,
    n_selectable,
    rope,
    rope_angles,
    select_top_k,
)


class DenseOut(NamedTuple):
    logits: Tensor  # [B, T, V] float32; rows before a sequence's decoder_from are meaningless
    index_kl: Tensor  # scalar: mean indexer KL over the indexer layers (0 if not asked for)


def _lin(mod: nn.Module, x: Tensor) -> Tensor:  # x: [..., fan_in] -> [..., fan_out], via model.Linear
    return mod(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def _rope(x: Tensor, cs: Tensor) -> Tensor:  # x: [B, T, ..., D], cs: [T, 2, r/2]
    return rope(x.transpose(0, 1), cs).transpose(0, 1)


def compress(comp: Compressor, h: Tensor, args: ModelArgs) -> tuple[Tensor, Tensor]:
    """h: [B, T, D] normed -> (main entries [B, G, Dh], indexer keys [B, G, Di]), G = T // m, fake-quantized."""
    b, m = h.shape[0], comp.m
    g = h.shape[1] // m
    kv = _lin(comp.wkv, h[:, : g * m])  # [B, G*m, Dh]
    if comp.wz is not None and comp.ape is not None:
        z = _lin(comp.wz, h[:, : g * m]).view(b, g, m, -1) + comp.ape
        c = (torch.softmax(z, dim=2) * kv.view(b, g, m, -1)).sum(2)  # softmax-gated pooling per channel
    else:
        c = kv
    c = comp.norm(c)
    cs = rope_angles(torch.arange(g, device=h.device) * m, args)
    return fq_main(_rope(c, cs)), fq_indexer(_rope(_lin(comp.wik, c.detach()), cs))


def index_scores(ix: Indexer, h: Tensor, cs: Tensor, keys: Tensor) -> Tensor:
    """h: [B, T, D], keys: [B, N, Di] -> score(t, s) = sum_h w_h ReLU(q_h . k_s): [B, T, N] float32."""
    b, t, nh, di = h.shape[0], h.shape[1], ix.args.index_heads, ix.args.index_dim
    q = _rope(_lin(ix.wq, h).view(b, t, nh, di), cs)
    s = torch.einsum("bthd,bnd->bthn", q, keys).relu()
    w = _lin(ix.ww, h) * (nh * di) ** -0.5  # [B, T, Hi]
    return (s * w[..., None]).sum(2).float()


@torch.no_grad()
def select(att: Attention, scores: Tensor, nvis: Tensor, pool: tuple[Tensor, Tensor] | None
           ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor] | None]:
    """As Attention.select, for every query at once. scores: [B, T, N], nvis: [B, T] -> ((entry ids [B, T, k]
    ascending, valid [B, T, k]), the decoder's candidate pool (ids, valid) [B*T, P] or None)."""
    b, t, n = scores.shape
    k, flat = att.args.top_k, scores.reshape(b * t, n)
    ids = torch.arange(n, device=scores.device).expand(b * t, n)
    nv = nvis.reshape(b * t)
    if att.mode == REINDEX:
        assert pool is not None
        pid, pok = pool
        sel, ok = select_top_k(_rank(flat.gather(1, pid), pid, pok), pid, k)
    else:
        ranked = _rank(flat, ids, ids < nv[:, None])
        if att.mode == FULL:
            sel, ok = select_top_k(ranked, ids, k)
        else:
            pid, pok = pool = block_pool(ranked, nv, att.args)
            sel, ok = select_top_k(ranked.gather(1, pid).masked_fill(~pok, float("-inf")), pid, k)
    return (sel.view(b, t, -1), ok.view(b, t, -1)), pool


def index_kl(q: Tensor, glob: Tensor, vis: Tensor, scores: Tensor, rows: Tensor) -> Tensor:
    """KL(p || softmax(scores)) over visible entries, p = head-mean softmax of the main attention logits.
    q: [B, T, H, Dh], glob: [B, N, Dh], vis: [B, T, N], scores: [B, T, N], rows: [B, T] which queries count."""
    rows = rows & vis.any(-1)
    if not bool(rows.any()):
        return scores.sum() * 0
    with torch.no_grad():
        logit = torch.einsum("bthd,bnd->bhtn", q, glob).float() * q.shape[-1] ** -0.5
        p = torch.softmax(logit.masked_fill(~vis[:, None], float("-inf")), -1).mean(1).nan_to_num_(0.0)  # [B, T, N]
        plogp = torch.where(vis, p * p.clamp_min(1e-30).log(), 0.0).sum(-1)
    logq = torch.log_softmax(scores.masked_fill(~vis, -1e9), -1)
    kl = plogp - torch.where(vis, p * logq, 0.0).sum(-1)  # [B, T]
    return kl[rows].mean()


def attend(q: Tensor, k: Tensor, lo: Tensor, glob: Tensor, glob_ok: Tensor, window: int) -> Tensor:
    """model.attend for a batch of sequences from position 0, with the same blocked arithmetic (so the logits
    equal _run's). q: [B, T, H, D]; k: [B, T, D] (K = V), visible from position lo: [B]; glob: [B, T, k, D],
    glob_ok: [B, T, k]. A row before its lo (a decoder position before decoder_from) sees only itself."""
    (b, t, h, d), qb = q.shape, _QB
    nb, span = -(-t // qb), qb + window - 1
    kbuf = torch.cat([k.new_zeros(b, window - 1, d), k, k.new_zeros(b, nb * qb - t, d)], 1)
    kblk = kbuf.unfold(1, span, qb)  # [B, nb, D, span]: block i sees positions i*QB - window + 1 + [0, span)
    qbuf = torch.cat([q, q.new_zeros(b, nb * qb - t, h, d)], 1)
    s = (qbuf.view(b, nb, qb * h, d) @ kblk).view(b, nb * qb, h, span)[:, :t]  # [B, T, H, span]
    p, j = torch.arange(t, device=q.device)[:, None], torch.arange(span, device=q.device)
    r = p % qb  # column j of row p is position p - r - window + 1 + j
    ok = ((j >= r) & (j < r + window))[None] & (j >= lo[:, None, None] - p + r + window - 1)
    ok = ok | ((j == r + window - 1) & (p < lo[:, None, None]))
    s = torch.cat([s, q @ glob.transpose(-1, -2)], -1) * d**-0.5  # [B, T, H, span + k]
    s = torch.softmax(s.masked_fill(~torch.cat([ok, glob_ok], -1)[:, :, None], float("-inf")), -1)
    pw = torch.cat([s[..., :span], s.new_zeros(b, nb * qb - t, h, span)], 1)
    out = (pw.view(b, nb, qb * h, span) @ kblk.transpose(-1, -2)).view(b, nb * qb, h, d)[:, :t]
    return out + s[..., span:] @ glob


def forward(model: Transformer, tokens: Tensor, decoder_from: Tensor | None = None, use_global: bool = True,
            with_index_kl: bool = False) -> DenseOut:
    """tokens: [B, T] from position 0; decoder_from: [B] (default 0). use_global=False masks every global
    entry (the SWA-only ablation). Returns every position's next-token logits."""
    a, (b, t) = model.args, tokens.shape
    dev, enc = tokens.device, a.n_encoder
    dfrom = torch.zeros(b, dtype=torch.long, device=dev) if decoder_from is None else decoder_from.to(dev)
    pos = torch.arange(t, device=dev)
    cs = rope_angles(pos, a)
    dec_rows = pos[None] >= dfrom[:, None]  # [B, T]: the decoder's loss rows
    caches: dict[int, tuple[Tensor, Tensor]] = {}
    sel: tuple[Tensor, Tensor] | None = None
    pool: tuple[Tensor, Tensor] | None = None
    kls: list[Tensor] = []
    x = model.tok_embeddings(tokens)  # [B, T, D]
    for i, layer in enumerate(model.layers):
        att = layer.attention
        h = layer.attention_norm(x)
        if att.compressor is not None:
            caches[i] = compress(att.compressor, h, a)
        q = _rope(_lin(att.wq, h).view(b, t, a.n_heads, a.head_dim), cs)  # [B, T, H, Dh]
        k = fq_swa(_rope(att.kv_norm(_lin(att.wkv, h)), cs))  # [B, T, Dh]
        glob, glob_ok = k.new_zeros(b, t, 0, a.head_dim), torch.zeros(b, t, 0, dtype=torch.bool, device=dev)
        lo = dfrom if i >= enc else torch.zeros_like(dfrom)  # where this layer's SWA run begins
        if att.mode != SWA:
            main, ikeys = caches[att.src]
            nvis = n_selectable(pos, lo[:, None], a.m[att.src], a).expand(b, t)  # [B, T]
            if att.indexer is not None:
                scores = index_scores(att.indexer, h.detach(), cs, ikeys)
                sel, pool = select(att, scores, nvis, pool)
                if with_index_kl:
                    vis = torch.arange(main.shape[1], device=dev) < nvis[..., None]  # [B, T, N]
                    rows = dec_rows if i >= enc else torch.ones_like(dec_rows)
                    kls.append(index_kl(q.detach(), main.detach(), vis, scores, rows))
            assert sel is not None
            if use_global:  # Reuse layers take the latest selection as it is
                ids, glob_ok = sel
                glob = main.gather(1, ids.reshape(b, -1, 1).expand(-1, -1, a.head_dim)).view(b, t, -1, a.head_dim)
        x = x + _lin(att.wo, attend(q, k, lo, glob, glob_ok, a.window).reshape(b, t, -1))
        x = x + _lin(layer.feed_forward, layer.ffn_norm(x))
    logits = _lin(model.output, model.norm(x)).float()
    kl = torch.stack(kls).mean() if kls else logits.new_zeros(())
    return DenseOut(logits, kl)
