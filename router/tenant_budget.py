"""Per-tenant rate limit in tokens per minute: a token bucket per tenant (issue 16, item 6).

Contract: ``TenantBudget(tokens_per_minute)`` holds, per tenant, a balance that refills at ``tokens_per_minute / 60``
per second up to ``tokens_per_minute``. ``retry_after(tenant)`` is None while the balance is positive (the request
may start), else the seconds until it is (the 429's ``Retry-After``, at least 1). ``charge(tenant, tokens)`` takes
a finished request's tokens (prompt + generated, counted by the ingress's engine client when the request ends, so
a request is admitted on what the tenant has already used and may leave the balance in debt). Who calls it:
``router.access.AccessGate`` (admission, for keyed generation requests) and ``router.engine_client`` (the charge).
One budget per router process: with R routers a tenant gets up to R times the rate (stated in the README). Not
thread-safe: the ingress runs both on its event loop. Mechanism only; the rate is ``app.ingress.
tenant_tokens_per_minute``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TenantBudget:
    def __init__(self, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic,
                 max_tenants: int = 65536) -> None:
        if tokens_per_minute <= 0:
            raise ValueError(f"tokens_per_minute must be positive, got {tokens_per_minute}")
        self.capacity = float(tokens_per_minute)
        self.rate = tokens_per_minute / 60.0
        self._clock = clock
        self._max_tenants = max_tenants
        self._balance: dict[str, tuple[float, float]] = {}  # tenant -> (balance, at)
        self.refused = 0

    def _now_balance(self, tenant: str) -> float:
        now = self._clock()
        balance, at = self._balance.get(tenant, (self.capacity, now))
        balance = min(self.capacity, balance + (now - at) * self.rate)
        if tenant not in self._balance and len(self._balance) >= self._max_tenants:
            self._forget_full()
        self._balance[tenant] = (balance, now)
        return balance

    def _forget_full(self) -> None:
        """Drop tenants whose bucket has refilled (they are as if never seen); bounds the table."""
        now = self._clock()
        for t, (b, at) in list(self._balance.items()):
            if b + (now - at) * self.rate >= self.capacity:
                del self._balance[t]

    def retry_after(self, tenant: str) -> int | None:
        balance = self._now_balance(tenant)
        if balance > 0:
            return None
        self.refused += 1
        return max(1, math.ceil((1.0 - balance) / self.rate))

    def charge(self, tenant: str, tokens: int) -> None:
        if tokens <= 0:
            return
        balance = self._now_balance(tenant)
        self._balance[tenant] = (balance - tokens, self._balance[tenant][1])

    def balance(self, tenant: str) -> float:
        return self._now_balance(tenant)
