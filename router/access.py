"""Who may call the endpoint, and how much it holds at once: API keys, the admin key, backpressure.

The contract (issue 16), applied to every HTTP request of the ingress (``router.ingress``) by ``AccessMiddleware``
(an ASGI middleware of its FastAPI app) before any route runs, with the process's ``AccessGate`` (``install``, by
the ingress at start):

- **API keys.** ``KVSTACK_API_KEYS`` (comma-separated ``key=tenant`` pairs) and/or ``app.ingress.api_keys_file`` (a
  YAML mapping key → tenant). When any key is configured, every ``/v1/*``, ``/tokenize``, ``/detokenize`` and
  ``/version`` request needs ``Authorization: Bearer KEY`` (the ``openai`` SDK's ``api_key``); a missing or unknown
  key is a 401 OpenAI error object (``invalid_api_key``). The key's tenant is put on the request
  (``request.state.tenant``). No key configured = open, as before, and the start-up log says so.
- **Admin key.** ``KVSTACK_ADMIN_KEY`` guards ``/kvstack/*`` (status, decisions, admin). With API keys configured
  and no admin key, ``/kvstack/*`` is closed (403): they show other tenants' cache hits and node addresses.
- ``/health`` is always open; ``/metrics`` is open unless ``app.ingress.metrics_need_key`` (then an API key or the
  admin key).
- **Backpressure.** ``app.ingress.max_queued_requests``: the most generation requests (chat, completions) one
  router holds unfinished at once, streaming ones until their stream ends; beyond it a 429 OpenAI error with
  ``Retry-After``, never an unbounded queue and never a 500. ``app.ingress.tenant_tokens_per_minute``: with API
  keys, each tenant's prompt + generated tokens a minute (``router.tenant_budget``, charged by the engine client as
  requests end); a tenant past it gets a 429 (``rate_limit_exceeded``) with ``Retry-After``.

Keys are compared in constant time (``hmac.compare_digest``) and never logged. Mechanism only: which paths need
what is ``path_class``; the settings come from ``AccessSettings`` (``app.ingress``) and the process environment.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from configs.schema import Strict
from router.tenant_budget import TenantBudget

log = logging.getLogger("kvstack.access")

API_KEYS_ENV = "KVSTACK_API_KEYS"
ADMIN_KEY_ENV = "KVSTACK_ADMIN_KEY"
RETRY_AFTER_S = 1
PathClass = Literal["open", "metrics", "admin", "api"]
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class AccessSettings(Strict):
    """``app.ingress`` keys of access control and backpressure (the keys themselves come from the environment or
    the keys file, never from the config)."""

    api_keys_file: str | None = Field(default=None, description="YAML mapping API key -> tenant (with or instead "
                                                                f"of ${API_KEYS_ENV})")
    metrics_need_key: bool = Field(default=False, description="/metrics needs an API key or the admin key")
    max_queued_requests: int | None = Field(default=None, gt=0, description="the most unfinished generation "
                                            "requests one router holds; beyond it 429 with Retry-After")
    tenant_tokens_per_minute: int | None = Field(default=None, gt=0, description="per tenant (API keys only), per "
                                                 "router: prompt + generated tokens a minute; beyond it 429 with "
                                                 "Retry-After")


class AccessConfigError(ValueError):
    """Malformed keys (env or file): the ingress refuses to start rather than run open by mistake."""


def parse_key_pairs(text: str, where: str) -> dict[str, str]:
    """``key=tenant,key=tenant`` → {key: tenant}."""
    out: dict[str, str] = {}
    for i, item in enumerate(p.strip() for p in text.split(",")):
        if not item:
            continue
        key, sep, tenant = item.partition("=")
        if not sep or not key.strip() or not tenant.strip():
            raise AccessConfigError(f"{where}: entry {i + 1} is not key=tenant")
        out[key.strip()] = tenant.strip()
    return out


def load_keys(settings: AccessSettings, env: Mapping[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """API keys (key → tenant) from the environment and the keys file, and the admin key (None if unset)."""
    env = os.environ if env is None else env
    keys = parse_key_pairs(env.get(API_KEYS_ENV, ""), API_KEYS_ENV)
    if settings.api_keys_file:
        path = Path(settings.api_keys_file)
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise AccessConfigError(f"app.ingress.api_keys_file {path}: cannot read: {exc}") from exc
        if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                                for k, v in raw.items()):
            raise AccessConfigError(f"app.ingress.api_keys_file {path}: expected a mapping of key -> tenant")
        keys.update(raw)
    admin = env.get(ADMIN_KEY_ENV) or None
    return keys, admin


def path_class(path: str) -> PathClass:
    if path == "/health":
        return "open"
    if path == "/metrics":
        return "metrics"
    if path.startswith("/kvstack/"):
        return "admin"
    return "api"


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass
class AccessGate:
    """The ingress's access check and in-flight bound (one per ingress replica)."""

    keys: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    metrics_need_key: bool = False
    max_queued_requests: int | None = None
    budget: TenantBudget | None = None  # the per-tenant rate limit (``router.tenant_budget``), if configured
    in_flight: int = 0
    rejected_busy: int = 0

    @classmethod
    def from_settings(cls, settings: AccessSettings, env: Mapping[str, str] | None = None) -> AccessGate:
        keys, admin = load_keys(settings, env)
        budget = TenantBudget(settings.tenant_tokens_per_minute) if settings.tenant_tokens_per_minute else None
        gate = cls(keys, admin, settings.metrics_need_key, settings.max_queued_requests, budget)
        if keys:
            log.info("kvstack ingress: %d API key(s) of %d tenant(s); /kvstack/* %s", len(keys),
                     len(set(keys.values())), "needs the admin key" if admin else "closed (no admin key set)")
        else:
            log.warning("kvstack ingress: no API keys configured (%s / app.ingress.api_keys_file): the endpoint is "
                        "open to anyone who can reach it%s", API_KEYS_ENV, "" if admin else
                        "; /kvstack/* too")
        return gate

    @property
    def keyed(self) -> bool:
        return bool(self.keys)

    def _tenant(self, token: str | None) -> str | None:
        if token is None:
            return None
        found = None
        for key, tenant in self.keys.items():  # every key compared: the time does not tell which one matched
            if hmac.compare_digest(key.encode(), token.encode()):
                found = tenant
        return found

    def _is_admin(self, token: str | None) -> bool:
        return token is not None and self.admin_key is not None and hmac.compare_digest(
            self.admin_key.encode(), token.encode())

    def authorize(self, path: str, headers: Mapping[str, str]) -> tuple[int, str, str | None]:
        """(0, "", tenant) when the request may go on (tenant None: unkeyed), else (status, message, None)."""
        cls = path_class(path)
        token = bearer(headers)
        if cls == "open":
            return 0, "", None
        if cls == "admin":
            if self.admin_key is None:
                return (0, "", None) if not self.keyed else (
                    403, f"/kvstack/* is closed: set {ADMIN_KEY_ENV} to use it", None)
            return (0, "", None) if self._is_admin(token) else (401, "this route needs the admin key", None)
        if cls == "metrics":
            if not self.metrics_need_key or self._is_admin(token):
                return 0, "", None
            tenant = self._tenant(token)
            return (0, "", tenant) if tenant is not None else (401, "/metrics needs an API key", None)
        if not self.keyed:
            return 0, "", None
        tenant = self._tenant(token)
        if tenant is None:
            why = "no API key given (Authorization: Bearer KEY)" if token is None else "invalid API key"
            return 401, why, None
        return 0, "", tenant

    def refusal(self, path: str, headers: Mapping[str, str]) -> tuple[Any, str | None]:
        """(an OpenAI error response to send instead, None) or (None, the request's tenant)."""
        from fastapi.responses import JSONResponse

        from router import openai_format as fmt

        status, message, tenant = self.authorize(path, headers)
        if status:
            err = fmt.ApiError(status, message, type_="authentication_error" if status == 401 else
                               "permission_error", code="invalid_api_key" if status == 401 else "forbidden")
            return JSONResponse(err.body(), status_code=status,
                                headers={"WWW-Authenticate": "Bearer"} if status == 401 else None), None
        if tenant is not None and self.budget is not None and path in GENERATION_PATHS:
            wait = self.budget.retry_after(tenant)
            if wait is not None:
                err = fmt.ApiError(429, f"tenant {tenant!r} used its tokens per minute "
                                        f"(app.ingress.tenant_tokens_per_minute): retry after {wait} s",
                                   type_="rate_limit_error", code="rate_limit_exceeded")
                return JSONResponse(err.body(), status_code=429, headers={"Retry-After": str(wait)}), None
        if self.counts(path) and self.in_flight >= self.max_queued_requests:  # type: ignore[operator]
            self.rejected_busy += 1
            err = fmt.ApiError(429, f"this router holds {self.in_flight} unfinished requests "
                                    f"(app.ingress.max_queued_requests): retry after {RETRY_AFTER_S} s",
                               type_="rate_limit_error", code="too_many_requests")
            return JSONResponse(err.body(), status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)}), None
        return None, tenant

    def charge(self, tenant: str, tokens: int) -> None:
        """A finished generation request of ``tenant`` used ``tokens`` (prompt + generated): its rate limit."""
        if self.budget is not None and tenant:
            self.budget.charge(tenant, tokens)

    def counts(self, path: str) -> bool:
        """Whether a request on ``path`` takes an in-flight slot."""
        return self.max_queued_requests is not None and path in GENERATION_PATHS


_GATE: AccessGate | None = None


def install(gate: AccessGate | None) -> None:
    """The gate of this process's ingress (Serve runs one ingress replica per process, and serves a frozen copy of
    the FastAPI app, so the gate lives here rather than on the app object)."""
    global _GATE
    _GATE = gate


def installed() -> AccessGate | None:
    return _GATE


class AccessMiddleware:
    """ASGI middleware of the ingress's FastAPI app: every HTTP request through the process's ``AccessGate``
    (``install``; until there is one only ``/health`` answers). A request that takes an in-flight slot holds it
    until its response is sent whole, or the client is gone."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        gate = _GATE
        if gate is None:
            if path_class(path) != "open":
                from fastapi.responses import JSONResponse

                from router import openai_format as fmt

                err = fmt.ApiError(503, "the endpoint is starting", type_="service_unavailable", code="starting")
                await JSONResponse(err.body(), status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused, tenant = gate.refusal(path, headers)
        if refused is not None:
            await refused(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        if not gate.counts(path):
            await self.app(scope, receive, send)
            return
        gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            gate.in_flight -= 1
