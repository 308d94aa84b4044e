"""What `kvcache bench daemon` reports beside its timings (benchmarks/daemon.py runs it): the
sides it times and their labels, the ratios it derives (worst case over block sizes) and their
targets, the notes and setups its JSON records, and the table it prints.
"""

from __future__ import annotations

# ratio -> (operation, measured side, baseline side); top level: worst case over sizes
RATIOS = {
    "daemon_get_vs_redis": ("get", "daemon_http", "redis_tcp"),
    "daemon_put_vs_redis": ("put", "daemon_http_memory", "redis_tcp"),
    "daemon_put_vs_redis_durable": ("put", "daemon_http", "redis_aof_always"),
    "durable_put_vs_redis_memory": ("put", "daemon_http", "redis_tcp"),
    "daemon_put_vs_raw_write": ("put", "daemon_http", "raw_write"),
    "unix_get_vs_redis": ("get", "daemon_unix", "redis_unix"),
    "unix_put_vs_redis": ("put", "daemon_unix", "redis_unix"),
    "shm_get_vs_redis": ("get", "daemon_shm", "redis_unix"),
    "local_get_vs_memcpy": ("get", "daemon_shm", "memcpy_arena"),
    "local_get_vs_private_memcpy": ("get", "daemon_shm", "memcpy"),
    "unix_get_vs_memcpy": ("get", "daemon_unix", "memcpy"),
    "http_get_vs_loopback": ("get", "daemon_http", "loopback_tcp"),
    # after a restart: every block on NVMe only, read through shared memory or HTTP, vs pread of the same bytes
    "nvme_get_after_restart_vs_pread": ("restart", "shm_cached", "pread_cached"),
    "nvme_get_after_restart_cold_vs_pread": ("restart", "shm_cold", "pread_cold"),
    "nvme_get_after_restart_vs_verified_pread": ("restart", "shm_cached", "pread_verify_cached"),
    "http_get_after_restart_vs_pread": ("restart", "http_cached", "pread_cached"),
    "verified_pread_vs_pread": ("restart", "pread_verify_cached", "pread_cached"),
}
TARGETS = {"daemon_get_vs_redis": 3.0, "daemon_put_vs_redis": 1.0, "local_get_vs_memcpy": 0.9,
           "nvme_get_after_restart_vs_pread": 0.7, "nvme_get_after_restart_cold_vs_pread": 0.8}
RESTART = {"pread_cached": "pread", "pread_verify_cached": "pread+hash", "shm_cached": "daemon shm",
           "http_cached": "daemon http", "pread_cold": "pread cold", "shm_cold": "daemon shm cold"}
SIDES = {"memcpy": "memcpy", "memcpy_arena": "memcpy arena", "raw_write": "write+fsync", "daemon_http": "daemon http",
         "daemon_http_memory": "daemon http wb", "daemon_unix": "daemon unix",
         "daemon_shm": "daemon shm",
         "redis_tcp": "redis tcp", "redis_unix": "redis unix", "redis_aof_always": "redis aof-always",
         "loopback_tcp": "loopback tcp"}
NOTES = ["puts are compared like for like: daemon_put_vs_redis = a write-back daemon (acknowledged from DRAM) "
         "vs the memory-only redis; daemon_put_vs_redis_durable = the write-through daemon (fsync always) vs "
         "redis appendfsync always; durable_put_vs_redis_memory shows what durability costs against a "
         "memory-only redis; daemon_put_vs_raw_write shows how close durable puts come to the disk's own "
         "write()+fdatasync of the same bytes",
         "unix_*_vs_redis: the daemon over its unix socket vs redis over its unix socket (unix puts go to the "
         "durable daemon, so unix_put_vs_redis is durable vs memory-only)",
         "puts run in two groups, each interleaved batch by batch: memory-only sides (memcpy, daemon wb, redis "
         "tcp/unix), then durable sides (raw write, daemon http/unix, redis aof-always); a side that follows an "
         "fsync starts with idle, cold CPUs, so mixing the groups charged ratios for their neighbours",
         "KVClient moves payloads in the calling thread: puts with sendmsg from the caller's buffers (HTTP/1.1, "
         "http.client), HTTP gets with readinto straight into the output buffers, shared-memory gets with one "
         "lease in flight ahead of the copies",
         "local_get_vs_memcpy: reads through the shared-memory arena (placed by the read directory, or by a lease "
         "over the unix socket; one memcpy) against a bare memcpy of the same blocks out of the same arena (found "
         "untimed): what a local get costs beyond the copy. local_get_vs_private_memcpy: the same reads against a "
         "memcpy out of the benchmark's own buffer; on the VM this was measured on, bare copies out of the "
         "daemon's arena ran 1x-3x slower than out of that buffer, varying from run to run (where the memory "
         "sits, not the read path). unix_get_vs_memcpy: payloads through the unix socket, against the private memcpy",
         "sides run in a rotating order, every other batch backwards, so each side reads a batch before and after "
         "each other side equally often: the first to read bytes the daemon just wrote pays for cold caches",
         "redis gets include copying each value into the output buffer, which is what get_many_into delivers",
         "http_get_vs_loopback: HTTP gets against the same bytes over a bare loopback TCP connection (a server "
         "thread sendall()s each batch from the benchmark's buffer; the client recv_into()s each block into the "
         "output buffer): what HTTP, framing and the store cost beyond the socket",
         "each put stores fresh blocks: the batch's keys are deleted everywhere first (untimed)",
         "restart (per size, when run): the blocks are put durably into a daemon of their own, which is then "
         "restarted before each read (a read promotes blocks into DRAM), so every read finds them on NVMe only; "
         "*_cached with the segment files in the page cache, *_cold after posix_fadvise(DONTNEED) on every file of "
         "the data directory; pread reads the segment files front to back, one block size a read, into one reused "
         "buffer (the page cache's or the disk's own speed for the same bytes); the last eviction before the "
         "daemon's cold read also evicts its index, which only the daemon then reads again; cold rounds first "
         "read everything once, untimed, since the VM's host caches the virtual disk; pread_verify_cached also hashes "
         "each read (xxh3-128, the records' checksum): the floor of any read that checks what it returns"]


