"""Tenant quotas under concurrent puts.

A put checks what its tenant holds (the index's per-tenant usage) before it stores. Two puts
checked at once would both see the same usage and both pass, taking the tenant past its quota
(8 parallel 60 kB puts against 100 kB: 240 kB stored). So a put *holds* its bytes from the check
until its store call returns:

    hold:     used(tenant) + held(tenant) + incoming <= quota ?  held += incoming  (one lock)
    store:    put_many(items)                    (usage grows as the index commits)
    release:  held -= incoming                   (stored or not)

Between the commit and the release the bytes count twice: a put racing that instant may be
refused although it would fit (never admitted although it would not).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator


class QuotaExceeded(Exception):
    pass


class Quotas:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, store, tenant: str, quota: int | None, incoming: int) -> Iterator[None]:
        """Reserve `incoming` payload bytes of `tenant`'s quota for the duration of the block
        (QuotaExceeded if they do not fit). Blocking: call it from a store worker thread."""
        if quota is None:
            yield
            return
        with self._lock:
            used, _ = store.tenant_usage(tenant)
            held = self._held[tenant]
            if used + held + incoming > quota:
                raise QuotaExceeded(f"tenant {tenant!r} holds {used} of its {quota} bytes"
                                    + (f" ({held} more in puts under way)" if held else "")
                                    + f"; this put needs {incoming} more. Delete or unpin blocks, wait for "
                                    "retention, or raise the quota")
            self._held[tenant] += incoming
        try:
            yield
        finally:
            with self._lock:
                self._held[tenant] -= incoming
                if not self._held[tenant]:
                    del self._held[tenant]


def put_within_quota(store, quotas: Quotas, who, items: list) -> object:
    """put_many of `items` for `who` (a Principal) inside its quota; the DRAM landings put_many
    did not adopt (duplicates, a refused or failed put) are freed either way."""
    try:
        with quotas.hold(store, who.tenant, who.quota, sum(memoryview(it.payload).nbytes for it in items)):
            return store.put_many(items)
    finally:
        store.release_payloads([it.payload for it in items])
