"""`kvcache bench daemon`: batched put/get through the real `kvcache serve` daemon (HTTP and its
unix socket) against redis-server (memory only, and appendfsync always), memcpy and write()+fdatasync
of the same bytes in the same run, plus the latency of a 1,000-block lookup. verbs.DAEMON_EPILOG says what each
side does; the method is `kvcache bench tiers`' (batch by batch in rotating order, GB/s of the median
of `repeats` rounds after a warm-up round, throughput ratios). Same-host reads are measured twice:
payloads through the unix socket, and through the shared-memory arena (the socket carries leases).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import xxhash
from tqdm import tqdm

from kvcache.benchmarks import verbs
from kvcache.benchmarks.args import parse_sizes, size_label
from kvcache.benchmarks.baselines import copy_all, copy_each, dest_buffer, interleave, raw_write, scratch_dir
from kvcache.benchmarks.daemon_report import NOTES, SIDES, describe_setups, format_table, summarize
from kvcache.benchmarks.daemon_restart import MODES, bench_restart
from kvcache.benchmarks.daemon_servers import (check_dependencies, daemon_config, print_report, start_daemon,
                                               start_redis)
from kvcache.benchmarks.loopback import LoopbackServer
from kvcache.benchmarks.record import load_now, machine_info, write_results
from kvcache.kvstore.hashing import Namespace, hash_blocks
from kvcache.client.shm_client import read_direct
from kvcache.kvstore.types import PutItem

_NS = Namespace("bench-daemon@v0", "raw/bench", 256, name="bench-daemon")
_LOOKUP_BLOCKS = 1000


# ---------------------------------------------------------------- operations
def _daemon_put(client, items, durable: bool = True) -> None:
    r = client.put_many(items)
    if r.stored != len(items) or r.durable != durable:
        raise RuntimeError(f"daemon put_many stored {r.stored} of {len(items)} blocks (durable={r.durable})")


def _daemon_get(client, keys, out, size: int) -> None:
    if client.get_many_into(keys, [out] * len(keys)) != [size] * len(keys):
        raise RuntimeError(f"a batch of {len(keys)} blocks could not be read back from the daemon")


def _arena_views(client, keys) -> list[memoryview]:
    """The blocks in the daemon's shared arena, placed through the read directory (untimed)."""
    client._shared()                              # maps the arena on first use
    c = client._client
    if c.directory is None or c._arena is None:
        raise RuntimeError("the shared-memory read directory is not mapped")
    views, missing = read_direct(c.directory, c._arena, "", keys, lambda i, view: view)   # no auth: tenant ""
    if missing:
        raise RuntimeError("a block is missing from the read directory (is DRAM large enough?)")
    return [views[i] for i in range(len(keys))]


def _redis_put(r, keys, blocks) -> None:
    p = r.pipeline(transaction=False)
    for k, b in zip(keys, blocks):
        p.set(k, b)
    p.execute()


def _redis_get(r, keys, dst, size: int) -> None:
    """Pipelined GET, each value copied into `dst` (what get_many_into delivers)."""
    p = r.pipeline(transaction=False)
    for k in keys:
        p.get(k)
    for v in p.execute():
        if v is None or len(v) != size:
            raise RuntimeError("a block could not be read back from redis")
        dst[:] = v


# ---------------------------------------------------------------- one block size
@dataclass
class Sides:
    http: object            # KVClient over loopback TCP
    unix: object            # KVClient over the daemon's unix socket (payloads through the socket)
    shm: object             # KVClient over the unix socket, payloads through the shared-memory arena
    memory: object          # KVClient over HTTP to a second daemon in write-back mode (puts acked from DRAM)
    rt: object              # redis (memory only) over TCP ...
    ru: object              # ... and over its unix socket
    aof: object | None      # the appendfsync-always redis over TCP
    loopback: LoopbackServer    # the same bytes over a bare loopback TCP socket


@dataclass
class Work:
    size: int
    blocks: list[memoryview]
    kh: list[bytes]         # keys of the HTTP side (and of redis over TCP)
    ku: list[bytes]         # keys of the unix-socket side (and of redis over unix)
    kw: list[bytes]         # keys of the write-back daemon
    batches: list[tuple[int, int]]

    def items(self, keys: list[bytes]) -> list[list[PutItem]]:
        return [[PutItem(keys[i], self.blocks[i], _NS.id) for i in range(a, b)] for a, b in self.batches]


