"""Store events: what the hit-rate reports are made of.

The store calls `sink.record(Event(...))` once per operation (a lookup, a batch of gets or
puts, an eviction batch, a GC expiry step), never per byte. The default sink drops events;
`kvstore/event_log.py` writes them to rotated Parquet files. A sink must be thread-safe,
cheap (buffer and write elsewhere) and must never raise into the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

KINDS = ("lookup", "get", "put", "evict", "expire")


@dataclass(frozen=True, slots=True)
class Event:
    time: float                 # the store's clock, seconds
    kind: str                   # one of KINDS
    namespace: str = ""         # namespace id (hex) of the blocks, "" when unknown (all misses)
    tenant: str = ""
    blocks: int = 0             # blocks asked for (lookup/get), written (put), removed (evict/expire)
    tokens: int = 0             # blocks x the namespace's block size
    hit_blocks: int = 0         # lookup: the contiguous prefix found; get: blocks served
    hits_dram: int = 0
    hits_nvme: int = 0
    hits_object: int = 0
    tier: str = ""              # evict: the tier evicted from
    nbytes: int = 0             # payload bytes moved
    latency_s: float = 0.0
    mean_age_s: float = 0.0     # evict/expire: mean time since the blocks were written
    client: str = ""            # lookup: the client software that asked (a daemon's metrics label: "vllm", ...)


class EventSink(Protocol):
    def record(self, event: Event) -> None: ...
    def close(self) -> None: ...


class NullSink:
    """The default: events are not kept."""

    def record(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass
