"""Shared fixtures: a store factory over a temporary data directory with a fake clock."""

import os

import numpy as np
import pytest

from kvcache.gc.collector import Collector
from kvcache.kvstore import Namespace, hash_blocks
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import DramConfig, NvmeConfig


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, hours: float = 0.0, seconds: float = 0.0) -> None:
        self.t += hours * 3600 + seconds


NS = Namespace("test-model@rev1", "raw/v1", 16, name="test")


class ListSink:
    """An event sink that keeps what the store records (BlockStore(events=ListSink()))."""

    def __init__(self):
        self.events = []

    def record(self, e) -> None:
        self.events.append(e)

    def close(self) -> None:
        pass


def payload_for(key: bytes, n: int = 4096) -> bytes:
    """Deterministic payload derived from the key, so any mix-up shows."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def make_keys(n: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return hash_blocks(ns, np.arange(start, start + n * ns.block_size) % 50_000)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def make_store(tmp_path, clock):
    stores = []

    def factory(dram_mib: float | None = 4, nvme: bool = True, subdir: str = "data", maintenance=Collector, **kw):
        """A store with its collector, as the daemon and open_store wire it (maintenance=None: bare)."""
        dram = None if dram_mib is None else DramConfig(capacity_bytes=int(dram_mib * (1 << 20)),
                                                        page_bytes=1 << 20, prefault=False)
        nvme_cfg = kw.pop("nvme_config", NvmeConfig(segment_bytes=1 << 20)) if nvme else None
        cfg = StoreConfig(str(tmp_path / subdir), dram=dram, nvme=nvme_cfg, **kw)
        store = BlockStore(cfg, clock=clock, maintenance=maintenance)
        store.register_namespace(NS)
        stores.append(store)
        return store

    yield factory
    for s in stores:
        s.close()


@pytest.fixture(scope="session")
def v4_tiny_checkpoint(tmp_path_factory):
    """The demo checkpoint `kvcache model init --config v4-tiny` writes (seed 0), built once for
    the session: tests only read it; one that changes a checkpoint copies it first."""
    from kvcache.engine.checkpoint.demo import config_path, write_demo_checkpoint
    out = tmp_path_factory.mktemp("checkpoints") / "v4-tiny"
    write_demo_checkpoint(config_path("v4-tiny"), str(out))
    return out


def put_blocks(store, keys, n=4096, tenant=""):
    return store.put_many([PutItem(k, payload_for(k, n), NS.id, tenant=tenant) for k in keys])


__all__ = ["FakeClock", "NS", "payload_for", "make_keys", "put_blocks", "os"]
