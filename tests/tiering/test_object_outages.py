"""The object tier under pressure: bounded upload queue, circuit breaker, S3 outages and hangs."""


from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from kvcache.kvstore.errors import StoreError
from kvcache.tiering.object_io import OPEN, ObjectStoreUnavailable
from kvcache.tiering.object_store import ObjectTier

pytest.importorskip("fsspec", reason="the object tier needs fsspec: pip install fsspec")

from tests.tiering.object_helpers import MotoServer, _flaky_tier, _key, _s3_config, _write


# ---------------------------------------------------------------- queue bounds
def test_queue_memory_stays_bounded_under_slow_uploads(tmp_path):
    t, fs = _flaky_tier(tmp_path, max_queue_bytes=512 << 10, pack_bytes=128 << 10, queue_full="block")
    fs.delay = 0.01
    landed = t.landed
    block = 40_000
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], t._queue.queued_bytes)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    writes = [_write(i, block) for i in range(1, 151)]   # 6 MB through a 512 KiB queue
    try:
        assert t.enqueue(writes) == len(writes)
        assert t.flush(30)
    finally:
        stop.set()
        sampler.join()
    s = t.stats()
    assert max(peak[0], s["queue_peak_bytes"]) <= (512 << 10) + block
    assert len(landed) == len(writes) and s["dropped_writes"] == 0
    assert s["packs_uploaded"] <= len(writes) // 2
    got = dict(landed)
    assert all(t.get(w.key, got[w.key]) == bytes(w.payload) for w in writes[::10])
    t.close()


def test_full_queue_drops_when_configured(tmp_path):
    t, fs = _flaky_tier(tmp_path, max_queue_bytes=256 << 10, pack_bytes=128 << 10, queue_full="drop")
    dropped = t.dropped
    fs.delay = 0.05
    writes = [_write(i, 50_000) for i in range(1, 41)]
    accepted = t.enqueue(writes)
    assert t.flush(30)
    assert 0 < accepted < len(writes) and accepted + len(dropped) == len(writes)
    assert t.stats()["dropped_writes"] == len(dropped)
    t.close()


# ---------------------------------------------------------------- breaker and outages
def test_breaker_opens_half_opens_and_closes(tmp_path):
    t, fs = _flaky_tier(tmp_path)
    [p] = t.put([_write(1, 1000)])
    fs.fail = True
    assert t.get(_key(1), p) is None and t.breaker.state == "closed"
    assert t.get(_key(1), p) is None and t.breaker.state == OPEN
    with pytest.raises(ObjectStoreUnavailable):
        t.put([_write(2, 1000)])                       # sync put: a StoreError, nothing referenced
    assert isinstance(ObjectStoreUnavailable("x"), StoreError)
    time.sleep(0.25)
    assert t.get(_key(1), p) is None and t.breaker.state == OPEN   # the half-open probe failed
    fs.fail = False
    time.sleep(0.25)
    assert t.get(_key(1), p) == bytes(_write(1, 1000).payload)
    b = t.stats()["breaker"]
    assert b["state"] == "closed" and b["opened"] == 2 and b["half_opened"] == 2 and b["closed"] == 1
    t.close()


def test_hold_mode_keeps_writes_queued_through_an_outage(tmp_path):
    t, fs = _flaky_tier(tmp_path, on_outage="hold")
    landed = t.landed
    fs.fail = True
    writes = [_write(i, 20_000) for i in range(1, 11)]
    assert t.enqueue(writes) == len(writes)
    assert not t.flush(0.6) and not landed
    assert t.breaker.state == OPEN or t.stats()["breaker"]["opened"] >= 1
    fs.fail = False
    assert t.flush(10)
    assert sorted(k for k, _ in landed) == sorted(w.key for w in writes)
    assert t.stats()["dropped_writes"] == 0
    t.close()


