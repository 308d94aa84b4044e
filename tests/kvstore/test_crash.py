"""Crash safety: SIGKILL a writer at random points, then check every promise it was given.

tests/kvstore/crash_writer.py puts, deletes, pins and compacts in a loop and journals what
the store acknowledged. After every kill the store is reopened and:

  * every acknowledged, not deleted block reads back bit-identical;
  * every acknowledged delete stays deleted;
  * a block whose put or delete was in flight reads back as a miss or its exact bytes;
  * `kvcache check` finds no bad block, no missing segment, an exact segment table,
    and nothing was ever quarantined (a kill tears files, it never corrupts them).

At the end the index is deleted and rebuilt from the segments, and the same holds.
Set KVCACHE_CRASH_SEED to replay a schedule (kill timing still varies with the machine).
"""

from __future__ import annotations

import importlib.util
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import xxhash

from kvcache.gc.collector import Collector
from kvcache.gc.fsck import check
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_writer.py")
_spec = importlib.util.spec_from_file_location("kvcache_crash_writer", WRITER)
cw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cw)

LIVE, GONE, MAYBE = "live", "gone", "maybe"
# Each kill costs a writer's start-up and a full verify of a store that keeps growing. Four kills
# land in start-up / open and twelve in a running writer: on 2 busy cores, seeds 0-7 left 1,100-2,500
# acknowledged blocks, about as many deletes and 77-150 GC steps that removed segments, far above
# what the loop asserts; every CI run draws a new schedule.
KILLS = 16
OPEN_EVERY = 4              # kill number 3, 7, 11, 15: during start-up / open


def replay(journal: str) -> dict[int, str]:
    """What the journal lets the test expect of each block ever attempted."""
    state: dict[int, str] = {}
    for op, idx in cw.read_journal(journal):
        if op == "p":
            if state.get(idx) != LIVE:
                state[idx] = MAYBE
        elif op == "P":
            state[idx] = LIVE
        elif op == "d":
            state[idx] = MAYBE
        elif op == "D":
            state[idx] = GONE
    return state


class Expected:
    """Digest and length of each block's bytes, computed once."""

    def __init__(self):
        self._cache: dict[int, tuple[int, bytes]] = {}

    def set(self, idx: int, payload: bytes) -> None:
        self._cache[idx] = (len(payload), xxhash.xxh3_128_digest(payload))

    def __call__(self, idx: int) -> tuple[int, bytes]:
        if idx not in self._cache:
            p = cw.payload_for(idx)
            self._cache[idx] = (len(p), xxhash.xxh3_128_digest(p))
        return self._cache[idx]


def _same(got: bytes, want: tuple[int, bytes]) -> bool:
    return len(got) == want[0] and xxhash.xxh3_128_digest(got) == want[1]


def verify(store: BlockStore, states: dict[int, str], expected: Expected, where: str) -> None:
    rep = check(store)  # before any read: a read would quarantine what check must report
    assert not rep.bad_blocks, f"{where}: check found bad blocks {rep.bad_blocks}"
    assert not rep.missing_segments, f"{where}: index references missing segments {rep.missing_segments}"
    assert rep.segment_table_mismatches == 0, f"{where}: segment table disagrees with the index: {rep.to_dict()}"
    out = bytearray(1 << 20)  # room for the largest block any test here writes
    problems = []
    for n, (idx, state) in enumerate(sorted(states.items())):
        key, want = cw.key_for(idx), expected(idx)
        if n % 3 == 0:  # exercise both read paths
            got_n = store.get_into(key, out)
            got = None if got_n is None else bytes(out[:got_n])
        else:
            got = store.get(key)
        if got is not None and not _same(got, want):
            problems.append(f"block {idx} ({state}) read back {len(got)} WRONG bytes")
        elif state == LIVE and got is None:
            problems.append(f"acknowledged block {idx} is missing")
        elif state == GONE and (got is not None or store.contains(key)):
            problems.append(f"deleted block {idx} came back")
    assert not problems, f"{where}: {len(problems)} problems, first: {problems[:10]}"
    quarantined = store.stats().persistent_counters.get("quarantined", 0)
    assert quarantined == 0, f"{where}: {quarantined} blocks were quarantined after a plain kill"