def _put_round(w: Work, s: Sides, ih, iu, iw, region: memoryview, fd: int, acc: dict, r: int) -> None:
    """Memory-only puts, then durable puts, each group interleaved batch by batch. Not all nine
    sides in one rotation: a durable side leaves the CPUs idle while it waits for the disk, and the
    side after it starts with cold caches (on this VM a 256 KiB batch then took 2x as long for the
    daemon and 1.3x for redis), which would charge each ratio for its neighbours, not its sides."""
    s.http.delete(w.kh + w.ku)                       # untimed: every put stores fresh blocks
    s.memory.delete(w.kw)
    s.rt.delete(*w.kh, *w.ku)
    if s.aof is not None:
        s.aof.delete(*w.kh)
    for j, (a, b) in enumerate(w.batches):
        interleave(acc, {"put:memcpy": lambda: copy_all(w.blocks[a:b], region[a * w.size:]),
                          "put:daemon_http_memory": lambda: _daemon_put(s.memory, iw[j], durable=False),
                          "put:redis_tcp": lambda: _redis_put(s.rt, w.kh[a:b], w.blocks[a:b]),
                          "put:redis_unix": lambda: _redis_put(s.ru, w.ku[a:b], w.blocks[a:b])}, j + r)
    for j, (a, b) in enumerate(w.batches):
        steps = {"put:raw_write": lambda: raw_write(fd, w.blocks[a:b]),
                 "put:daemon_http": lambda: _daemon_put(s.http, ih[j]),
                 "put:daemon_unix": lambda: _daemon_put(s.unix, iu[j])}
        if s.aof is not None:
            steps["put:redis_aof_always"] = lambda: _redis_put(s.aof, w.kh[a:b], w.blocks[a:b])
        interleave(acc, steps, j + r)


def _get_round(w: Work, s: Sides, out: memoryview, acc: dict, r: int) -> None:
    for j, (a, b) in enumerate(w.batches):
        held = _arena_views(s.shm, w.ku[a:b])     # untimed: where the daemon holds this batch
        interleave(acc, {"get:memcpy": lambda: copy_each(w.blocks[a:b], out),
                          "get:memcpy_arena": lambda: copy_each(held, out),
                          "get:daemon_http": lambda: _daemon_get(s.http, w.kh[a:b], out, w.size),
                          "get:daemon_unix": lambda: _daemon_get(s.unix, w.ku[a:b], out, w.size),
                          "get:daemon_shm": lambda: _daemon_get(s.shm, w.ku[a:b], out, w.size),
                          "get:redis_tcp": lambda: _redis_get(s.rt, w.kh[a:b], out, w.size),
                          "get:redis_unix": lambda: _redis_get(s.ru, w.ku[a:b], out, w.size),
                          "get:loopback_tcp": lambda: s.loopback.get(a * w.size, w.size, b - a, out)}, j + r)


def bench_size(size: int, source: memoryview, region: memoryview, total_bytes: int, batch_bytes: int,
               repeats: int, s: Sides, root: str, bar) -> dict:
    n, per = max(1, total_bytes // size), max(1, batch_bytes // size)
    key = lambda side, i: xxhash.xxh3_128_digest(f"daemon-bench:{side}:{size}:{i}".encode())  # noqa: E731
    w = Work(size, [source[i * size: (i + 1) * size] for i in range(n)], [key("http", i) for i in range(n)],
             [key("unix", i) for i in range(n)], [key("memory", i) for i in range(n)],
             [(a, min(n, a + per)) for a in range(0, n, per)])
    ih, iu, iw = w.items(w.kh), w.items(w.ku), w.items(w.kw)
    out, raw_path = dest_buffer(size), os.path.join(root, "raw.bin")
    times: dict[str, list[float]] = {}
    served: Counter = Counter()
    for r in range(repeats + 1):
        acc: dict[str, float] = {}
        bar.set_postfix_str(f"{size_label(size)} put")
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)   # a fresh file each round
        try:
            _put_round(w, s, ih, iu, iw, region, fd, acc, r)
        finally:
            os.close(fd)
            os.unlink(raw_path)
        if r == 0:   # untimed checks: which tier will serve the gets, and the bytes themselves
            served.update(t.label for t in s.http.lookup(w.kh).tiers + s.unix.lookup(w.ku).tiers)
            for got in (s.http.get(w.kh[-1]), s.unix.get(w.ku[-1]), s.rt.get(w.kh[-1]), s.ru.get(w.ku[-1])):
                if got != w.blocks[-1]:
                    raise RuntimeError("a block read back differs from what was written")
        bar.set_postfix_str(f"{size_label(size)} get")
        _get_round(w, s, out, acc, r)
        if r:   # round 0 is the warm-up
            for name, t in acc.items():
                times.setdefault(name, []).append(t)
        bar.update(1)
    s.http.delete(w.kh + w.ku)                          # free DRAM and redis memory for the next size
    s.memory.delete(w.kw)
    s.rt.delete(*w.kh, *w.ku)
    if s.aof is not None:
        s.aof.flushall()
    res: dict = {"block_bytes": size, "blocks": n, "bytes": n * size, "batches": len(w.batches),
                 "batch_blocks": per, "daemon_gets_served_from": dict(served)}
    for op in ("put", "get"):
        done = [x for x in SIDES if f"{op}:{x}" in times]
        res[op] = {x: n * size / statistics.median(times[f"{op}:{x}"]) / 1e9 for x in done}
        res[op]["rounds_s"] = {x: times[f"{op}:{x}"] for x in done}
    return res


