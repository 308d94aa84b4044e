"""ParquetEventLog: what the store records comes back whole, files rotate, a stuck or failing
writer drops and counts events instead of blocking or raising, readers never see a half file."""

import collections
import os
import subprocess
import sys
import threading
import time

import pytest

from kvcache.kvstore.event_log import ParquetEventLog, event_files, live_files, read_events
from kvcache.kvstore.events import Event
from tests.conftest import NS, FakeClock, ListSink
from tests.kvstore.event_sim import simulate


def _ev(t: float, kind: str = "lookup", **kw) -> Event:
    return Event(t, kind, **kw)


def test_two_days_of_store_events_come_back_whole(tmp_path, clock):
    tally = simulate(str(tmp_path), clock, hours=48, rotate_s=3600)
    files = event_files(str(tmp_path / "events"))
    assert len(files) == 48  # flushed on the hour with rotate_s = 1 h: one file per hour
    assert not [f for f in os.listdir(tmp_path / "events") if f.endswith(".tmp")]
    table = read_events(str(tmp_path / "events"))
    rows = table.to_pylist()
    kinds = collections.Counter(r["kind"] for r in rows)
    assert {k: kinds[k] for k in ("lookup", "get", "put", "expire")} == dict(tally.kinds)
    lookups = [r for r in rows if r["kind"] == "lookup"]
    for tenant in ("acme", "beta"):
        mine = [r for r in lookups if r["tenant"] == tenant]
        assert sum(r["blocks"] for r in mine) == tally.requested[tenant]
        assert sum(r["hit_blocks"] for r in mine) == tally.hits[tenant]
    assert sum(r["hits_dram"] for r in lookups) == tally.hit_tiers["dram"] > 0
    assert sum(r["hits_nvme"] for r in lookups) == tally.hit_tiers["nvme"] > 0
    assert all(r["tokens"] in (0, r["blocks"] * NS.block_size) for r in lookups)
    assert sum(r["blocks"] for r in rows if r["kind"] == "evict") == tally.evicted > 0
    assert sum(r["blocks"] for r in rows if r["kind"] == "expire") == tally.expired > 0
    assert {r["tenant"] for r in rows if r["kind"] == "put"} == {"acme", "beta"}


def test_since_keeps_only_recent_events(tmp_path, clock):
    tally = simulate(str(tmp_path), clock, hours=6, rotate_s=3600)
    everything = read_events(str(tmp_path / "events")).column("time").to_pylist()
    cut = tally.start + 3 * 3600
    recent = read_events(str(tmp_path / "events"), since=cut).column("time").to_pylist()
    assert recent and sorted(recent) == sorted(t for t in everything if t >= cut)
    assert len(recent) < len(everything)


def test_rotation_by_size(tmp_path):
    log = ParquetEventLog(str(tmp_path), rotate_bytes=1, rotate_s=1e9, tick_s=3600)
    for batch in range(5):
        for i in range(30):
            log.record(_ev(batch * 100 + i, tenant="t"))
        log.flush()  # every row group is over 1 byte: each flush closes a file
    log.close()
    assert len(event_files(str(tmp_path))) == 5
    assert read_events(str(tmp_path)).num_rows == 150
    assert log.stats() == {"recorded": 150, "written": 150, "dropped": 0, "buffered": 0, "files": 5}


