"""Agent sessions over the kvstore daemon: prefill, decode, save, drop, resume.

Saving sends only what is new: the complete chunks since the last save (their packed global
entries, read straight from the model's caches: nothing is re-encoded) and a manifest with the
trailing tokens and the last 128 token ids. The SWA state is never sent.

Resume modes (../shared/PAPER.md, SWA Bounded Replay):
- ``bounded``:   load the global KV, replay the last ``window`` (128) tokens through every layer (or
  ``replay_tokens``, or the smallest calibrated length that meets a ``max_kl`` budget);
- ``exact``:     load the global KV, replay the last ``n_layers x window`` tokens (exact rebuild);
- ``reprefill``: recompute everything from token 0 (ground truth; fetches the chunks but uses only their token ids).

A chunk the manifest names but the load does not deliver verified (the daemon refused it: a copy
damaged since, stored token ids that differ from its key's; a ``Lookup`` counts such a chunk, since
it reads no bytes) is counted in the report (``refused_chunks``). The global KV before the first
such chunk is used; from there on the model recomputes it from the caller's own record of the
session's tokens (``token_ids``, checked against the manifest's key chain), or the resume fails
with ResumeError saying so. An empty session resumes as an empty model state.

A session remembers the version it saved or resumed and names it as the base of its next save: a
save over a version another writer saved meanwhile fails (FailedPrecondition), nothing replaced.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.client import Client
from kvstore.format import chunk
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.layout import Layout
from kvstore.format.manifest import Manifest, Retention
from kvstore.transport.framing import Blob
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
    #: chunks the manifest promised that the load did not deliver verified (refused by the daemon, or by the
    #: client's key-chain check); the global KV from the first of them on was recomputed from ``token_ids``
    refused_chunks: int = 0
    #: where the loaded global KV ended (``tokens`` unless chunks were refused): recomputed from there on
    loaded_tokens: int | None = None

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
        #: the stored version this session last saved or resumed (0: none yet): its next save's base
        self.generation = 0

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
        # one call: the new chunks and the manifest, one durable commit (nothing stored if it fails), replacing
        # only the version this session saved or resumed (FailedPrecondition if another writer saved since)
        res = self.client.save_session(manifest, blobs, base=self.generation)
        self.saved_keys = list(res.manifest.chunk_keys)
        self.generation = res.manifest.generation
        written = res.written
        sent = sum(len(b) for b in blobs) + len(tail)
        return SaveReport(len(blobs), written, sent, len(self.tokens), time.perf_counter() - t0)

    # -- resuming ---------------------------------------------------------------------------------
    @classmethod
    def resume(cls, model: Transformer, client: Client, namespace: str, session_id: str,
               mode: str = "bounded", replay_tokens: int | None = None, max_kl: float | None = None,
               token_ids: Sequence[int] | None = None) -> tuple[AgentSession, ResumeReport]:
        """Rebuild a session from the store. ``replay_tokens`` overrides the mode's replay length; ``max_kl``
        (bounded only) picks the smallest replay length whose calibrated mean KL meets that budget, from the
        checkpoint's calibration table (``model.calibration``). ``token_ids``: the caller's record of the
        session's tokens, used only if the store refuses chunks the manifest names (see the module docstring)."""
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
        chunks, refused = _verified_prefix(manifest, stream, lay, namespace)
        try:
            tail = chunk.decode(manifest.tail, lay)
        except chunk.ChunkError as e:
            raise ResumeError(f"session {session_id}: its trailing span is no chunk of {lay.name}: {e}") from e
        tokens = _session_tokens(manifest, chunks, tail, refused, token_ids)
        fetch_s = time.perf_counter() - t0
        fetched = sum(c.header.total_bytes for c in chunks) + len(manifest.tail)

        meta = {k: v for k, v in manifest.metadata.items() if k != DECODER_FROM}
        sess = cls(model, client, namespace, session_id, meta)
        # chunks past the first refused one are not known to be stored: the next save sends them again (their KV
        # as recomputed here; the store keeps the bytes it has of any it still holds)
        held = manifest.chunk_keys[: len(chunks)] if refused else manifest.chunk_keys
        sess.tokens, sess.saved_keys, sess.generation = tokens, list(held), manifest.generation
        state = sess.state
        assert state is not None
        window, n = model.args.window, len(tokens)
        loaded = len(chunks) * manifest.chunk_tokens + (tail.token_count if not refused else 0)  # KV installed
        if n == 0:  # an empty session: an empty model state, nothing to replay
            kl = 0.0 if mode != "reprefill" else None  # an empty state is exact
            return sess, ResumeReport(mode, 0, 0, fetch_s, 0.0, 0.0, fetched, kl, kl, refused_chunks=0, loaded_tokens=0)
        default = {"bounded": window, "exact": window * model.args.n_layers, "reprefill": n}[mode]
        r = n if mode == "reprefill" else min(n, replay_tokens if replay_tokens is not None else default)
        # the replay starts r tokens before the end, or before the first token whose KV is not loaded (its KV is
        # recomputed by the replay, from a history of the same length as the mode gives the end)
        start = n - r if loaded == n else max(0, min(n - r, loaded - r))
        t1 = time.perf_counter()
        if mode != "reprefill":
            for c in lay.caches:
                parts = [ch.entries[c.name] for ch in chunks] + ([] if refused else [tail.entries[c.name]])
                codes = torch.from_numpy(np.concatenate([p.codes for p in parts]))
                scales = torch.from_numpy(np.concatenate([p.scales for p in parts]))
                state.load_global(c.name, codes, scales)
        t2 = time.perf_counter()
        if mode == "reprefill":
            sess.last_logits = model.prefill(tokens, state, chunk_size=512)
        else:
            decoder_from = min(int(manifest.metadata.get(DECODER_FROM, n - min(n, window))), n - 1)
            sess.last_logits = model.replay(state, tokens[start:], start_pos=start, decoder_from=decoder_from)
            # The session's decoder run began at decoder_from whatever suffix was replayed (and replay leaves
            # state.decoder_from unset when the decoder starts with the replay); a later save must say so, or
            # the next exact resume would rebuild another decoder window than the never-evicted session had.
            state.decoder_from = decoder_from
        t3 = time.perf_counter()
        replayed = n - start
        # exact: the end state's receptive field is replayed, and so is that of every recomputed global entry
        recomputed_exact = loaded == n or start == 0 or loaded - start >= model.args.n_encoder * (window - 1)
        exact = (mode != "reprefill" and recomputed_exact
                 and replayed >= exact_replay_length(n, state.decoder_from, model.args))
        expected = (0.0, 0.0) if exact else None  # (a re-prefill differs from a session that decoded: None)
        if expected is None and cal is not None and mode == "bounded" and not refused:
            row = cal.expected(r)
            expected = (row.mean_kl, row.max_kl)
        mean_kl, max_kl = expected if expected is not None else (None, None)
        return sess, ResumeReport(mode, n, replayed, fetch_s, t2 - t1, t3 - t2, fetched, mean_kl, max_kl,
                                  refused_chunks=refused, loaded_tokens=loaded)