def bench_lookup(http, rt, runs: int) -> dict:
    """Milliseconds per daemon lookup (HTTP) of a 1,000-block chained prefix, all present; a
    pipelined EXISTS of the same keys in redis as a reference."""
    keys = hash_blocks(_NS, np.arange(_LOOKUP_BLOCKS * _NS.block_size, dtype=np.int32) % 100_000)
    payload = os.urandom(4096)
    http.put_many([PutItem(k, payload, _NS.id) for k in keys])
    rt.mset({k: payload for k in keys})

    def redis_exists() -> int:
        p = rt.pipeline(transaction=False)
        for k in keys:
            p.exists(k)
        return sum(p.execute())

    out: dict = {"lookup_blocks": len(keys), "runs": runs}
    for name, fn in (("daemon_http", lambda: http.lookup(keys).num_hits), ("redis_pipelined_exists", redis_exists)):
        ms = []
        for i in range(max(3, runs // 20) + runs):      # the first few are warm-up
            t0 = time.perf_counter()
            if fn() != len(keys):
                raise RuntimeError(f"{name} did not find all {len(keys)} present keys")
            ms.append((time.perf_counter() - t0) * 1e3)
        ms = ms[-runs:]
        out[name] = {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                     "mean_ms": statistics.fmean(ms), "max_ms": max(ms)}
    http.delete(keys)
    rt.delete(*keys)
    return out


class _Bar(tqdm):
    monitor_interval = 0     # no monitor thread: the restart phase forks daemons while its bar is open


def _restart_phase(sizes, source, total_bytes, batch_bytes, repeats, rounds, root, sock_dir, progress) -> dict:
    """The read-after-restart phase of every size (daemon_restart.py), run before any other process
    or client thread exists; each size's daemon data is removed before the next."""
    if not rounds:
        return {}
    cfg, out = daemon_config(sizes, total_bytes, repeats), {}
    with _Bar(total=len(sizes) * rounds * len(MODES), desc="restart phase", unit="read", disable=not progress) as bar:
        for size in sizes:
            out[size_label(size)] = bench_restart(size, source, total_bytes, batch_bytes, rounds, root, sock_dir,
                                                  cfg, _NS, bar)
            shutil.rmtree(os.path.join(root, f"daemon-restart-{size_label(size)}-data"), True)
    return out


def run(sizes, total_bytes: int, out_dir: str, repeats: int = 5, *, batch_bytes: int = 16 << 20,
        data_dir: str | None = None, lookup_runs: int = 200, redis_server: str = "redis-server",
        redis_durable: bool = True, progress: bool = True, restart_rounds: int = 3) -> dict:
    """Run the whole benchmark, write the JSON report into `out_dir` and return it. Raises
    MissingDependency without redis-server or redis-py. `restart_rounds` = 0 skips the
    read-after-restart phase."""
    from kvcache.client.sync_client import KVClient
    sizes = parse_sizes(sizes) if isinstance(sizes, str) else [int(s) for s in sizes]
    if not sizes or min(sizes) <= 0 or min(repeats, total_bytes, batch_bytes, lookup_runs) < 1 or restart_rounds < 0:
        raise ValueError("need block sizes, and repeats, total bytes, batch bytes and lookup runs >= 1 "
                         "(restart rounds >= 0)")
    redis_path = check_dependencies(redis_server)
    started, load = time.perf_counter(), load_now()
    with contextlib.ExitStack() as cleanup:   # unwinds on errors and Ctrl-C: clients, processes, then dirs
        root, sock_dir = scratch_dir(data_dir), tempfile.mkdtemp(prefix="kvb-")   # sockets: short paths
        cleanup.callback(shutil.rmtree, root, True)
        cleanup.callback(shutil.rmtree, sock_dir, True)
        source = memoryview(os.urandom(max(total_bytes, max(sizes))))
        restart = _restart_phase(sizes, source, total_bytes, batch_bytes, repeats, restart_rounds, root, sock_dir,
                                 progress)
        # processes first, before any thread of ours exists (preexec_fn runs in the forked child)
        daemon = start_daemon(cleanup, root, sock_dir, daemon_config(sizes, total_bytes, repeats))
        memory_daemon = start_daemon(cleanup, root, sock_dir, daemon_config(sizes, total_bytes, repeats, "write-back"),
                                     "daemon-wb")
        red = start_redis(cleanup, redis_path, root, sock_dir, "redis", durable=False)
        aof = start_redis(cleanup, redis_path, root, sock_dir, "redis-aof", durable=True) if redis_durable else None
        red["version"] = red["tcp"].info("server")["redis_version"]
        http = cleanup.enter_context(KVClient(daemon["url"], retries=0, timeout_s=120, shared_memory="off"))
        unix, shm = (cleanup.enter_context(KVClient("http://localhost", unix_socket=daemon["unix_socket"], retries=0,
                                                    timeout_s=120, shared_memory=mode)) for mode in ("off", "on"))
        memory = cleanup.enter_context(KVClient(memory_daemon["url"], retries=0, timeout_s=120,
                                                shared_memory="off"))
        http.register_namespace(_NS)
        memory.register_namespace(_NS)
        loopback = LoopbackServer(source)      # a thread: after every process has started
        cleanup.callback(loopback.close)
        sides = Sides(http, unix, shm, memory, red["tcp"], red["unix"], aof["tcp"] if aof else None, loopback)
        region = memoryview(bytearray(len(source)))
        with tqdm(total=len(sizes) * (repeats + 1) + 1, desc="daemon benchmark", unit="round",
                  disable=not progress) as bar:
            per_size = {size_label(size): bench_size(size, source, region, total_bytes, batch_bytes, repeats,
                                                     sides, root, bar) for size in sizes}
            bar.set_postfix_str("lookup")
            lookup = bench_lookup(http, red["tcp"], lookup_runs)
            bar.update(1)
        for label, r in restart.items():
            per_size[label]["restart"] = r
        machine = {**machine_info(root), "load_at_start": load}
        setups = describe_setups(daemon, memory_daemon, red, aof)
    doc = {"benchmark": "daemon_throughput", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started, "machine": machine,
           "config": {"sizes": [size_label(s) for s in sizes], "total_bytes_per_size": total_bytes,
                      "repeats": repeats, "batch_bytes": batch_bytes, "lookup_runs": lookup_runs,
                      "restart_rounds": restart_rounds,
                      "data_dir": os.path.dirname(root),
                      "same_host_path": "shared-memory arena (daemon_shm) and unix socket (daemon_unix)",
                      "units": "GB/s = 1e9 bytes/s; ratio = measured throughput / baseline throughput",
                      "top_level_ratios": "worst case over sizes; per size under ratios_per_size"},
           "setups": setups, "notes": NOTES, "sizes": per_size, "lookup": lookup,
           "lookup_1000_p50_ms": lookup["daemon_http"]["p50_ms"], "lookup_1000_p99_ms": lookup["daemon_http"]["p99_ms"]}
    doc.update(summarize(per_size))
    write_results(doc, out_dir, "daemon_throughput")
    return doc


# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    """Exit status 0 even when a target is missed (the report says so); 2 without redis."""
    mib = 1 << 20
    return print_report("daemon", lambda: run(
        args.sizes, int(args.total_mib * mib), args.out_dir, args.repeats, batch_bytes=int(args.batch_mib * mib),
        data_dir=args.data_dir, lookup_runs=args.lookup_runs, redis_server=args.redis_server,
        redis_durable=not args.no_redis_durable, progress=not args.no_progress,
        restart_rounds=args.restart_rounds), format_table)


def main(argv: list[str] | None = None) -> int:
    try:
        return verbs.main("daemon", argv)
    except KeyboardInterrupt:   # processes and scratch directories are already cleaned up
        return 130


if __name__ == "__main__":
    sys.exit(main())
