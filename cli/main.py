"""`kvstore` command line: one subcommand per module under cli/, dispatched from here."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from cli import layout_cmd
from cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CliError
from kvstore.errors import InvalidArgument, KvstoreError

EPILOG = """\
exit codes:
  0    success
  1    the command failed: daemon unreachable or not serving, not authenticated or not allowed,
       no such session, a port or data dir already in use, a store that cannot be opened
  2    usage or configuration error: a bad flag or value, --config file, KVSTORE_* variable or TLS
       file, or an argument the daemon rejects as invalid (INVALID_ARGUMENT, e.g. an unknown tier)
  130  interrupted (Ctrl-C)"""
# Every KVSTORE_* variable something in this repository reads, beside the daemon's own settings
# (kvstore/server/config.py: KVSTORE_<SETTING>): a variable outside both gets a warning.
OTHER_ENV = (
    "KVSTORE_ADDRESS", "KVSTORE_TOKEN",  # client commands, kvstore.client
    "KVSTORE_VENV", "KVSTORE_TORCH", "KVSTORE_TORCH_INDEX", "KVSTORE_TORCH_GPU",  # scripts/install.sh
    "KVSTORE_BENCH_WRITE", "KVSTORE_GIT_REV",  # benchmarks
    "KVSTORE_REQUIRE_REDIS_CLUSTER", "KVSTORE_REQUIRE_NODE", "KVSTORE_CODEC_TEST_DEVICE",  # tests
    "KVSTORE_FUZZ_EXAMPLES", "KVSTORE_FUZZ_REPORT", "KVSTORE_ISOLATION_REPORT", "KVSTORE_ISOLATION_ROUNDS",
    "KVSTORE_REQUIRE_VLLM", "KVSTORE_VLLM_VENV",  # the vLLM tier's environment and tests
    "KVSTORE_REQUIRE_SGLANG", "KVSTORE_SGLANG_VENV",  # the SGLang backend's environment and tests
)


class OneLineParser(argparse.ArgumentParser):
    """Usage mistakes in one line (argparse prints the whole usage block first), exit code 2.
    Subcommand parsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvstore", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tiered store for the FP4 global KV of DeepSeek-V4.1-Flash-style models: run the daemon, "
                    "inspect it, and see the whole story with `kvstore demo`.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _modules():
        module.register(sub)
    return parser


def _modules() -> list:  # type: ignore[type-arg]
    from cli import client_cmds, demo, serve_cmd

    return [layout_cmd, serve_cmd, client_cmds, demo]


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """A warning for each KVSTORE_* variable nothing reads, naming the closest known one."""
    from kvstore.server.config import env_names

    known = sorted({*env_names(), *OTHER_ENV})
    out = []
    for name in sorted(n for n in env if n.startswith("KVSTORE_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = f"did you mean ${close[0]}?" if close else "known: kvstore serve --help, README"
        out.append(f"${name} is not a kvstore setting ({hint}); ignored")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's core logs its own lines (a failed bind, a bad certificate) before the one line we print;
    # GRPC_VERBOSITY=ERROR (or DEBUG) brings them back. Read when grpc loads: nothing has imported it yet.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    args = build_parser().parse_args(argv)
    for warning in unknown_env(os.environ):
        print(f"kvstore: warning: {warning}", file=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except CliError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return e.code
    except KvstoreError as e:  # a command that talks to the daemon without the client commands' wrapper
        print(f"kvstore: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, InvalidArgument) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
