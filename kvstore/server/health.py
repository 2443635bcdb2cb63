"""The daemon's health, per part, through the standard health service (grpc.health.v1).

Service names a health check may ask for:

- ``""`` (the whole daemon) and ``kvstore.v1.KVStore``: NOT_SERVING when saves cannot succeed: the
  durable tier (ssd) fails, or sessions are shared through Redis (``--redis-share-sessions``, every
  save is published there first) and the Redis tier fails. A failing cache tier leaves them SERVING.
- ``kvstore.tier.<name>`` for each tier (``kvstore.tier.host``, ``kvstore.tier.ssd``,
  ``kvstore.tier.redis``, ``kvstore.tier.hbm``): NOT_SERVING while that tier fails.
- ``kvstore.layouts``: NOT_SERVING while a stored engine page layout did not reopen (damage): its
  data is kept, loads of it miss and saves under it fail until it is registered again
  (``kvstore/store/sessions/layouts.py``; the log at open and the durable tier's last error name it).

Each tier is probed (its usage, one round trip for Redis) at start, before the daemon says it is
ready, and then every ``interval_s``. A probe goes to the tier directly, not through the store's
counters, so probing does not add to a tier's error count in `kvstore stats`; changes are logged
once each (a warning when a tier starts failing, naming what saves do meanwhile, a line when it is
back).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

from kvstore.store import SessionStore

log = logging.getLogger(__name__)
TIER_PREFIX = "kvstore.tier."
LAYOUTS = "kvstore.layouts"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def tier_service(name: str) -> str:
    """The health service name of a tier: ``kvstore.tier.redis``."""
    return TIER_PREFIX + name


@dataclass(frozen=True)
class Probe:
    """One round of probes: each tier's error (None when it answered), and whether saves can succeed."""

    errors: dict[str, str | None]
    essential: tuple[str, ...]  # the tiers every save needs

    @property
    def saves_ok(self) -> bool:
        return not any(self.errors[t] for t in self.essential)


class DaemonHealth:
    """Keeps the health servicer's statuses in step with the tiers (``run``, until cancelled)."""

    def __init__(self, servicer: health.aio.HealthServicer, sessions: SessionStore, service: str,
                 interval_s: float) -> None:
        self.servicer = servicer
        self.sessions = sessions
        self.service = service
        self.interval_s = interval_s
        self.shared = sessions.sharing_tiers()
        self.essential = (sessions.store.durable_name(), *self.shared)
        self._last: Probe | None = None

    def _probe_tiers(self) -> Probe:
        errors = {name: None if e is None else " ".join(str(e).split()).rstrip(".") or type(e).__name__
                  for name, e in self.sessions.store.probe().items()}
        return Probe(errors, self.essential)

    async def check(self) -> Probe:
        """Probe every tier now, publish the statuses, log what changed; the probe."""
        p = await asyncio.to_thread(self._probe_tiers)
        for name, error in p.errors.items():
            await self.servicer.set(tier_service(name), NOT_SERVING if error else SERVING)
        for name in ("", self.service):
            await self.servicer.set(name, SERVING if p.saves_ok else NOT_SERVING)
        await self.servicer.set(LAYOUTS, NOT_SERVING if self.sessions.layouts.unreadable else SERVING)
        self._log_changes(p)
        self._last = p
        return p

    def _log_changes(self, p: Probe) -> None:
        before = self._last.errors if self._last is not None else {}
        for name, error in p.errors.items():
            if error and not before.get(name):
                log.warning("tier %s is unreachable: %s. %s Health: %s NOT_SERVING%s; checked again every %gs",
                            name, error, self._consequence(name), tier_service(name),
                            "" if name not in self.essential else f", {self.service} NOT_SERVING",
                            self.interval_s)
            elif not error and before.get(name):
                log.info("tier %s is reachable again: %s SERVING", name, tier_service(name))

    def _consequence(self, name: str) -> str:
        if name in self.shared:
            return (f"Sessions are shared through it (--redis-share-sessions): every save fails (UNAVAILABLE) "
                    f"until {name} is back.")
        if name in self.essential:
            return f"{name} is the durable tier: every save fails until it is back."
        return "Saves go on without it (the durable tier keeps them)."

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # a probe must never end the loop: health would freeze at its last answer
                log.exception("health probe failed")
