"""AgentSession against a real daemon: save, drop, resume (bounded / exact / reprefill), and the
ways a resume must refuse to hand back a session it cannot rebuild intact.

tiny-8 keeps it fast: its exact rebuild is 8 x 128 = 1,024 replayed tokens, so the long session
(1,296 tokens) is the shortest one where exact replay starts past token 0. Tokens are bytes of the
standard library's own sources. One daemon serves the module; sessions are saved once, by the
``saved`` fixture, and every test resumes them afresh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvstore.client import Client
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.server.process import DaemonProcess
from replay.calibration import Calibration, CalibrationRow
from replay.corpus import split_bytes, stdlib_tokens
from replay.fidelity import compare, teacher_forced
from replay.model import ModelArgs, Transformer
from replay.session import AgentSession, ResumeError, SaveReport
from replay.weights import DEFAULT_CHECKPOINT, load_model

REPO = Path(__file__).resolve().parents[2]
NS = "replay-test"
ATOL = 1e-4




@dataclass
class Saved:
    """A session as it was when it was saved and dropped: what a resume must give back."""

    session_id: str
    tokens: list[int]
    logits: torch.Tensor  # next-token logits after the last token
    reports: list[SaveReport]
    probe: int = 0  # a token fed after the last one ...
    next_logits: torch.Tensor | None = None  # ... and the logits it gave, never evicted


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path_factory.mktemp("kvstore")).start()
    yield proc
    proc.stop()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    c = Client(address=daemon.address)  # per test: the restart test moves the daemon to a new port
    yield c
    c.close()


@pytest.fixture(scope="module")
def tiny8() -> Transformer:
    return Transformer(ModelArgs.tiny8(), seed=0)


def _finish(sess: AgentSession, reports: list[SaveReport], probe: int) -> Saved:
    """Record what the live session would say next, then drop its local state."""
    saved = Saved(sess.session_id, list(sess.tokens), sess.last_logits.clone(), reports, probe)  # type: ignore[union-attr]
    saved.next_logits = sess.model.decode_one_token(probe, sess.state)  # type: ignore[arg-type]
    sess.drop()
    return saved


@pytest.fixture(scope="module")
def saved(daemon: DaemonProcess, tiny8: Transformer) -> dict[str, Saved]:
    text = stdlib_tokens(4096)
    out = {}
    with Client(address=daemon.address) as c:
        # long: one agent turn (prefill), a reply (decode), a tool result (prefill); saved after each
        s = AgentSession(tiny8, c, NS, "long")
        logits = s.prefill(text[:1200])
        first = s.save()
        s.generate(logits, 16)
        s.prefill(text[1200:1280])
        out["long"] = _finish(s, [first, s.save()], probe=text[2000])
        # prefill-only: the decoder ran over the last 128 tokens only, just as a re-prefill runs it
        s = AgentSession(tiny8, c, NS, "prefill-only")
        s.prefill(text[1300:2000])
        out["prefill-only"] = _finish(s, [s.save()], probe=text[2001])
        # short: shorter than the 128-token window, with a few decoded tokens
        s = AgentSession(tiny8, c, NS, "short")
        s.generate(s.prefill(text[2100:2190]), 6)
        out["short"] = _finish(s, [s.save()], probe=text[2002])
        # a tiny-16 session, which a tiny-8 model must refuse
        s16 = AgentSession(Transformer(ModelArgs.tiny16(), seed=0), c, NS, "tiny16")
        s16.prefill(text[:300])
        out["tiny16"] = _finish(s16, [s16.save()], probe=text[2003])
    return out


def assert_resumed(model: Transformer, sess: AgentSession, want: Saved) -> None:
    """Same tokens, same next-token logits, and the same logits one decoded token later."""
    assert sess.tokens == want.tokens
    assert sess.last_logits is not None
    assert torch.allclose(sess.last_logits, want.logits, atol=ATOL), (sess.last_logits - want.logits).abs().max()
    nxt = sess.step(want.probe)
    assert torch.allclose(nxt, want.next_logits, atol=ATOL), (nxt - want.next_logits).abs().max()


def test_save_sends_only_new_chunks(saved: dict[str, Saved], client: Client, tiny8: Transformer) -> None:
    ct = client.info().chunk_tokens
    assert ct == 256
    first, second = saved["long"].reports
    assert (first.tokens, first.new_chunks, first.written) == (1200, 1200 // ct, 1200 // ct)
    assert (second.tokens, second.new_chunks, second.written) == (1296, 1, 1)  # tokens [1024, 1280) completed chunk 4
    assert second.bytes_sent < first.bytes_sent
    sess, _ = AgentSession.resume(tiny8, client, NS, "long", "bounded")
    again = sess.save()  # a resumed session knows what the store holds
    assert (again.new_chunks, again.written, again.tokens) == (0, 0, 1296)
    # ... and saving it changes nothing an exact resume depends on (the decoder's run began at 1072, not 1168)
    exact, _ = AgentSession.resume(tiny8, client, NS, "long", "exact")
    assert_resumed(tiny8, exact, saved["long"])


def test_exact_resume_reproduces_the_never_evicted_session(saved: dict[str, Saved], client: Client,
                                                          tiny8: Transformer) -> None:
    sess, rep = AgentSession.resume(tiny8, client, NS, "long", "exact")
    assert (rep.mode, rep.tokens, rep.replayed) == ("exact", 1296, 8 * 128)  # replay starts at token 272
    assert rep.bytes_fetched > 0
    assert_resumed(tiny8, sess, saved["long"])


def test_reprefill_reproduces_a_session_that_only_prefilled(saved: dict[str, Saved], client: Client,
                                                           tiny8: Transformer) -> None:
    for mode in ("reprefill", "exact"):
        sess, rep = AgentSession.resume(tiny8, client, NS, "prefill-only", mode)
        assert rep.replayed == 700
        assert_resumed(tiny8, sess, saved["prefill-only"])


def test_bounded_equals_exact_below_the_window(saved: dict[str, Saved], client: Client, tiny8: Transformer) -> None:
    bounded, rb = AgentSession.resume(tiny8, client, NS, "short", "bounded")
    exact, re = AgentSession.resume(tiny8, client, NS, "short", "exact")
    assert rb.replayed == re.replayed == 96
    assert torch.equal(bounded.last_logits, exact.last_logits)  # type: ignore[arg-type]
    assert_resumed(tiny8, bounded, saved["short"])


def test_bounded_replays_only_the_window(saved: dict[str, Saved], client: Client, tiny8: Transformer) -> None:
    sess, rep = AgentSession.resume(tiny8, client, NS, "long", "bounded")
    assert (rep.replayed, sess.tokens) == (128, saved["long"].tokens)
    assert sess.state is not None
    assert [(r.lo, r.hi) for r in sess.state.rings] == [(1296 - 128, 1296)] * 8
    assert torch.isfinite(sess.last_logits).all()  # type: ignore[arg-type]


def test_resume_after_daemon_restart(saved: dict[str, Saved], daemon: DaemonProcess, tiny8: Transformer) -> None:
    assert daemon.stop() == 0
    daemon.start()  # same data dir; the memory tier starts empty
    with Client(address=daemon.address) as c:
        assert {"long", "prefill-only", "short", "tiny16"} <= {x.session_id for x in c.list_sessions(NS)}
        sess, _ = AgentSession.resume(tiny8, c, NS, "long", "exact")
        assert_resumed(tiny8, sess, saved["long"])


def test_resume_from_the_ssd_tier(saved: dict[str, Saved], client: Client, tiny8: Transformer) -> None:
    client.evict(NS, "long", "ssd")
    assert client.get_session(NS, "long")[1] == {"ssd": 5}
    sess, _ = AgentSession.resume(tiny8, client, NS, "long", "exact")
    assert_resumed(tiny8, sess, saved["long"])


def test_resume_in_another_process(saved: dict[str, Saved], daemon: DaemonProcess) -> None:
    script = (
        "import json, sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from kvstore.client import Client\n"
        "from replay.model import ModelArgs, Transformer\n"
        "from replay.session import AgentSession\n"
        "with Client(address=sys.argv[1]) as c:\n"
        "    s, _ = AgentSession.resume(Transformer(ModelArgs.tiny8(), seed=0), c, sys.argv[2], 'long', 'exact')\n"
        "print(json.dumps({'argmax': int(s.last_logits.argmax()), 'logits': s.last_logits.tolist(),\n"
        "                  'tokens': s.tokens}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, daemon.address, NS], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = saved["long"]
    assert got["argmax"] == int(want.logits.argmax())
    assert torch.allclose(torch.tensor(got["logits"]), want.logits, atol=ATOL)
    assert got["tokens"] == want.tokens


def test_a_session_of_another_layout_is_refused(saved: dict[str, Saved], client: Client, tiny8: Transformer) -> None:
    with pytest.raises(ResumeError, match="layout"):
        AgentSession.resume(tiny8, client, NS, "tiny16", "bounded")


def test_a_manifest_naming_another_namespaces_chunks_is_refused_by_the_daemon(client: Client) -> None:
    m, _ = client.get_session(NS, "long")
    with pytest.raises(FailedPrecondition, match="not stored in namespace"):
        client.commit(dataclasses.replace(m, namespace=NS + "-other"))
    with pytest.raises(NotFound):
        client.get_session(NS + "-other", "long")


@pytest.mark.parametrize("tamper", ["reordered chunks", "last token ids"])
def test_a_manifest_that_disagrees_with_its_chunks_is_refused(saved: dict[str, Saved], client: Client,
                                                              tiny8: Transformer, tamper: str) -> None:
    # The daemon checks the chunks' order itself (a chunk out of place is INVALID_ARGUMENT); it accepts wrong
    # last token ids (every chunk the manifest names is stored), which the client's key-chain check must not.
    m, _ = client.get_session(NS, "long")
    bad = {
        "reordered chunks": dataclasses.replace(m, session_id="bad-order", chunk_keys=m.chunk_keys[::-1]),
        "last token ids": dataclasses.replace(m, session_id="bad-last",
                                              last_token_ids=((m.last_token_ids[0] + 1) % 256, *m.last_token_ids[1:])),
    }[tamper]
    if tamper == "reordered chunks":
        with pytest.raises(InvalidArgument, match="out of place"):
            client.commit(bad)
        return
    client.commit(bad)
    try:
        with pytest.raises(ResumeError):
            AgentSession.resume(tiny8, client, bad.namespace, bad.session_id, "exact")
    finally:
        client.delete_session(bad.namespace, bad.session_id)


def test_an_unknown_session_is_not_found(client: Client, tiny8: Transformer) -> None:
    with pytest.raises(NotFound):
        AgentSession.resume(tiny8, client, NS, "never-saved", "bounded")
    with pytest.raises(ValueError, match="mode"):
        AgentSession.resume(tiny8, client, NS, "long", "approximate")


def test_max_kl_picks_the_calibrated_replay_length(saved: dict[str, Saved], client: Client,
                                                   tiny8: Transformer) -> None:
    model = Transformer(ModelArgs.tiny8(), seed=0)  # tiny8's weights, with a calibration table of its own
    model.calibration = Calibration("test", 1024, 1, tuple(CalibrationRow(r, kl, 10 * kl, 1.0) for r, kl in
                                                           ((64, 1e-2), (128, 1e-3), (256, 1e-4), (512, 0.0))))
    sess, rep = AgentSession.resume(model, client, NS, "long", "bounded", max_kl=2e-4)
    assert (rep.replayed, rep.expected_mean_kl, rep.expected_max_kl) == (256, 1e-4, 1e-3)
    assert sess.tokens == saved["long"].tokens
    _, rep = AgentSession.resume(model, client, NS, "long", "bounded", replay_tokens=200)
    assert (rep.replayed, rep.expected_mean_kl) == (200, 1e-3)  # the largest calibrated R below 200
    _, rep = AgentSession.resume(model, client, NS, "long", "exact")
    assert (rep.expected_mean_kl, rep.expected_max_kl) == (0.0, 0.0)
    _, rep = AgentSession.resume(tiny8, client, NS, "long", "bounded")
    assert rep.expected_mean_kl is None  # random weights: nothing calibrated
    for bad in ({"model": tiny8}, {"mode": "exact"}, {"replay_tokens": 128}, {"max_kl": -1.0}):
        kw = {"model": model, "mode": "bounded", "max_kl": 1e-3, **bad}
        with pytest.raises(ValueError):
            AgentSession.resume(kw.pop("model"), client, NS, "long", **kw)  # type: ignore[arg-type]


@pytest.mark.skipif(not DEFAULT_CHECKPOINT.exists(), reason="no trained checkpoint")
def test_the_trained_checkpoint_resumes_with_its_calibrated_error(client: Client) -> None:
    model, weights = load_model()
    assert weights == f"trained checkpoint {DEFAULT_CHECKPOINT.name}" and model.calibration is not None
    text = list(split_bytes("heldout", 664))
    s = AgentSession(model, client, NS, "trained")
    s.prefill(text[:600])
    s.save()
    s.drop()
    sess, rep = AgentSession.resume(model, client, NS, "trained", "bounded")
    assert (rep.replayed, rep.expected_mean_kl) == (128, model.calibration.expected(128).mean_kl)
    live = model.new_state()
    ref = teacher_forced(model, live, model.prefill(text[:600], live), text[600:])
    f = compare(ref, teacher_forced(model, sess.state, sess.last_logits, text[600:]), 128)  # type: ignore[arg-type]
    assert f.mean_kl < 0.01 and f.top1_agreement >= 0.9, f  # random weights: ~0.2-0.5 nats


# -- issue 19: empty sessions, the vocabulary, versions, chunks a load refuses ----------------------------
def test_an_empty_session_saves_lists_and_resumes_as_an_empty_state(client: Client, tiny8: Transformer) -> None:
    s = AgentSession(tiny8, client, NS, "empty")
    assert s.save().tokens == 0
    assert "empty" in {x.session_id for x in client.list_sessions(NS)}
    text = stdlib_tokens(300)[200:300]
    fresh = AgentSession(tiny8, client, NS, "never-saved-fresh")
    want = fresh.prefill(text)
    for mode in ("bounded", "exact", "reprefill"):
        sess, rep = AgentSession.resume(tiny8, client, NS, "empty", mode)
        assert (sess.tokens, rep.tokens, rep.replayed, rep.refused_chunks, sess.last_logits) == ([], 0, 0, 0, None)
        assert torch.equal(sess.prefill(text), want)  # and it goes on like a session that never was saved
    assert sess.save().tokens == 100  # based on the version it resumed
    assert AgentSession.resume(tiny8, client, NS, "empty", "exact")[0].tokens == text


def test_token_ids_outside_the_vocabulary_are_a_value_error_naming_them(client: Client, tiny8: Transformer) -> None:
    s = AgentSession(tiny8, client, NS, "vocab")
    s.prefill([1, 2, 3])
    for call, bad in ((lambda: s.prefill([4, 256, 5]), 256), (lambda: s.step(-1), -1), (lambda: s.step(1000), 1000)):
        with pytest.raises(ValueError, match=f"token id {bad} is outside .* 0 to 255 \\(vocab_size 256\\)"):
            call()
    assert s.tokens == [1, 2, 3] and s.state is not None and s.state.pos == 3  # nothing was fed


def test_two_clients_saving_one_session_never_overwrite_each_other_silently(daemon: DaemonProcess,
                                                                            tiny8: Transformer) -> None:
    text = stdlib_tokens(1200)
    with Client(daemon.address) as c1, Client(daemon.address) as c2:  # the address positionally
        a = AgentSession(tiny8, c1, NS, "shared")
        a.prefill(text[:300])
        a.save()
        b, _ = AgentSession.resume(tiny8, c2, NS, "shared", "bounded")  # b loads version 1
        a.prefill(text[300:400])
        a.save()  # a saved version 1 and saves version 2: its base is current
        b.prefill(text[400:450])
        with pytest.raises(FailedPrecondition, match=r"changed through another client.*load the session again "
                                                     r"and retry"):
            b.save()  # b's base is version 1: stale, nothing replaced
        assert c2.get_session(NS, "shared")[0].token_count == 400
        b, _ = AgentSession.resume(tiny8, c2, NS, "shared", "bounded")  # load again, retry: it goes through
        b.prefill(text[400:450])
        assert b.save().tokens == 450
        with pytest.raises(FailedPrecondition):
            a.save()  # now a is the stale one
        m, _ = c1.get_session(NS, "shared")  # the client tracks what it reads: its next save is based on it
        assert c1.commit(m).generation > m.generation
        # a writer without a base (a brand-new session object) replaces whatever is stored, as before versions
        fresh = AgentSession(tiny8, c1, NS, "shared")
        fresh.prefill(text[:10])
        assert fresh.save().tokens == 10
        current = c2.get_session(NS, "shared")[0]
        with pytest.raises(FailedPrecondition):  # a change on a stale base (an explicit one here)
            c2.commit(dataclasses.replace(current, metadata={**current.metadata, "by": "c2"}), base=m.generation)
        assert c2.get_session(NS, "shared")[0].token_count == 10


def _forge(data_dir: Path, key: bytes) -> None:
    """Replace the stored chunk ``key`` (daemon stopped) by one that claims the same key but holds
    other token ids, with a valid checksum: what a lookup cannot see and a load must refuse."""
    import lmdb

    from kvstore.format import chunk
    from kvstore.tiers.ssd.record import RecordCodec

    lay = ModelArgs.tiny8().layout
    env = lmdb.open(str(data_dir / "ssd"), max_dbs=8)
    try:
        db = env.open_db(b"chunks")
        with env.begin(write=True, db=db) as txn:
            old = chunk.decode(bytes(RecordCodec(1, None).decode(key, txn.get(key))), lay)
            ents = {n: chunk.Entries(e.codes.copy(), e.scales.copy()) for n, e in old.entries.items()}
            forged = chunk.encode(lay, key=key, start=old.start, token_ids=(old.token_ids + 1) % 256, entries=ents)
            txn.put(key, RecordCodec(0, None).encode(memoryview(forged)))
    finally:
        env.close()


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_a_chunk_lookup_counts_but_the_load_refuses_is_reported_and_recomputed(tmp_path: Path, tiny8: Transformer,
                                                                              mode: str) -> None:
    text = stdlib_tokens(1200)[:900]  # chunks 0-2 and a 132-token tail
    proc = DaemonProcess(tmp_path / "data").start()
    try:
        with Client(proc.address) as c:
            s = AgentSession(tiny8, c, NS, "forged")
            s.prefill(text)
            s.save()
            keys = list(s.saved_keys)
            live = _finish(s, [], probe=text[100])
        proc.stop()
        _forge(tmp_path / "data", keys[1])
        proc.start()
        with Client(proc.address) as c:
            lay = tiny8.args.layout
            assert c.lookup(NS, lay.layout_id, text).chunks == 3  # an estimate: it reads no bytes
            with pytest.raises(ResumeError, match=r"refused 1 of the 3 chunks .*first: chunk 1.*token_ids="):
                AgentSession.resume(tiny8, c, NS, "forged", mode)
            assert c.lookup(NS, lay.layout_id, text).chunks == 1  # the load dropped the bad copy
            with pytest.raises(ResumeError, match="not this session's"):
                AgentSession.resume(tiny8, c, NS, "forged", mode, token_ids=[t ^ 1 for t in text])
            sess, rep = AgentSession.resume(tiny8, c, NS, "forged", mode, token_ids=text)
            # chunk 2 came back verified but lies past the gap: its KV is recomputed with the rest
            assert (rep.refused_chunks, rep.loaded_tokens, sess.tokens) == (1, 256, text)
            assert rep.replayed == (900 if mode == "exact" else 900 - 256 + 128)
            if mode == "exact":
                assert (rep.expected_mean_kl, rep.expected_max_kl) == (0.0, 0.0)
                assert_resumed(tiny8, sess, live)
            again = sess.save()  # saving it again sends the chunks from the gap on: the store lacked one
            assert (again.new_chunks, again.written) == (2, 1)
        with Client(proc.address) as c:
            again, rep = AgentSession.resume(tiny8, c, NS, "forged", mode)
            assert rep.refused_chunks == 0 and again.tokens == sess.tokens
    finally:
        proc.stop()
