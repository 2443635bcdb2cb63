"""The `kvstore` command line against a real daemon (with bearer tokens): each command as a
subprocess, and the remaining error paths in-process through cli.main.main."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli.main import main
from kvstore.client import Client
from tests.helpers.daemon import (
    REPO,
    Daemon,
    clean_env,
    free_port,
    kvstore_command,
    make_session,
    running_daemon,
    save_session,
)

ADMIN = "tok-admin"
TOKENS = f'[tokens]\n"{ADMIN}" = ["*"]\n"tok-a" = ["cli"]\n'


def kvstore(*args: str, daemon: Daemon | None = None, token: str | None = ADMIN,
            timeout_s: float = 60, **env_extra: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI; the address and token come from $KVSTORE_ADDRESS / $KVSTORE_TOKEN."""
    env = clean_env(**env_extra)
    if daemon is not None:
        env["KVSTORE_ADDRESS"] = daemon.address
    if token is not None:
        env["KVSTORE_TOKEN"] = token
    return subprocess.run([*kvstore_command(), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "tokens.toml").write_text(TOKENS)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        yield d


@pytest.fixture(scope="module")
def saved(daemon: Daemon) -> Daemon:
    """The daemon, holding cli/chat-1 (1000 tokens: 3 chunks) and cli/chat-2 (its first 600 tokens)."""
    with Client(address=daemon.address, token=ADMIN, shared_memory=False) as c:
        save_session(c, make_session(namespace="cli", session_id="chat-1", metadata={"user": "alice"}))
        save_session(c, make_session(namespace="cli", session_id="chat-2", tokens=600))  # shares 2 chunks
    return daemon


# Each `kvstore` process spends seconds importing torch, so the commands that only read run
# concurrently, once, and the tests below check their output.
CLOSED = f"127.0.0.1:{free_port()}"
READS: dict[str, tuple[str, ...]] = {
    "stats at 80 columns": ("stats",),
    "bytes-per-token at 80 columns": ("bytes-per-token",),
    "layout show": ("layout", "show", "deepseek-v4.1-flash"),
    "health": ("health",),
    "stats": ("stats",),
    "stats --json": ("stats", "--json"),
    "sessions ls": ("sessions", "ls"),
    "sessions show": ("sessions", "show", "cli", "chat-1"),
    "bytes-per-token": ("bytes-per-token",),
    "daemon down": ("stats", "--address", CLOSED),
    "unknown session": ("sessions", "show", "cli", "nope"),
}


@pytest.fixture(scope="module")
def reads(saved: Daemon) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(kvstore, *args, daemon=saved, **({"COLUMNS": "80"} if "80" in name else {}))
                for name, args in READS.items()}
        return {name: run.result() for name, run in runs.items()}


