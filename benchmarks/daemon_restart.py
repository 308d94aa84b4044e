"""The read-after-restart phase of `kvcache bench daemon`: what serves the cache once DRAM is
empty (after a restart, or once it has turned over) is the NVMe tier.

    put every block durably ─ stop ─┬─ start ─ pread, pread + hash ─ read all (shared memory)         page-cached
                                    ├─ start ─ drop ─ pread (untimed) ─ drop ─ pread ─ drop ─ read all   cold disk
                                    └─ start ─ read all over HTTP                                      page-cached
    (each read starts from a fresh daemon: a read promotes blocks into DRAM, so a second one would
     measure DRAM)

"Cold" is cold for this host's page cache only. Under a hypervisor that caches the virtual
disk, the first read after the writes pays the device and later ones hit the host's cache (on
the VM this was written on: 0.6 GB/s once, then 4-5 GB/s with the guest's cache dropped), so
whichever side read first would be charged for both: each cold round reads everything once,
untimed, before the two timed reads.

"Drop" is page_cache.evict_page_cache on the daemon's data directory (segments and index):
write back, then posix_fadvise(DONTNEED), which evicts clean pages without root. The baseline reads each segment file
front to back in reads of one block size into one reused buffer, as many bytes as the blocks
hold: the disk's and the page cache's own speed for the same bytes, in the same run; and once
more hashing each read (pread_verify): the floor of any read that checks its bytes.

Both sides read into one buffer, baselines.dest_buffer (where a buffer starts changes a copy's
speed 3x on some CPUs: its docstring says why).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import xxhash

from kvcache.benchmarks.args import size_label
from kvcache.benchmarks.baselines import dest_buffer
from kvcache.benchmarks.page_cache import evict_page_cache
from kvcache.benchmarks.daemon_servers import start_daemon, stop_daemon
from kvcache.kvstore.types import PutItem

MODES = ("shm_cached", "shm_cold", "http_cached")


def _files(data_dir: str) -> list[str]:
    out = []
    for d, _, names in os.walk(data_dir):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def pread_segments(data_dir: str, size: int, total: int, buf: memoryview, verify: bool = False) -> int:
    """Read `total` bytes of the segment files, `size` bytes a pread into `buf`: the baseline.
    With `verify`, each read is also hashed (xxh3-128, the records' checksum): the floor of any
    read that checks what it returns."""
    done = 0
    for path in (p for p in _files(data_dir) if p.endswith(".kvs")):
        fd = os.open(path, os.O_RDONLY)
        try:
            end = os.fstat(fd).st_size
            for off in range(0, end - size + 1, size):
                if done >= total:
                    return done
                done += os.preadv(fd, [buf[:size]], off)
                if verify:
                    xxhash.xxh3_128_digest(buf[:size])
        finally:
            os.close(fd)
    if done < total:
        raise RuntimeError(f"the segments hold {done} bytes, fewer than the {total} written")
    return done


def _read_all(client, keys: list[bytes], per: int, out: memoryview, size: int) -> None:
    for a in range(0, len(keys), per):
        chunk = keys[a: a + per]
        if client.get_many_into(chunk, [out] * len(chunk)) != [size] * len(chunk):
            raise RuntimeError("a block could not be read back after the restart")


def _timed_read(daemon: dict, mode: str, keys, per, out, size) -> float:
    from kvcache.client.sync_client import KVClient
    shm = "on" if mode.startswith("shm") else "off"
    url, sock = (daemon["url"], None) if mode.startswith("http") else ("http://localhost", daemon["unix_socket"])
    with KVClient(url, unix_socket=sock, retries=0, timeout_s=120, shared_memory=shm) as c:
        if shm == "on":
            c._shared()                # map the arena before the clock starts (once per client)
        t0 = time.perf_counter()
        _read_all(c, keys, per, out, size)
        return time.perf_counter() - t0


def bench_restart(size: int, source: memoryview, total_bytes: int, batch_bytes: int, rounds: int, root: str,
                  sock_dir: str, cfg: dict, ns, bar=None) -> dict:
    """GB/s of each read after a restart and of pread of the same bytes; medians of `rounds`."""
    from kvcache.client.sync_client import KVClient
    n, per = max(1, total_bytes // size), max(1, batch_bytes // size)
    keys = [xxhash.xxh3_128_digest(f"daemon-restart:{size}:{i}".encode()) for i in range(n)]
    name = f"daemon-restart-{size_label(size)}"
    out = dest_buffer(size)
    times: dict[str, list[float]] = {}
    with contextlib.ExitStack() as cleanup:
        d = start_daemon(cleanup, root, sock_dir, cfg, name)
        data = d["data_dir"]
        with KVClient(d["url"], retries=0, timeout_s=120, shared_memory="off") as c:
            c.register_namespace(ns)
            for a in range(0, n, per):
                r = c.put_many([PutItem(keys[i], source[i * size: (i + 1) * size], ns.id)
                                for i in range(a, min(n, a + per))])
                if r.durable is not True:
                    raise RuntimeError("the restart phase needs durable puts")
        for r in range(rounds):
            for mode in MODES:
                if bar is not None:
                    bar.set_postfix_str(f"{size_label(size)} restart {mode}")
                stop_daemon(d)
                d = start_daemon(cleanup, root, sock_dir, cfg, name)
                if mode.startswith("shm"):   # the baseline first: the daemon promotes what it served
                    if mode.endswith("cold"):    # once reads pause, which must not overlap the baseline
                        evict_page_cache(data)
                        pread_segments(data, size, n * size, out)   # untimed: primes a host-side disk cache
                        evict_page_cache(data)
                    for verify in (False, True) if mode == "shm_cached" else (False,):
                        t0 = time.perf_counter()
                        pread_segments(data, size, n * size, out, verify)
                        times.setdefault(f"pread{'_verify' if verify else ''}_{mode[4:]}", []).append(
                            time.perf_counter() - t0)
                if mode.endswith("cold"):
                    evict_page_cache(data)
                times.setdefault(mode, []).append(_timed_read(d, mode, keys, per, out, size))
                if bar is not None:
                    bar.update(1)
        stop_daemon(d)
    res = {k: n * size / statistics.median(v) / 1e9 for k, v in times.items()}
    return {**res, "blocks": n, "rounds_s": times}