def _wait_ready(proc: subprocess.Popen, timeout: float) -> bool:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return bool(ready) and proc.stdout.readline().strip() == b"READY"


@pytest.fixture(scope="module")
def kill_loop(tmp_path_factory):
    """Runs the writer/kill/verify loop once; both tests below read its outcome."""
    tmp = tmp_path_factory.mktemp("crash")
    seed = int(os.environ.get("KVCACHE_CRASH_SEED", random.randrange(1 << 30)))
    out = {"data": str(tmp / "data"), "journal": str(tmp / "journal.txt"), "seed": seed,
           "expected": Expected(), "failure": None}
    try:
        _kill_loop(tmp, out)
    except AssertionError as e:
        out["failure"] = f"{e}\n(replay with KVCACHE_CRASH_SEED={seed})"
    return out


def _kill_loop(tmp, out) -> None:
    seed, data, journal, expected = out["seed"], out["data"], out["journal"], out["expected"]
    rng = random.Random(seed)
    kills_in_open = kills_after_ready = 0
    for it in range(KILLS):
        stderr_path = tmp / f"writer-{it}.err"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, WRITER, data, journal, str(it * 1_000_000),
                                     str(rng.randrange(1 << 30))], stdout=subprocess.PIPE, stderr=err)
        try:
            if it % OPEN_EVERY == OPEN_EVERY - 1:  # now and then: kill during start-up / open
                time.sleep(rng.uniform(0.05, 0.4))
                kills_in_open += 1
            else:
                assert _wait_ready(proc, 30), f"writer {it} never became ready: {stderr_path.read_text()}"
                time.sleep(rng.uniform(0.05, 0.6))
                kills_after_ready += 1
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, (
            f"writer {it} died by itself (rc {proc.returncode}): {stderr_path.read_text()[-3000:]}")
        with BlockStore(cw.config(data)) as store:
            verify(store, replay(journal), expected, f"after kill {it}")

    states = replay(journal)
    counts = {s: sum(1 for v in states.values() if v == s) for s in (LIVE, GONE, MAYBE)}
    print(f"blocks: {counts}; kills in open: {kills_in_open}, after ready: {kills_after_ready}")
    assert counts[LIVE] > 50 and counts[GONE] > 10, f"the writers did too little to test anything: {counts}"
    with open(journal) as f:
        gc_notes = [line for line in f if line.startswith("# gc")]
    assert any("removed=0" not in line for line in gc_notes), "no GC step ever removed a segment"


@pytest.mark.slow
def test_sigkill_loop_loses_nothing_acknowledged(kill_loop):
    assert kill_loop["failure"] is None, kill_loop["failure"]


@pytest.mark.slow
def test_index_rebuilt_after_the_kill_loop_keeps_every_promise(kill_loop):
    if kill_loop["failure"] is not None:
        pytest.fail("the kill loop itself failed; see test_sigkill_loop_loses_nothing_acknowledged")
    data, seed = kill_loop["data"], kill_loop["seed"]
    states = replay(kill_loop["journal"])
    # one more case on top of whatever the kill loop left: a delete whose tombstone sits alone
    # in a segment, then GC to completion (segment 'small + big' stays; the tombstone's goes)
    small, big = 900_000_001, 900_000_002
    payloads = {small: b"s" * 1000, big: random.Random(big).randbytes(600_000)}  # big keeps its segment
    for i, p in payloads.items():
        kill_loop["expected"].set(i, p)
    with _store(data) as s:
        s.put_many([PutItem(cw.key_for(i), p, cw.NS.id) for i, p in payloads.items()])
    with _store(data) as s:
        assert s.delete([cw.key_for(small)]) == 1
    with _store(data) as s:
        Collector(s).run()
    states.update({small: GONE, big: LIVE})

    # the index is a cache of the segments: throw it away and rebuild it
    shutil.rmtree(os.path.join(data, "index"))
    with BlockStore(cw.config(data)) as store:
        assert store.index.count() >= sum(1 for v in states.values() if v == LIVE)
        verify(store, states, kill_loop["expected"], f"after the index rebuild (seed {seed})")
    with BlockStore(cw.config(data)) as store:  # and the rebuilt index is durable
        verify(store, states, kill_loop["expected"], f"after reopening the rebuilt index (seed {seed})")


