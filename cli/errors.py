"""The CLI's errors and exit codes: every command raises these, ``cli.main`` prints them as one line."""

from __future__ import annotations

EXIT_FAILED = 1  # the command was well formed but did not succeed
EXIT_USAGE = 2  # the command line or the configuration is wrong
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """An error the CLI reports as one line; ``code`` is the exit status (1: the command failed)."""

    code = EXIT_FAILED


class UsageError(CliError):
    """The command line or the configuration is wrong: exit status 2."""

    code = EXIT_USAGE
