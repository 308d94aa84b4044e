"""Admission of model requests: a bound on the server's requests in flight and per-tenant limits.

A request is admitted before it reaches the engine and holds its place until its Ticket is
released (answer sent, stream ended, client gone):

    enter(tenant, tokens):  tokens > tenant_max_tokens            -> Overloaded 400 (can never fit)
                            in flight == max_waiting              -> Overloaded 429 (server busy)
                            tenant's requests == tenant_max_requests
                            or its tokens + tokens > tenant_max_tokens -> Overloaded 429
                            else count it: a Ticket
    ticket.release():       uncount it (once; later calls do nothing)

`tokens` is what the request may occupy: its prompt plus its max_tokens. Everything here runs on
the event loop and never awaits, so each enter or release is one atomic step between two
coroutines' turns: no lock, and no check can be overtaken by another request's admission.

Retry-After is the expected wait for one place to free: the mean time a ticket was held
(a moving average over released tickets) divided by the tickets holding the refusing limit,
in whole seconds within [1, 60].
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0
HOLD_SMOOTHING = 0.2            # weight of the newest release in the mean hold time


class Overloaded(Exception):
    """A refused admission. status 429: try again after retry_after_s; 400: the request can
    never be admitted (retry_after_s is 0). reason is a short fixed word for metrics labels."""

    def __init__(self, status: int, retry_after_s: float, message: str, reason: str = "overloaded"):
        super().__init__(message)
        self.status, self.retry_after_s, self.message, self.reason = status, retry_after_s, message, reason


@dataclass(slots=True)
class _TenantLoad:
    requests: int = 0
    tokens: int = 0


class Ticket:
    """One admitted request's place. A context manager: leaving the block releases it."""

    __slots__ = ("tenant", "tokens", "admitted_at", "_admission", "_released")

    def __init__(self, admission: Admission, tenant: str, tokens: int, admitted_at: float):
        self.tenant, self.tokens, self.admitted_at = tenant, tokens, admitted_at
        self._admission, self._released = admission, False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Admission:
    def __init__(self, max_waiting: int, tenant_max_requests: int | None, tenant_max_tokens: int | None,
                 clock: Callable[[], float] = time.monotonic):
        _check_limit("max_waiting", max_waiting)
        _check_limit("tenant_max_requests", tenant_max_requests)
        _check_limit("tenant_max_tokens", tenant_max_tokens)
        self.max_waiting = max_waiting
        self.tenant_max_requests = tenant_max_requests
        self.tenant_max_tokens = tenant_max_tokens
        self._clock = clock
        self._in_flight = 0
        self._tenants: dict[str, _TenantLoad] = {}   # only tenants with a request in flight
        self._mean_hold_s: float | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def tenant_load(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) the tenant has in flight."""
        load = self._tenants.get(tenant)
        return (0, 0) if load is None else (load.requests, load.tokens)

    def tracked_tenants(self) -> int:
        return len(self._tenants)

    def enter(self, tenant: str, tokens: int) -> Ticket:
        if tokens < 0:
            raise ValueError(f"a request occupies tokens >= 0, not {tokens}")
        self._refuse_if_over(tenant, tokens)
        load = self._tenants.setdefault(tenant, _TenantLoad())
        load.requests += 1
        load.tokens += tokens
        self._in_flight += 1
        return Ticket(self, tenant, tokens, self._clock())

    def _refuse_if_over(self, tenant: str, tokens: int) -> None:
        cap = self.tenant_max_tokens
        if cap is not None and tokens > cap:
            raise Overloaded(400, 0.0, f"the request may occupy {tokens} tokens (prompt + max_tokens), more "
                             f"than a tenant may have in flight ({cap}): shorten the prompt or lower max_tokens",
                             reason="too_large")
        if self._in_flight >= self.max_waiting:
            raise Overloaded(429, self._retry_after(self._in_flight), f"the server has {self._in_flight} "
                             "requests in flight, its limit: retry later", reason="server_busy")
        load = self._tenants.get(tenant)
        if load is None:
            return
        if self.tenant_max_requests is not None and load.requests >= self.tenant_max_requests:
            raise Overloaded(429, self._retry_after(load.requests), f"this tenant has {load.requests} requests "
                             "in flight, its limit: retry later", reason="tenant_requests")
        if cap is not None and load.tokens + tokens > cap:
            raise Overloaded(429, self._retry_after(load.requests), f"this tenant has {load.tokens} tokens in "
                             f"flight; {tokens} more would pass its limit of {cap}: retry later",
                             reason="tenant_tokens")

    def _release(self, ticket: Ticket) -> None:
        load = self._tenants[ticket.tenant]
        load.requests -= 1
        load.tokens -= ticket.tokens
        if not load.requests:
            del self._tenants[ticket.tenant]
        self._in_flight -= 1
        held = max(0.0, self._clock() - ticket.admitted_at)
        prev = self._mean_hold_s
        self._mean_hold_s = held if prev is None else prev + HOLD_SMOOTHING * (held - prev)

    def _retry_after(self, holders: int) -> float:
        """Whole seconds until one of `holders` tickets is expected to be released."""
        if self._mean_hold_s is None:
            return RETRY_MIN_S
        wait = self._mean_hold_s / max(holders, 1)
        return min(RETRY_MAX_S, max(RETRY_MIN_S, float(math.ceil(wait))))


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1 (or unset), not {value}")
