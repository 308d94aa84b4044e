"""Shared-memory reads: lease blocks in the DRAM arena so that a local client copies them itself.

    local client                          daemon (BlockStore.lease_dram)
    ─ LEASE keys (control socket) ─────>  live? ── in DRAM ──────────────> lease the chunk
                                                └─ on NVMe / object ─> read, promote to DRAM, lease
                                          publish each leased block in the read directory
    <── (offset, nbytes) | miss | socket
    memcpy arena[offset:offset+nbytes] -> its own buffer        (the payload never crosses the socket)
    ─ FORGET / RELEASE lease ──────────>  release_dram: chunks may be evicted / reused again

    later reads of a published block:     directory -> copy -> seq check      (no round trip)
    ─ TOUCH keys (no answer) ──────────>  touch_dram: recency, last access, hits, events

A leased chunk cannot be evicted, deleted-and-reused or compacted away, so what the client copies is
exactly the block. "socket" means the block is live but could not be placed in DRAM (it is full
of pinned blocks): read it over the socket. Leases held across requests are bounded in time by
the server (server/shm_leases.py), which tells the client at release whether its lease was still valid.
Why a directory read needs no lease: kvstore/shm_directory.py.
A mixin only to keep store.py readable; it uses BlockStore's state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from kvcache.kvstore.shm_directory import HORIZON_S
from kvcache.kvstore.shm_wire import FileSlot, close_fds as close_all
from kvcache.kvstore.types import Tier

SOCKET = "socket"   # slot marker: live, but read it over the socket


@dataclass(frozen=True, slots=True)
class DramLease:
    """Chunks held for one lease_dram call; give it back to release_dram exactly once."""
    held: tuple
    nbytes: int


class StoreLeases:
    def lease_dram(self, keys: Sequence[bytes]) -> tuple[list, DramLease]:
        """Per key: (offset, nbytes) in the DRAM arena, None (a miss) or SOCKET; and the lease."""
        slots, lease, _ = self.lease_shared(keys, max_files=0)
        return slots, lease

    def lease_views(self, keys: Sequence[bytes]) -> tuple[list, DramLease]:
        """lease_dram for a reader in this process: per key a read-only view of its payload in the
        arena (valid until release_dram(lease)), None (a miss) or SOCKET; nothing is published in
        the read directory. The HTTP read path sends large blocks from these views, uncopied."""
        slots, lease, _ = self.lease_shared(keys, max_files=0, publish=False)
        with self.dram.arena_view() as arena:     # the slices keep the arena mapped, not this view
            return [s if s is None or s == SOCKET else arena[s[0]: s[0] + s[1]] for s in slots], lease

    def lease_shared(self, keys: Sequence[bytes], max_files: int,
                     publish: bool = True) -> tuple[list, DramLease, list[int]]:
        """lease_dram, where a block only on NVMe, in at most `max_files` segments, may be
        answered with its record's place instead of being promoted first: a FileSlot whose fd
        indexes the descriptors returned (read-only; the caller sends, then closes them). The
        client reads and verifies the record itself (one copy, not read + promote + copy), and
        those blocks are promoted in the background for their next read."""
        if self.dram is None:
            raise ValueError("this store has no DRAM tier to share")
        if self._promoter is not None:
            self._promoter.note_read()        # promotions wait until reads pause
        metas = self._metas(list(keys))
        live = [i for i, m in enumerate(metas) if m is not None]
        held = self.dram.acquire([keys[i] for i in live])
        fds: list[int] = []
        try:
            cold = [i for i, e in zip(live, held) if e is None]
            files, fds = self._file_slots(metas, cold, max_files) if cold and max_files else ({}, [])
            held = self._acquire_cold(keys, metas, live, held, [i for i in cold if i not in files])
            slots, lease = self._granted(keys, metas, live, held, cold, files, publish)
            return slots, lease, fds
        except BaseException:    # acquired chunks stay unevictable until released: never leak them
            self.dram.release(held)
            close_all(fds)
            raise

    def _file_slots(self, metas, cold: list[int], max_files: int) -> tuple[dict[int, FileSlot], list[int]]:
        """FileSlots for the cold blocks on NVMe, in at most `max_files` segments (the rest are
        promoted), and the segments' descriptors."""
        files: dict[int, FileSlot] = {}
        fds: list[int] = []
        index_of: dict[int, int | None] = {}
        if self.nvme is None:
            return files, fds
        on_nvme = int(Tier.NVME)            # an int bit test, not Flag.__contains__: this runs per block
        for i in cold:
            m = metas[i]
            if not int(m.residency) & on_nvme:
                continue
            at = index_of.get(m.segment_id, -1)
            if at == -1:
                fd = self.nvme.dup_reader(m.segment_id) if len(fds) < max_files else None
                at = index_of[m.segment_id] = None if fd is None else len(fds)
                if fd is not None:
                    fds.append(fd)
            if at is not None:
                files[i] = FileSlot(at, m.offset, m.record_len - m.payload_len, m.payload_len)
        return files, fds

    def _acquire_cold(self, keys, metas, live: list[int], held: list, cold: list[int]) -> list:
        """Blocks below DRAM: read through the tiers (that promotes them into DRAM), then acquire."""
        now = self.clock()
        for i in cold:
            if self._read_into_dram(keys[i], metas[i], now) is None:
                self._read(keys[i], metas[i], bytearray(metas[i].payload_len), now)
        if cold:
            by_index = dict(zip(cold, self.dram.acquire([keys[i] for i in cold])))
            held = [by_index.get(i, e) for i, e in zip(live, held)]
        return held

    def _granted(self, keys, metas, live: list[int], held: list, cold: list[int],
                 files: dict[int, FileSlot], publish: bool = True) -> tuple[list, DramLease]:
        slots: list = [None] * len(keys)
        for i, e in zip(live, held):
            slots[i] = files.get(i) or (SOCKET if e is None else (e.offset, e.nbytes))
        cold_set, now = set(cold), self.clock()
        warm = [keys[i] for i in live if i not in cold_set]
        got = [i for i, e in zip(live, held) if e is not None]
        kept = tuple(e for e in held if e is not None)
        lease = DramLease(kept, sum(e.nbytes for e in kept))
        found = [metas[i] for i in got]
        file_bytes = sum(f.nbytes for f in files.values())
        label = found[0] if found else metas[next(iter(files))] if files else None
        self._count_dram_reads(warm, len(keys) - len(live), now, len(keys), label,
                               [m.residency.fastest() for m in found] + [Tier.NVME] * len(files),
                               lease.nbytes + file_bytes)
        if publish:
            self._publish([keys[i] for i in got], found, now)
        if files:
            self._count_file_reads([(keys[i], metas[i]) for i in files], now, file_bytes)
        return slots, lease

    def _count_file_reads(self, blocks: list, now: float, nbytes: int) -> None:
        """Blocks a client reads from the segment files (`nbytes` of payload): NVMe hits, and
        promoted for next time, once the client has had time to read them."""
        self.stats_counters["hits_nvme"] += len(blocks)
        self._touch_many([k for k, _ in blocks], now)
        self._promote_soon(blocks)
        if self._promoter is not None:
            self._promoter.note_read(nbytes)

    def touch_dram(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Account reads a local client made through the read directory, without a lease (it
        sends their keys afterwards): recency, last access, hit counters, events. (hits, bytes)."""
        if self.dram is None:
            return 0, 0
        sizes = self.dram.touch(keys)
        found = [k for k, n in zip(keys, sizes) if n is not None]
        # the event needs one block's metadata for its labels (an index read), not every block's
        label = next((m for m in self._metas(found[:1]) if m is not None), None) if self._events_on and found else None
        nbytes = sum(n for n in sizes if n is not None)
        self._count_dram_reads(found, 0, self.clock(), len(found), label, [Tier.DRAM] * len(found), nbytes)
        return len(found), nbytes

    def _count_dram_reads(self, warm: list[bytes], misses: int, now: float, blocks: int, label, tiers: list,
                          nbytes: int) -> None:
        """Bookkeeping of a shared-memory read: `warm` keys were in DRAM; the event is labelled
        with `label`'s namespace and tenant and counts a hit per entry of `tiers`."""
        self._touch_many(warm, now)
        self.stats_counters["hits_dram"] += len(warm)
        self.stats_counters["misses"] += misses
        if self._events_on and blocks:
            self._event("get", label, "", blocks, tiers, 0.0, nbytes)

    def _publish(self, keys: Sequence[bytes], metas: Sequence, now: float) -> None:
        """Enter blocks now in DRAM in the read directory (after a lease, and right after a put,
        so that a local client's first read needs no round trip either)."""
        if keys and self.dram is not None and self.dram.directory is not None:
            wall = time.time()   # the directory speaks the clients' clock; the store's may be another
            self.dram.publish(keys, [wall + self._valid_for(m, now) for m in metas])

    def _valid_for(self, meta, now: float) -> float:
        """How many seconds the read directory may hand out a leased block: until it could expire
        (a hard pin lasts until unpinned, which clears the entry), at most HORIZON_S."""
        if meta.hard_pins:
            return HORIZON_S
        ns = self.namespaces.get(meta.namespace_id)
        until = max(self.config.retention.expires_at(meta, ns.name if ns else ""), meta.soft_pin_until)
        return min(HORIZON_S, until - now)

    def release_dram(self, lease: DramLease) -> None:
        if self.dram is not None:
            self.dram.release(lease.held)
