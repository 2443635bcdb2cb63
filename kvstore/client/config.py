"""How a client reaches the daemon: one frozen config, shared by ``Client`` and ``AsyncClient``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.defaults import DEFAULT_ADDRESS


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
    # that arena's size (0 = no arena: the stream); a larger batch overflows to the stream for that call
    arena_bytes: int = 64 << 20