def summarize(per_size: dict) -> dict:
    """The ratios per size, their worst case at the top level, and each target's pass or miss."""
    by = {name: {lab: r[op][a] / r[op][b] for lab, r in per_size.items() if a in r.get(op, {}) and b in r[op]}
          for name, (op, a, b) in RATIOS.items()}
    by = {k: v for k, v in by.items() if v}
    out: dict = {name: min(v.values()) for name, v in by.items()}
    out["ratios_per_size"] = by
    out["targets"] = {name: {"target": t, "worst": out[name], "pass": out[name] >= t,
                             "per_size_pass": {s: v >= t for s, v in by[name].items()}}
                      for name, t in TARGETS.items() if name in out}
    return out


def describe_setups(daemon: dict, memory_daemon: dict, red: dict, aof: dict | None) -> dict:
    """How each side was set up (argv, config, client, durability): the JSON's `setups`."""
    import redis
    parser = "hiredis" if getattr(redis.utils, "HIREDIS_AVAILABLE", False) else "pure-Python"
    return {"daemon": {"argv": daemon["argv"], "config": daemon["config"], "client": "KVClient (aiohttp), retries=0",
                       "transport": "HTTP/1.1 over loopback TCP, and over the daemon's unix socket",
                       "durability": "durable: write-through, NVMe fsync 'always' (segment append + fdatasync + index "
                                     "commit before the reply; every put checked durable=true); event log on (the "
                                     "serve default); GC every 3600 s (not during the run)"},
            "daemon_memory": {"argv": memory_daemon["argv"], "config": memory_daemon["config"],
                              "client": "KVClient (aiohttp) over loopback TCP, retries=0",
                              "durability": "none at acknowledgement: write-back, puts acknowledged from DRAM "
                                            "(durable=false), like the memory-only redis; puts only"},
            "redis": {"argv": red["argv"], "version": red["version"], "durability": "none: --save '' --appendonly no",
                      "client": f"redis-py {redis.__version__} ({parser} parser), pipeline(transaction=False)"},
            "redis_aof_always": aof and {"argv": aof["argv"], "durability": "durable: --appendonly yes --appendfsync "
                                         "always (AOF fsync before replies; rewrite off); puts only, over TCP"},
            "raw_write": "write() of each block to a fresh file in the data dir, one fdatasync per batch",
            "memcpy": "slice assignment of the same blocks (put: into one region; get: into the one output "
                      "buffer that every get side fills)",
            "loopback_tcp": "one loopback TCP connection (TCP_NODELAY) to a thread of the benchmark that sendall()s "
                            "each batch's bytes from its buffer on request; recv_into() each block into the "
                            "output buffer",
            "memcpy_arena": "slice assignment of the same blocks out of the daemon's shared arena (found "
                            "through the read directory, untimed) into the same output buffer"}


def _aligned(rows: list[tuple]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def format_table(doc: dict) -> str:
    rows = [("size", "op", *SIDES.values())]
    for label, r in doc["sizes"].items():
        rows += [(label, op, *(f"{r[op][x]:.2f}" if x in r[op] else "-" for x in SIDES)) for op in ("put", "get")]
    lines = ["throughput, GB/s (median round):", *_aligned(rows)]
    restart = [(label, *(f"{r['restart'][x]:.2f}" for x in RESTART)) for label, r in doc["sizes"].items()
               if "restart" in r]
    if restart:
        lines += ["", "after a restart (blocks on NVMe only), GB/s (median round):",
                  *_aligned([("size", *RESTART.values()), *restart])]
    lines += ["", "ratios: worst over sizes (per size):"]
    for name, per in doc["ratios_per_size"].items():
        t = doc["targets"].get(name)
        mark = "" if t is None else f"   target >= {t['target']}: {'PASS' if t['pass'] else 'MISS'}"
        lines.append(f"  {name:<40} {doc[name]:5.2f}  ({', '.join(f'{s} {v:.2f}' for s, v in per.items())}){mark}")
    lk = doc["lookup"]
    d, x = lk["daemon_http"], lk["redis_pipelined_exists"]
    lines += ["", f"lookup of {lk['lookup_blocks']} present blocks, daemon over HTTP: p50 {d['p50_ms']:.2f} ms, "
                  f"p99 {d['p99_ms']:.2f} ms ({lk['runs']} runs); redis pipelined EXISTS: p50 {x['p50_ms']:.2f} ms, "
                  f"p99 {x['p99_ms']:.2f} ms",
              "durability: daemon puts durable (fsync always), daemon wb acked from DRAM, redis tcp/unix memory only, "
              "redis aof-always durable; "
              "same-host reads: daemon shm = shared-memory arena, daemon unix = payloads through the unix socket"]
    return "\n".join(lines)
