"""The one seam between the engine and the cache: what the engine asks of a block store.

    scheduler side (reads only)
    lookup(keys)                  tier of each block of the longest stored prefix
    snapshots_present(keys)       which block boundaries have a tail snapshot (present: for any keys)
    load_seconds(tiers)           time to load blocks from those tiers, at the measured bandwidth

    worker side (threads; the engine applies the results)
    fetch(keys, tiers, snapshot)  loader thread: soft pin (TTL, left to lapse) ─> get_many ─>
                                  payloads (None for a block that failed), the snapshot's bytes
    get_now / put_now             get_many_into the caller's buffers (no pin) / a put_many, in the
                                  caller's thread (the plug-ins' own threads, SGLang's)
    save(blocks)                  saver thread: put_many; only blocks whose tokens are all committed
    save_raw(key, data)           saver thread: a tail snapshot under its own key (exact mode)
    flush()                       wait until every save submitted so far has landed

The store is anything with the BlockStore interface (`client.open_store`: an in-process store on
a directory or TOML config, or `kvcache serve` over http:// or unix://). A store that fails
degrades to misses: a failed lookup finds nothing, a failed fetch returns None for its blocks
(those tokens are recomputed), a failed save is counted and dropped. Saves are best effort and
bounded: beyond `max_pending_save_bytes` new saves are dropped (counted), never queued without limit.

A store that does not answer (StoreUnavailableError: a daemon not running yet, or gone) is
down: one warning, then nothing is sent to it (every lookup a miss, saves dropped) until
`retry_s` has passed; then the loader thread registers the namespace again (a daemon that came
back without its data needs it) and, once that answers, the store is used again. A store that
answers the probe with another error (a refused token, a namespace limit) stays down the same
way, with one warning of its own. The probe never runs on the scheduler's path, so a store that
is down costs a request nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvcache.engine.config import CacheConfig
from kvcache.kvstore.errors import StoreUnavailableError
from kvcache.kvstore.hashing import Namespace, snapshot_key
from kvcache.kvstore.types import PutItem
from kvcache.kvstore.types import TensorSpec, TierName

log = logging.getLogger(__name__)
TIERS = tuple(TierName)       # fastest first
RETRY_S = 10.0      # a store that did not answer is tried again after this many seconds



class KVConnector:
    def __init__(self, store, namespace: Namespace, layout: tuple[TensorSpec, ...], config: CacheConfig, *,
                 retry_s: float | None = None, clock=time.monotonic, refusal_is_miss: bool = False):
        self.store, self.namespace, self.layout, self.config = store, namespace, layout, config
        self.namespace_id = namespace.id              # what registering returns (a daemon checks it)
        self.where = config.store or getattr(store, "base_url", "") or type(store).__name__   # for log lines
        self.retry_s, self._clock = RETRY_S if retry_s is None else retry_s, clock
        self._down_until: float | None = None         # None: the store answers
        self._probing = False
        self._refusal_said = False                    # a probe's refusal warned of (once per outage)
        self.block_bytes = sum(s.nbytes for s in layout)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvcache-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvcache-save")
        self._lock = threading.Lock()
        self._pending_save = 0
        self.bandwidth = dict(config.bandwidth)       # bytes/s per tier label, measured as loads happen
        self.stats = {"lookups": 0, "lookup_errors": 0, "fetched_blocks": 0, "failed_blocks": 0, "saved_blocks": 0,
                      "saved_snapshots": 0, "save_errors": 0, "save_dropped": 0, "store_down": 0}
        try:
            self._register()
        except Exception as e:      # refused (a token, a namespace limit): raise, unless a plug-in asks
            if not refusal_is_miss:   # for a miss (another engine's process must not die of its cache)
                raise
            self._refused(e)

    # ------------------------------------------------------------ a store that is down
    def _register(self) -> bool:
        try:
            self.namespace_id = self.store.register_namespace(self.namespace)
        except StoreUnavailableError as e:
            self._lost(e)
            return False
        return True

    def available(self) -> bool:
        """Whether to send anything to the store now. While it is down: no, and once `retry_s`
        has passed a probe starts in the loader thread (never on the caller's path)."""
        with self._lock:
            if self._down_until is None:
                return True
            if self._probing or self._clock() < self._down_until:
                return False
            self._probing = True
        self._loader.submit(self._probe)
        return False

    def _probe(self) -> None:
        try:
            up = self._register()
        except Exception as e:        # it answered but refused: an error here would die in the Future
            self._refused(e)
            up = False
        finally:
            with self._lock:
                self._probing = False
        if up:
            with self._lock:
                self._down_until, self._refusal_said = None, False
            log.warning("cache store %s answers now: using it", self.where)

    def _refused(self, e: Exception) -> None:
        """Registering again failed with the store answering (a 5xx past the client's retries, a
        refused token, a namespace limit, another namespace id): down for retry_s more, else every
        lookup would probe again at once; warned once until the store is used again."""
        with self._lock:
            self._down_until = self._clock() + self.retry_s
            first, self._refusal_said = not self._refusal_said, True
        if first:
            log.warning("cache store %s answered but refused the namespace (%s): generating without the cache, "
                        "trying it again every %g s", self.where, e, self.retry_s)

    def _lost(self, e: Exception) -> None:
        """The store did not answer: warn once (not per request), try again in retry_s."""
        with self._lock:
            first = self._down_until is None
            self._down_until = self._clock() + self.retry_s
        if first:
            log.warning("cache store %s is unreachable (%s): generating without the cache, trying it again "
                        "every %g s", self.where, e, self.retry_s)

    def _failed(self, e: Exception, what: str, then: str) -> None:
        if isinstance(e, StoreUnavailableError):
            self._lost(e)
        else:
            log.warning("%s failed (%s): %s", what, e, then)

    # ------------------------------------------------------------ scheduler side
    def lookup(self, keys: list[bytes]) -> list[TierName]:
        """Tier of each block of the longest stored prefix of `keys` ([] on any error)."""
        if not keys:
            return []
        self.stats["lookups"] += 1
        if not self.available():
            self.stats["store_down"] += 1
            return []
        try:
            r = self.store.lookup(keys, namespace_id=self.namespace_id)
        except Exception as e:                       # a failing store is a miss
            self.stats["lookup_errors"] += 1
            self._failed(e, "cache lookup", "treated as a miss")
            return []
        return [TierName.of(t) for t in r.tiers[: r.num_hits]]

    def snapshots_present(self, keys: list[bytes]) -> list[bool]:
        """Whether the tail snapshot after each block key is stored."""
        return self.present([snapshot_key(k) for k in keys])

    def present(self, keys: list[bytes]) -> list[bool]:
        """Whether each key (a snapshot's) is stored; all False when the store fails or is down."""
        if not keys:
            return []
        if not self.available():
            self.stats["store_down"] += 1
            return [False] * len(keys)
        try:
            return list(self.store.exists_many(keys))
        except Exception as e:
            self._failed(e, "cache snapshot lookup", "treated as a miss")
            return [False] * len(keys)

    def load_seconds(self, tiers: list[TierName]) -> float:
        return sum(self.block_bytes / self.bandwidth.get(t, 1e8) for t in tiers if t != TierName.HBM)

    # ------------------------------------------------------------ worker side
    def fetch(self, keys: list[bytes], tiers: list[TierName], snapshot: bytes | None = None) -> Future:
        """Start loading blocks (and a snapshot); the future gives (payloads with None for a block
        that failed, snapshot bytes or None)."""
        return self._loader.submit(self._fetch, list(keys), list(tiers), snapshot)

    def _fetch(self, keys: list[bytes], tiers: list[TierName], snap_key: bytes | None):
        want = keys + ([snap_key] if snap_key else [])
        t0 = time.perf_counter()
        try:
            # a soft pin for the fetch, left to lapse: an unpin drops a hard pin first, and the
            # blocks may hold someone else's (an operator's, another client's)
            self.store.pin(want, ttl_s=self.config.pin_ttl_s)
            got = self.store.get_many(want)
        except Exception as e:
            self._failed(e, f"cache fetch of {len(want)} blocks", "they are recomputed")
            got = [None] * len(want)
        dt = time.perf_counter() - t0
        loaded = sum(memoryview(p).nbytes for p in got if p is not None)
        slow = [t for t in tiers if t != TierName.HBM]
        if loaded and slow and dt > 0:                # the slowest tier of the fetch gets the measurement
            tier = max(slow, key=TIERS.index)
            self.bandwidth[tier] = 0.7 * self.bandwidth.get(tier, loaded / dt) + 0.3 * (loaded / dt)
        blocks = got[: len(keys)]
        self.stats["fetched_blocks"] += sum(p is not None for p in blocks)
        self.stats["failed_blocks"] += sum(p is None for p in blocks)
        return blocks, (got[-1] if snap_key else None), loaded, dt

    def get_now(self, keys: list[bytes], outs: list) -> list[int | None]:
        """Blocks straight into the caller's buffers (one per key, each at least a block), in the
        caller's thread (for engines that call the store from threads of their own): lengths, None
        per block that failed; all None while the store is down or when the call fails (a buffer
        it may have half filled is the caller's to ignore)."""
        if not self.available():
            self.stats["store_down"] += 1
            return [None] * len(keys)
        # no soft pin (unlike _fetch): the read leases each batch of blocks while it copies them
        # (shared memory) or reads each whole in one response (HTTP), and the interval a pin
        # would guard, from the plug-in's lookup to this read, has passed already; a block
        # evicted in it is a miss the engine recomputes. A pin is an index write in the daemon
        # that, beside a 128 MiB read from DRAM, took a fifth of its rate on a 2-core host.
        try:
            got = list(self.store.get_many_into(keys, outs))
        except Exception as e:
            self._failed(e, f"cache fetch of {len(keys)} blocks", "they are recomputed")
            got = [None] * len(keys)
        self.stats["fetched_blocks"] += sum(n is not None for n in got)
        self.stats["failed_blocks"] += sum(n is None for n in got)
        return got

    def put_now(self, blocks: list[tuple[bytes, object]], layout=None) -> bool:
        """Store (key, payload) blocks in the caller's thread (`layout`: theirs, else the seam's);
        True once stored (or already there), False when the store is down or failed."""
        if not blocks:
            return True
        if not self.available():
            self.stats["store_down"] += 1
            return False
        items = [PutItem(k, p, self.namespace_id, layout or self.layout or None) for k, p in blocks]
        try:
            self.store.put_many(items)
        except Exception as e:
            self.stats["save_errors"] += len(items)
            self._failed(e, f"saving {len(items)} cache entries", "they stay uncached")
            return False
        self.stats["saved_blocks"] += len(items)
        return True

    def save(self, blocks: list[tuple[bytes, bytes]], on_done=None) -> None:
        """Store (key, payload) blocks in the background: best effort, bounded. `on_done()` runs
        once the payloads are no longer needed (stored, failed or dropped): their buffers may be
        reused then."""
        self._submit([PutItem(k, p, self.namespace_id, self.layout) for k, p in blocks], "saved_blocks", on_done)

    def save_raw(self, key: bytes, data: bytes) -> None:
        """A snapshot (opaque bytes) under its own key."""
        self._submit([PutItem(key, data, self.namespace_id)], "saved_snapshots")

    def _submit(self, items: list[PutItem], counter: str, on_done=None) -> None:
        if not items or not self.available():
            self.stats["store_down"] += bool(items)
            return on_done() if on_done else None
        n = sum(len(i.payload) for i in items)
        with self._lock:
            dropped = self._pending_save + n > self.config.max_pending_save_bytes
            if not dropped:
                self._pending_save += n
        if dropped:
            self.stats["save_dropped"] += len(items)
            return on_done() if on_done else None
        self._saver.submit(self._put, items, n, counter, on_done)

    def _put(self, items: list[PutItem], n: int, counter: str, on_done=None) -> None:
        try:
            self.store.put_many(items)
            self.stats[counter] += len(items)
        except Exception as e:
            self.stats["save_errors"] += len(items)
            self._failed(e, f"saving {len(items)} cache entries", "they stay uncached")
        finally:
            with self._lock:
                self._pending_save -= n
            if on_done is not None:
                on_done()

    def flush(self) -> None:
        """Wait until every save submitted so far has landed (or failed)."""
        try:
            self._saver.submit(lambda: None).result()
        except RuntimeError:        # the interpreter is exiting: its executors already ran their queues
            pass

    def close(self) -> None:
        self.flush()
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