def test_buffer_full_triggers_a_write_from_the_log_thread(tmp_path):
    log = ParquetEventLog(str(tmp_path), buffer_events=10, rotate_bytes=1, tick_s=3600)
    for i in range(25):
        log.record(_ev(i))
    deadline = time.monotonic() + 10
    # rows are counted when written to the open file; the file shows up once rotated (right after)
    while not (log.stats()["written"] >= 20 and event_files(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.stats()["written"] >= 20 and event_files(str(tmp_path))
    log.close()
    assert read_events(str(tmp_path)).num_rows == 25


def test_flushed_events_are_readable_before_their_file_closes_and_once_after(tmp_path):
    log = ParquetEventLog(str(tmp_path), tick_s=3600)
    log.record(_ev(1.0))
    log.flush()  # written into the open .tmp file, and as a live file
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert event_files(str(tmp_path)) == [] and len(live_files(str(tmp_path))) == 1
    assert read_events(str(tmp_path)).num_rows == 1
    log.record(_ev(2.0))
    log.flush()
    assert read_events(str(tmp_path)).column("time").to_pylist() == [1.0, 2.0]
    log.close()  # the closed file holds both rows; its live files are gone
    assert len(event_files(str(tmp_path))) == 1 and live_files(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(event_files(str(tmp_path))[0])]
    assert read_events(str(tmp_path)).num_rows == 2


def test_a_running_log_publishes_within_publish_s_from_its_own_thread(tmp_path):
    log = ParquetEventLog(str(tmp_path), tick_s=0.05, publish_s=0.2)
    log.record(_ev(1.0))
    deadline = time.monotonic() + 10
    while not read_events(str(tmp_path)).num_rows and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_events(str(tmp_path)).num_rows == 1 and event_files(str(tmp_path)) == []
    log.close()


def test_a_crash_keeps_the_live_files_and_a_closed_file_wins_over_its_live_files(tmp_path):
    import shutil
    log = ParquetEventLog(str(tmp_path / "a"), tick_s=3600)
    for t in (1.0, 2.0):
        log.record(_ev(t))
        log.flush()
    live = live_files(str(tmp_path / "a"))
    crashed = tmp_path / "crashed"   # a copy of the directory as a SIGKILL leaves it, less the open file
    shutil.copytree(tmp_path / "a", crashed, ignore=shutil.ignore_patterns("*.tmp"))
    assert read_events(str(crashed)).num_rows == 2
    log.close()
    for path in live:   # a crash between closing the file and removing its live files
        shutil.copy(crashed / os.path.basename(path), path)
    assert read_events(str(tmp_path / "a")).num_rows == 2   # each row once
    ParquetEventLog(str(tmp_path / "a"), tick_s=3600).close()   # the next start removes them
    assert os.listdir(tmp_path / "a") == [os.path.basename(event_files(str(tmp_path / "a"))[0])]
    with ParquetEventLog(str(crashed), tick_s=3600) as again:   # a new file, not the crashed one's name
        again.record(_ev(3.0))
    assert read_events(str(crashed)).num_rows == 3


def test_stuck_writer_drops_and_counts_but_never_blocks(tmp_path):
    log = ParquetEventLog(str(tmp_path), buffer_events=10, tick_s=3600)
    release, entered = threading.Event(), threading.Event()
    real_write = log._write_rows

    def stuck(table):  # a disk that stops answering
        entered.set()
        release.wait(30)
        real_write(table)

    log._write_rows = stuck
    for i in range(10):
        log.record(_ev(i))
    assert entered.wait(10)  # the log thread took a batch and hangs in the write
    t0 = time.perf_counter()
    for i in range(10, 1010):
        log.record(_ev(i))
    assert time.perf_counter() - t0 < 1.0  # 1,000 records never waited for the disk
    st = log.stats()  # 10 events in the stuck write, 100 buffered (10 x buffer_events), the rest dropped
    assert (st["buffered"], st["dropped"], st["written"]) == (100, 900, 0)
    release.set()
    log.close()
    st = log.stats()
    assert (st["recorded"], st["written"], st["dropped"]) == (1010, 110, 900)
    assert read_events(str(tmp_path)).num_rows == st["written"]


def test_failing_writer_drops_and_counts_without_raising(tmp_path, caplog):
    log = ParquetEventLog(str(tmp_path), tick_s=3600)

    def broken(table):
        raise OSError(28, "No space left on device")

    log._write_rows = broken
    for i in range(7):
        log.record(_ev(i))
    log.flush()
    log.close()
    log.record(_ev(8))  # after close: counted, never raised
    assert log.stats()["dropped"] == 8 and log.stats()["written"] == 0
    assert "could not be written" in caplog.text
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_unreadable_files_are_skipped_and_stale_tmp_removed(tmp_path, caplog):
    (tmp_path / "events-20260101T000000Z-000000.parquet").write_bytes(b"not parquet at all")
    stale = tmp_path / "events-20260101T000000Z-000001.parquet.999999999.tmp"  # a dead pid's open file
    stale.write_bytes(b"PAR1 torn")
    with ParquetEventLog(str(tmp_path), tick_s=3600) as log:
        log.record(_ev(5.0, tenant="x"))
    assert not stale.exists()
    table = read_events(str(tmp_path))
    assert table.to_pylist()[0]["tenant"] == "x" and table.num_rows == 1
    assert "skipping unreadable event file" in caplog.text
    with pytest.raises(FileNotFoundError):
        read_events(str(tmp_path / "missing"))


def test_time_rotation_counts_from_the_first_event(tmp_path):
    clock = FakeClock()
    log = ParquetEventLog(str(tmp_path), rotate_s=600, clock=clock, tick_s=3600)
    log.flush()
    clock.advance(hours=5)
    log.flush()  # nothing recorded: nothing to rotate, no empty files
    assert os.listdir(tmp_path) == []
    log.record(_ev(clock()))
    clock.advance(seconds=599)
    log.flush()
    assert event_files(str(tmp_path)) == []
    clock.advance(seconds=1)
    log.flush()
    assert len(event_files(str(tmp_path))) == 1
    clock.advance(hours=2)
    log.record(_ev(clock()))  # the next file's 10 minutes start here, not at the last rotation
    clock.advance(seconds=300)
    log.flush()
    assert len(event_files(str(tmp_path))) == 1
    clock.advance(seconds=300)
    log.flush()
    assert len(event_files(str(tmp_path))) == 2
    log.close()


def test_importing_the_store_does_not_import_pyarrow():
    code = ("import sys, kvcache.kvstore.store, kvcache.kvstore.event_log; "
            "assert 'pyarrow' not in sys.modules, 'pyarrow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_full_miss_lookup_counts_tokens_when_the_namespace_is_named(tmp_path):
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    from tests.conftest import make_keys

    sink = ListSink()
    with BlockStore(StoreConfig(str(tmp_path)), events=sink) as store:
        store.register_namespace(NS)
        keys = make_keys(3, start=77)
        store.lookup(keys)
        store.lookup(keys, namespace_id=NS.id)
    unnamed, named = [e for e in sink.events if e.kind == "lookup"]
    assert unnamed.tokens == 0 and named.tokens == 3 * NS.block_size and named.hit_blocks == 0


def test_a_live_file_removed_while_reading_starts_the_reading_over(tmp_path, monkeypatch, caplog):
    from kvcache.kvstore import event_log
    with ParquetEventLog(str(tmp_path), tick_s=3600) as log:
        log.record(_ev(1.0))
    gone = [str(tmp_path / "events-20260101T000000Z-000000.live-000001.parquet")]   # its file closed meanwhile
    monkeypatch.setattr(event_log, "live_files", lambda d: [gone.pop()] if gone else [])
    assert read_events(str(tmp_path)).num_rows == 1 and not gone and "skipping" not in caplog.text
