"""`kvstore` command line: one subcommand per module under cli/, dispatched from here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from cli import layout_cmd
from kvstore.errors import KvstoreError


class OneLineParser(argparse.ArgumentParser):
    """Usage mistakes in one line (argparse prints the whole usage block first), exit code 2.
    Subcommand parsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvstore",
        description="Tiered store for the FP4 global KV of DeepSeek-V4.1-Flash-style models: run the daemon, "
                    "inspect it, and see the whole story with `kvstore demo`.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _modules():
        module.register(sub)
    return parser


def _modules() -> list:  # type: ignore[type-arg]
    from cli import client_cmds, demo, serve_cmd

    return [layout_cmd, serve_cmd, client_cmds, demo]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 2
    except KvstoreError as e:  # a command that talks to the daemon without the client commands' wrapper
        print(f"kvstore: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit."""


if __name__ == "__main__":
    # `python -m cli.main` runs this file as __main__: call the importable module's main, so the
    # commands' CliError (raised from cli.main) is the class caught there
    from cli.main import main as _main

    sys.exit(_main())
