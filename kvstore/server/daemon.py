"""serve(config): build the store, the servicer, health, reflection and metrics, and run until a
signal. Nothing global: everything is built here and injected."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvstore import framing, shm
from kvstore.server.auth import Auth
from kvstore.server.config import DaemonConfig
from kvstore.server.handlers import add_service, methods
from kvstore.server.local import LocalServer, socket_path
from kvstore.server.malloc_tuning import keep_freed_memory
from kvstore.server.metrics import start_metrics
from kvstore.server.reflection import enable_reflection
from kvstore.server.rpc_metrics import MetricsInterceptor, RpcMetrics
from kvstore.server.service import KVStoreService
from kvstore.server.startup import SERVER_OPTIONS, bind, data_dir_lock
from kvstore.server.stats_pb import prefetch_to_pb
from kvstore.store import SessionStore, open_store
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


def _credentials(config: DaemonConfig) -> grpc.ServerCredentials | None:
    tls = config.tls
    if not tls.enabled:
        return None
    key, cert = Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes()
    ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def serve(config: DaemonConfig, on_ready: Callable[[int], None] | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT; in-flight RPCs get ``grace_s`` to finish, then the
    store (LMDB) is closed. Raises ``startup.CannotStart`` when another daemon holds the data dir
    or the port."""
    keep_freed_memory()
    with data_dir_lock(Path(config.data_dir)):  # before opening the store: its startup GC writes
        sessions = await asyncio.to_thread(open_store, config.store_config())
        try:
            await _serve(config, sessions, on_ready)
        finally:
            # store calls still running in worker threads finish before the store closes
            await asyncio.get_running_loop().shutdown_default_executor()
            sessions.close()
    log.info("kvstore stopped; store closed")


async def _serve(config: DaemonConfig, sessions: SessionStore, on_ready: Callable[[int], None] | None) -> None:
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
    addr = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    port = bind(server, addr, _credentials(config))
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
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("kvstore listening on %s:%d (tls=%s, tokens=%s, shm=%s, tiers=%s)", config.host, port,
             config.tls.enabled, bool(config.tokens_file), shm_dir or "off",
             ",".join(t.name for t in sessions.store.tiers))
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

    task = asyncio.create_task(maintenance())
    await stop.wait()
    log.info("shutting down: %.0fs grace for in-flight RPCs", config.grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    if local is not None:
        await local.stop(config.grace_s)
    task.cancel()
    await asyncio.to_thread(service.prefetcher.stop)  # its chunk copy done before the store closes
    if metrics is not None:
        metrics.shutdown()
    service.carriers.arenas.close_all()
