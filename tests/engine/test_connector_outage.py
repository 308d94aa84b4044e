"""KVConnector with a store that is down and then answers the probe with an error other than
StoreUnavailableError: the store stays down for retry_s (no probe per lookup) with one warning."""

import logging
from types import SimpleNamespace

import pytest

from kvcache.client.common import AuthError, DaemonError
from kvcache.engine.cache.connector import KVConnector
from kvcache.engine.config import CacheConfig
from kvcache.kvstore.errors import StoreUnavailableError


class RefusingStore:
    """Registering raises each of `errors` in turn, then answers; lookups find nothing."""

    def __init__(self, *errors: Exception):
        self.errors, self.registers, self.lookups = list(errors), 0, 0

    def register_namespace(self, ns):
        self.registers += 1
        if self.errors:
            raise self.errors.pop(0)
        return ns.id

    def lookup(self, keys, namespace_id):
        self.lookups += 1
        return SimpleNamespace(tiers=[], num_hits=0)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _connector(store, clock) -> KVConnector:
    return KVConnector(store, SimpleNamespace(id=b"n" * 16), (), CacheConfig(), retry_s=10.0, clock=clock)


def _lookups(conn: KVConnector, n: int) -> None:
    for _ in range(n):
        conn.lookup([b"k" * 32])
        conn._loader.submit(lambda: None).result()     # any probe it started has run


def _said(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_probe_the_store_refuses_keeps_it_down_for_retry_s_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    store, clock = RefusingStore(StoreUnavailableError("down"), DaemonError("HTTP 503"), AuthError("HTTP 401"),
                                 DaemonError("daemon registered namespace aa, expected bb")), Clock()
    conn = _connector(store, clock)
    try:
        assert store.registers == 1 and _said(caplog, "is unreachable") == 1
        clock.now += 11                               # past retry_s: the next lookup probes, and is refused
        _lookups(conn, 50)
        assert store.registers == 2 and store.lookups == 0
        assert _said(caplog, "refused the namespace") == 1 and "HTTP 503" in caplog.text
        clock.now += 11                               # refused again, the same outage: no second warning
        _lookups(conn, 50)
        clock.now += 11
        _lookups(conn, 50)
        assert store.registers == 4 and _said(caplog, "refused the namespace") == 1
        clock.now += 11                               # it registers: used again
        _lookups(conn, 2)
        assert store.registers == 5 and conn.available() and store.lookups >= 1
        assert _said(caplog, "answers now") == 1 and _said(caplog, "is unreachable") == 1
    finally:
        conn.close()


def test_a_refusal_after_the_store_was_used_again_is_warned_of_again(caplog):
    caplog.set_level(logging.WARNING)
    store, clock = RefusingStore(StoreUnavailableError("down"), AuthError("HTTP 401")), Clock()
    conn = _connector(store, clock)
    try:
        clock.now += 11
        _lookups(conn, 1)
        clock.now += 11
        _lookups(conn, 1)
        assert conn.available() and _said(caplog, "refused the namespace") == 1
        store.errors = [StoreUnavailableError("gone"), AuthError("HTTP 403")]
        conn._lost(StoreUnavailableError("gone"))     # a failing call found it gone
        for _ in range(2):
            clock.now += 11
            _lookups(conn, 5)
        assert _said(caplog, "refused the namespace") == 2 and _said(caplog, "is unreachable") == 2
    finally:
        conn.close()


def test_a_refusal_at_start_raises_unless_the_caller_asks_for_a_miss(caplog):
    with pytest.raises(AuthError):
        _connector(RefusingStore(AuthError("token refused")), Clock())
    clock = Clock()
    with caplog.at_level(logging.WARNING):
        conn = KVConnector(RefusingStore(AuthError("token refused")), SimpleNamespace(id=b"n" * 16), (),
                           CacheConfig(), retry_s=10.0, clock=clock, refusal_is_miss=True)
        assert not conn.available() and conn.lookup([b"k" * 32]) == []
        assert _said(caplog, "refused the namespace") == 1
        clock.now += 11
        _lookups(conn, 1)                             # the probe registers: the store answers now
        assert conn.available()
