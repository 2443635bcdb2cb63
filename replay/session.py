"""Agent sessions over the kvstore daemon: prefill, decode, save, drop, resume.

Saving sends only what is new: the complete chunks since the last save (their packed global
entries, read straight from the model's caches: nothing is re-encoded) and a manifest with the
trailing tokens and the last 128 token ids. The SWA state is never sent.

Resume modes (../shared/PAPER.md, SWA Bounded Replay):
- ``bounded``:   load the global KV, replay the last ``window`` (128) tokens through every layer (or
  ``replay_tokens``, or the smallest calibrated length that meets a ``max_kl`` budget);
- ``exact``:     load the global KV, replay the last ``n_layers x window`` tokens (exact rebuild);
- ``reprefill``: recompute everything from token 0 (ground truth; fetches the chunks but uses only their token ids).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore import chunk
from kvstore.client import Client
from kvstore.keys import ROOT, chunk_key
from kvstore.manifest import Manifest, Retention
from replay.fidelity import exact_replay_length
from replay.model import SessionState, Transformer

MODES = ("bounded", "exact", "reprefill")
#: Manifest metadata key: where the decoder's current contiguous run began. Replay starts the
#: decoder there (or at the replay start, if later) so its SWA rings cover what the original saw.
DECODER_FROM = "replay.decoder_from"


@dataclass(frozen=True)
class SaveReport:
    new_chunks: int  # chunks sent this save
    written: int  # chunks the daemon did not have yet (the rest were shared or resent)
    bytes_sent: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class ResumeReport:
    mode: str
    tokens: int  # session length
    replayed: int  # tokens run through the model
    fetch_s: float  # manifest + chunks from the daemon (and chain verification)
    install_s: float  # packed entries into the model's caches (incl. dequantize)
    replay_s: float
    bytes_fetched: int
    #: the checkpoint's calibrated error at this replay length (replay/calibration.py): mean and worst KL in
    #: nats per next-token distribution, against the never-evicted session; 0 when the replay is exact
    #: (R >= replay.fidelity.exact_replay_length); None for re-prefill and for weights without a calibration table
    expected_mean_kl: float | None = None
    expected_max_kl: float | None = None

    @property
    def total_s(self) -> float:
        return self.fetch_s + self.install_s + self.replay_s


class ResumeError(RuntimeError):
    """The store cannot give back this session intact (a chunk is missing or fails verification)."""


def chunk_entries(state: SessionState, t0: int, t1: int) -> dict[str, chunk.Entries]:
    """The packed entries of tokens [t0, t1) of every persisted cache (t0 a multiple of every m)."""
    out = {}
    for c in state.layout.caches:
        codes, scales = state.global_entries(c.name, t0 // c.m, t0 // c.m + (t1 - t0) // c.m)
        out[c.name] = chunk.Entries.of(codes, scales)
    return out


class AgentSession:
    """One agent's sequence: the model state, the tokens so far, and what the store already holds."""

    def __init__(self, model: Transformer, client: Client, namespace: str, session_id: str,
                 metadata: dict[str, str] | None = None) -> None:
        self.model = model
        self.client = client
        self.namespace = namespace
        self.session_id = session_id
        self.metadata = dict(metadata or {})
        self.layout = model.args.layout
        self.chunk_tokens = int(client.info().chunk_tokens)
        self.state: SessionState | None = model.new_state()
        self.tokens: list[int] = []
        self.saved_keys: list[bytes] = []  # keys of the complete chunks the store holds, in order
        self.last_logits: torch.Tensor | None = None  # next-token logits after the last token fed

    # -- running the model ------------------------------------------------------------------------
    def _live(self) -> SessionState:
        if self.state is None:
            raise RuntimeError("session state was dropped; resume it first")
        return self.state

    def prefill(self, tokens: Sequence[int], chunk_size: int = 512) -> torch.Tensor:
        logits = self.model.prefill(list(tokens), self._live(), chunk_size=chunk_size)
        self.tokens.extend(int(t) for t in tokens)
        self.last_logits = logits
        return logits

    def step(self, token: int) -> torch.Tensor:
        """Feed one token; returns the next-token logits."""
        logits = self.model.decode_one_token(int(token), self._live())
        self.tokens.append(int(token))
        self.last_logits = logits
        return logits

    def generate(self, logits: torch.Tensor, n: int) -> list[int]:
        """Greedy-decode ``n`` tokens starting from ``logits``."""
        out = []
        for _ in range(n):
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits = self.step(tok)
        return out

    def drop(self) -> None:
        """Forget all local state (what an inference worker does when it evicts a session)."""
        self.state = None

    # -- saving -----------------------------------------------------------------------------------
    def save(self, retention_pinned: bool = False) -> SaveReport:
        t0 = time.perf_counter()
        state, ct, lay = self._live(), self.chunk_tokens, self.layout
        n_full = len(self.tokens) // ct
        first = len(self.saved_keys)
        blobs, new_keys, parent = [], [], self.saved_keys[-1] if self.saved_keys else ROOT
        for i in range(first, n_full):
            ids = np.asarray(self.tokens[i * ct : (i + 1) * ct], dtype=np.uint32)
            key = chunk_key(lay.layout_id, self.namespace, parent, ids)
            blobs.append(chunk.encode(lay, key=key, start=i * ct, token_ids=ids,
                                      entries=chunk_entries(state, i * ct, (i + 1) * ct)))
            new_keys.append(key)
            parent = key
        tail_ids = np.asarray(self.tokens[n_full * ct :], dtype=np.uint32)
        tail = chunk.encode(lay, key=bytes(16), start=n_full * ct, token_ids=tail_ids,
                            entries=chunk_entries(state, n_full * ct, len(self.tokens)))
        manifest = Manifest(
            session_id=self.session_id, namespace=self.namespace, layout_id=lay.layout_id,
            token_count=len(self.tokens), chunk_tokens=ct, chunk_keys=(*self.saved_keys, *new_keys), tail=tail,
            last_token_ids=tuple(self.tokens[-self.model.args.window :]),
            retention=Retention(pinned=retention_pinned),
            metadata={**self.metadata, DECODER_FROM: str(state.decoder_from)},
        )
        # one call: the new chunks and the manifest, one durable commit (nothing stored if it fails)
        res = self.client.save_session(manifest, blobs)
        self.saved_keys = list(res.manifest.chunk_keys)
        written = res.written
        sent = sum(len(b) for b in blobs) + len(tail)
        return SaveReport(len(blobs), written, sent, len(self.tokens), time.perf_counter() - t0)

    # -- resuming ---------------------------------------------------------------------------------
    @classmethod
    def resume(cls, model: Transformer, client: Client, namespace: str, session_id: str,
               mode: str = "bounded", replay_tokens: int | None = None, max_kl: float | None = None
               ) -> tuple[AgentSession, ResumeReport]:
        """Rebuild a session from the store. ``replay_tokens`` overrides the mode's replay length; ``max_kl``
        (bounded only) picks the smallest replay length whose calibrated mean KL meets that budget, from the
        checkpoint's calibration table (``model.calibration``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cal = model.calibration
        if max_kl is not None:
            if mode != "bounded" or replay_tokens is not None:
                raise ValueError("max_kl picks a bounded resume's replay length: give it alone, with mode='bounded'")
            if cal is None:
                raise ValueError("max_kl needs a calibrated checkpoint (model.calibration is None: random weights?)")
            replay_tokens = cal.pick(max_kl).replay_tokens
        t0 = time.perf_counter()
        manifest, stream = client.load_session(namespace, session_id, zero_copy=True)
        lay = model.args.layout
        if manifest.layout_id != lay.layout_id:
            raise ResumeError(f"session {session_id} was saved under another layout than this model's ({lay.name})")
        chunks = [chunk.decode(blob, lay) for _, blob in stream]
        tail = chunk.decode(manifest.tail, lay)
        tokens = _verified_tokens(manifest, chunks, tail, namespace)
        fetch_s = time.perf_counter() - t0
        fetched = sum(c.header.total_bytes for c in chunks) + len(manifest.tail)

        meta = {k: v for k, v in manifest.metadata.items() if k != DECODER_FROM}
        sess = cls(model, client, namespace, session_id, meta)
        sess.tokens, sess.saved_keys = tokens, list(manifest.chunk_keys)
        state = sess.state
        assert state is not None
        window, n = model.args.window, len(tokens)
        default = {"bounded": window, "exact": window * model.args.n_layers, "reprefill": n}[mode]
        r = n if mode == "reprefill" else min(n, replay_tokens if replay_tokens is not None else default)
        t1 = time.perf_counter()
        if mode != "reprefill":
            for c in lay.caches:
                parts = [ch.entries[c.name] for ch in chunks] + [tail.entries[c.name]]
                codes = torch.from_numpy(np.concatenate([p.codes for p in parts]))
                scales = torch.from_numpy(np.concatenate([p.scales for p in parts]))
                state.load_global(c.name, codes, scales)
        t2 = time.perf_counter()
        if mode == "reprefill":
            sess.last_logits = model.prefill(tokens, state, chunk_size=512)
        else:
            decoder_from = min(int(manifest.metadata.get(DECODER_FROM, n - min(n, window))), n - 1)
            sess.last_logits = model.replay(state, tokens[n - r :], start_pos=n - r, decoder_from=decoder_from)
            # The session's decoder run began at decoder_from whatever suffix was replayed (and replay leaves
            # state.decoder_from unset when the decoder starts with the replay); a later save must say so, or
            # the next exact resume would rebuild another decoder window than the never-evicted session had.
            state.decoder_from = decoder_from
        t3 = time.perf_counter()
        exact = mode != "reprefill" and r >= exact_replay_length(n, state.decoder_from, model.args)
        expected = (0.0, 0.0) if exact else None  # (a re-prefill differs from a session that decoded: None)
        if expected is None and cal is not None and mode == "bounded":
            row = cal.expected(r)
            expected = (row.mean_kl, row.max_kl)
        return sess, ResumeReport(mode, n, r, fetch_s, t2 - t1, t3 - t2, fetched, *(expected or (None, None)))


def _verified_tokens(m: Manifest, chunks: list[chunk.Chunk], tail: chunk.Chunk, namespace: str) -> list[int]:
    """All token ids of the session, after checking every chunk against the manifest's key chain:
    a chunk whose token ids do not hash to the key the manifest names is never used."""
    if len(chunks) != len(m.chunk_keys):
        raise ResumeError(f"the store returned {len(chunks)} of {len(m.chunk_keys)} chunks (evicted or corrupted)")
    parent = ROOT
    ids: list[int] = []
    for i, (c, want) in enumerate(zip(chunks, m.chunk_keys)):
        got = chunk_key(m.layout_id, namespace, parent, c.token_ids)
        if got != want or c.key != want or c.start != i * m.chunk_tokens:
            raise ResumeError(f"chunk {i} does not match the session's key chain")
        ids.extend(c.token_ids.tolist())
        parent = want
    if tail.start != len(ids) or tail.token_count != m.tail_tokens:
        raise ResumeError("the trailing span does not continue the chunks")
    ids.extend(tail.token_ids.tolist())
    if tuple(ids[-len(m.last_token_ids):] if m.last_token_ids else ()) != tuple(m.last_token_ids):
        raise ResumeError("the manifest's last token ids disagree with its chunks")
    return ids