def _verified_prefix(m: Manifest, stream: Iterable[tuple[int, Blob]], lay: Layout, namespace: str
                     ) -> tuple[list[chunk.Chunk], int]:
    """The manifest's chunks up to the first one the load did not deliver verified (missing from the
    answer, not a chunk, or not what the manifest's key chain names), and how many chunks the load
    did not deliver verified in all."""
    good: dict[int, chunk.Chunk] = {}
    for i, blob in stream:
        if not 0 <= i < len(m.chunk_keys):
            continue
        try:
            c = chunk.decode(blob, lay)
        except chunk.ChunkError:
            continue  # never used: counted as refused
        parent = m.chunk_keys[i - 1] if i else ROOT
        want = m.chunk_keys[i]
        if c.key == want and c.start == i * m.chunk_tokens and chunk_key(m.layout_id, namespace, parent,
                                                                          c.token_ids) == want:
            good[i] = c
    prefix: list[chunk.Chunk] = []
    while len(prefix) in good:
        prefix.append(good[len(prefix)])
    return prefix, len(m.chunk_keys) - len(good)


def _session_tokens(m: Manifest, prefix: list[chunk.Chunk], tail: chunk.Chunk, refused: int,
                    token_ids: Sequence[int] | None) -> list[int]:
    """All token ids of the session: the verified chunks' and the tail's; past a refused chunk, the
    caller's ``token_ids``, checked against the manifest's key chain from there on."""
    ids = [t for c in prefix for t in c.token_ids.tolist()]
    if tail.start != len(m.chunk_keys) * m.chunk_tokens or tail.token_count != m.tail_tokens:
        raise ResumeError("the trailing span does not continue the chunks")
    if refused:
        if token_ids is None:
            first = len(prefix)
            raise ResumeError(f"the store refused {refused} of the {len(m.chunk_keys)} chunks the manifest names "
                              f"(first: chunk {first}, tokens from {first * m.chunk_tokens}; missing, damaged or "
                              f"not what its key says): pass token_ids= (the session's tokens) to recompute their "
                              f"global KV, or re-prefill")
        given = [int(t) for t in token_ids]
        if len(given) != m.token_count or given[: len(ids)] != ids:
            raise ResumeError(f"token_ids ({len(given)} ids) are not this session's {m.token_count} tokens")
        ct = m.chunk_tokens
        parent = m.chunk_keys[len(prefix) - 1] if prefix else ROOT
        for j in range(len(prefix), len(m.chunk_keys)):
            got = chunk_key(m.layout_id, m.namespace, parent, np.asarray(given[j * ct : (j + 1) * ct], np.uint32))
            if got != m.chunk_keys[j]:
                raise ResumeError(f"token_ids are not this session's: chunk {j}'s tokens do not hash to its key")
            parent = got
        ids = given[: len(m.chunk_keys) * ct]
        if given[len(ids):] != tail.token_ids.tolist():
            raise ResumeError("token_ids are not this session's: they end otherwise than its trailing span")
    ids.extend(tail.token_ids.tolist())
    if tuple(ids[-len(m.last_token_ids):] if m.last_token_ids else ()) != tuple(m.last_token_ids):
        raise ResumeError("the manifest's last token ids disagree with its chunks")
    return ids
