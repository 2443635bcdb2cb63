"""serve(config): build the store, the servicer, health, reflection and metrics, and run until a
signal. Nothing global: everything is built here and injected."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import ssl
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvstore.server.auth import Auth, load_quotas
from kvstore.server.config import ConfigError, DaemonConfig, setting
from kvstore.server.grpc_adapter import add_service
from kvstore.server.handlers import methods
from kvstore.server.health import DaemonHealth
from kvstore.server.local import LocalServer, socket_path
from kvstore.server.malloc_tuning import keep_freed_memory
from kvstore.server.metrics import start_metrics
from kvstore.server.reflection import enable_reflection
from kvstore.server.rpc_metrics import MetricsInterceptor, RpcMetrics
from kvstore.server.service import KVStoreService
from kvstore.server.startup import SERVER_OPTIONS, bind, data_dir_lock
from kvstore.server.stats_pb import prefetch_to_pb
from kvstore.store import SessionStore, open_store
from kvstore.transport import framing, shm
from kvstore.v1 import kvstore_pb2

log = logging.getLogger("kvstore.server")
SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
MAINTENANCE_S = 30.0


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(config: DaemonConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())


def credentials(config: DaemonConfig) -> grpc.ServerCredentials | None:
    """The server's TLS credentials, or None without TLS. Files that cannot be read, or are no PEM
    certificate and matching key (or CA), are a ConfigError naming the flag: gRPC would only say that
    it cannot bind."""
    tls = config.tls
    if not tls.enabled:
        return None
    pem = {}
    for name in ("cert_file", "key_file", "client_ca_file"):
        path = getattr(tls, name)
        if path:
            try:
                pem[name] = Path(path).read_bytes()
            except OSError as e:
                raise ConfigError(f"{setting('tls.' + name)} {path}: {e.strerror or e}", f"tls.{name}") from None
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as e:
        raise ConfigError(f"--tls-cert-file {tls.cert_file} / --tls-key-file {tls.key_file}: not a PEM certificate "
                          f"and its private key ({e.reason or e})", "tls.cert_file") from None
    if tls.client_ca_file:
        try:
            check.load_verify_locations(tls.client_ca_file)
        except ssl.SSLError as e:
            raise ConfigError(f"--tls-client-ca-file {tls.client_ca_file}: not a PEM CA certificate "
                              f"({e.reason or e})", "tls.client_ca_file") from None
    ca = pem.get("client_ca_file")
    return grpc.ssl_server_credentials([(pem["key_file"], pem["cert_file"])], root_certificates=ca,
                                       require_client_auth=ca is not None)


async def serve(config: DaemonConfig, on_ready: Callable[[int], None] | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT; in-flight RPCs get ``grace_s`` to finish, then the
    store (LMDB) is closed. Raises ``startup.CannotStart`` when another daemon holds the data dir
    or the port, ``config.ConfigError`` for TLS files it cannot use."""
    keep_freed_memory()
    creds = credentials(config)  # bad TLS files fail here, before the store is opened
    with data_dir_lock(Path(config.data_dir)):  # before opening the store: its startup GC writes
        store = replace(config.store_config(), quotas=load_quotas(config.tokens_file))
        sessions = await asyncio.to_thread(open_store, store)
        try:
            await _serve(config, sessions, creds, on_ready)
        finally:
            # store calls still running in worker threads finish before the store closes
            await asyncio.get_running_loop().shutdown_default_executor()
            sessions.close()
    log.info("kvstore stopped; store closed")


async def _serve(config: DaemonConfig, sessions: SessionStore, creds: grpc.ServerCredentials | None,
                 on_ready: Callable[[int], None] | None) -> None:
    shm_dir = shm.default_shm_dir() if config.shared_memory else None
    opts = [("grpc.max_receive_message_length", framing.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", framing.MAX_MESSAGE_BYTES), *SERVER_OPTIONS]
    registry = CollectorRegistry() if config.metrics_port else None
    interceptors = [MetricsInterceptor(RpcMetrics(registry))] if registry is not None else []
    server = grpc.aio.server(options=opts, interceptors=interceptors)
    service = KVStoreService(sessions, Auth.from_file(config.tokens_file), shm_dir)
    add_service(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection([SERVICE, health.SERVICE_NAME], server)  # v1 and v1alpha
    port = bind(server, config.host, config.port, creds)
    metrics = (start_metrics(registry, sessions, service.carriers.stats, config.host, config.metrics_port,
                             lambda: prefetch_to_pb(service.prefetcher.counters()))
               if registry is not None else None)
    service.prefetcher.start()
    await server.start()
    local = (LocalServer(methods(service), socket_path(shm_dir, port), service.carriers.count_local)
             if shm_dir is not None else None)
    if local is not None:
        await local.start()
        service.local_socket = str(local.path)
    # every tier probed before the daemon says it is ready: a Redis it cannot reach is a warning now
    daemon_health = DaemonHealth(health_servicer, sessions, SERVICE, config.health_interval_s)
    await daemon_health.check()
    log.info("kvstore listening on %s:%d (tls=%s, tokens=%s, shm=%s, tiers=%s)", config.host, port,
             config.tls.enabled, bool(config.tokens_file), shm_dir or "off",
             ",".join(sessions.store.tier_names()))
    # handlers before announcing readiness: a SIGTERM right after on_ready must shut down cleanly
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready:
        on_ready(port)

    async def maintenance() -> None:
        while True:
            await asyncio.sleep(MAINTENANCE_S)
            expired = await asyncio.to_thread(sessions.expire)
            idle = service.carriers.arenas.close_idle()
            if expired or idle:
                log.info("maintenance: expired %d sessions, closed %d idle arenas", expired, idle)

    tasks = [asyncio.create_task(maintenance()), asyncio.create_task(daemon_health.run())]
    await stop.wait()
    log.info("shutting down: %.0fs grace for in-flight RPCs", config.grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    if local is not None:
        await local.stop(config.grace_s)
    for task in tasks:
        task.cancel()
    await asyncio.to_thread(service.prefetcher.stop)  # its chunk copy done before the store closes
    if metrics is not None:
        metrics.shutdown()
    service.carriers.arenas.close_all()
