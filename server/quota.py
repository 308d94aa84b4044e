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

Bytes of an upload still being received count too, from before the daemon reserves memory for
them (a PendingBytes per upload): against the tenant's quota, and against a daemon-wide bound
(server.max_pending_upload_bytes, past which uploads wait for a 503) so that many stalled
uploads cannot make the daemon hold what they declare:

    payload arriving:  pending(tenant) += n   (quota: used + held + pending + n <= quota)
    its chunk stored:  hold: pending -= n, held += n (one step) ... put_many ... held -= n
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

from kvcache.kvstore.errors import StoreError


class QuotaExceeded(Exception):
    pass


class UploadsBusy(StoreError):
    """The daemon holds server.max_pending_upload_bytes of uploads under way (HTTP 503: retry)."""


class Quotas:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()   # bytes of uploads being received, per tenant
        self.pending_total = 0

    @contextlib.contextmanager
    def hold(self, store, tenant: str, quota: int | None, incoming: int,
             pending: "PendingBytes | None" = None) -> Iterator[None]:
        """Reserve `incoming` payload bytes of `tenant`'s quota for the duration of the block
        (QuotaExceeded if they do not fit). With `pending` (the upload they arrived in), those
        bytes move from pending to held in the same step, so that they never count twice.
        Blocking: call it from a store worker thread."""
        with self._lock:
            if pending is not None:
                self._release_pending(pending, incoming)
            if quota is None:
                incoming = 0
            else:
                used, _ = store.tenant_usage(tenant)
                held = self._held[tenant] + self._pending[tenant]
                if used + held + incoming > quota:
                    raise QuotaExceeded(_over(tenant, used, quota, held, incoming))
                self._held[tenant] += incoming
        try:
            yield
        finally:
            with self._lock:
                self._held[tenant] -= incoming
                if not self._held[tenant]:
                    del self._held[tenant]


    def add_pending(self, p: "PendingBytes", n: int) -> None:
        """Count n more bytes of an upload under way, before memory is reserved for them."""
        tenant, quota = p.who.tenant, p.who.quota
        with self._lock:
            if self.pending_total + n > p.limit:
                raise UploadsBusy(f"the daemon is receiving {self.pending_total} bytes of uploads "
                                  f"(server.max_pending_upload_bytes = {p.limit}); retry shortly")
            if quota is not None:
                used, _ = p.store.tenant_usage(tenant)
                held = self._held[tenant] + self._pending[tenant]
                if used + held + n > quota:
                    raise QuotaExceeded(_over(tenant, used, quota, held, n))
            self._pending[tenant] += n
            self.pending_total += n
            p.count += n

    def release_pending(self, p: "PendingBytes", n: int | None = None) -> None:
        with self._lock:
            self._release_pending(p, p.count if n is None else n)

    def _release_pending(self, p: "PendingBytes", n: int) -> None:
        n = min(n, p.count)
        p.count -= n
        self.pending_total -= n
        self._pending[p.who.tenant] -= n
        if not self._pending[p.who.tenant]:
            del self._pending[p.who.tenant]


def _over(tenant: str, used: int, quota: int, held: int, incoming: int) -> str:
    return (f"tenant {tenant!r} holds {used} of its {quota} bytes"
            + (f" ({held} more in puts under way)" if held else "")
            + f"; this put needs {incoming} more. Delete or unpin blocks, wait for retention, or raise the quota")


@dataclass
class PendingBytes:
    """The payload bytes one upload has counted as pending (Quotas.add_pending) and not yet stored."""
    quotas: Quotas
    store: object
    who: object                 # the Principal
    limit: int                  # server.max_pending_upload_bytes
    count: int = 0

    def add(self, n: int) -> None:
        self.quotas.add_pending(self, n)

    def release(self, n: int | None = None) -> None:
        """n bytes (all when None) are stored or dropped."""
        self.quotas.release_pending(self, n)


def put_within_quota(store, quotas: Quotas, who, items: list, pending: PendingBytes | None = None) -> object:
    """put_many of `items` for `who` (a Principal) inside its quota; the DRAM landings put_many
    did not adopt (duplicates, a refused or failed put) are freed either way. With `pending`,
    the items' bytes were counted as pending when they arrived; they are held from here on."""
    incoming = sum(memoryview(it.payload).nbytes for it in items)
    try:
        with quotas.hold(store, who.tenant, who.quota, incoming, pending):
            return store.put_many(items)
    finally:
        store.release_payloads([it.payload for it in items])
