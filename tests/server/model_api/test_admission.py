"""Admission: the server-wide bound, per-tenant request and token limits, 400 for what can never
fit, Retry-After from the mean hold time, idempotent release, and no state left for idle tenants."""

import asyncio

import pytest

from kvcache.server.model_api.admission import Admission, Overloaded


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(admission: Admission, tenant: str, tokens: int) -> Overloaded:
    with pytest.raises(Overloaded) as e:
        admission.enter(tenant, tokens)
    return e.value


def test_the_server_bound_counts_every_tenant():
    a = Admission(max_waiting=2, tenant_max_requests=None, tenant_max_tokens=None)
    a.enter("alice", 10)
    a.enter("bob", 10)
    e = refused(a, "carol", 1)
    assert (e.status, e.reason) == (429, "server_busy")
    assert e.retry_after_s >= 1 and "2 requests" in e.message
    assert a.in_flight == 2


def test_a_tenant_at_its_request_limit_is_refused_while_others_are_admitted():
    a = Admission(max_waiting=10, tenant_max_requests=2, tenant_max_tokens=None)
    a.enter("alice", 1)
    a.enter("alice", 1)
    e = refused(a, "alice", 1)
    assert (e.status, e.reason) == (429, "tenant_requests")
    a.enter("bob", 1)
    assert a.tenant_load("alice") == (2, 2) and a.tenant_load("bob") == (1, 1)


def test_tokens_in_flight_are_summed_per_tenant():
    a = Admission(max_waiting=10, tenant_max_requests=None, tenant_max_tokens=100)
    a.enter("alice", 60)
    a.enter("alice", 40)                       # exactly at the limit: admitted
    e = refused(a, "alice", 1)
    assert (e.status, e.reason) == (429, "tenant_tokens")
    assert "100 tokens in flight" in e.message
    a.enter("bob", 100)


def test_a_request_larger_than_the_tenant_token_limit_is_a_400_even_when_idle():
    a = Admission(max_waiting=10, tenant_max_requests=None, tenant_max_tokens=100)
    e = refused(a, "alice", 101)
    assert (e.status, e.retry_after_s, e.reason) == (400, 0.0, "too_large")
    assert a.in_flight == 0 and a.tracked_tenants() == 0


def test_release_frees_the_place_once_and_drops_an_idle_tenant():
    a = Admission(max_waiting=1, tenant_max_requests=None, tenant_max_tokens=50)
    t = a.enter("alice", 50)
    refused(a, "bob", 1)
    t.release()
    t.release()                                # idempotent: does not free a second place
    assert a.in_flight == 0 and a.tracked_tenants() == 0 and t.released
    u = a.enter("bob", 1)
    refused(a, "alice", 1)                     # the second release did not uncount bob's
    u.release()


def test_a_ticket_is_a_context_manager_released_on_error():
    a = Admission(max_waiting=1, tenant_max_requests=1, tenant_max_tokens=None)
    with pytest.raises(RuntimeError):
        with a.enter("alice", 5) as ticket:
            assert a.tenant_load("alice") == (1, 5)
            raise RuntimeError("the stream broke")
    assert ticket.released and a.in_flight == 0 and a.tenant_load("alice") == (0, 0)


def test_many_tenants_leave_no_state_behind():
    a = Admission(max_waiting=4, tenant_max_requests=1, tenant_max_tokens=10)
    for i in range(1000):
        with a.enter(f"tenant-{i}", 3):
            pass
    assert a.tracked_tenants() == 0


def test_retry_after_follows_the_mean_hold_time():
    clock = Clock()
    a = Admission(max_waiting=2, tenant_max_requests=None, tenant_max_tokens=None, clock=clock)
    held = [a.enter("alice", 1), a.enter("alice", 1)]
    assert refused(a, "bob", 1).retry_after_s == 1.0      # nothing released yet: the floor
    for t in held:
        t.release()
    for _ in range(30):                                   # requests held 10 s each
        t = a.enter("alice", 1)
        clock.now += 10
        t.release()
    a.enter("alice", 1)
    a.enter("alice", 1)
    assert refused(a, "bob", 1).retry_after_s == 5.0      # two in flight: one expected free in 10 / 2 s


def test_retry_after_is_capped():
    clock = Clock()
    a = Admission(max_waiting=1, tenant_max_requests=None, tenant_max_tokens=None, clock=clock)
    t = a.enter("alice", 1)
    clock.now += 3600
    t.release()
    a.enter("alice", 1)
    assert refused(a, "bob", 1).retry_after_s == 60.0


def test_limits_and_tokens_are_checked():
    with pytest.raises(ValueError):
        Admission(max_waiting=0, tenant_max_requests=None, tenant_max_tokens=None)
    with pytest.raises(ValueError):
        Admission(max_waiting=1, tenant_max_requests=0, tenant_max_tokens=None)
    with pytest.raises(ValueError):
        Admission(max_waiting=1, tenant_max_requests=None, tenant_max_tokens=-1)
    with pytest.raises(ValueError):
        Admission(max_waiting=1, tenant_max_requests=None, tenant_max_tokens=None).enter("alice", -1)


async def test_interleaved_coroutines_never_pass_the_limits():
    a = Admission(max_waiting=5, tenant_max_requests=3, tenant_max_tokens=None)
    peak = {"all": 0, "alice": 0}
    outcomes = []

    async def request(tenant: str, i: int):
        try:
            with a.enter(tenant, 1):
                peak["all"] = max(peak["all"], a.in_flight)
                if tenant == "alice":
                    peak["alice"] = max(peak["alice"], a.tenant_load("alice")[0])
                for _ in range(i % 4):
                    await asyncio.sleep(0)
            outcomes.append("done")
        except Overloaded:
            outcomes.append("refused")

    await asyncio.gather(*(request("alice" if i % 2 else f"t{i % 6}", i) for i in range(200)))
    assert peak == {"all": 5, "alice": 3}
    assert "refused" in outcomes and "done" in outcomes
    assert a.in_flight == 0 and a.tracked_tenants() == 0
