"""Shared-memory reads: lease blocks in the DRAM arena so that a local client copies them itself.

    local client                          daemon (BlockStore.lease_dram)
    ─ POST /v1/shm/lease {keys} ───────>  live? ── in DRAM ──────────────> lease the chunk
                                                └─ on NVMe / object ─> read, promote to DRAM, lease
    <── [offset, nbytes] | null | "socket"
    memcpy arena[offset:offset+nbytes] -> its own buffer        (the payload never crosses the socket)
    ─ POST /v1/shm/release {lease} ────>  release_dram: chunks may be evicted / reused again

A leased chunk cannot be evicted, deleted-and-reused or compacted away, so what the client copies is
exactly the block. "socket" means the block is live but could not be placed in DRAM (it is full
of pinned blocks): read it over the socket. Leases held across requests are bounded in time by
the server (cli/server_shm.py), which tells the client at release whether its lease was still valid.
A mixin only to keep store.py readable; it uses BlockStore's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

SOCKET = "socket"   # slot marker: live, but read it over the socket


@dataclass(frozen=True, slots=True)
class DramLease:
    """Chunks held for one lease_dram call; give it back to release_dram exactly once."""
    held: tuple
    nbytes: int


class StoreLeases:
    def lease_dram(self, keys: Sequence[bytes]) -> tuple[list, DramLease]:
        """Per key: (offset, nbytes) in the DRAM arena, None (a miss) or SOCKET; and the lease."""
        if self.dram is None:
            raise ValueError("this store has no DRAM tier to share")
        metas = self._metas(list(keys))
        live = [i for i, m in enumerate(metas) if m is not None]
        held = self.dram.acquire([keys[i] for i in live])
        cold = [i for i, e in zip(live, held) if e is None]
        for i in cold:   # read through the tiers below: that promotes the block into DRAM
            self._read(keys[i], metas[i], bytearray(metas[i].payload_len))
        if cold:
            by_index = dict(zip(cold, self.dram.acquire([keys[i] for i in cold])))
            held = [by_index[i] if e is None else e for i, e in zip(live, held)]
        slots: list = [None] * len(keys)
        for i, e in zip(live, held):
            slots[i] = SOCKET if e is None else (e.offset, e.nbytes)
        cold_set = set(cold)
        warm = [keys[i] for i in live if i not in cold_set]
        self._touch_many(warm, self.clock())
        self.stats_counters["hits_dram"] += len(warm)
        self.stats_counters["misses"] += len(keys) - len(live)
        if self._events_on:
            tiers = [metas[i].residency.fastest() for i, e in zip(live, held) if e is not None]
            self._event("get", next((m for m in metas if m), None), "", len(keys), tiers, 0.0,
                        sum(e.nbytes for e in held if e is not None))
        kept = tuple(e for e in held if e is not None)
        return slots, DramLease(kept, sum(e.nbytes for e in kept))

    def release_dram(self, lease: DramLease) -> None:
        if self.dram is not None:
            self.dram.release(lease.held)
