"""vLLM's requests on the shared page sessions (``kvstore/engines/pages/sessions.py``): which tenant a
request's blocks belong to (its ``kv_transfer_params``) and the page session they are saved under."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.engines.pages.sessions import PageSession, PageSessions, Tenant, session_id

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import ReqContext

    from kvstore.format.manifest import Retention
    from kvstore.format.page_layout import PageLayout


class Sessions(PageSessions):
    """The tier's tenants and the page sessions of its requests (scheduler and job threads both
    reach them)."""

    def __init__(self, layout: PageLayout, default: Tenant, tenants: dict[str, Tenant], retention: Retention) -> None:
        super().__init__(layout, default, retention)
        self.tenants = tenants
        #: each request's page session; None: its tenant is unknown, it is never offloaded
        self._requests: dict[str, PageSession | None] = {}

    def tenant(self, ctx: ReqContext) -> Tenant | None:
        """The tenant of a request (None: an unknown salt, never offloaded)."""
        params = ctx.kv_transfer_params or {}
        salt = params.get("kvstore_tenant") or params.get("cache_salt")
        if not salt:
            return self.default
        return self.tenants.get(str(salt))

    def of_request(self, ctx: ReqContext) -> PageSession | None:
        """The page session of a request (None: not offloaded), made at its first sight."""
        if ctx.req_id not in self._requests:
            params = ctx.kv_transfer_params or {}
            tenant = self.tenant(ctx)
            sid = session_id(str(params.get("kvstore_session") or f"vllm-{ctx.req_id}"))
            self._requests[ctx.req_id] = self.session(tenant, sid) if tenant else None
        return self._requests[ctx.req_id]

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
