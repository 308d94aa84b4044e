"""Writer process for tests/kvstore/test_crash.py; the test SIGKILLs it at random points.

    python crash_writer.py DATA_DIR JOURNAL START_INDEX SEED

Opens the store, prints READY, then loops forever over puts (put and put_many, random
batch and payload sizes), deletes, pins and GC steps. Every block's key, size and bytes
derive from its integer index, so the test can regenerate what any key must hold.

The journal says what the test may expect. One line per event, written and fsync'ed:

    p IDX   a put of block IDX is about to start      (it may or may not land)
    P IDX   put() returned for IDX (durable=True)     (it must survive any crash)
    d IDX   a delete of IDX is about to start         (it may or may not land)
    D IDX   delete() returned for IDX                 (it must stay deleted)
    # ...   diagnostics (GC reports)

Intent lines go out before the call and acknowledgements only after it returned, so a
kill anywhere leaves a journal that never claims more than the store promised.

This file doubles as the module the test imports for `config`, `key_for`, `payload_for`,
so it must not import anything from `tests`.
"""

from __future__ import annotations

import os
import random
import sys

import xxhash

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.hashing import Namespace
from kvcache.tiering.config import DramConfig, NvmeConfig

NS = Namespace("crash-model@rev1", "raw/v1", 16, name="crash")
MIN_PAYLOAD, MAX_PAYLOAD = 1 << 10, 300 << 10


def config(data_dir: str) -> StoreConfig:
    return StoreConfig(
        data_dir,
        dram=DramConfig(capacity_bytes=2 << 20, page_bytes=1 << 20, prefault=False),
        nvme=NvmeConfig(fsync="always", segment_bytes=1 << 20),
    )


def key_for(idx: int) -> bytes:
    return xxhash.xxh3_128_digest(b"crash-test-block:%d" % idx)


def size_for(idx: int) -> int:
    r = random.Random(idx * 2654435761 + 17)
    roll = r.random()
    if roll < 0.6:
        return r.randint(MIN_PAYLOAD, 32 << 10)
    if roll < 0.9:
        return r.randint(32 << 10, 128 << 10)
    return r.randint(128 << 10, MAX_PAYLOAD)


def payload_for(idx: int) -> bytes:
    return random.Random(idx).randbytes(size_for(idx))


def read_journal(path: str) -> list[tuple[str, int]]:
    """Complete journal lines as (op, index); a torn last line is ignored."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:  # the part after the last newline may be torn
        if line and line[0] in "pPdD":
            op, idx = line.split()
            out.append((op, int(idx)))
    return out


class Journal:
    def __init__(self, path: str):
        self.f = open(path, "a")

    def log(self, op: str, idxs) -> None:
        self.f.write("".join(f"{op} {i}\n" for i in idxs))
        self.f.flush()
        os.fsync(self.f.fileno())

    def note(self, text: str) -> None:
        self.f.write(f"# {text}\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def main(data_dir: str, journal_path: str, start: int, seed: int) -> None:
    from kvcache.gc.collector import Collector
    from kvcache.kvstore.store import BlockStore
    from kvcache.kvstore.types import PutItem

    # what this writer may touch: blocks acknowledged by earlier writers
    live: set[int] = set()
    deleted: set[int] = set()
    for op, idx in read_journal(journal_path):
        if op == "P":
            live.add(idx)
            deleted.discard(idx)
        elif op == "D":
            live.discard(idx)
            deleted.add(idx)
        elif op == "d":
            live.discard(idx)  # unknown outcome: leave it alone
    journal = Journal(journal_path)
    rng = random.Random(seed)
    store = BlockStore(config(data_dir))
    store.register_namespace(NS)
    print("READY", flush=True)

    # some writers compact a lot, so that kills land inside compaction too
    gc_share = 0.35 if rng.random() < 0.3 else 0.07
    nxt = start
    while True:
        roll = rng.random()
        if roll < gc_share:  # a bounded GC step: expiry scan, capacity check, maybe one compaction
            r = Collector(store, seed=rng.randrange(1 << 30)).step()
            if r.segments_removed or r.segments_compacted or r.evicted or r.expired:
                journal.note(f"gc compacted={r.segments_compacted} removed={r.segments_removed} "
                             f"evicted={r.evicted} expired={r.expired}")
            continue
        roll = rng.random()
        if roll < 0.62:  # put or put_many of fresh blocks, sometimes re-putting a deleted one
            n = rng.choice((1, 1, 1, 2, 3, 4, 6, 9))
            idxs = list(range(nxt, nxt + n))
            nxt += n
            if deleted and rng.random() < 0.15:
                back = rng.choice(sorted(deleted))
                deleted.discard(back)
                idxs.append(back)
            journal.log("p", idxs)
            if len(idxs) == 1 and rng.random() < 0.5:
                res = store.put(key_for(idxs[0]), payload_for(idxs[0]), NS.id)
            else:
                res = store.put_many([PutItem(key_for(i), payload_for(i), NS.id) for i in idxs])
            if not res.durable:
                raise AssertionError(f"put returned durable=False: {res}")
            journal.log("P", idxs)
            live.update(idxs)
        elif roll < 0.86 and live:  # delete acknowledged blocks
            idxs = rng.sample(sorted(live), min(len(live), rng.randint(1, 8)))
            journal.log("d", idxs)
            live.difference_update(idxs)
            store.delete([key_for(i) for i in idxs])
            journal.log("D", idxs)
            deleted.update(idxs)
        elif live:  # pins: hard, soft, unpin
            idxs = rng.sample(sorted(live), min(len(live), rng.randint(1, 4)))
            keys = [key_for(i) for i in idxs]
            kind = rng.random()
            if kind < 0.4:
                store.pin(keys)
            elif kind < 0.7:
                store.pin(keys, ttl_s=rng.uniform(0.01, 5.0))
            else:
                store.unpin(keys)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
