"""The store the cold-versus-warm benchmark runs on, and how a scenario puts the faster tiers'
copies out of reach with nothing but the store's public API: it reopens the store.

    bench_store(root)    an in-process BlockStore on root/data: DRAM 1 GiB, NVMe fsync always,
                         object tier of file:// packs in root/bucket
    ReopenableStore      that store behind one object, the one an engine is given, so a
                         long-lived engine keeps its own state (prefill speed, measured tier
                         bandwidth) while the store under it is closed and opened again:
        reopen()                   the same data directory: DRAM empty, the NVMe and object
                                   copies as they were (the store restarted)
        reopen(bucket_only=True)   an empty data directory on the same bucket: the index rebuilt
                                   from the packs, every block in the object tier only (another
                                   host that shares the bucket)
"""

from __future__ import annotations

import os
import shutil

from kvcache.gc.collector import Collector
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import DramConfig, NvmeConfig, ObjectConfig

BUCKET_ONLY = "bucket-only"        # the data directory of reopen(bucket_only=True), under root


def bench_store(root: str, fresh: bool = False, data: str = "data") -> BlockStore:
    """The benchmark's store on root/<data>; `fresh`: root emptied first."""
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    return BlockStore(StoreConfig(os.path.join(root, data), dram=DramConfig(capacity_bytes=1 << 30, prefault=False),
                                  nvme=NvmeConfig(fsync="always"),
                                  object_store=ObjectConfig(url=f"file://{root}/bucket", pack_linger_s=0.05),
                                  event_log=False), maintenance=Collector)


class ReopenableStore:
    """Every store method is the current store's own (attribute lookup falls through to it)."""

    def __init__(self, root: str, fresh: bool = False):
        self.root = root
        self.store = bench_store(root, fresh)

    def reopen(self, bucket_only: bool = False) -> None:
        """Close the store (flushing it: every upload lands first), then open it again."""
        self.store.close()
        if bucket_only:
            shutil.rmtree(os.path.join(self.root, BUCKET_ONLY), ignore_errors=True)
        self.store = bench_store(self.root, data=BUCKET_ONLY if bucket_only else "data")

    def __getattr__(self, name: str):
        if name == "store":                # not opened (yet): no recursion
            raise AttributeError(name)
        return getattr(self.store, name)
