"""The object tier's write-back queue: bounded memory, one packer thread, parallel uploads.

    enqueue(writes) ──copy──> pending ──packer thread: encode (zstd), append──> open pack
        │ (bounded: blocks or drops                      seal when full (pack_bytes / pack_max_blocks),
        │  when max_queue_bytes is reached)              on flush, under memory pressure, or after linger
        v                                                          │
    returns the number accepted                     upload workers: PUT the pack (retries, breaker)
                                                          │                       │
                                            on_stored([(key, Placement)])   on_dropped(keys, reason)
                                            (caller commits its index)      (never landed)

Memory: a write counts its raw payload size from enqueue until its pack has landed or been
dropped, so the bytes held (pending copies + open pack + packs in flight) stay within
`max_queue_bytes`, plus one block when a single block is larger than the whole bound.

Callbacks run on an upload worker thread, before the writes count as finished: keep them
short and thread-safe, and never call flush() or close() from them.

Outage (`on_outage`): "drop" drops writes while the breaker is open, and packs whose upload
failed `write_retries + 1` times; "hold" keeps them queued (inside the bound) and retries
each pack when the breaker lets a probe through, so enqueue blocks or drops per `queue_full`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvcache.kvstore.errors import BlockFormatError, StoreError
from kvcache.tiering.base import BlockWrite, Placement
from kvcache.tiering.object_io import OPEN, CircuitBreaker, ObjectStoreUnavailable
from kvcache.tiering.object_pack import PackBuilder

log = logging.getLogger(__name__)

StoredCallback = Callable[[list[tuple[bytes, Placement]]], None]
DroppedCallback = Callable[[list[bytes], str], None]


@dataclass(slots=True)
class _Item:
    write: BlockWrite | None
    key: bytes
    nbytes: int


@dataclass(slots=True)
class _Sealed:
    builder: PackBuilder
    records: list[tuple[_Item, int, int, int]]   # item, offset, record_len, stored payload len


class WriteBackQueue:
    def __init__(self, config, breaker: CircuitBreaker,
                 encode: Callable[[BlockWrite], tuple[bytes, object]],
                 upload: Callable[[PackBuilder], int],
                 on_stored: StoredCallback | None, on_dropped: DroppedCallback | None,
                 count: Callable[..., None]):
        self.cfg, self.breaker = config, breaker
        self._encode, self._upload, self._count = encode, upload, count
        self._on_stored = on_stored or (lambda landed: None)
        self._on_dropped = on_dropped or (lambda keys, why: None)
        self._cond = threading.Condition()
        self._pending: collections.deque[_Item] = collections.deque()
        self.queued_bytes = 0
        self.peak_bytes = 0
        self._unfinished = 0
        self._flushers = 0
        self._space_waiters = 0
        self._closing = False
        self._abandon = threading.Event()
        self._uploads = concurrent.futures.ThreadPoolExecutor(config.upload_workers,
                                                              thread_name_prefix="kvcache-objput")
        self._packer = threading.Thread(target=self._pack_loop, name="kvcache-objpack", daemon=True)
        self._packer.start()

    # ---------------------------------------------------------------- producer side
    def enqueue(self, writes: Sequence[BlockWrite]) -> int:
        """Queue copies of `writes`; returns how many were accepted (the rest are dropped,
        counted and reported through on_dropped)."""
        accepted = 0
        for w in writes:
            _validate(w)
            n = memoryview(w.payload).nbytes
            why = self._reserve(n)
            if why:
                self._drop([w.key], n, why)
                continue
            item = _Item(BlockWrite(w.key, w.namespace_id, bytes(w.payload), w.layout, w.created, w.tenant), w.key, n)
            with self._cond:
                self._pending.append(item)
                self._cond.notify_all()
            accepted += 1
        return accepted

    def _reserve(self, n: int) -> str:
        """Count `n` bytes against the bound; '' when admitted, else why not."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.enqueue_timeout_s
        with self._cond:
            while True:
                if self._closing:
                    raise StoreError("the object tier is closed")
                if cfg.on_outage == "drop" and self.breaker.state == OPEN and self.breaker.retry_in() > 0:
                    return "object store unavailable (circuit open)"
                if self.queued_bytes == 0 or self.queued_bytes + n <= cfg.max_queue_bytes:
                    self.queued_bytes += n
                    self._unfinished += 1
                    self.peak_bytes = max(self.peak_bytes, self.queued_bytes)
                    return ""
                left = deadline - time.monotonic()
                if cfg.queue_full == "drop" or left <= 0:
                    return "write-back queue full"
                self._space_waiters += 1
                self._cond.notify_all()   # let the packer seal a partial pack under pressure
                try:
                    self._cond.wait(min(left, 0.5))
                finally:
                    self._space_waiters -= 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything enqueued so far has landed or been dropped."""
        with self._cond:
            self._flushers += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._unfinished == 0, timeout)
            finally:
                self._flushers -= 1

    # ---------------------------------------------------------------- packer thread
    def _seal_wanted(self, open_pack: _Sealed | None) -> bool:
        if open_pack is None or self._pending:
            return False
        lingered = time.monotonic() - open_pack.builder.first_added >= self.cfg.pack_linger_s
        return bool(self._flushers or self._space_waiters or self._closing or lingered)

    def _pack_loop(self) -> None:
        open_pack: _Sealed | None = None
        while True:
            with self._cond:
                while not self._pending and not self._seal_wanted(open_pack) and not (
                        self._closing and open_pack is None):
                    wait = None
                    if open_pack is not None:
                        wait = max(0.01, open_pack.builder.first_added + self.cfg.pack_linger_s - time.monotonic())
                    self._cond.wait(wait)
                if self._closing and open_pack is None and not self._pending:
                    return
                batch = list(self._pending)
                self._pending.clear()
            for item in batch:
                try:
                    header, stored = self._encode(item.write)
                except (BlockFormatError, ValueError) as e:
                    self._finish([item], dropped=f"cannot encode: {e}")
                    continue
                plen = memoryview(stored).nbytes
                rec_len = len(header) + plen
                if open_pack is not None and (open_pack.builder.size + rec_len > self.cfg.pack_bytes
                                              or open_pack.builder.count >= self.cfg.pack_max_blocks):
                    self._submit(open_pack)
                    open_pack = None
                if open_pack is None:
                    open_pack = _Sealed(PackBuilder(), [])
                offset = open_pack.builder.add(header, stored)
                open_pack.records.append((item, offset, rec_len, plen))
                item.write = None   # the pack holds the bytes now; they stay counted until it lands
                del stored
            with self._cond:
                seal = self._seal_wanted(open_pack)
            if seal:
                self._submit(open_pack)
                open_pack = None

    def _submit(self, sealed: _Sealed) -> None:
        try:
            self._uploads.submit(self._land, sealed)
        except RuntimeError:    # executor shut down under us
            self._finish([r[0] for r in sealed.records], dropped="object tier closed")

    # ---------------------------------------------------------------- upload workers
    def _land(self, sealed: _Sealed) -> None:
        items = [r[0] for r in sealed.records]
        attempts = 0
        while True:
            if self._abandon.is_set():
                return self._finish(items, dropped="object tier closed before upload")
            try:
                pack_id = self._upload(sealed.builder)
                break
            except ObjectStoreUnavailable as e:
                attempts += 1
                if self.cfg.on_outage == "drop" and (attempts > self.cfg.write_retries
                                                     or self.breaker.state == OPEN):
                    log.warning("object tier dropped a pack of %d writes after %d attempts: %s",
                                len(items), attempts, e)
                    return self._finish(items, dropped=str(e))
                pause = self.breaker.retry_in() or min(1.0, 0.05 * 2 ** attempts)
                self._abandon.wait(min(pause, 0.5))
            except Exception as e:   # a bug, not an outage: never leave the queue hanging
                log.exception("object tier upload failed unexpectedly")
                return self._finish(items, dropped=f"upload error: {e}")
        landed = [(item.key, Placement(pack_id, off, rec_len, plen)) for item, off, rec_len, plen in sealed.records]
        try:
            self._on_stored(landed)
        except Exception:
            log.exception("on_stored callback failed for pack %d", pack_id)
        self._finish(items)

    def _finish(self, items: list[_Item], dropped: str = "") -> None:
        n = sum(i.nbytes for i in items)
        if dropped:
            self._drop([i.key for i in items], n, dropped)
        with self._cond:
            self.queued_bytes -= n
            self._unfinished -= len(items)
            self._cond.notify_all()

    def _drop(self, keys: list[bytes], nbytes: int, why: str) -> None:
        self._count(dropped_writes=len(keys), dropped_bytes=nbytes)
        log.debug("object tier dropped %d writes: %s", len(keys), why)
        try:
            self._on_dropped(keys, why)
        except Exception:
            log.exception("on_dropped callback failed")

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {"queue_bytes": self.queued_bytes, "queue_peak_bytes": self.peak_bytes,
                    "queue_unfinished": self._unfinished}

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._packer.join()
        self._abandon.set()
        self._uploads.shutdown(wait=True)


def _validate(w: BlockWrite) -> None:
    if not 1 <= len(w.key) <= 64:
        raise BlockFormatError(f"block key must be 1-64 bytes, got {len(w.key)}")
    if len(w.namespace_id) != 16:
        raise BlockFormatError("namespace id must be 16 bytes")
