"""The fork launcher's helper process: import the daemon once, then fork a daemon per request.

Reads one JSON command per line on stdin and answers one line on stdout:
``{"cmd": "spawn", "argv": [...], "out": path, "err": path}`` -> the child's pid;
``{"cmd": "reap", "pid": n}`` -> its wait status. The child runs ``kvstore <argv>`` (the CLI's own
``main``) with its stdout and stderr redirected, and never returns into this loop.

Single-threaded and gRPC-object-free by construction: it only imports modules before forking.
"""

from __future__ import annotations

import json
import os
import sys


def _preload() -> None:
    """Everything ``kvstore serve`` imports on its way to serving, so a forked child skips it."""
    import lmdb
    import torch
    import zstandard

    import cli.main
    import cli.serve_cmd
    import kvstore.server.daemon
    import kvstore.tiers.host
    import kvstore.tiers.ssd

    del cli, kvstore, lmdb, torch, zstandard


def _child(argv: list[str], out: str, err: str) -> None:
    code = 1
    try:
        fo = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fe = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fo, 1)
        os.dup2(fe, 2)
        for fd in (fo, fe, null):
            os.close(fd)
        sys.stdin = open(0)  # noqa: SIM115 - the child's own, for the rest of its life
        from cli.main import main as kvstore_main

        code = kvstore_main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    _preload()
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(command["argv"], command["out"], command["err"])
            print(pid, flush=True)
        elif command["cmd"] == "reap":
            _, status = os.waitpid(int(command["pid"]), 0)
            print(status, flush=True)
