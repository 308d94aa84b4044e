"""The store is handed its collector (BlockStore(config, maintenance=...)), never imports it: a
wired store makes room and runs background GC through what it was handed; a bare store evicts
nothing, says so once, and refuses a background GC it could not run."""

import ast
import logging
import pathlib
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.protocol import Maintenance
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import NvmeConfig
from tests.conftest import make_keys, put_blocks

KVSTORE = pathlib.Path(__file__).resolve().parents[2] / "kvstore"
SMALL = NvmeConfig(segment_bytes=1 << 20, capacity_bytes=1 << 20, high_watermark=0.5, low_watermark=0.25)


@dataclass
class Room:
    evicted: int


class Recorder:
    """A collector that records what the store asks of it."""

    def __init__(self, store):
        self.store, self.steps, self.rooms = store, 0, 0
        self.stepped = threading.Event()

    def step(self) -> None:
        self.steps += 1
        self.stepped.set()

    def make_room(self) -> Room:
        self.rooms += 1
        return Room(evicted=2)


def test_puts_over_the_watermark_make_room_through_the_handed_collector(make_store):
    made = []
    s = make_store(dram_mib=None, nvme_config=SMALL, maintenance=lambda store: made.append(Recorder(store)) or made[-1])
    for i in range(0, 300, 10):                          # ~1.2 MiB: puts past the 0.5 MiB watermark
        put_blocks(s, make_keys(10, start=i))
    [collector] = made
    assert isinstance(collector, Maintenance) and collector.store is s
    assert collector.rooms > 0 and s.stats_counters["evictions_nvme"] == 2 * collector.rooms
    assert collector.steps == 0                            # gc_interval_s 0: no background steps


def test_a_bare_store_evicts_nothing_and_warns_once(make_store, caplog):
    s = make_store(dram_mib=None, nvme_config=SMALL, maintenance=None)
    keys = make_keys(300)
    with caplog.at_level(logging.WARNING, logger="kvcache.kvstore.writes"):
        for i in range(0, 300, 10):
            put_blocks(s, keys[i:i + 10])
    assert s.stats_counters["evictions_nvme"] == 0
    assert all(s.contains(k) for k in keys)                # every put went on, none was evicted
    warned = [r for r in caplog.records if "has no collector" in r.getMessage()]
    assert len(warned) == 1 and "maintenance=" in warned[0].getMessage()


def test_background_gc_runs_the_handed_collectors_steps(tmp_path):
    made = []
    cfg = StoreConfig(str(tmp_path / "d"), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20), gc_interval_s=0.01)
    with BlockStore(cfg, maintenance=lambda store: made.append(Recorder(store)) or made[-1]) as s:
        assert len(made) == 2                              # one for puts' make_room, one for the thread
        assert made[1].stepped.wait(10) and made[0].steps == 0
        assert all(c.store is s for c in made)


def test_a_bare_store_refuses_background_gc_before_opening_anything(tmp_path):
    cfg = StoreConfig(str(tmp_path / "d"), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20), gc_interval_s=1.0)
    with pytest.raises(ValueError, match="needs a collector"):
        BlockStore(cfg)
    assert not (tmp_path / "d").exists()
    with BlockStore(cfg, maintenance=Recorder):           # nothing held: the directory opens
        pass


def test_the_store_core_imports_nothing_from_gc():
    found = []
    for path in sorted(KVSTORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):     # `from kvcache import gc` too
                names = [f"{node.module}.{a.name}" if node.module == "kvcache" else node.module or ""
                         for a in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n == "kvcache.gc" or n.startswith("kvcache.gc.")]
    assert found == []
    code = ("import sys, kvcache.kvstore.store, kvcache.kvstore.trace_replay, kvcache.kvstore.config; "
            "print(sorted(m for m in sys.modules if m.startswith('kvcache.gc')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