# ------------------------------------------------------------------ deterministic cases

def _store(data_dir: str) -> BlockStore:
    s = BlockStore(cw.config(data_dir))
    s.register_namespace(cw.NS)
    return s


def test_compaction_keeps_tombstones_of_a_segment_without_live_blocks(tmp_path):
    data = str(tmp_path / "data")
    small, big = cw.key_for(1), cw.key_for(2)
    with _store(data) as s:  # segment 1: a small block and a big one that keeps the segment alive
        s.put_many([PutItem(small, b"s" * 1000, cw.NS.id), PutItem(big, b"b" * 600_000, cw.NS.id)])
    with _store(data) as s:  # segment 2: just the tombstone
        assert s.delete([small]) == 1
    with _store(data) as s:
        segs_before = s.nvme.segment_ids()
        Collector(s).run(max_steps=20)
        assert s.get(small) is None and s.get(big) == b"b" * 600_000
        assert s.nvme.segment_ids() != segs_before, "GC reclaimed nothing: the test proves nothing"
    shutil.rmtree(os.path.join(data, "index"))
    with _store(data) as s:
        assert s.get(big) == b"b" * 600_000
        assert s.get(small) is None, "a deleted block came back after compaction + index rebuild"


def _block(i: int) -> bytes:
    return random.Random(i).randbytes(20_000)


def test_compaction_then_rebuild_keeps_deletes_and_reputs(tmp_path):
    """Segments that still hold live blocks keep their tombstones through compaction."""
    data = str(tmp_path / "data")
    keys = [cw.key_for(i) for i in range(40)]
    with _store(data) as s:
        s.put_many([PutItem(k, _block(i), cw.NS.id) for i, k in enumerate(keys)])
        s.delete(keys[:30])
        s.put(keys[0], _block(0), cw.NS.id)  # put again after its delete
        for i in range(100, 160):  # roll over into later segments
            s.put(cw.key_for(i), _block(i), cw.NS.id)
        r = Collector(s).run(max_steps=50)
        assert r.segments_removed >= 1
    shutil.rmtree(os.path.join(data, "index"))
    with _store(data) as s:
        for i, k in enumerate(keys):
            got = s.get(k)
            if 0 < i < 30:
                assert got is None, f"deleted block {i} came back after the rebuild"
            else:
                assert got == _block(i), f"block {i} lost"


_KILL_IN_REBUILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import crash_writer as cw
    from kvcache.kvstore import index as index_mod
    from kvcache.kvstore.store import BlockStore

    def die(self, *a, **kw):  # SIGKILL in the middle of the rebuild, before its commits
        os.kill(os.getpid(), signal.SIGKILL)

    index_mod.Index.commit = die
    BlockStore(cw.config({data!r}))
""")


def test_kill_during_index_rebuild_loses_nothing(tmp_path):
    data = str(tmp_path / "data")
    keys = [cw.key_for(i) for i in range(20)]
    with _store(data) as s:
        s.put_many([PutItem(k, cw.payload_for(i), cw.NS.id) for i, k in enumerate(keys)])
    shutil.rmtree(os.path.join(data, "index"))
    code = _KILL_IN_REBUILD.format(here=os.path.dirname(WRITER), data=data)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    with _store(data) as s:
        missing = [i for i, k in enumerate(keys) if s.get(k) != cw.payload_for(i)]
        assert not missing, f"{len(missing)} of {len(keys)} blocks lost after a crash during the rebuild"
