"""Helpers shared by the fault tests."""


from __future__ import annotations

import random

import xxhash

from kvcache.gc.collector import Collector
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.hashing import HashAlgo, Namespace
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import DramConfig, NvmeConfig

NS = Namespace("faults-model@rev1", "raw/v1", 16, name="faults")
NS_SHA = Namespace("faults-model@rev1", "raw/v1", 16, algo=HashAlgo.SHA256, name="faults-sha")


def key_for(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"faults-block:%d" % i)


def payload_for(i: int, n: int | None = None) -> bytes:
    r = random.Random(i)
    return r.randbytes(n if n is not None else r.randint(2 << 10, 40 << 10))


def make_config(data_dir, dram: bool = True) -> StoreConfig:
    return StoreConfig(
        str(data_dir),
        dram=DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False) if dram else None,
        nvme=NvmeConfig(segment_bytes=1 << 20),
    )


def open_store(data_dir, dram: bool = True) -> BlockStore:
    s = BlockStore(make_config(data_dir, dram), maintenance=Collector)     # puts make room, as in the daemon
    s.register_namespace(NS)
    return s


def fill(store: BlockStore, idxs) -> None:
    store.put_many([PutItem(key_for(i), payload_for(i), NS.id) for i in idxs])


def placements(store: BlockStore) -> dict[int, tuple[bytes, object]]:
    """Index of every block -> (key, meta), for blocks numbered by `key_for`."""
    by_key = dict(store.index.iter_all())
    return {i: (key_for(i), by_key[key_for(i)]) for i in range(10_000) if key_for(i) in by_key}


