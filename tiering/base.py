"""The contract every block tier honours (checked by tests/tiering/test_tier_conformance.py).

A tier stores opaque block payloads by block key. It owns bytes, not policy: the store
decides what goes where, when a block expires, and what is pinned.

    put(writes)                -> one Placement per write, in order. Either every write lands
                                  or TierFullError/StoreError is raised and none is visible.
    get(key, placement)        -> the payload bytes, or None on a miss. Corrupt data is never
                                  returned: it is a miss, reported through `on_corrupt`.
    get_into(key, placement, out) -> payload length copied into `out`, or None on a miss.
    delete(key, placement)     -> the tier may reuse the block's space. Deleting a missing block
                                  is a no-op. A later get may return None or the original
                                  bytes (a segment keeps records until compaction), never others.
    usage()                    -> TierUsage.

`placement` is what `put` returned (the NVMe tier needs it to find the record; the DRAM
tier ignores it and keeps its own map). All methods are thread-safe.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Sequence

from kvcache.kvstore.types import TensorSpec, Tier


@dataclass(slots=True)
class BlockWrite:
    """One block for a tier to keep. Not frozen: a frozen dataclass's __init__ costs ~0.6 us,
    a tenth of copying a 64 KiB block; no tier changes one it is handed."""

    key: bytes
    namespace_id: bytes
    payload: bytes | bytearray | memoryview
    layout: tuple[TensorSpec, ...]
    created: float
    tenant: str = ""            # whose block: persisted in its record (a rebuild restores it)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a persistent tier put a record (segment, byte offset, lengths)."""

    segment_id: int = 0
    offset: int = 0
    record_len: int = 0
    payload_len: int = 0


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: Tier
    blocks: int
    used_bytes: int
    capacity_bytes: int

    @property
    def fill(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


CorruptCallback = Callable[[bytes, "Placement", str], None]


class BlockTier(abc.ABC):
    kind: Tier

    @abc.abstractmethod
    def put(self, writes: Sequence[BlockWrite]) -> list[Placement]: ...

    @abc.abstractmethod
    def get(self, key: bytes, placement: Placement | None = None) -> bytes | None: ...

    @abc.abstractmethod
    def get_into(self, key: bytes, placement: Placement | None, out) -> int | None: ...

    @abc.abstractmethod
    def delete(self, key: bytes, placement: Placement | None = None) -> None: ...

    @abc.abstractmethod
    def usage(self) -> TierUsage: ...

    def close(self) -> None:
        """Release resources; the tier is unusable afterwards."""
