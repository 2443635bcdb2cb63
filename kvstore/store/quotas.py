"""Per-namespace quotas: what one namespace may hold on the host tier and the ssd tier, and how many
sessions it may keep (docs/CONFIG.md, "Quotas"; docs/SECURITY.md says what they guarantee).

Configured in the tokens file beside the tokens, one table per namespace, ``"*"`` for every
namespace not listed::

    [quotas.team-a]
    host_bytes = 268435456     # its share of the host tier: past it, its own LRU chunks move down first
    ssd_bytes = 4294967296     # past it, its saves are RESOURCE_EXHAUSTED
    sessions = 1000            # live sessions; a save that would start one more is RESOURCE_EXHAUSTED

A field left out is unlimited. A namespace with no host share has no guaranteed room on the host
tier: when the tier is full its chunks are the first to move down.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.format.manifest import check_namespace

#: The quotas table's key for every namespace it does not list.
EVERY = "*"


class QuotaConfigError(ValueError):
    """A quota the daemon cannot use, naming the namespace and the field."""


@dataclass(frozen=True)
class Quota:
    """One namespace's limits; None is unlimited."""

    host_bytes: int | None = None
    ssd_bytes: int | None = None
    sessions: int | None = None

    def bytes_on(self, tier: str) -> int | None:
        """The share of the tier named ``tier`` (host or ssd), None: unlimited (or no such quota)."""
        return self.host_bytes if tier == "host" else self.ssd_bytes if tier == "ssd" else None


@dataclass(frozen=True)
class Quotas:
    """Every namespace's quota: those listed, and ``default`` (the ``"*"`` table) for the rest."""

    namespaces: Mapping[str, Quota] = field(default_factory=dict)
    default: Quota = field(default_factory=Quota)

    def of(self, namespace: str) -> Quota:
        return self.namespaces.get(namespace, self.default)

    @property
    def enabled(self) -> bool:
        return any(q != Quota() for q in (*self.namespaces.values(), self.default))

    def shares(self, tier: str) -> bool:
        """Whether any namespace has a share of the tier named ``tier``: only then is it shared fairly."""
        return any(q.bytes_on(tier) is not None for q in (*self.namespaces.values(), self.default))

    def listed_shares(self, tier: str) -> int:
        """The listed namespaces' shares of ``tier`` together (the ``"*"`` one excluded: it is per namespace)."""
        return sum(q.bytes_on(tier) or 0 for q in self.namespaces.values())

    @classmethod
    def from_table(cls, table: Any) -> Quotas:
        """From the tokens file's ``[quotas]`` table; QuotaConfigError naming the namespace and field."""
        if not isinstance(table, dict):
            raise QuotaConfigError("[quotas] must be a table of namespace = {host_bytes, ssd_bytes, sessions}")
        known = [f.name for f in fields(Quota)]
        out: dict[str, Quota] = {}
        for ns, limits in table.items():
            where = f"[quotas.{ns!r}]" if ns != EVERY else '[quotas."*"]'
            if ns != EVERY:
                try:
                    check_namespace(ns)
                except InvalidArgument as e:
                    raise QuotaConfigError(f"{where}: {e}") from None
            if not isinstance(limits, dict):
                raise QuotaConfigError(f"{where}: must be a table of {', '.join(known)}")
            for k, v in limits.items():
                if k not in known:
                    raise QuotaConfigError(f"{where} {k}: not a quota (one of {', '.join(known)})")
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise QuotaConfigError(f"{where} {k}: must be a non-negative integer, got {v!r}")
            out[ns] = Quota(**limits)
        default = out.pop(EVERY, Quota())
        return cls(out, default)


def from_tokens_file(data: Mapping[str, Any]) -> Quotas:
    """The quotas of a parsed tokens file (none without a ``[quotas]`` table)."""
    return Quotas.from_table(data["quotas"]) if "quotas" in data else Quotas()


@dataclass(frozen=True)
class NamespaceUsage:
    """What one namespace holds now, and its quota: for stats and metrics."""

    namespace: str
    host_bytes: int
    ssd_bytes: int
    sessions: int
    quota: Quota


def refuse_ssd(namespace: str, quota: int, used: int, incoming: int, freed: int = 0) -> ResourceExhausted:
    """The answer to a save that would take ``namespace`` past its ssd quota: ``incoming`` net bytes
    (its new bytes less the ``freed`` bytes of the version it replaces) on top of ``used``."""
    net = f" ({incoming + freed} new, {freed} freed by the version it replaces)" if freed else ""
    return ResourceExhausted(f"namespace {namespace!r} is over its ssd quota: this save needs {incoming} more "
                             f"bytes{net}, it holds {used} of its {quota} (quotas.{namespace}.ssd_bytes); nothing "
                             f"was stored. Delete sessions of {namespace!r} or raise its quota")


def refuse_sessions(namespace: str, quota: int, used: int) -> ResourceExhausted:
    return ResourceExhausted(f"namespace {namespace!r} is at its sessions quota: it holds {used} of its {quota} "
                             f"sessions (quotas.{namespace}.sessions); this new session was not stored. "
                             f"Delete sessions of {namespace!r} or raise its quota")
