"""`kvstore serve`: run the daemon. Flags > environment (KVSTORE_*) > --config TOML > defaults."""

from __future__ import annotations

import argparse
import asyncio
import sys

from cli import args as check
from kvstore.server.config import ConfigError, DaemonConfig, load_config


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = DaemonConfig()
    p = sub.add_parser("serve", help="run the kvstore daemon", description=__doc__)
    p.add_argument("--config", help="TOML file whose keys are the long flag names with underscores")
    p.add_argument("--host", help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=check.port, help=f"port (default {d.port}; 0 picks a free one and prints it)")
    p.add_argument("--data-dir", help=f"where the LMDB tier lives (default {d.data_dir})")
    p.add_argument("--host-capacity-bytes", type=int, help=f"host-memory tier size (default {d.host_capacity_bytes})")
    p.add_argument("--ssd-capacity-bytes", type=int, help="ssd tier size (default unlimited)")
    p.add_argument("--ssd-max-map-bytes", type=int, help="hard limit of the LMDB file: past it saves fail with "
                   "RESOURCE_EXHAUSTED and reads go on (default none: the disk is the limit)")
    p.add_argument("--zstd-level", type=int, help=f"ssd compression level, 0 = off (default {d.zstd_level})")
    p.add_argument("--ssd-compact-records", action="store_const", const=True,
                   help="store chunks on the ssd tier in the compact record format: ~4%% fewer bytes at rest "
                   "(834 vs 866 B/token at deepseek-v4.1-flash), ~10x slower to encode and decode")
    p.add_argument("--no-sync", dest="sync", action="store_const", const=False, help="do not fsync each write")
    p.add_argument("--redis-url", help="add a shared Redis tier after the ssd tier")
    p.add_argument("--redis-ttl-s", type=int, help="expiry of values in the Redis tier")
    p.add_argument("--redis-cluster", action="store_const", const=True,
                   help="--redis-url names one node of a Redis Cluster (the others are found from it)")
    p.add_argument("--redis-share-sessions", action="store_const", const=True,
                   help="publish every save to Redis, and list and resume sessions other daemons published")
    p.add_argument("--redis-wait-replicas", type=int, help="a write to Redis returns only once this many "
                   "replicas of each master acknowledged it (WAIT), else the save fails (default 0: no wait)")
    p.add_argument("--redis-wait-timeout-ms", type=int, help=f"how long a write waits for its replicas "
                   f"(default {d.redis_wait_timeout_ms})")
    p.add_argument("--hbm-capacity-bytes", type=int, help="add an HBM tier of this size in front (needs CUDA)")
    p.add_argument("--chunk-tokens", type=int, help=f"tokens per chunk (default {d.chunk_tokens})")
    p.add_argument("--write-mode", choices=["through", "back"], help=f"default {d.write_mode}")
    p.add_argument("--no-shared-memory", dest="shared_memory", action="store_const", const=False,
                   help="never use the same-host shared-memory path")
    p.add_argument("--tokens-file", help="TOML [tokens] table of per-namespace bearer tokens")
    p.add_argument("--tls-cert-file", help="server certificate (PEM)")
    p.add_argument("--tls-key-file", help="server private key (PEM)")
    p.add_argument("--tls-client-ca-file", help="require client certificates signed by this CA (mTLS)")
    p.add_argument("--metrics-port", type=check.port, help="serve Prometheus metrics on this port")
    p.add_argument("--log-format", choices=["json", "text"])
    p.add_argument("--log-level", type=check.log_level, help=f"{', '.join(check.LOG_LEVELS)} (default "
                   f"{d.log_level})")
    p.add_argument("--allow-insecure-remote", action="store_const", const=True,
                   help="allow a non-loopback bind without TLS and tokens")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit status 2 for what the operator configured wrong (flags, --config, KVSTORE_*, the data dir,
    TLS files), 1 for a daemon that cannot start here (port or data dir in use, a damaged store)."""
    from cli.errors import CliError, UsageError
    from kvstore.server.daemon import serve, setup_logging
    from kvstore.server.startup import CannotStart
    from kvstore.tiers.base import TierError

    overrides = {k: v for k, v in vars(args).items() if k not in ("func", "command", "config")}
    try:
        config = load_config(args.config, overrides=overrides)
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
