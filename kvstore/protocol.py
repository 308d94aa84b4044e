"""The store seam: what `BlockStore`, `KVClient` (`Store`) and `AsyncKVClient` (`AsyncStore`) share.

Code that only caches (the engine's connector, benchmarks, tools) is written against these and
takes whatever `client.open_store` returns. The contracts hold for every implementation; where
one differs (the daemon takes the tenant from the bearer token; only BlockStore has flush()),
its own docstring says so.

`Maintenance` is the other seam, below the store: what BlockStore asks of the collector it is
handed at construction (gc/ is built on kvstore, never imported by it).

Errors (kvstore/errors.py), common to every method:
  * a miss is never an error: an absent or expired block is None / False / not counted;
  * a corrupt copy is a miss too (quarantined, never served); CorruptBlockError never surfaces;
  * StoreUnavailableError: the store did not answer (a daemon not running, a connection refused,
    reset or timed out). Nothing was refused and the same call may succeed later: a cache reader
    treats it as a miss and tries again after a while;
  * BlockFormatError (a ValueError): the caller's input is not a valid block, key or layout;
  * UnknownNamespaceError: a put names a namespace never registered;
  * TierFullError: no tier can make room (everything left is pinned, the disk is full, or, from
    the daemon, the tenant's quota);
  * anything else is a StoreError.
Keys are bytes (TypeError otherwise); a key no block can have (outside 1-64 bytes) is a miss.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.types import LookupResult, PutItem, PutResult, StoreStats


@runtime_checkable
class Store(Protocol):
    """A blocking block store: BlockStore in-process, KVClient over the daemon."""

    def register_namespace(self, ns: Namespace) -> bytes:
        """Make `ns` known (persisted) and return its 16-byte id. Idempotent; a new non-empty
        `ns.name` renames the namespace. Puts into a namespace need it registered first."""

    def lookup(self, keys: Sequence[bytes], tenant: str = "", namespace_id: bytes | None = None) -> LookupResult:
        """The longest run of live blocks from keys[0], and the fastest tier of each. Reads no
        payload; a block found only in object storage may start its prefetch into DRAM.
        `tenant` and `namespace_id` only label the event for hit-rate reports."""

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a live block has it (not only a prefix run, unlike lookup)."""

    def contains(self, key: bytes) -> bool:
        """exists_many for one key."""

    def get(self, key: bytes) -> bytes | None:
        """The payload, verified; None on a miss."""

    def get_into(self, key: bytes, out) -> int | None:
        """Copy the payload into `out` (any writable buffer; the daemon clients, whose
        `reads_scatter` is True, also take a `types.Scatter`); its length, or None on a miss.
        A buffer smaller than the payload raises ValueError."""

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """get for each key, in order, as one batch."""

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """get_into for each (key, buffer) pair as one batch: lengths, None per miss. Different
        lengths of `keys` and `outs`, or a buffer too small, raise ValueError (buffers before
        the too-small one may already be filled)."""

    def put(self, key: bytes, payload, namespace_id: bytes, layout=None, tenant: str = "",
            ttl_s: float | None = None) -> PutResult:
        """put_many of one PutItem."""

    def put_many(self, items: Sequence[PutItem]) -> PutResult:
        """Store the blocks. Content-addressed: a block already held is counted in
        `already_present` and not written again, so a retried put is harmless. Every item is
        validated before any is stored; `durable` is True once the blocks survive a crash.
        A put_many split into several batches (the daemon's limits) that fails part-way may
        have stored its earlier batches."""

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Hold blocks against eviction and expiry: a hard pin (counted, until unpin) when
        `ttl_s` is None, else a soft pin for `ttl_s` seconds. Returns the blocks pinned; absent
        keys are skipped."""

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one hard pin, or if none the soft pin; returns the blocks whose pin changed.
        Pin counts never go negative."""

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove blocks from every tier, pinned or not; returns how many were there. Never
        retried by a client: a lost reply surfaces as an error, not as a second delete."""

    def stats(self) -> StoreStats:
        """Block counts, tier usage and counters (`.to_dict()` for JSON)."""

    def close(self) -> None:
        """Release everything (idempotent); BlockStore flushes first."""

    def __enter__(self) -> "Store": ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class AsyncStore(Protocol):
    """Store's contract as coroutines: AsyncKVClient."""

    async def register_namespace(self, ns: Namespace) -> bytes:
        """As Store.register_namespace."""

    async def lookup(self, keys: Sequence[bytes], tenant: str = "",
                     namespace_id: bytes | None = None) -> LookupResult:
        """As Store.lookup."""

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """As Store.exists_many."""

    async def contains(self, key: bytes) -> bool:
        """As Store.contains."""

    async def get(self, key: bytes) -> bytes | None:
        """As Store.get."""

    async def get_into(self, key: bytes, out) -> int | None:
        """As Store.get_into."""

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """As Store.get_many."""

    async def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """As Store.get_many_into."""

    async def put(self, key: bytes, payload, namespace_id: bytes, layout=None, tenant: str = "",
                  ttl_s: float | None = None) -> PutResult:
        """As Store.put."""

    async def put_many(self, items: Sequence[PutItem]) -> PutResult:
        """As Store.put_many."""

    async def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """As Store.pin."""

    async def unpin(self, keys: Sequence[bytes]) -> int:
        """As Store.unpin."""

    async def delete(self, keys: Sequence[bytes]) -> int:
        """As Store.delete."""

    async def stats(self) -> StoreStats:
        """As Store.stats."""

    async def close(self) -> None:
        """As Store.close."""

    async def __aenter__(self) -> "AsyncStore": ...

    async def __aexit__(self, *exc) -> None: ...


class RoomMade(Protocol):
    """What a collector's make_room reports back to the store (gc/collector.py's GcReport)."""

    evicted: int                       # blocks whose NVMe copy was dropped


@runtime_checkable
class Maintenance(Protocol):
    """What BlockStore asks of the collector it is handed (`BlockStore(config, maintenance=...)`,
    a factory called with the store; gc/collector.py's Collector is the one kvcache wires). The
    store never imports GC: whoever opens a store for real (the daemon, open_store, the CLI,
    benchmarks, trace replay) hands it the collector."""

    def step(self) -> object:
        """One bounded GC step (expiry, capacity eviction, compaction). The store's background
        thread calls it every `gc_interval_s` seconds; an exception is logged and retried."""

    def make_room(self) -> RoomMade:
        """Bounded work for a put that found the NVMe tier over its high watermark, called under
        the store lock before the put's records are written. Finding nothing to evict is no
        error: the put goes on, and a disk that really is full answers TierFullError."""
