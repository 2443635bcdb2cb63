"""`kvstore serve`: run the daemon. Flags > environment (KVSTORE_*) > --config TOML > defaults."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping

from cli import args as check
from kvstore.server.config import SETTINGS, ConfigError, DaemonConfig, load_config
from kvstore.server.settings import ALIASES, OLD_FLAGS, SECTIONS, Setting

#: Flags that parse their value themselves, for a message naming the mistake (argparse prints it).
_PARSE = {"port": check.port, "metrics_port": check.port, "log_level": check.log_level}
_TYPES = {"int": int, "float": float, "str": str}


def _shown(s: Setting) -> str:
    """A setting's default as its help states it."""
    if s.adds_tier:
        return ""
    if s.type == "bool":
        return " (default on)" if s.default else " (default off)"
    return f" (default {s.default})" if s.default != "" else ""


def _add(group: argparse._ArgumentGroup, s: Setting) -> None:
    """The flag of setting ``s``: its value's type, its help text and default from its field."""
    help_ = (s.help + _shown(s)).replace("%", "%%")
    if s.type == "bool":  # --ssd-sync / --no-ssd-sync
        group.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, help=help_)
    else:
        group.add_argument(s.flag, dest=s.name, type=_PARSE.get(s.name, _TYPES[s.type]), help=help_,
                           choices=s.choices or None, metavar=s.name.rpartition(".")[2].upper())


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the kvstore daemon", description=__doc__)
    p.add_argument("--config", help="TOML file: the daemon's own settings as top-level keys, the others in tables "
                   "[tls], [host], [ssd], [redis], [hbm], [store] (docs/CONFIG.md)")
    groups = {"": p.add_argument_group("the daemon"), "tls": p.add_argument_group("TLS ([tls])")}
    for sec in SECTIONS:
        groups[sec.name] = p.add_argument_group(f"[{sec.name}]" if sec.name == "store" else f"{sec.name} tier "
                                                f"([{sec.name}])")
    for s in SETTINGS.values():
        _add(groups[s.name.rpartition(".")[0]], s)
    for flag, (alias, const) in OLD_FLAGS.items():  # the old spellings (docs/CONFIG.md): hidden
        if const is None:
            s = SETTINGS[ALIASES[alias]]
            p.add_argument(flag, dest=alias, type=_TYPES[s.type], choices=s.choices or None, help=argparse.SUPPRESS,
                           metavar=alias.upper())
        else:
            p.add_argument(flag, dest=alias, action="store_const", const=const, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def config_of(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> DaemonConfig:
    """The config ``serve``'s flags, ``env`` (None: this process's) and its ``--config`` file give."""
    overrides = {k: v for k, v in vars(args).items() if k not in ("func", "command", "config")}
    return load_config(args.config, env, overrides)


def run(args: argparse.Namespace) -> int:
    """Exit status 2 for what the operator configured wrong (flags, --config, KVSTORE_*, the data dir,
    TLS files), 1 for a daemon that cannot start here (port or data dir in use, a damaged store)."""
    from cli.errors import CliError, UsageError
    from kvstore.server.daemon import serve, setup_logging
    from kvstore.server.startup import CannotStart
    from kvstore.tiers.base import TierError

    try:
        config = config_of(args)
        check.log_level(config.log_level)  # it may come from the environment or the TOML file too
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise UsageError(str(e)) from None
    why = check.check_data_dir(config.data_dir)
    if why:
        raise UsageError(why)
    setup_logging(config)

    def ready(port: int) -> None:
        print(f"kvstore serving on {config.host}:{port}", flush=True)

    try:
        asyncio.run(serve(config, on_ready=ready))
    except ConfigError as e:  # TLS files that cannot be used
        raise UsageError(str(e)) from None
    except CannotStart as e:
        raise CliError(str(e)) from None
    except TierError as e:  # e.g. an LMDB file damaged beyond repair: the message names it
        raise CliError(f"cannot open the store: {e}") from None
    except OSError as e:
        raise CliError(f"cannot start: {e}") from e
    sys.stdout.flush()
    return 0
