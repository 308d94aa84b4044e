"""Many threads on one BlockStore: writers, readers, GC, pins, deletes and flushes at once.

DRAM is tiny (evictions, and demotions under write-back, happen all the time) and NVMe
segments are 1 MiB (compaction always has work). Every read must return a miss or the
exact bytes of its key, no thread may raise, and afterwards every block put (and not
deleted) must read back, before and after a restart.
"""

from __future__ import annotations

import logging
import random
import threading

import pytest
import xxhash

from kvcache.gc.collector import Collector
from kvcache.gc.fsck import check
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import DramConfig, NvmeConfig

NS = Namespace("concurrency-model@rev1", "raw/v1", 16, name="conc")
N_KEEP, N_DOOMED = 500, 500           # kept blocks are never deleted; doomed ones are
N_WRITERS, N_READERS = 3, 3
PASSES = 6                            # each writer puts its key set this many times
MAX_PAYLOAD = 48 << 10


def key_for(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"concurrency-block:%d" % i)


def payload_for(i: int) -> bytes:
    r = random.Random(i)
    return r.randbytes(r.choice((r.randint(1 << 10, 8 << 10), r.randint(8 << 10, MAX_PAYLOAD))))


PAYLOADS = {i: payload_for(i) for i in range(N_KEEP + N_DOOMED)}
BY_KEY = {key_for(i): p for i, p in PAYLOADS.items()}
KEEP = [key_for(i) for i in range(N_KEEP)]
DOOMED = [key_for(i) for i in range(N_KEEP, N_KEEP + N_DOOMED)]
DOOMED_SET = frozenset(DOOMED)


# The write-back race this file pins down (fixed): a put of a block that another thread put
# (dirty) between this put's validation and its DRAM insert used to lose the dirty copy's
# metadata, and the next eviction or flush dropped a whole batch of dirty blocks.


def make_config(data_dir: str, policy: str) -> StoreConfig:
    return StoreConfig(
        data_dir,
        dram=DramConfig(capacity_bytes=2 << 20, page_bytes=256 << 10, prefault=False),
        nvme=NvmeConfig(segment_bytes=1 << 20, fsync="never"),
        write_policy=policy,
    )


class Workers:
    """Runs thread bodies released together by one barrier; collects their exceptions."""

    def __init__(self):
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._bodies = []

    def add(self, name, body, *args):
        self._bodies.append((name, body, args))

    def run(self, writers_first: int) -> None:
        barrier = threading.Barrier(len(self._bodies))

        def wrap(name, body, args):
            try:
                barrier.wait(timeout=30)
                body(*args)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the test
                import traceback
                self.errors.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                self.stop.set()

        self.threads = [threading.Thread(target=wrap, args=b, name=b[0], daemon=True) for b in self._bodies]
        for t in self.threads:
            t.start()
        for t in self.threads[:writers_first]:  # the writers bound the run ...
            t.join(timeout=120)
        self.stop.set()                          # ... then everyone else winds down
        for t in self.threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a worker thread hung"


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_threads_share_one_store(tmp_path, policy, caplog):
    if policy == "write-back":  # first the deterministic form of the race the threads hit at random
        race_same_block_write_back(tmp_path / "race")
    store = BlockStore(make_config(str(tmp_path / "data"), policy))
    store.register_namespace(NS)
    w = Workers()
    put_by = [set() for _ in range(N_WRITERS)]
    written: list[bytes] = []          # appended by writers (list.append is atomic), read by others
    written_doomed: list[bytes] = []
    reads = {"hits": 0, "misses": 0, "wrong": []}
    gc_steps = {"n": 0, "removed": 0}
    pins = {"pinned": 0}

    def writer(n: int) -> None:
        rng = random.Random(1000 + n)
        # overlapping key sets: every kept block is written by two of the three writers
        keys = [k for i, k in enumerate(KEEP) if i % N_WRITERS != n] + DOOMED[n::2]
        mine = []
        for _ in range(PASSES):  # later passes: duplicates, and doomed blocks put again after deletes
            rng.shuffle(keys)
            mine += keys
        pos = 0
        while pos < len(mine) and not w.stop.is_set():
            batch = mine[pos: pos + rng.choice((1, 1, 2, 5, 8))]
            pos += len(batch)
            if len(batch) == 1 and rng.random() < 0.5:
                store.put(batch[0], BY_KEY[batch[0]], NS.id)
            else:
                store.put_many([PutItem(k, BY_KEY[k], NS.id) for k in batch])
            put_by[n].update(batch)
            written.extend(batch)
            written_doomed.extend(k for k in batch if k in DOOMED_SET)
            if policy == "write-back" and rng.random() < 0.03:
                store.flush()

    def reader(n: int) -> None:
        rng = random.Random(2000 + n)
        out = bytearray(MAX_PAYLOAD)
        everything = KEEP + DOOMED
        while not w.stop.is_set():
            if written and rng.random() < 0.7:  # mostly blocks that were put
                start = rng.randrange(len(written))
                keys = written[start: start + rng.randint(1, 8)]
            else:
                start = rng.randrange(len(everything))
                keys = everything[start: start + rng.randint(1, 8)]
            res = store.lookup(keys)
            assert 0 <= res.num_hits <= len(keys) and len(res.tiers) == res.num_hits
            for k in keys:
                how = rng.random()
                if how < 0.4:
                    got = store.get(k)
                elif how < 0.8:
                    got_n = store.get_into(k, out)
                    got = None if got_n is None else bytes(out[:got_n])
                else:
                    got = store.get_many([k])[0]
                if got is None:
                    reads["misses"] += 1
                elif got == BY_KEY[k]:
                    reads["hits"] += 1
                else:
                    reads["wrong"].append((k.hex(), len(got), len(BY_KEY[k])))

    def collector() -> None:
        gc = Collector(store, batch=200, seed=7)
        while not w.stop.is_set():
            r = gc.step()
            gc_steps["n"] += 1
            gc_steps["removed"] += r.segments_removed

    def pinner() -> None:
        rng = random.Random(3000)
        while not w.stop.is_set():
            keys = rng.sample(KEEP, 4)
            if rng.random() < 0.5:
                pins["pinned"] += store.pin(keys)
                store.unpin(keys)
            else:
                store.pin(keys, ttl_s=0.05)
                store.unpin(keys)
            store.stats()

    def deleter() -> None:
        rng = random.Random(4000)
        while not w.stop.is_set():
            if len(written_doomed) > 10:
                n = len(written_doomed)
                store.delete([written_doomed[rng.randrange(n)] for _ in range(4)])
            else:
                store.delete(rng.sample(DOOMED, 2))

    for n in range(N_WRITERS):
        w.add(f"writer-{n}", writer, n)
    for n in range(N_READERS):
        w.add(f"reader-{n}", reader, n)
    w.add("gc", collector)
    w.add("pinner", pinner)
    w.add("deleter", deleter)
    try:
        w.run(writers_first=N_WRITERS)
        assert not w.errors, "\n".join(w.errors)
        swallowed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not swallowed, f"errors were logged (and swallowed) during the run: {swallowed[:5]}"
        assert not reads["wrong"], f"reads returned wrong bytes: {reads['wrong'][:5]}"
        assert reads["hits"] > 0, "the readers never hit: the test exercised nothing"
        assert gc_steps["removed"] > 0, "GC never compacted a segment while the others ran"
        assert pins["pinned"] > 0

        store.flush()
        assert set(KEEP) <= set().union(*put_by), "the writers did not finish their work"
        missing = [k.hex() for k in KEEP if store.get(k) != BY_KEY[k]]
        assert not missing, f"{len(missing)} blocks put by the writers do not read back: {missing[:5]}"
        for k in DOOMED:
            got = store.get(k)
            assert got is None or got == BY_KEY[k]
        rep = check(store)
        assert not rep.bad_blocks and not rep.missing_segments and rep.segment_table_mismatches == 0, rep
    finally:
        store.close()

    with BlockStore(make_config(str(tmp_path / "data"), policy)) as store:  # and after a restart
        missing = [k.hex() for k in KEEP if store.get(k) != BY_KEY[k]]
        assert not missing, f"{len(missing)} blocks lost across close/reopen: {missing[:5]}"
        assert store.stats().persistent_counters.get("quarantined", 0) == 0


