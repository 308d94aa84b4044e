"""The read half of BlockStore: gets, reads through the tiers, promotion and prefetch.

    get_many_into(keys, outs)
        metadata (index or `_dram_meta`), expiry ──> miss
        DRAM  ─ memcpy out of the arena (the chunk leased while copying)
        NVMe  ─ preadv into `out`, verify checksums and key ──> promote into DRAM
        object─ ranged GET of one pack record, verify ──> promote into DRAM
        corrupt ─ quarantine, miss (the caller recomputes)

Sizes from the index are checked before a buffer is sized from them (`_sized`): a payload
length beyond MAX_BLOCK_BYTES, or an NVMe record that its segment cannot hold, is a damaged
entry (bit flips at rest): the copy is quarantined and the read is a miss, no allocation made.

Lookups that find blocks only in object storage prefetch them into DRAM in the background
(`_prefetch`); a get of such a block waits for its prefetch rather than fetching it twice.
A mixin only to keep store.py readable: it uses BlockStore's state and is not meant to be
used on its own.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from typing import Sequence

from kvcache.kvstore.block_format import check_layout
from kvcache.kvstore.errors import TierFullError
from kvcache.kvstore.types import BlockMeta, Tier, check_room
from kvcache.tiering.base import BlockWrite, Placement

log = logging.getLogger(__name__)
_NBYTES, _PAYLOAD_LEN = operator.attrgetter("nbytes"), operator.attrgetter("payload_len")
MAX_BLOCK_BYTES = 1 << 30   # no block is larger: a bigger payload length in the index is damage


def _all_fit(outs: Sequence, metas: Sequence[BlockMeta]) -> bool:
    """Whether each of `outs`, all flat memoryviews (the usual buffers), holds its block: C-level
    passes. False also when some are not memoryviews (the caller checks each with check_room)."""
    return (set(map(type, outs)) == {memoryview}
            and all(map(operator.ge, map(_NBYTES, outs), map(_PAYLOAD_LEN, metas))))


def has_none(items: list) -> bool:
    """`None in items` without `==` per item (a dataclass's __eq__ is Python, called per item)."""
    return any(map(operator.is_, items, itertools.repeat(None)))


def _placement(meta: BlockMeta) -> Placement:
    return Placement(meta.segment_id, meta.offset, meta.record_len, meta.payload_len)


class StoreReads:
    def contains(self, key: bytes) -> bool:
        return self.exists_many([key])[0]

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_into(self, key: bytes, out) -> int | None:
        """Copy the payload into `out` (any writable buffer); its length, or None on a miss."""
        now = self.clock()
        meta = self._meta(key, now)
        if meta is None:
            return self._miss()
        check_room(out, meta.payload_len)
        return self._read(key, meta, out, now)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Batched get: one index transaction for all keys."""
        return [payload for payload, _ in self.get_many_tiered(keys)]

    def get_many_tiered(self, keys: Sequence[bytes]) -> list[tuple[bytes | None, Tier]]:
        """Batched get that also says which tier served each block (Tier.NONE on a miss)."""
        self._await_prefetch(keys)
        t0, out, first = time.perf_counter(), [], None
        for key, meta in zip(keys, self._sized(keys, self._metas(list(keys)))):
            if meta is None:
                out.append((self._miss(), Tier.NONE))
                continue
            first = first or meta
            tier, buf = meta.residency.fastest(), bytearray(meta.payload_len)
            n = self._read(key, meta, buf)
            out.append((bytes(buf[:n]) if n != len(buf) else bytes(buf), tier) if n is not None else (None, Tier.NONE))
        hits = [t for p, t in out if p is not None]
        self._event("get", first, "", len(keys), hits, time.perf_counter() - t0,
                    sum(len(p) for p, _ in out if p is not None))
        return out

    def sizes_tiered(self, keys: Sequence[bytes]) -> list[tuple[int, Tier] | None]:
        """(payload length, fastest tier) of each live block, None where absent: one index read,
        so that a reader can size its buffers before get_many_into."""
        metas = self._sized(keys, self._metas(list(keys)))
        return [None if m is None else (m.payload_len, m.residency.fastest()) for m in metas]

    def _sized(self, keys: Sequence[bytes], metas: list[BlockMeta | None]) -> list[BlockMeta | None]:
        """`metas` with each entry whose sizes cannot be true replaced by None, its copy quarantined
        (a buffer is sized from them next). Blocks held in DRAM are checked by the DRAM tier."""
        for i, (key, meta) in enumerate(zip(keys, metas)):
            if meta is None or int(meta.residency) & 1:      # Tier.DRAM
                continue
            on_nvme = Tier.NVME in meta.residency and self.nvme is not None
            if meta.payload_len > MAX_BLOCK_BYTES:
                why = f"the index gives a payload of {meta.payload_len} bytes (at most {MAX_BLOCK_BYTES})"
            elif on_nvme and not self.nvme.holds_extent(_placement(meta)):
                why = (f"the index places a {meta.record_len}-byte record at offset {meta.offset} of segment "
                       f"{meta.segment_id}, which does not hold it")
            else:
                continue
            metas[i] = None
            self._quarantine(key, _placement(meta), why)
        return metas

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [m is not None for m in self._metas(list(keys))]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Batched get_into (the engine's load path): one index transaction and one DRAM
        lease round-trip for the whole batch; payload lengths or None per key.

            metadata of all ──> sizes checked (before any copy) ──> DRAM copies all it holds
                                                                    └─ the rest: NVMe, object
        """
        if self._prefetching:
            self._await_prefetch(keys)
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        now = self.clock()
        metas = self._metas(list(keys), now)
        if not has_none(metas) and _all_fit(outs, metas):     # the usual batch: all live, flat buffers
            result = self._get_live(keys, outs, metas, now)
        else:
            result = self._get_sparse(keys, outs, metas, now)
        if self._events_on:
            hits = [m.residency.fastest() for m, n in zip(metas, result) if n is not None]
            self._event("get", next((m for m in metas if m), None), "", len(keys), hits, 0.0,
                        sum(n for n in result if n))
        return result

    def _get_sparse(self, keys, outs, metas, now: float) -> list[int | None]:
        """A batch with misses or other buffers: every size checked (before any copy), then the
        live blocks read."""
        live = [i for i, meta in enumerate(metas) if meta is not None]
        for i in live:
            check_room(outs[i], metas[i].payload_len)
        self.stats_counters["misses"] += len(keys) - len(live)
        result: list[int | None] = [None] * len(keys)
        if live:
            got = self._get_live([keys[i] for i in live], [outs[i] for i in live], [metas[i] for i in live], now)
            for i, n in zip(live, got):
                result[i] = n
        return result

    def _get_live(self, keys, outs, metas, now: float) -> list[int | None]:
        """Blocks all live, each buffer big enough: DRAM copies those it holds; the others (not
        in DRAM, or evicted since the lookup) are read from NVMe or object storage."""
        got = self.dram.get_many_into(keys, outs) if self.dram is not None else [None] * len(keys)
        if not has_none(got):
            self._touch_many(keys, now, metas)
            self.stats_counters["hits_dram"] += len(keys)
            return got
        in_dram = [k for k, n in zip(keys, got) if n is not None]
        if in_dram:
            self._touch_many(in_dram, now)
            self.stats_counters["hits_dram"] += len(in_dram)
        for i, n in enumerate(got):
            if n is None:
                metas[i].residency &= ~Tier.DRAM
                got[i] = self._read(keys[i], metas[i], outs[i], now)
        return got

    def _read(self, key: bytes, meta: BlockMeta, out, now: float | None = None) -> int | None:
        now = self.clock() if now is None else now
        if int(meta.residency) & 1:   # Tier.DRAM; IntFlag `in` costs ~0.2 us, `&` ~0.5 us
            n = self.dram.get_into(key, None, out)
            if n is not None:
                self.stats_counters["hits_dram"] += 1
                self._touch(key, now)
                return n
        if Tier.NVME in meta.residency and self.nvme is not None:
            header = self.nvme.read_into(key, _placement(meta), out)
            if header is None:  # compaction may have moved it between index read and file read
                moved = self.index.get(key)
                if moved is not None and (moved.segment_id, moved.offset) != (meta.segment_id, meta.offset):
                    header = self.nvme.read_into(key, _placement(moved), out)
            if header is not None:
                self.stats_counters["hits_nvme"] += 1
                self._touch(key, now)
                self._promote(key, meta, header.layout, memoryview(out).cast("B")[: header.raw_len])
                return header.raw_len
        if Tier.OBJECT in meta.residency and self.object is not None:
            n = self._read_object(key, meta, out, now)
            if n is not None:
                return n
        return self._miss()

    def _read_into_dram(self, key: bytes, meta: BlockMeta, now: float, count: bool = True) -> bool | None:
        """Promote an NVMe block by reading it straight into a DRAM chunk set aside for it, which
        put then adopts: one copy, no fresh buffer (a fresh multi-MiB bytearray is faulted in
        page by page, at a fraction of a copy's speed). True: promoted (and, with `count`, a
        hit); False: the read missed (damaged, deleted); None: no chunk to spare, or the record
        moved or is compressed: the caller reads it the usual way."""
        if self.dram is None or self.nvme is None:
            return None
        view = self.dram.reserve(meta.payload_len, span=True)
        if view is None:
            return None
        try:
            header = self.nvme.read_into(key, _placement(meta), view)
            if header is None:
                moved = self.index.get(key)      # compaction may have moved it: the usual read follows it
                same = moved is None or (moved.segment_id, moved.offset) == (meta.segment_id, meta.offset)
                return False if same else None
            if header.raw_len != meta.payload_len:
                return None
            if count:
                self.stats_counters["hits_nvme"] += 1
                self._touch(key, now)
            self._promote(key, meta, header.layout, view)
            return True
        except ValueError:             # a compressed payload larger than the chunk
            return None
        finally:
            self.dram.unreserve([view])      # a no-op once put adopted it

    def _promote_soon(self, blocks: list[tuple[bytes, BlockMeta]]) -> None:
        """Copy NVMe blocks a local client read from the segment files itself into DRAM once the
        store is idle (kvstore/promoter.py), so that their next read is a DRAM one."""
        if self.dram is None or not blocks:
            return
        if self._promoter is None:
            from kvcache.kvstore.promoter import Promoter
            self._promoter = Promoter(self._promote_idle)
        self._promoter.submit(blocks)

    def _promote_idle(self, key: bytes, meta: BlockMeta) -> None:
        if not self.dram.contains(key):
            self._read_into_dram(key, meta, self.clock(), count=False)

    def _prefetch(self, blocks: list[tuple[bytes, BlockMeta]]) -> None:
        """A lookup found blocks only in the object tier: start copying them into DRAM now,
        so that the gets which usually follow are served from memory."""
        if self._prefetcher is None:
            from concurrent.futures import ThreadPoolExecutor
            self._prefetcher = ThreadPoolExecutor(2, thread_name_prefix="kvcache-prefetch")

        def fetch(key: bytes, meta: BlockMeta) -> None:
            placement = self.index.object_location(key)
            if meta.payload_len > MAX_BLOCK_BYTES:       # a damaged entry: the get that follows misses
                return
            buf = bytearray(meta.payload_len)
            n = None if placement is None else self.object.get_into(key, placement, buf)
            if n is not None:
                self._promote(key, meta, check_layout(None, n), memoryview(buf)[:n])
                self.stats_counters["prefetched"] += 1
        for key, meta in blocks:
            if key not in self._prefetching:
                f = self._prefetcher.submit(fetch, key, meta)
                self._prefetching[key] = f
                f.add_done_callback(lambda _f, k=key: self._prefetching.pop(k, None))

    def _await_prefetch(self, keys: Sequence[bytes], timeout_s: float = 30.0) -> None:
        """A get of blocks being prefetched waits for those copies instead of reading the object
        tier a second time (the usual case: lookup, then get at once)."""
        for f in [self._prefetching.get(k) for k in keys] if self._prefetching else ():
            if f is not None:
                try:
                    f.result(timeout=timeout_s)
                except Exception:       # a failed or slow prefetch: the get reads the tier itself
                    pass

    def _read_object(self, key: bytes, meta: BlockMeta, out, now: float) -> int | None:
        """The object tier: a miss (never an error) when it is down; promoted to DRAM on a hit."""
        placement = self.index.object_location(key)
        n = None if placement is None else self.object.get_into(key, placement, out)
        if n is not None:
            self.stats_counters["hits_object"] += 1
            self._touch(key, now)
            self._promote(key, meta, check_layout(None, n), memoryview(out).cast("B")[:n])
        return n

    def _miss(self) -> None:
        self.stats_counters["misses"] += 1
        return None

    def _promote(self, key: bytes, meta: BlockMeta, layout, payload: memoryview) -> None:
        """Copy a block read from NVMe into DRAM (clean), keeping its pins. Best effort."""
        if self.dram is None:
            return
        with self._lock:
            if self.index.get(key) is None:  # deleted while we read it: do not resurrect it in DRAM
                return
            if key in self._dram_meta:       # put again meanwhile (write-back): DRAM holds the newer copy
                return
            try:
                self.dram.put([BlockWrite(key, meta.namespace_id, payload, layout, meta.created, meta.tenant)])
            except (TierFullError, ValueError) as e:
                log.debug("block %s not promoted to DRAM: %s", key.hex(), e)
                return
            self.dram.set_pin(key, meta.hard_pins, meta.soft_pin_until)
            self.stats_counters["promotions"] += 1
