"""How a client reaches the daemon: one frozen config, the address it dials and the channel it opens."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.defaults import DEFAULT_ADDRESS, DEFAULT_PORT
from kvstore.transport import framing


def default_address() -> str:
    return os.environ.get("KVSTORE_ADDRESS", DEFAULT_ADDRESS)


@dataclass(frozen=True)
class ClientTls:
    ca_file: str = ""  # CA that signed the daemon's certificate
    cert_file: str = ""  # client certificate for mutual TLS
    key_file: str = ""
    server_name: str = ""  # override the name checked against the certificate

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: str) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


@dataclass(frozen=True)
class ClientConfig:
    address: str = ""  # "" = $KVSTORE_ADDRESS or 127.0.0.1:50151
    token: str = ""  # bearer token
    tls: ClientTls | None = None
    timeout_s: float = 60.0  # deadline of each call
    retries: int = 4  # attempts after the first, on UNAVAILABLE
    backoff_s: float = 0.1  # first retry delay; doubles each time, with jitter
    shared_memory: bool = True  # use an arena when the daemon runs on this host
    # that arena's first size (0 = no arena: the stream); it grows to fit a larger load, up to
    # max_arena_bytes (a 1M-token DeepSeek-V4.1 session is 0.94 GB); a batch larger still takes the stream.
    # max_arena_bytes also bounds the buffer load_session() keeps between loads (kvstore/client/load_into.py)
    arena_bytes: int = 64 << 20
    max_arena_bytes: int = 2 << 30


def client_config(config: ClientConfig | str | None, overrides: Mapping[str, Any]) -> ClientConfig:
    """What ``Client(...)`` was given: a ClientConfig, or the address as a positional string
    (``Client("127.0.0.1:50151")``), with keyword overrides of its fields."""
    if isinstance(config, str):
        if "address" in overrides:
            raise TypeError("the address was given twice: positionally and as address=")
        overrides = {**overrides, "address": config}
        config = None
    if config is not None and not isinstance(config, ClientConfig):
        raise TypeError(f"expected a ClientConfig or an address string, got {type(config).__name__}")
    cfg = config or ClientConfig()
    return ClientConfig(**{**cfg.__dict__, **overrides}) if overrides else cfg


#: gRPC target URIs, passed to gRPC as they are (``unix:/run/kvstore.sock``, ``dns:///host:port``, ...)
_URI = re.compile(r"(unix|unix-abstract|dns|ipv4|ipv6|vsock):")


def target(address: str) -> str:
    """The gRPC target a client dials for ``address`` ("" = $KVSTORE_ADDRESS or the default): HOST,
    HOST:PORT, [IPv6] or [IPv6]:PORT, or a bare IPv6 address; without a port the daemon's default
    port (50151, not gRPC's 443). A gRPC URI (unix:, dns:, ipv4:, ...) is passed on as it is.
    ValueError for a port that is not a number in 1-65535."""
    a = (address or default_address()).strip()
    if not a:
        raise ValueError("empty daemon address")
    if _URI.match(a):
        return a
    if a.startswith("["):
        host, bracket, rest = a.partition("]")
        if not bracket or host == "[":
            raise ValueError(f"malformed daemon address {address!r}: an IPv6 address needs its closing ']'")
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            raise ValueError(f"malformed daemon address {address!r}: expected [IPv6]:PORT")
    elif a.count(":") > 1:  # a bare IPv6 address: it has no port
        return f"[{a}]:{DEFAULT_PORT}"
    else:
        host, colon, port_s = a.partition(":")
        if not host:
            raise ValueError(f"malformed daemon address {address!r}: no host")
        port = port_s if colon else None
    if port is None:
        return f"{a}:{DEFAULT_PORT}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"malformed daemon address {address!r}: the port must be a number in 1-65535, got {port!r}")
    return a


def channel_options(cfg: ClientConfig) -> list[tuple[str, Any]]:
    """The gRPC channel's options: messages up to the framing's limit, the TLS name override."""
    opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", framing.MAX_MESSAGE_BYTES),
                                   ("grpc.max_send_message_length", framing.MAX_MESSAGE_BYTES)]
    if cfg.tls and cfg.tls.server_name:
        opts.append(("grpc.ssl_target_name_override", cfg.tls.server_name))
    return opts


def metadata(cfg: ClientConfig) -> tuple[tuple[str, str], ...]:
    """What every call carries: the bearer token, if any."""
    return (("authorization", f"Bearer {cfg.token}"),) if cfg.token else ()