def race_same_block_write_back(data_dir) -> None:
    """The race the threaded test hits now and then, forced deterministically."""
    cfg = StoreConfig(
        str(data_dir),
        # 4 pages of 256 KiB, no watermark eviction: a 256 KiB block needs a whole page
        dram=DramConfig(capacity_bytes=1 << 20, page_bytes=256 << 10, high_watermark=1.0,
                        low_watermark=1.0, prefault=False),
        nvme=NvmeConfig(segment_bytes=4 << 20, fsync="never"),
        write_policy="write-back",
    )
    blocks = {key_for(10_000 + i): random.Random(i).randbytes(256 << 10) for i in range(8)}
    x, a, *fillers = list(blocks)
    store = BlockStore(cfg)
    store.register_namespace(NS)
    validated, go = threading.Event(), threading.Event()
    real_validate = store._validate

    def paused_validate(items, now):  # writer 1 stops right after validating [a, x]
        out = real_validate(items, now)
        if any(i.key == a for i in items):
            validated.set()
            go.wait(30)
        return out

    store._validate = paused_validate
    errors = []

    def writer1():
        try:
            store.put_many([PutItem(a, blocks[a], NS.id), PutItem(x, blocks[x], NS.id)])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=writer1)
    t.start()
    try:
        assert validated.wait(30)
        if store._lock.acquire(blocking=False):  # validation runs outside the store lock:
            store._lock.release()                # the race is possible, so force it
            store.put(x, blocks[x], NS.id)       # writer 2 wins the race for x ...
            for k in fillers[:3]:                # ... and the DRAM fills up behind it
                store.put(k, blocks[k], NS.id)
        # else: writer 1 validates under the store lock, so writer 2 cannot get in between
    finally:
        go.set()
        t.join(30)
    assert not t.is_alive() and not errors, errors
    for k in [x, *fillers[:3]]:                 # (a no-op where writer 2 already put them)
        store.put(k, blocks[k], NS.id)
    for k in fillers[3:]:                       # more puts: more evictions
        store.put(k, blocks[k], NS.id)
    try:
        store.flush()
        assert {k: store.get(k) for k in blocks} == blocks
    finally:
        store.close()
    with BlockStore(cfg) as store:
        lost = [k.hex() for k, v in blocks.items() if store.get(k) != v]
        assert not lost, f"{len(lost)} acknowledged write-back blocks lost across flush + close"


def test_write_back_put_racing_another_put_of_the_same_block(tmp_path):
    race_same_block_write_back(tmp_path / "data")