def test_bytes_per_token_without_sessions(daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    # in-process, and before `saved`: the daemon holds no sessions yet
    assert main(["bytes-per-token", "--address", daemon.address, "--token", ADMIN]) == 0
    assert "no live sessions" in capsys.readouterr().out


def test_layout_show(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    out = ok(reads["layout show"])
    assert "890.0" in out and "main.L2" in out


def test_health(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    assert ok(reads["health"]).strip() == "SERVING"


def test_stats_table(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    out = ok(reads["stats"])
    for text in ("host", "ssd", "persistent", "1.0 GiB", "unlimited", "evictions", "verify failures",
                 "tokens hit", "sessions 2", "hit rate", "a shared prefix counts once", "on the gRPC stream"):
        assert text in out, out


def test_stats_json(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    stats = json.loads(ok(reads["stats --json"]))
    tiers = {t["name"]: t for t in stats["tiers"]}
    assert set(tiers) == {"host", "ssd"}
    assert tiers["ssd"]["persistent"] is True and tiers["ssd"]["items"] == 3  # chunks (manifests: own keyspace)
    assert stats["sessions"] == 2
    assert stats["bytes_per_token"]["tokens"] == 3 * 256 + 232 + 88  # shared chunks counted once


def test_sessions_ls_show(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    out = ok(reads["sessions ls"])
    assert "chat-1" in out and "chat-2" in out and "tiny-16" in out and "2 sessions, 1,600 tokens" in out
    out = ok(reads["sessions show"])
    for text in ("tiny-16", "1,000 (3 chunks of 256 + 232 trailing)", "host 3", "alice", "default"):
        assert text in out, out


def test_bytes_per_token(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    out = ok(reads["bytes-per-token"])
    for text in ("layout formula", "222.50", "on disk (stored + LMDB overhead)", "stored values, compressed",
                 "uncompressed (before zstd)", "payload", "chunk overhead", "manifests", "LMDB overhead",
                 "compression (raw / stored)", "baseline / measured", "one SWA snapshot per session",
                 # a tiny-16 session: V4-Flash's design scaled to this model (222.5 x 3514.25 / 890),
                 # with the model's own SWA state per turn boundary, not the real geometry's numbers
                 "scaled to this model", "878.56 B/token", "270,336 B"):
        assert text in out, out
    assert "3,514.25" not in out


@pytest.mark.parametrize("name", ["stats at 80 columns", "bytes-per-token at 80 columns"])
def test_tables_are_readable_at_80_columns(name: str, reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """Nothing cut (rich marks a cut cell or header with an ellipsis), no line past 80 columns, and every
    label and number whole on its line."""
    out = ok(reads[name])
    assert "…" not in out and max(map(len, out.splitlines())) <= 80, out
    rows = {"stats at 80 columns": ("verify failures", "promotions", "hit rate", "unlimited"),
            "bytes-per-token at 80 columns": ("chunk overhead (headers, ids, sums)", "on disk (stored + LMDB overhead)",
                                              "878.56 B/token", "+ SWA snapshot, 270,336 B per session (2)")}[name]
    for text in rows:
        assert any(text in line for line in out.splitlines()), (text, out)


def test_sessions_ls_of_an_empty_namespace(saved: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sessions", "ls", "--namespace", "other", "--address", saved.address, "--token", ADMIN]) == 0
    assert capsys.readouterr().out.strip() == "no sessions in namespace 'other'"


def test_stats_watch_stops_cleanly_on_ctrl_c(saved: Daemon) -> None:
    env = clean_env(KVSTORE_ADDRESS=saved.address, KVSTORE_TOKEN=ADMIN)
    proc = subprocess.Popen([*kvstore_command(), "stats", "--watch", "0.2"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = ""
    for line in proc.stdout:  # wait until the first table is drawn, then interrupt
        first += line
        if "lookups" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (first + out, err)
    assert "host" in first and "Traceback" not in err


def test_evict_then_rm(saved: Daemon, reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    def demotions() -> int:
        with Client(address=saved.address, token=ADMIN, shared_memory=False) as c:
            return sum(t.demotions for t in c.stats().tiers)

    before = demotions()
    out = ok(kvstore("evict", "cli", "chat-1", "--to", "ssd", daemon=saved))
    assert out.strip() == "moved 3 chunks of cli/chat-1 down to ssd (chunks now: ssd 3)"
    assert demotions() == before + 3
    # again: nothing moves, nothing is counted; and a move up is refused, saying what to use instead
    out = ok(kvstore("evict", "cli", "chat-1", "--to", "ssd", daemon=saved))
    assert out.strip() == "nothing to move: the 3 chunks of cli/chat-1 are already in ssd (chunks now: ssd 3)"
    up = kvstore("evict", "cli", "chat-1", "--to", "host", daemon=saved)
    assert up.returncode == 2 and one_line_error(up) == (
        "kvstore: error: evict moves chunks down; use prefetch to move them up (3 of 3 chunks of cli/chat-1 are "
        "below host: ssd 3)")
    assert demotions() == before + 3
    # chat-2's two chunks are chat-1's first two: already there too
    out = ok(kvstore("evict", "cli", "chat-2", "--to", "ssd", daemon=saved))
    assert out.strip() == "nothing to move: the 2 chunks of cli/chat-2 are already in ssd (chunks now: ssd 2)"
    # chat-2 shares chat-1's first two chunks, so deleting chat-1 frees only its third
    assert ok(kvstore("sessions", "rm", "cli", "chat-1", daemon=saved)).strip() == \
        "deleted cli/chat-1: freed 1 chunks"


# -- errors: one line on stderr, a non-zero exit, never a traceback -------------------------------
def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: "), r.stderr
    return lines[0]


def test_daemon_down_is_one_line(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    line = one_line_error(reads["daemon down"])
    assert f"cannot reach kvstore daemon at {CLOSED}: " in line and "Connection refused" in line


def test_unknown_session_is_one_line(reads: dict[str, subprocess.CompletedProcess[str]]) -> None:
    assert one_line_error(reads["unknown session"]) == "kvstore: error: no session 'nope' in namespace 'cli'"


# The other error paths run in-process (same output: main() turns each CliError into one line on stderr).
FAILED, USAGE = 1, 2  # exit codes: the command failed; the command line or configuration is wrong
INPROCESS_ERRORS: dict[str, tuple[tuple[str, ...], int, str]] = {
    # name: (arguments, with the daemon's --address added unless given; exit code; what the one line says)
    "health of a daemon that is down": (("health", "--address", "127.0.0.1:1"), FAILED,
                                        "cannot reach kvstore daemon at"),
    "rm of an unknown session": (("sessions", "rm", "cli", "nope", "--token", ADMIN), FAILED, "no session 'nope'"),
    "bad tier": (("evict", "cli", "chat-2", "--to", "nvme", "--token", ADMIN), USAGE,
                 "unknown tier 'nvme'; this store has host, ssd"),
    "bad namespace": (("sessions", "ls", "--namespace", "a b", "--token", ADMIN), USAGE, "malformed namespace 'a b'"),
    "wrong token": (("sessions", "ls", "--token", "tok-wrong"), FAILED, "not authenticated: unknown bearer token"),
    "missing token": (("sessions", "ls"), FAILED, "not authenticated: missing bearer token"),
    # (a tenant's `kvstore stats` shows its own namespaces' usage: tests/server/test_quotas.py)
    "bytes-per-token without the admin token": (("bytes-per-token", "--token", "tok-a"), FAILED,
                                                "permission denied: this RPC needs an admin"),
    "evict without the admin token": (("evict", "cli", "chat-2", "--to", "ssd", "--token", "tok-a"), FAILED,
                                      "permission denied"),
    "another team's namespace": (("sessions", "show", "team-b", "x", "--token", "tok-a"), FAILED,
                                 "does not cover namespace 'team-b'"),
    "unreadable TLS file": (("health", "--tls-ca-file", "/nonexistent/ca.pem"), USAGE, "/nonexistent/ca.pem"),
    "non-positive watch interval": (("stats", "--watch", "0", "--token", ADMIN), USAGE, "--watch needs a positive"),
}


@pytest.mark.parametrize("name", list(INPROCESS_ERRORS))
def test_error_paths(name: str, saved: Daemon, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVSTORE_ADDRESS", "KVSTORE_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    args, code, message = INPROCESS_ERRORS[name]
    rc = main(list(args) if "--address" in args else [*args, "--address", saved.address])
    out, err = capsys.readouterr()
    assert rc == code and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and message in lines[0], err


def test_usage_errors_exit_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["evict", "cli", "chat-2"])  # --to is required
    assert e.value.code == 2 and "--to" in capsys.readouterr().err


# Operator mistakes before anything starts: one line on stderr, exit 2, no traceback, no usage block.
OPERATOR_MISTAKES: dict[str, tuple[tuple[str, ...], str]] = {
    "port out of range": (("serve", "--port", "70000"), "port must be 0-65535, got 70000"),
    "port missing": (("serve", "--port"), "argument --port: expected one argument"),
    "port not a number": (("serve", "--port", "abc"), "port must be a number 0-65535"),
    "metrics port out of range": (("serve", "--metrics-port", "-1"), "port must be 0-65535, got -1"),
    "bad log level": (("serve", "--log-level", "LOUD"), "log level must be one of DEBUG, INFO"),
    "address without a port": (("health", "--address", "127.0.0.1"), "address must be HOST:PORT"),
    "IPv6 address without brackets": (("health", "--address", "::1:50151"), "needs brackets"),
    "address with port 0": (("health", "--address", "127.0.0.1:0"), "port 0 cannot be dialled"),
    "unknown command": (("bogus",), "invalid choice: 'bogus'"),
}


@pytest.mark.parametrize("name", list(OPERATOR_MISTAKES))
def test_operator_mistakes_are_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, message = OPERATOR_MISTAKES[name]
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "" and len(lines) == 1 and message in lines[0], err


def test_bad_data_dirs_and_settings_from_the_environment_are_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    wrecked = tmp_path / "wrecked"
    (wrecked / "ssd").mkdir(parents=True)
    (wrecked / "ssd" / "data.mdb").write_bytes(bytes(range(256)) * 64)  # no LMDB meta page survives this
    cases = [((f"--data-dir={a_file}",), {}, USAGE, "exists and is not a directory"),
             ((f"--data-dir={wrecked}",), {}, FAILED,
              f"cannot open the store: ssd tier: {wrecked}/ssd/data.mdb is damaged"),
             ((f"--data-dir={a_file}/sub",), {}, USAGE, "is not a directory"),
             (("--data-dir", str(tmp_path / "d")), {"KVSTORE_LOG_LEVEL": "loud"}, USAGE, "log level must be one of")]
    if os.geteuid() != 0:  # root writes anywhere: the permission check cannot fail for it
        cases.append(((f"--data-dir={locked}/sub",), {}, USAGE, "is not writable by this user"))
    for flags, env, code, message in cases:
        r = subprocess.run([*kvstore_command(), "serve", "--port", "0", *flags], cwd=REPO,
                           env=clean_env(**env), capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code and len(lines) == 1 and message in lines[0], (flags, r.stderr)
    r = subprocess.run([*kvstore_command(), "health"], cwd=REPO, env=clean_env(KVSTORE_ADDRESS="nohost"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "kvstore: error: $KVSTORE_ADDRESS: address must be HOST:PORT (e.g. 127.0.0.1:50151), got 'nohost'")


def test_demo_against_an_unreachable_daemon_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    assert main(["demo", "--address", address]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvstore: error: cannot reach kvstore daemon at {address}: "), lines


# `kvstore demo` mistakes: one line, exit 2, before the model or a daemon starts (or right after the model loads).
DEMO_MISTAKES: dict[str, tuple[tuple[str, ...], str]] = {
    "no agents": (("--agents", "0"), "argument --agents: must be a whole number >= 1, got 0"),
    "no turns": (("--turns", "0"), "argument --turns: must be a whole number >= 1, got 0"),
    "no threads": (("--threads", "0"), "argument --threads: must be a whole number >= 1, got 0"),
    "empty turns": (("--turn-tokens", "0"), "argument --turn-tokens: must be a whole number >= 1, got 0"),
    "not a number": (("--agents", "three"), "argument --agents: must be a whole number >= 1, got 'three'"),
    "more fidelity steps than there is text for": (("--fidelity-steps", "100"),
                                                   "argument --fidelity-steps: must be a whole number 1-64, got 100"),
    "an address without a port": (("--address", "127.0.0.1"), "address must be HOST:PORT"),
    "a checkpoint and random weights": (("--checkpoint", "x.safetensors", "--random-weights"),
                                        "argument --random-weights: not allowed with argument --checkpoint"),
}


@pytest.mark.parametrize("name", list(DEMO_MISTAKES))
def test_demo_flag_mistakes_are_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, message = DEMO_MISTAKES[name]
    with pytest.raises(SystemExit) as e:
        main(["demo", *args])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "" and len(lines) == 1 and message in lines[0], err


def test_demo_checkpoint_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a checkpoint")
    cases = {(str(tmp_path / "none.safetensors"), "tiny-16"): f"--checkpoint {tmp_path / 'none.safetensors'}: "
                                                               f"no such file",
             (str(garbage), "tiny-16"): f"--checkpoint {garbage}: not a kvstore model checkpoint (",
             (str(REPO / "replay/checkpoints/tiny16-stdlib.safetensors"), "tiny-8"):
                 f"--checkpoint {REPO / 'replay/checkpoints/tiny16-stdlib.safetensors'} holds a tiny-16 model, not "
                 f"--model tiny-8"}
    for (checkpoint, model), message in cases.items():
        rc = main(["demo", "--checkpoint", checkpoint, "--model", model, "--address", f"127.0.0.1:{free_port()}"])
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and err.startswith(f"kvstore: error: {message}") and err.count("\n") == 1, err


def test_demo_continuations_are_text() -> None:
    from cli.demo import continuation

    assert continuation(list(b"def f(x):\n\treturn x")) == "def f(x):\\n\\treturn x"
    assert continuation([0xE2, 0x82, 0xAC, 0x00, 0xFF]) == "€\\x00\\xff"  # UTF-8 decoded; the rest escaped
    assert continuation(list(b"a\\nb")) == "a\\\\nb"  # a backslash in the text is not an escape


def test_serve_ssd_max_map_bytes_fails_saves_cleanly_and_keeps_serving(tmp_path: Path) -> None:
    """`--ssd-max-map-bytes`: past the limit a save is RESOURCE_EXHAUSTED with the reason; what was
    stored before still loads."""
    from kvstore.errors import ResourceExhausted

    with running_daemon(tmp_path / "data", "--ssd-max-map-bytes", str(2 << 20)) as d, \
            Client(address=d.address, shared_memory=False) as c:
        first = make_session(namespace="full", session_id="s0", tokens=2048)
        save_session(c, first)
        with pytest.raises(ResourceExhausted, match="map limit"):
            for i in range(1, 64):  # ~2 MB of chunks per 8 sessions of tiny-16: the limit comes quickly
                save_session(c, make_session(namespace="full", session_id=f"s{i}", tokens=2048, seed=i))
        _, chunks = c.load_session("full", "s0")
        assert [bytes(b) for _, b in chunks] == [bytes(b) for b in first.blobs]


# -- the daemon's settings: one line that names the flag, the variable or the file and line -------------
def _serve_mistakes(tmp: Path) -> dict[str, tuple[tuple[str, ...], dict[str, str], str]]:
    garbage = tmp / "garbage.pem"
    garbage.write_text("not a certificate\n")
    configs = {"syntax": "port = 1\nhost = \n", "typo": "port = 1\nprot = 2\n", "range": "\n\nport = 70000\n",
               "tls typo": "[tls]\ncert_fil = 'x.pem'\n", "type": "zstd_level = 'high'\n"}
    for name, text in configs.items():
        (tmp / f"{name.replace(' ', '-')}.toml").write_text(text)
    toml = {name: str(tmp / f"{name.replace(' ', '-')}.toml") for name in configs}
    return {
        # name: (flags, environment, the whole line after "kvstore: error: ")
        "a certificate without its key": (("--tls-cert-file", str(garbage)), {},
                                          "TLS needs both --tls-cert-file and --tls-key-file: --tls-cert-file is "
                                          "set, --tls-key-file is not"),
        "the key from the environment, no certificate": ((), {"KVSTORE_TLS_KEY_FILE": str(garbage)},
                                                         "TLS needs both --tls-cert-file and --tls-key-file: "
                                                         "--tls-key-file is set, --tls-cert-file is not (from "
                                                         "$KVSTORE_TLS_KEY_FILE)"),
        "a host that does not resolve": (("--host", "nohost.invalid"), {},
                                         "--host 'nohost.invalid' does not resolve (Name or service not known): "
                                         "give an address of this host, e.g. 127.0.0.1 or 0.0.0.0"),
        "a config file that is not there": (("--config", str(tmp / "none.toml")), {},
                                            f"--config {tmp / 'none.toml'}: No such file or directory"),
        "a TOML syntax error": (("--config", toml["syntax"]), {},
                                f"--config {toml['syntax']}: Invalid value (at line 2, column 8)"),
        "an unknown TOML key": (("--config", toml["typo"]), {},
                                f"{toml['typo']} line 2: prot is not a setting (did you mean 'port'?)"),
        "an unknown [tls] key": (("--config", toml["tls typo"]), {},
                                 f"{toml['tls typo']} line 2: tls.cert_fil is not a setting (did you mean "
                                 f"'cert_file'?)"),
        "a TOML value out of range": (("--config", toml["range"]), {},
                                      f"--port must be 0-65535 (0 picks a free port), got 70000 (from "
                                      f"{toml['range']} line 3: port)"),
        "a TOML value of the wrong type": (("--config", toml["type"]), {},
                                           f"{toml['type']} line 1: zstd_level: cannot read 'high' as int"),
        "an environment value of the wrong type": ((), {"KVSTORE_PORT": "x"}, "$KVSTORE_PORT: cannot read 'x' as int"),
        "a flag value out of range": (("--zstd-level", "30"), {}, "--zstd-level must be 0 (off) to 22, got 30"),
    }


def test_daemon_setting_mistakes_name_their_source(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_dir = tmp_path / "a-file"  # a setting that passed by mistake fails on this instead of serving
    not_a_dir.write_text("")
    for name, (flags, env, message) in _serve_mistakes(tmp_path).items():
        with monkeypatch.context() as m:
            for var in [v for v in os.environ if v.startswith("KVSTORE_")]:
                m.delenv(var)
            for var, value in env.items():
                m.setenv(var, value)
            rc = main(["serve", "--data-dir", str(not_a_dir), *flags])
        out, err = capsys.readouterr()
        assert (rc, out, err) == (2, "", f"kvstore: error: {message}\n"), name


def test_bind_and_tls_failures_are_one_line_without_grpc_logs(tmp_path: Path) -> None:
    """gRPC's core logs its own lines for both (before our one line): silenced."""
    import socket

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        runs = {(1, f"cannot listen on 127.0.0.1:{port}: port {port} is in use (another kvstore daemon, or another "
                    f"program)"): ("--port", str(port)),
                (2, f"--tls-cert-file {garbage} / --tls-key-file {garbage}: not a PEM certificate and its private "
                    f"key"): ("--port", "0", "--tls-cert-file", str(garbage), "--tls-key-file", str(garbage)),
                (2, "--tls-cert-file /nonexistent/cert.pem: No such file or directory"):
                    ("--port", "0", "--tls-cert-file", "/nonexistent/cert.pem", "--tls-key-file", str(garbage))}
        for (code, message), flags in runs.items():
            r = subprocess.run([*kvstore_command(), "serve", "--data-dir", str(tmp_path / "data"), *flags], cwd=REPO,
                               env=clean_env(), capture_output=True, text=True, timeout=60)  # a daemon that serves
            # by mistake is killed by the timeout
            assert r.returncode == code and r.stdout == "", r.stderr
            assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"kvstore: error: {message}"), r.stderr


def test_a_mistyped_environment_variable_is_named_with_the_closest_known_one() -> None:
    r = subprocess.run([*kvstore_command(), "layout", "list"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=clean_env(KVSTORE_DATA_DIRR="/tmp/x", KVSTORE_ADRESS="127.0.0.1:1", KVSTORE_TOKEN="t"))
    assert r.returncode == 0 and r.stderr.splitlines() == [
        "kvstore: warning: $KVSTORE_ADRESS is not a kvstore setting (did you mean $KVSTORE_ADDRESS?); ignored",
        "kvstore: warning: $KVSTORE_DATA_DIRR is not a kvstore setting (did you mean $KVSTORE_DATA_DIR?); ignored"]


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "exit codes:" in out
    for line in ("  0    success", "  1    the command failed", "  2    usage or configuration error"):
        assert line in out, out