def test_drop_mode_drops_writes_while_the_breaker_is_open(tmp_path):
    t, fs = _flaky_tier(tmp_path, breaker_cooldown_s=30)
    fs.fail = True
    t.enqueue([_write(1, 1000)])
    assert t.flush(5)
    t.enqueue([_write(2, 1000)])
    assert t.flush(5)
    t.enqueue([_write(3, 1000)])   # breaker open by now: dropped at the door
    assert t.flush(5)
    assert t.stats()["dropped_writes"] == 3 and any("circuit open" in why for _, why in t.dropped)
    t.close()


def test_s3_outage_reads_miss_fast_then_recover(moto):
    server = MotoServer().start()
    try:
        server.create_bucket("kv-outage")
        corrupt, dropped, landed = [], [], []
        cfg = _s3_config(server, "kv-outage", timeout_s=1.0, breaker_failures=3, breaker_cooldown_s=1.0)
        t = ObjectTier(cfg, on_corrupt=lambda k, p, why: corrupt.append(why), on_stored=landed.extend,
                       on_dropped=lambda keys, why: dropped.extend(keys))
        writes = [_write(i, 50_000) for i in range(1, 6)]
        placements = t.put(writes)
        assert t.get(writes[0].key, placements[0]) == bytes(writes[0].payload)

        server.stop()                                        # kill -9 mid-run
        for w, p in zip(writes * 2, placements * 2):
            t0 = time.monotonic()
            assert t.get(w.key, p) is None                   # a miss, never an exception
            assert time.monotonic() - t0 < cfg.timeout_s * 2
        assert t.breaker.state == OPEN and not corrupt       # an outage is not corruption
        t0 = time.monotonic()
        assert t.get_into(writes[0].key, placements[0], bytearray(60_000)) is None
        assert time.monotonic() - t0 < 0.05                   # open breaker: immediate
        assert t.enqueue([_write(10, 1000)]) == 0 and dropped == [_key(10)]
        with pytest.raises(StoreError):
            t.put([_write(11, 1000)])

        server.start()                                       # same port, empty (moto is in-memory)
        server.create_bucket("kv-outage")
        time.sleep(cfg.breaker_cooldown_s + 0.1)
        assert t.get(writes[0].key, placements[0]) is None  # the data is gone; the store answers
        assert t.breaker.state == "closed" and any("gone from the bucket" in why for why in corrupt)
        assert t.enqueue([_write(20, 30_000)]) == 1 and t.flush(10)
        [p] = t.put([_write(21, 30_000)])
        assert t.get(_key(20), dict(landed)[_key(20)]) == bytes(_write(20, 30_000).payload)
        assert t.get(_key(21), p) == bytes(_write(21, 30_000).payload)
        s = t.stats()
        assert s["breaker"]["opened"] >= 1 and s["breaker"]["closed"] >= 1 and s["dropped_writes"] >= 1
        assert s["misses_unavailable"] >= 10
        t.close()
    finally:
        server.stop()


def test_s3_hung_server_reads_time_out(moto):
    server = MotoServer().start()
    try:
        server.create_bucket("kv-hung")
        cfg = _s3_config(server, "kv-hung", timeout_s=0.5, breaker_failures=2, breaker_cooldown_s=0.5)
        writer = ObjectTier(dataclasses.replace(cfg, timeout_s=30.0))   # a healthy server's first calls
        [p] = writer.put([_write(1, 10_000)])                         # can pass 0.5 s on a loaded CI host
        writer.close()
        t = ObjectTier(cfg)
        os.kill(server.proc.pid, signal.SIGSTOP)             # accepts connections, never answers
        times = []
        for _ in range(4):
            t0 = time.monotonic()
            assert t.get(_key(1), p) is None
            times.append(time.monotonic() - t0)
        assert max(times) < cfg.timeout_s * 2.5 and t.breaker.state == OPEN
        assert times[-1] < 0.05
        os.kill(server.proc.pid, signal.SIGCONT)
        time.sleep(cfg.breaker_cooldown_s + 0.1)
        assert t.get(_key(1), p) == bytes(_write(1, 10_000).payload)
        assert t.breaker.state == "closed"
        t.close()
    finally:
        server.stop()
